"""Weight gradient of the grouped expert GEMM (grouped_gemm.gmm): each expert's rows reduced into
its own dw[e], routing read from the device.

Shape legend: P rows (slots, sorted by expert), E experts, M and Kd the two dims of a weight grad.

    offsets (E+1,) int32, on the device: rows offsets[e] .. offsets[e+1]-1 belong to expert e
    gmm_wgrad: dw[e] += alpha * sum_p (s_p * a[ra(p)])^T b[rb(p)]  over the rows p of expert e, in order
               ra / rb = gather_a / gather_b [p] // gather_div, else p; s_p = vec[index[p]], else 1
      dw (E, M, Kd) fp32 contiguous; a (rows, M), b (rows, Kd) one dtype; scale = (vec (P,), index (P,) int32)
      s_p * a is rounded to a's dtype before the product (as HF rounds the routing-weighted output).
Uses (models/moe.py; n2 (N, C), order the slot order, K top-k, s the LoRA scale):
    dB       gmm_wgrad(dB, dh_s, xa_s, off, alpha=s)                   M = 2F, Kd = R
    dA       gmm_wgrad(dA, dhb_s, n2, off, gather_b=order, gather_div=K, alpha=s)   M = R, Kd = C
    dBd      gmm_wgrad(dBd, g, xad_s, off, gather_a=order, gather_div=K, scale=(w, order), alpha=s)
    dAd      gmm_wgrad(dAd, gb_s, act_s, off, scale=(w, order), alpha=s)

Grid (tiles of dw[e], E, S); a program owns one (BLOCK_M, BLOCK_K) tile of one expert and
walks that expert's rows BLOCK_T at a time: all of them (S = 1), or one of S runs of whole steps,
writing an fp32 partial that gemm_splitk.reduce_partials adds to dw in run order (S = wgrad_split:
the busiest expert's rows over S programs). No atomics: dw is bit-identical from run to run; an
expert with no row leaves dw[e]'s values as they were (S > 1 adds 0 to them).

Supported: E <= 1024, any P, M, Kd >= 0; bf16/fp16 on the tensor cores with fp32 accumulation, fp32
with exact IEEE products (the correctness path).
Tested: tests/test_grouped_gemm.py: every gather/scale combination, splits 1 and several, empty
experts, guard values around dw, bitwise repeatability (CPU interpreter, fp32 and fp16); bf16 at
Qwen3-30B-A3B sizes on the GPU (dA gathered, dB scaled).
Speed: WGRAD_TILE's note (H200: the four calls of a Qwen3-30B-A3B layer 292 us with uniform routing,
316 with Zipf(0.5)).
Caution:
  - the time is the busiest expert's: one program walks all of an expert's rows (or, with
    WGRAD_SPLIT > 1, a run of them where dw[e] is small). At WGRAD_TILE's narrow tiles an expert
    has several programs a row of dw[e] tiles, and no split measured fastest.
  - the kernel trusts offsets and the gathers: nothing on the device checks them.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.gemm import FLOATS, interpret_big, interpreting
from lean.kernels.gemm_splitk import reduce_partials
from lean.kernels.grouped_gemm import _offsets, _pow2, _rows


@triton.jit
def _gmm_wgrad_kernel(
    dw_ptr,                                 # (E, M, Kd) fp32 contiguous, accumulated
    a_ptr, b_ptr, off_ptr,                  # a (rows, M), b (rows, Kd) strided; offsets (E+1,)
    ga_ptr, gb_ptr, svec_ptr, sidx_ptr,     # gathers (P,) int32; scale vec (P,), index (P,) int32
    part_ptr,                               # SPLIT > 1: (SPLIT, E, M, Kd) fp32 partial sums, written
    M, Kd, gather_div, alpha,
    stride_at, stride_am, stride_bt, stride_bk,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,                    # programs per (tile, expert), each a run of its rows
):
    e = tl.program_id(1)
    tiles_k = tl.cdiv(Kd, BLOCK_K)
    rm = (tl.program_id(0) // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = (tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_ok = rk < Kd
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    if SPLIT > 1:  # run s of the expert's rows: cdiv(rows, SPLIT) rounded up to whole BLOCK_T steps
        run = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_T) * BLOCK_T
        start = tl.minimum(start + tl.program_id(2) * run, end)
        end = tl.minimum(start + run, end)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):   # the expert's rows in order: a fixed summation order
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < end
        ra = rt
        rb = rt
        if GATHER_A:
            ra = tl.load(ga_ptr + rt, mask=t_ok, other=0) // gather_div
        if GATHER_B:
            rb = tl.load(gb_ptr + rt, mask=t_ok, other=0) // gather_div
        at = tl.load(a_ptr + ra.to(tl.int64)[None, :] * stride_at + rm[:, None] * stride_am,
                     mask=m_ok[:, None] & t_ok[None, :], other=0.0)             # a^T tile (BM, BT)
        if SCALE:                           # s_p * a[ra(p)], rounded to a's dtype
            s = tl.load(svec_ptr + tl.load(sidx_ptr + rt, mask=t_ok, other=0), mask=t_ok, other=0.0)
            at = (at.to(tl.float32) * s.to(tl.float32)[None, :]).to(a_ptr.dtype.element_ty)
        bt = tl.load(b_ptr + rb.to(tl.int64)[:, None] * stride_bt + rk[None, :] * stride_bk,
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0)             # (BT, BK)
        acc = tl.dot(at, bt, acc, input_precision=PRECISION)
    if SPLIT > 1:  # every run writes its partial (an empty run: zeros); gemm_splitk.reduce_partials adds them
        slab = tl.program_id(2) * tl.num_programs(1) + e
        p_ptrs = part_ptr + slab.to(tl.int64) * M * Kd + rm.to(tl.int64)[:, None] * Kd + rk[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & k_ok[None, :])
    else:
        dw_ptrs = dw_ptr + e.to(tl.int64) * M * Kd + rm.to(tl.int64)[:, None] * Kd + rk[None, :]
        mask = m_ok[:, None] & k_ok[None, :] & (end > start)                    # no row: dw[e] untouched
        dw = tl.load(dw_ptrs, mask=mask, other=0.0)
        tl.store(dw_ptrs, dw + alpha * acc, mask=mask)


# gmm_wgrad's runs per expert (wgrad_split) where dw[e] is small (M * Kd <= WGRAD_SPLIT_MAX_DW):
# there the partials cost little and the busiest expert's rows set the time. H100, `LEAN_WGRAD_SPLIT=S
# python tools/bench.py kernels --only moe` (Qwen3-30B-A3B, P 65,536, E 128, Zipf(0.5) routing:
# busiest expert 2,749 rows, mean 512), ms at S = 1 / 2 / 4 / 8 for every call:
#   down dA   (M 16,   Kd 768)  0.139 / 0.100 / 0.091 / 0.104   (torch._grouped_mm 0.060)
#   down dB   (M 2048, Kd 16)   0.178 / 0.178 / 0.205 / 0.258
#   gate_up dB (M 1536, Kd 32)  0.088 / 0.121 / 0.157 / 0.236
#   gate_up dA (M 32,  Kd 2048) 0.108 / 0.144 / 0.188 / 0.276
# Since the tile below (WGRAD_TILE, 2026-11-28) one run an expert is fastest in every case measured
# (split 4: down dA 61.1 -> 65.9 us with Zipf routing, 53.2 -> 68 uniform; the others slower still), so
# the default is 1 and the split stays for other tiles and experiments.
WGRAD_SPLIT = int(os.environ.get("LEAN_WGRAD_SPLIT", "1"))  # the env: experiments (tools/gmm_tune.py --wgrad)
WGRAD_SPLIT_MAX_DW = 16384
# gmm_wgrad's (BLOCK_M, BLOCK_K, BLOCK_T, num_warps, num_stages) for 16-bit inputs, every tier: BLOCK_M and
# BLOCK_K at most 64 (narrowed to the rank side), 128 rows a step, 4 warps, 3 stages (98,304 B by the
# pipeline reckoning; arch_fit.json has the compiler's count on every target). Timed on an H200 (sm_90;
# `python tools/gmm_tune.py --wgrad --models a3b [--zipf 0]`, 12 tiles x splits 1 / 4, Qwen3-30B-A3B's
# four calls, P 65,536, E 128), us uniform | Zipf(0.5) routing, the tier tile before (128 x 128 cap, 64
# rows a step, 8 warps, 4 stages; down dA split 4) -> this one: gate_up dB 74.3 -> 73.0 | 71.5 -> 71.3,
# gate_up dA 89.3 -> 78.5 | 110.3 -> 88.0, down dB 159.2 -> 87.2 | 184.4 -> 95.3, down dA 77.7 -> 53.2 |
# 90.2 -> 61.1 (the best of the 12 within 10% in every case). Not timed on other GPUs: chosen to fit.
WGRAD_TILE = tuple(int(v) for v in os.environ.get("LEAN_WGRAD_TILE", "64,64,128,4,3").split(","))  # env: experiments
_FP32 = (64, 64, 32, 4, 3)  # fp32: exact CUDA-core products, the correctness path (49,152 B at s3)


def _wgrad_config(M, Kd, dtype, device):
    """gmm_wgrad's (BLOCK_M, BLOCK_K, BLOCK_T, num_warps, num_stages): the rank side narrowed."""
    if interpreting():
        if not interpret_big(M, Kd, 1 << 10):
            return _pow2(M, 16, 32), _pow2(Kd, 16, 32), 16, 4, 1
        bm = _pow2(M, 16, 2048)
        bk = _pow2(Kd, 16, max(16, 2**20 // bm))
        return bm, bk, _pow2(2**18 // max(bm, bk), 16, 256), 4, 1
    bm, bk, bt, warps, stages = _FP32 if dtype == torch.float32 else WGRAD_TILE
    return _pow2(M, 16, bm), _pow2(Kd, 16, bk), bt, warps, stages


def gmm_wgrad(dw, a, b, offsets, *, gather_a=None, gather_b=None, gather_div=1, scale=None, alpha=1.0):
    """dw (E, M, Kd) fp32 += alpha * sum over expert e's rows of (s_p a[ra(p)])^T b[rb(p)]; see the module docstring."""
    check(a, "a", shape=(None, None), dtype=FLOATS)
    M = a.shape[1]
    check(b, "b", shape=(None, None), dtype=a.dtype, device=a.device)
    Kd = b.shape[1]
    check(dw, "dw", shape=(None, M, Kd), dtype=torch.float32, device=a.device, contiguous=True)
    E = dw.shape[0]
    _offsets(offsets, E, a.device)
    lengths = [len(t) for t in (gather_a, gather_b) if t is not None]
    lengths += [len(t) for t, g in ((a, gather_a), (b, gather_b)) if g is None]
    P = lengths[0]
    if any(n != P for n in lengths):
        raise ValueError(f"gmm_wgrad: row counts disagree: gathers, then a and b where not gathered: {lengths}")
    _rows(gather_a, "gather_a", P, a.device)
    _rows(gather_b, "gather_b", P, a.device)
    if int(gather_div) < 1:
        raise ValueError(f"gather_div: expected >= 1, got {gather_div}")
    vec = idx = None
    if scale is not None:
        vec, idx = scale
        check(vec, "scale vec", shape=(None,), dtype=FLOATS, device=a.device, contiguous=True)
        _rows(idx, "scale index", P, a.device)
    if M == 0 or Kd == 0 or P == 0:
        return
    BM, BK, BT, warps, stages = _wgrad_config(M, Kd, a.dtype, a.device)
    S = wgrad_split(M, Kd)
    part = torch.empty((S, E, M, Kd), dtype=torch.float32, device=a.device) if S > 1 else dw  # (S, E, M, Kd)
    _gmm_wgrad_kernel[(triton.cdiv(M, BM) * triton.cdiv(Kd, BK), E, S)](
        dw, a, b, offsets,
        *(t if t is not None else offsets for t in (gather_a, gather_b)),
        vec if vec is not None else dw, idx if idx is not None else offsets, part,
        M, Kd, int(gather_div), float(alpha),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        GATHER_A=gather_a is not None, GATHER_B=gather_b is not None, SCALE=scale is not None,
        BLOCK_M=BM, BLOCK_K=BK, BLOCK_T=BT, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        SPLIT=S, num_warps=warps, num_stages=stages)
    if S > 1:  # dw += alpha * the runs' partials summed in order (an expert with no row: += 0)
        reduce_partials(dw.view(E * M, Kd), part.view(S, E * M, Kd), alpha, accumulate=True)


def wgrad_split(M, Kd):
    """gmm_wgrad's programs per (tile, expert), each walking one run of the expert's rows (its time
    is the busiest expert's otherwise): WGRAD_SPLIT where dw[e] (M, Kd) is small, else 1. Every
    dtype and the interpreter alike (the CPU tests' small experts split)."""
    return WGRAD_SPLIT if M * Kd <= WGRAD_SPLIT_MAX_DW else 1


def wgrad_scratch(E, M, Kd):
    """Bytes one gmm_wgrad call allocates: the (S, E, M, Kd) fp32 partials when it splits."""
    S = wgrad_split(M, Kd)
    return S * E * M * Kd * 4 if S > 1 else 0
