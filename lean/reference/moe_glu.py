"""Plain-torch reference for lean/kernels/moe_glu.py: GPT-OSS's clamped SwiGLU (HF transformers
GptOssExperts._apply_gate, the same expression and cast order) and, by autograd, its backward
fused with the routing-weight gradient.

Call them on the kernels' own inputs for torch's low-precision result, or on float64 copies for
the high-precision reference.
"""
import torch


def moe_glu_ref(h, limit=7.0, alpha=1.702):
    """act (P, F) from h (P, 2F), gate = even columns, up = odd columns, in h's dtype."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def moe_glu_bwd_ref(G, h, weights, order, limit=7.0, alpha=1.702):
    """(dh, dweights, act) by autograd of L = sum_p w[order[p]] * <G[p], moe_glu_ref(h)[p]>, in the
    inputs' dtype; dweights shaped like weights."""
    hh = h.detach().clone().requires_grad_(True)
    w = weights.detach().clone().to(h.dtype).requires_grad_(True)
    act = moe_glu_ref(hh, limit, alpha)
    w_sorted = w.reshape(-1)[order.long()]
    loss = (w_sorted[:, None] * act * G).sum()
    dh, dw = torch.autograd.grad(loss, (hh, w))
    return dh, dw, act.detach()
