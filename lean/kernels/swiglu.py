"""SwiGLU gate of the MLP: h = silu(g) * u, between the gate/up projections and the down one.

Shape legend: N tokens in the packed batch, F MLP hidden size.

    g, u, h, dh, dg, du : (N, F) in one activation dtype (fp32, fp16 or bf16); any row stride,
                          unit stride in the last dim, so g and u may be the two halves
                          [:, :F] and [:, F:] of one (N, 2F) gate-up buffer.

Forward:   s = sigmoid(g),  h = round(g * s * u)          all in fp32, rounded once
Backward:  dg = round(dh * u * s * (1 + g * (1 - s)))      silu'(g) = s * (1 + g * (1 - s))
           du = round(dh * g * s)
Saved for backward: nothing beyond g and u (the caller keeps the gate-up buffer). The backward
can write h again (h=, over dh if wanted): the down projection's input, the same bits, for a
layer that dropped it after its forward.

Supported: any N, F >= 1; fp32 / fp16 / bf16.
Tested: tests/test_swiglu.py: fp32 and fp16 through the interpreter (F 37, 131, 1000; N 1, 7,
129), bf16 on GPU; g, u as halves of one buffer, strided h, dg/du written over g/u.

Caution:
  - torch rounds silu(g) to the activation dtype before the product; we do not, so h is closer
    to the fp32 value than HF's and may differ from it by one ulp.
  - dg may be g and du may be u (each element is read before it is written, by the same
    program); h may be g or u. Partly overlapping views are not supported.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr,                                        # output: (N, F)
    g_ptr, u_ptr,                                 # inputs: (N, F), (N, F)
    stride_h, stride_g, stride_u,                 # row strides, in elements
    N, F,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]              # row * stride can pass 2^31
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dg_ptr, du_ptr, h_ptr,                        # gradients out: (N, F), (N, F); h (N, F) if WRITE_H
    dh_ptr,                                       # incoming gradient: (N, F)
    g_ptr, u_ptr,                                 # inputs: (N, F), (N, F)
    stride_dg, stride_du, stride_h, stride_dh, stride_g, stride_u,
    N, F,
    WRITE_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    # All three loads come before either store: dg may be g and du may be u.
    dh = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * g * s
    tl.store(dg_ptr + r64 * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r64 * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)
    if WRITE_H:  # the forward's h: the same product on the same bits
        tl.store(h_ptr + r64 * stride_h + cols[None, :], (g * s * u).to(h_ptr.dtype.element_ty), mask=mask)


def _config(N, F):
    """(grid, BLOCK_N, BLOCK_F, num_warps). Column blocks of at most 1024 (F = 14336 = 14 * 1024
    leaves no masked tail), a few rows when F is short, 2048-element tiles, 16 elements per
    thread (two 16-byte vectors in bf16). Untuned, from experience with elementwise kernels on
    Hopper. The interpreter takes more rows and wider columns (below): it pays per program."""
    BLOCK_F = min(triton.next_power_of_2(F), 1024)
    BLOCK_N = max(1, min(32, 2048 // BLOCK_F))
    if os.environ.get("TRITON_INTERPRET") == "1":
        # interpreter: cost per program, so about four row blocks per call (a tail when N is odd),
        # and one column block up to F = 2048 (SmolLM2's 1536: decode 7.6 -> 3.6 ms, 497 rows -15%)
        BLOCK_N = max(BLOCK_N, min(64, triton.next_power_of_2(triton.cdiv(N, 4))))
        BLOCK_F = min(triton.next_power_of_2(F), 2048)
    num_warps = max(1, BLOCK_N * BLOCK_F // 512)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(F, BLOCK_F))
    return grid, BLOCK_N, BLOCK_F, num_warps


def swiglu_fwd(h, g, u):
    """h (N, F) = silu(g) * u, computed in fp32 and rounded once; h may be g or u (in place).
    Returns nothing."""
    check(g, "g", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, F = g.shape
    dev, dt = g.device, g.dtype
    check(h, "h", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(u, "u", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if N == 0 or F == 0:
        return
    grid, BLOCK_N, BLOCK_F, num_warps = _config(N, F)
    _swiglu_fwd_kernel[grid](
        h, g, u,
        h.stride(0), g.stride(0), u.stride(0),
        N, F,
        BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )


def swiglu_bwd(dg, du, dh, g, u, *, h=None):
    """dg = dh * u * silu'(g), du = dh * silu(g), each (N, F); dg may be g and du may be u
    (in place). h (N, F), optional: the forward's silu(g) * u rebuilt (h may be dh). Returns nothing."""
    check(g, "g", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, F = g.shape
    dev, dt = g.device, g.dtype
    check(dg, "dg", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(du, "du", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(dh, "dh", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(u, "u", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if h is not None:
        check(h, "h", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if N == 0 or F == 0:
        return
    grid, BLOCK_N, BLOCK_F, num_warps = _config(N, F)
    _swiglu_bwd_kernel[grid](
        dg, du, h if h is not None else dg, dh, g, u,
        dg.stride(0), du.stride(0), h.stride(0) if h is not None else 0, dh.stride(0), g.stride(0), u.stride(0),
        N, F,
        WRITE_H=h is not None, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )
