"""Plain-torch references for lean/kernels/rmsnorm.py, in HF LlamaRMSNorm's cast order.

Call them on low-precision inputs for torch's own low-precision result, or on inputs upcast to
float32/float64 for the high-precision reference (the tolerance rule needs both).
"""
import torch


def rmsnorm_ref(x, w, eps, residual=None):
    """(y, h, rstd): h = x [+ residual] in x's dtype; statistics in at least float32;
    y = w * cast(h * rstd) as in HF (cast to the activation dtype, then the weight)."""
    h = x if residual is None else x + residual
    acc = torch.promote_types(h.dtype, torch.float32)       # fp16/bf16 -> fp32, fp64 stays
    hf = h.to(acc)
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)            # (N,)
    y = w * (hf * rstd[:, None]).to(h.dtype)
    return y, h, rstd


def rmsnorm_bwd_ref(dy, x, w, eps, dresidual=None):
    """(dx, dw) by autograd through rmsnorm_ref at x (the normalised tensor), in the inputs'
    dtype; dx += dresidual when given. dw comes back in w's dtype."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y, _, _ = rmsnorm_ref(x, w, eps)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    if dresidual is not None:
        dx = dx + dresidual
    return dx, dw
