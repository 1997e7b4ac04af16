"""Plain-torch references for lean/kernels/gemm.py and lean/kernels/lora_linear.py.

Each function computes in the dtype of its inputs: call it on float64/float32 tensors for the
reference, and on bf16/fp16 tensors for torch's own low-precision result (the tolerance rule's
`lowp`). Dropout is the inverted dropout PEFT applies to the LoRA branch only; the 0/1 keep mask is
an argument (tests produce it with lean's `lora_dropout_mask`, the same random stream the kernels
regenerate).
"""
import torch


def matmul_ref(a, b, *, bias=None, c0=None, alpha=1.0):
    """alpha * (a @ b) [+ bias] [+ c0]."""
    c = alpha * (a @ b)
    if bias is not None:
        c = c + bias.to(c.dtype)
    if c0 is not None:
        c = c + c0.to(c.dtype)
    return c


def lora_linear_ref(x, w, a, b, scale, *, bias=None, mask=None, p=0.0):
    """y = x W^T + bias + scale * (drop(x) A^T) B^T; returns (y, xa) with xa = drop(x) A^T.
    x (N, K), w (O, K), a (R, K), b (O, R), bias (O,), mask (N, K) of 0/1 or None."""
    xd = x if mask is None else x * mask.to(x.dtype) / (1.0 - p)
    xa = xd @ a.t()
    y = x @ w.t() + scale * (xa @ b.t())
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y, xa


def lora_linear_grads_ref(dy, x, w, a, b, scale, *, mask=None, p=0.0):
    """(dx, da, db) of <dy, lora_linear_ref(...)[0]> by torch.autograd (w and bias frozen)."""
    x = x.detach().clone().requires_grad_(True)
    a = a.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    y, _ = lora_linear_ref(x, w, a, b, scale, mask=mask, p=p)
    dx, da, db = torch.autograd.grad(y, (x, a, b), dy)
    return dx, da, db
