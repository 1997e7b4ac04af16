"""Plain-torch references for lean/kernels/moe_route.py and lean/kernels/moe_group.py: the MoE
router (HF transformers 5 Qwen3MoeTopKRouter / GptOssTopKRouter math), slot grouping, combine,
the fused SwiGLU + routing-weight backward and HF's load_balancing_loss_func.

Call them on the kernels' own inputs for torch's low-precision result, or on float64 copies for
the high-precision reference (the tolerance rule needs both). Backward references go through
autograd of the forward ones.
"""
import torch
import torch.nn.functional as F

from lean.reference.swiglu import swiglu_ref


def _acc(t):
    """The softmax dtype HF uses (float32), or float64 for a float64 reference."""
    return torch.promote_types(t.dtype, torch.float32)


def _topk(score, K):
    """torch.topk's values and indices, ties to the lower index (a stable descending sort; on
    distinct values it is exactly torch.topk)."""
    idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :K]
    return score.gather(1, idx), idx


def route_topk_ref(logits, K, *, norm_topk, softmax_first=True, dtype=None):
    """(weights, experts int32, probs): HF's router on (N, E) logits; weights cast to dtype
    (default the logits' dtype, as HF casts). probs is the full softmax (prob_sum's terms)."""
    dtype = dtype or logits.dtype
    probs = F.softmax(logits, dim=-1, dtype=_acc(logits))
    if softmax_first:                                     # Qwen3MoeTopKRouter.forward
        top, idx = _topk(probs, K)
        if norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
    else:                                                 # GptOssTopKRouter.forward (softmax in fp32)
        top, idx = _topk(logits.to(_acc(logits)), K)
        top = F.softmax(top, dim=1)
    return top.to(dtype), idx.to(torch.int32), probs


def route_weights_of(logits, experts, *, norm_topk, softmax_first=True):
    """The routing weights (unrounded) as a differentiable function of logits at fixed experts."""
    idx = experts.long()
    probs = F.softmax(logits, dim=-1, dtype=_acc(logits))
    if softmax_first:
        top = probs.gather(1, idx)
        return (top / top.sum(dim=-1, keepdim=True) if norm_topk else top), probs
    return F.softmax(logits.to(_acc(logits)).gather(1, idx), dim=1), probs


def route_topk_bwd_ref(dweights, logits, experts, *, norm_topk, softmax_first=True, aux_grad=None):
    """dlogits (N, E) in the logits' dtype by autograd: dweights through the routing weights, plus
    aux_grad (E,) as the gradient of every token's full softmax probs."""
    x = logits.detach().clone().requires_grad_(True)
    w, probs = route_weights_of(x, experts, norm_topk=norm_topk, softmax_first=softmax_first)
    loss = (w * dweights.to(w.dtype)).sum()
    if aux_grad is not None:
        loss = loss + (probs * aux_grad.to(probs.dtype)).sum()
    return torch.autograd.grad(loss, x)[0]


def group_slots_ref(experts, E):
    """(order, slot_pos, offsets) int32 and counts (E,) fp32: a stable sort of the flat slots by expert."""
    flat = experts.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    slot_pos = torch.empty_like(order)
    slot_pos[order] = torch.arange(flat.numel(), device=flat.device)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order.int(), slot_pos.int(), offsets.int(), counts.float()


def moe_combine_ref(ys, slot_pos, N, weights=None, out=None):
    """(N, C): sum_i w[n, i] * ys[slot_pos[n*K + i]] (+ out) in ys's dtype, as torch rounds it."""
    y = ys[slot_pos.long()].view(N, -1, ys.shape[1])      # (N, K, C)
    if weights is not None:
        y = y * weights.to(ys.dtype)[:, :, None]
    s = y.sum(dim=1)
    return s if out is None else out.to(s.dtype) + s


def moe_act_bwd_ref(G, h, weights, order):
    """(dh, dweights, act) by autograd of L = sum_p w[order[p]] * <G[p], silu(gate) * up>, in
    the inputs' dtype; dweights (N, K) like weights, act = swiglu_ref(gate, up)."""
    F_ = h.shape[1] // 2
    hh = h.detach().clone().requires_grad_(True)
    w = weights.detach().clone().to(h.dtype).requires_grad_(True)
    act = swiglu_ref(hh[:, :F_], hh[:, F_:])
    w_sorted = w.reshape(-1)[order.long()]
    loss = (w_sorted[:, None] * act * G).sum()
    dh, dw = torch.autograd.grad(loss, (hh, w))
    return dh, dw, act.detach()


def moe_aux_ref(counts, prob_sum, rows, E, scale=1.0):
    """(aux, aux_grad) from summed counts and prob sums, as load_balancing_loss_func normalises them."""
    f = counts / rows
    aux = torch.sum(f * (prob_sum / rows)) * E
    return aux.reshape(1), scale * E * f / rows
