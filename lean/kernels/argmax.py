"""Row-wise argmax: greedy decoding's token pick.

Shape legend: M rows (sequences), V vocab.
    idx[m] = the first v with x[m, v] = max_v x[m, v]     (ties: lowest index, as torch.argmax)
Inputs: x (M, V) fp32/fp16/bf16 with a unit last stride. Output: idx (M,) int64. NaNs are skipped
(a row of only NaNs gives 0). Inference only: no backward.
Tested: tests/test_kv_attention.py (odd V, ties, fp32/fp16 on CPU; bf16 on GPU) against torch.argmax.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check


@triton.jit
def _argmax_fwd_kernel(idx_ptr, x_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    rv = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), dtype=tl.float32)
    best_i = tl.full((), 0, dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + rv < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + v0 + rv, mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))                         # NaN never wins
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, rv, BLOCK_V), axis=0)              # first index of the max
        take = m > best                                                # strict: earlier blocks win ties
        best_i = tl.where(take, (v0 + i).to(tl.int64), best_i)
        best = tl.where(take, m, best)
    tl.store(idx_ptr + row, best_i)


def argmax_fwd(idx, x):
    """idx (M,) int64 <- argmax over the last dim of x (M, V)."""
    check(x, "x", shape=(None, None), dtype=(torch.float32, torch.float16, torch.bfloat16),
          last_contiguous=True)
    M, V = x.shape
    check(idx, "idx", shape=(M,), dtype=torch.int64, device=x.device, contiguous=True)
    if M == 0:
        return
    if V == 0:
        raise ValueError("x: argmax over an empty last dimension")
    BLOCK_V = 8192 if os.environ.get("TRITON_INTERPRET") == "1" else 4096  # untuned
    _argmax_fwd_kernel[(M,)](idx, x, V, x.stride(0), BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)),
                             num_warps=8)
