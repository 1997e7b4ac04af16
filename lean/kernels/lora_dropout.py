"""The LoRA branch's dropout (PEFT semantics: on the LoRA input only, inverted, keep-probability
1 - p): its mask, and the forward's pre-pass xa = drop(x) A^T that lora_linear.py runs when p > 0.

Shape legend: N tokens, K input features, R LoRA rank.

    keep(n, k) = tl.rand(seed, n * K + k) >= p      (int64 flat index of x; lora_grad._keep)
    xa         = (x * keep) A^T / (1 - p)           (N, R)  x's dtype, fp32 accumulation

The mask is never stored: the pre-pass here, lora_linear.py's backward kernel (its dx epilogue) and
lora_grad.py's dA partials each regenerate it from (seed, index), so it is the same in all three and
reproducible for a seed. lora_dropout_mask writes it out as 0/1 (tests, the reference's input).
Generating it inside the fused forward GEMM's K loop would run Philox O / BLOCK_N times per x
element (lora_linear.py's docstring): hence the pre-pass.

Inputs: x (N, K) unit last stride, a (R, K) contiguous, x's dtype; xa (N, R) contiguous, written.
Tested: tests/test_lora_linear.py (mask statistics and seeds, the p > 0 forward and backward
against the reference with this mask).
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.gemm import FLOATS, interpreting
from lean.kernels.lora_grad import _keep

XA_TILE = (64, 64, 4, 3)  # the pre-pass's (BLOCK_M, BLOCK_K, num_warps, num_stages) on a GPU, untuned


@triton.jit
def _lora_dropout_mask_kernel(mask_ptr, N, K, seed, p, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    keep = _keep(seed, rm.to(tl.int64)[:, None] * K + rk[None, :], p)
    ptrs = mask_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(ptrs, keep.to(mask_ptr.dtype.element_ty), mask=(rm < N)[:, None] & (rk < K)[None, :])


@triton.jit
def _lora_xa_kernel(
    xa_ptr,                                 # (N, R) out: drop(x) A^T
    x_ptr, a_ptr,                           # (N, K) row stride stride_x; (R, K)
    N, K, R, stride_x, seed, p, inv_keep,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < N
    r_ok = rr < R
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]
    a_ptrs = a_ptr + rr[None, :] * K + rk[:, None]                     # A^T tile (BLOCK_K, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        idx = rm.to(tl.int64)[:, None] * K + (k0 + rk)[None, :]
        xt = tl.where(_keep(seed, idx, p), xt, tl.zeros_like(xt))
        at = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    xa_ptrs = xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :]
    tl.store(xa_ptrs, (acc * inv_keep).to(xa_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


def lora_dropout_xa(xa, x, a, seed, p, block_r, precision, tile=None):
    """xa (N, R) = drop(x) A^T, written (lora_linear_fwd's caller-checked arguments; tile: the
    (BLOCK_M, BLOCK_K, num_warps, num_stages) to run at, default XA_TILE)."""
    N, K = x.shape
    BM, BK, warps, stages = tile or XA_TILE
    _lora_xa_kernel[(triton.cdiv(N, BM),)](
        xa, x, a, N, K, a.shape[0], x.stride(0), seed, float(p), 1.0 / (1.0 - p),
        BLOCK_M=BM, BLOCK_K=BK, BLOCK_R=block_r, PRECISION=precision, num_warps=warps, num_stages=stages)


def lora_dropout_mask(mask_out, seed, p):
    """mask_out (N, K) = 1 where the LoRA dropout keeps x[n, k], else 0 (the kernels' own mask)."""
    check(mask_out, "mask_out", shape=(None, None), dtype=FLOATS + (torch.uint8,), contiguous=True)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p: expected a probability in [0, 1), got {p}")
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"seed: expected an int in [0, 2^63), got {seed!r}")
    N, K = mask_out.shape
    B = 32 if interpreting() else 64
    _lora_dropout_mask_kernel[(triton.cdiv(N, B), triton.cdiv(K, B))](
        mask_out, N, K, seed, float(p), BLOCK_M=B, BLOCK_K=B)
