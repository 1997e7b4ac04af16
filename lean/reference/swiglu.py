"""Plain-torch references for lean/kernels/swiglu.py (HF LlamaMLP's act_fn(gate) * up)."""
import torch
import torch.nn.functional as F


def swiglu_ref(g, u):
    """h = silu(g) * u in the inputs' dtype (torch rounds silu, then the product)."""
    return F.silu(g) * u


def swiglu_bwd_ref(dh, g, u):
    """(dg, du) by autograd through swiglu_ref, in the inputs' dtype."""
    g = g.detach().clone().requires_grad_(True)
    u = u.detach().clone().requires_grad_(True)
    dg, du = torch.autograd.grad(swiglu_ref(g, u), (g, u), dh)
    return dg, du
