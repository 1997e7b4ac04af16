"""Plain-torch reference for lean/kernels/qk_norm_rope.py: Qwen3's per-head RMSNorm, then RoPE.

Shapes: N tokens, heads (H or KVH), D head dim, D2 = D/2. Computed in x's dtype as HF does
(rmsnorm_ref's cast order, then rope_ref); differentiable, so the backward is torch.autograd's.
"""
from .rmsnorm import rmsnorm_ref
from .rope import rope_ref


def qk_norm_rope_ref(x, w, eps, cos, sin):
    """x (N, heads, D) before the norm, w (D,), cos/sin (N, D2) -> (out (N, heads, D), rstd (N*heads,))."""
    D = x.shape[-1]
    n, _, rstd = rmsnorm_ref(x.reshape(-1, D), w, eps)
    return rope_ref(n.view(x.shape), cos, sin), rstd
