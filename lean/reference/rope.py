"""Plain-torch references for lean/kernels/rope.py (HF's half-split rotate_half layout).

Shapes: N tokens, heads (H or KVH), D head dim, D2 = D/2.
"""
import torch


def rope_table_ref(positions, inv_freq, attention_scaling=1.0):
    """positions (N,) int, inv_freq (D2,) -> cos, sin (N, D2) fp32, as HF's rotary class computes them."""
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # (N, D2), one fp32 product
    return angle.cos() * attention_scaling, angle.sin() * attention_scaling


def rope_ref(x, cos, sin):
    """x (N, heads, D) rotated by cos, sin (N, D2), computed in x.dtype with cos/sin cast to it (as HF).

    out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1).
    The backward reference is torch.autograd through this function.
    """
    half = x.shape[-1] // 2
    c = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]  # (N, 1, D)
    s = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]  # (N, 1, D)
    x1, x2 = x[..., :half], x[..., half:]
    return x * c + torch.cat((-x2, x1), dim=-1) * s
