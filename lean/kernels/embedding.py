"""Token embedding gather: out = table[ids].

Shape legend: N tokens in the packed batch, C hidden size, V vocabulary size.

    ids   : (N,) int32 or int64, contiguous, on the table's device
    table : (V, C) fp32 / fp16 / bf16, any row stride, unit stride in the last dim; on out's
            device, or in pinned host memory when out is on a GPU (below)
    out   : (N, C) in the table's dtype, any row stride, unit stride in the last dim

Forward: out[i, :] = table[ids[i], :], a plain copy (bit exact).
Backward: none. The table is frozen in LoRA training and ids carry no gradient, so the
backward pass stops at the first layer's input.
Saved: nothing.

Supported: any N, V, C >= 1; row offsets in int64 (V * C may pass 2^31).
Tested: tests/test_embedding.py: fp32, fp16 and bf16 (a copy: exact even in the interpreter),
int32 and int64 ids, C 37, 131, 1000; N 1, 7, 129, strided table and out, out-of-range ids.

A table in pinned host memory (runtime/planner.py puts an untied table there under a VRAM
budget): the kernel reads its rows through the mapped host address, over PCIe, and only the N
rows it needs (H100: 8192 rows of 4096 bf16, 64 MiB, in 1.3 ms, ~50 GB/s). No copy, no sync; it
captures in a CUDA graph like any kernel.

Caution:
  - ids must lie in [0, V). The launcher cannot check it without a host sync; the kernel masks
    its loads instead, so an out-of-range id never reads outside the table: its row of out is
    written with ZEROS (not clamped), which makes the bad token visible as a zero embedding.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _embedding_fwd_kernel(
    out_ptr,                                      # output: (N, C)
    ids_ptr, table_ptr,                           # inputs: (N,) int32/int64, (V, C)
    stride_out, stride_table,                     # row strides, in elements
    N, V, C,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < N
    col_ok = cols < C
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    id_ok = (ids >= 0) & (ids < V)                # out-of-range ids read nothing, write zeros
    vals = tl.load(table_ptr + ids[:, None] * stride_table + cols[None, :],
                   mask=(row_ok & id_ok)[:, None] & col_ok[None, :], other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], vals,
             mask=row_ok[:, None] & col_ok[None, :])


def embedding_fwd(out, ids, table):
    """out (N, C) = table[ids]; rows of ids outside [0, V) are written as zeros (see Caution).
    Returns nothing."""
    check(table, "table", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    V, C = table.shape
    dev = out.device
    if table.device != dev and not (dev.type == "cuda" and table.device.type == "cpu" and table.is_pinned()):
        raise ValueError(f"table: expected it on out's device ({dev}) or in pinned host memory (out on a "
                         f"GPU), got {table.device}{'' if table.device.type != 'cpu' else ' (not pinned)'}")
    check(ids, "ids", shape=(None,), dtype=(torch.int32, torch.int64), device=dev, contiguous=True)
    N = ids.shape[0]
    check(out, "out", shape=(N, C), dtype=table.dtype, device=dev, last_contiguous=True)
    if N == 0 or C == 0:
        return
    # Column blocks of at most 1024, a few rows when C is short, 2048-element tiles, 16
    # elements per thread. Untuned, from experience with copy kernels on Hopper.
    BLOCK_C = min(triton.next_power_of_2(C), 1024)
    BLOCK_N = max(1, min(32, 2048 // BLOCK_C))
    if os.environ.get("TRITON_INTERPRET") == "1":
        # interpreter: cost per program, so about four row blocks per call (a tail when N is odd);
        # SmolLM2, 497 tokens: 249 programs, 0.44 s -> 8 programs
        BLOCK_N = max(BLOCK_N, min(64, triton.next_power_of_2(triton.cdiv(N, 4))))
    num_warps = max(1, BLOCK_N * BLOCK_C // 512)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(C, BLOCK_C))
    _embedding_fwd_kernel[grid](
        out, ids, table,
        out.stride(0), table.stride(0),
        N, V, C,
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )
