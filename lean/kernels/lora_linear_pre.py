"""The fused LoRA linear with its rank-R product from a pre-pass, for lora_linear.py (p = 0, 16-bit):
the Hopper path's persistent TMA kernels and the pointer path's kernels, side by side.

Shape legend: N tokens in the packed batch, K input features, O output features, R LoRA rank,
RP the rank padded to a power of two >= 16 (lora_linear_bwd's zero-padded copies of a and b).

Same math, shapes and rounding as lean/kernels/lora_linear.py's fused kernels (see its
docstring): forward y = x W^T + bias + scale * xa B^T with xa = x A^T written; backward kernel 1
dx (=, or +=) dy W + scale * dyb A with dyb = dy B written. The rank-R product comes first, from
a skinny memory-bound kernel (_lora_lowrank_kernel: lora_xa / lora_dyb, one read of x or dy);
then the GEMM's main loop is exactly one of gemm.py's, and the (BLOCK_M, BLOCK_R) xa / dyb tile,
read with pointers, adds its product with the B^T (A) tile in the epilogue (the Hopper forward:
before the main loop, its accumulator starting from that product, LORA_FIRST):
  - Hopper (_lora_linear_fwd_tma_pre_kernel, _lora_linear_bwd_tma_pre_kernel): _matmul_tma_kernel's
    loop (x and W tiles by TMA descriptors, one persistent program per SM walking grouped tiles);
  - pointer (_lora_linear_fwd_pre_kernel, _lora_linear_bwd_pre_kernel): gemm.dot_tile_kmajor (a
    persistent grid, _matmul_kmajor_kernel's x W^T loop) and gemm.dot_tile (one program per tile,
    _matmul_kernel's dy W loop).
(Inside the main loop, as the fused kernels do it, the rank-R product costs an N = 16 wgmma
every K step and 10-20% of the GEMM's speed on an H100: the numbers are beside _TMA_PRE and in
BENCHMARKS.md, "Every GPU".)

Rounding: the rank-R product accumulates in fp32 and is rounded once to x's (dy's) dtype (the
stored xa / dyb); the epilogue multiplies that by scale in fp32, rounds again (exact for
power-of-two scales) and adds its product into the GEMM's fp32 accumulator; one rounding of y
(dx) at the end. The pointer kernels round alike and differ only in summation order (so does the
Hopper forward under LORA_FIRST, which adds the rank-R product first).

    lora_xa(xa, x, a):    xa  (N, R)  = x (N, K) A^T,  a (R, K);  x's dtype, fp32 accumulation
    lora_dyb(dyb, dy, b): dyb (N, RP) = dy (N, O) B,   b (O, RP); dy's dtype, fp32 accumulation

lora_linear picks these kernels when dropout is 0 and the GEMM has at least gemm.TMA_MIN_MACS
multiply-adds (a TMA descriptor costs ~45 us of host time, a pre-pass one more launch; a captured
step lowers the threshold to 0: gemm.tma_at_every_size): the TMA kernels where the inputs are
TMA-describable (16-byte aligned bases and row strides) on an arch that takes TMA, the pointer
kernels for other 16-bit inputs. Nothing is saved here beyond xa (the forward's output).
Supported: the TMA kernels take 16-bit inputs on a GPU (fp32 runs IEEE products on small tiles: a
test path), the pointer kernels 16-bit; R (RP) 1..128; any N, K, O (TMA: with 16-byte rows).
lora_xa / lora_dyb: any float dtype.
Tested: tests/test_lora_linear_pre.py (lora_xa, lora_dyb and the two GEMMs: fp32 and fp16 under the
interpreter with odd sizes, bias, accumulate, rank 5, 8 and 16; bf16 on the H100 at N = 8192
sizes); tests/test_lora_linear.py::test_lora_linear_prepass_kernels (both paths, as lora_linear
picks them).
Speed: tools/lora_bench.py (H100, bf16, against cuBLAS).
Caution:
  - R = 8: the forward's epilogue loads xa's 16-byte rows masked to (BLOCK_M, 16), the pattern that
    once gave a wrong dy B on an H100 inside a main loop (lora_linear.py's Caution); the bf16
    GPU test at R = 8 passes.
  - Not offered: tl.range(flatten=True) on the persistent loop (176 KB of shared memory at R = 16;
    wrong results on the H100 once combined with loads ahead of the main loop; on the H200 10-20%
    slower with the rank-R term last and 0.41-0.56x cuBLAS with it first, while gemm.py's plain
    x W^T gains from it: gemm.TMA_FLAT) and warp
    specialisation (Triton 3.6 on sm_90 ignores it at 8 warps and fails to compile it at 4 warps
    with pointer loads in the epilogue).
  - y, dx must not alias x, dy or w (other programs still read them while tiles are stored).
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import (FLOATS, GROUP_M, dot_tile, dot_tile_kmajor, gemm_config, grouped_tile, interpret_config,
                               interpreting, tma_desc, tma_describable)


@triton.jit
def _lora_lowrank_kernel(
    out_ptr, out2_ptr, out3_ptr,            # (N, R) out each, contiguous: u v rounded to out's dtype
    u_ptr, v_ptr, v2_ptr, v3_ptr,           # u (N, K) row stride stride_u; v (K, R) at k*stride_vk + r*stride_vr
    N, K, R, stride_u, stride_vk, stride_vr,
    NV: tl.constexpr,                       # 1..3 (v, out) pairs sharing u: one read of u for all
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    """out = u v for a skinny v: xa = x A^T (v = a.t(), stride_vk = 1) and dyb = dy B (v = b,
    stride_vr = 1; a unit stride is specialised by Triton, so either load vectorises). With NV > 1,
    out2 = u v2 (and out3 = u v3) too, each the bits it would have alone (same tiles, same order)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    m_ok, r_ok = rm < N, rr < R
    u_ptrs = u_ptr + rm.to(tl.int64)[:, None] * stride_u + rk[None, :]
    v_offs = rk[:, None] * stride_vk + rr[None, :] * stride_vr   # (BLOCK_K, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        v_mask = k_ok[:, None] & r_ok[None, :]
        ut = tl.load(u_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(ut, tl.load(v_ptr + v_offs, mask=v_mask, other=0.0), acc, input_precision=PRECISION)
        if NV > 1:
            acc2 = tl.dot(ut, tl.load(v2_ptr + v_offs, mask=v_mask, other=0.0), acc2, input_precision=PRECISION)
        if NV > 2:
            acc3 = tl.dot(ut, tl.load(v3_ptr + v_offs, mask=v_mask, other=0.0), acc3, input_precision=PRECISION)
        u_ptrs += BLOCK_K
        v_offs += BLOCK_K * stride_vk
    out_offs = rm.to(tl.int64)[:, None] * R + rr[None, :]
    out_mask = m_ok[:, None] & r_ok[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if NV > 1:
        tl.store(out2_ptr + out_offs, acc2.to(out2_ptr.dtype.element_ty), mask=out_mask)
    if NV > 2:
        tl.store(out3_ptr + out_offs, acc3.to(out3_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _lora_linear_fwd_tma_pre_kernel(
    y_ptr,                                  # (N, O) out; with FIRST its descriptor, tiles (BM, BN)
    x_desc, w_desc,                         # descriptors: x (N, K) tiles (BM, BK), w (O, K) (BN, BK)
    xa_ptr, b_ptr, bias_ptr,                # (N, R) from lora_xa; (O, R); (O,) or dummy
    N, K, O, R, stride_y, scale, n_programs,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, FIRST: tl.constexpr,
):
    """FIRST (LORA_FIRST): the rank-R term first, the accumulator starting from it (as gmm's), and
    y's tiles leaving by TMA stores; else the rank-R term after the main loop, pointer stores."""
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(O, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, O, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < N, rn < O
        if FIRST:
            acc = _lora_term(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, rr, r_ok, R, scale,
                             tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                               # gemm.py's TMA main loop
            acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc,
                         input_precision=PRECISION)
        if not FIRST:
            acc = _lora_term(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, rr, r_ok, R, scale, acc, PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if FIRST:
            y_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype))
        else:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_term(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, rr, r_ok, R, scale, acc, PRECISION: tl.constexpr):
    """acc + (scale * xa[rm]) b[rn]^T: xa (N, R) and b (O, R) contiguous, scale applied to xa in fp32
    and rounded to its dtype (the tensor cores take 16-bit operands)."""
    xa_lp = tl.load(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0)
    bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
    return tl.dot(xs, bt, acc, input_precision=PRECISION)


@triton.jit
def _lora_linear_bwd_tma_pre_kernel(
    dx_desc,                                # descriptor: dx (N, K) out (ACCUMULATE: +=), tiles (BM, BN)
    dy_desc, w_desc,                        # descriptors: dy (N, O) tiles (BM, BO), w (O, K) (BO, BN)
    dyb_ptr, a_ptr,                         # (N, R) from lora_dyb; (R, K)
    N, K, O, R, scale, n_programs,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """dx tiles leave by TMA stores (the rows and columns past N, K clipped by the descriptor): the
    store runs asynchronously while the next tile's loads start (H100: 2-4% of the backward GEMM
    over pointer stores, tools/lora_bench.py; the forward's did not gain)."""
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(K, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, K, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for o0 in range(0, O, BLOCK_O):                               # gemm.py's TMA main loop
            acc = tl.dot(dy_desc.load([pid_m * BLOCK_M, o0]), w_desc.load([o0, pid_n * BLOCK_N]), acc,
                         input_precision=PRECISION)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < N, rn < K
        dyb_lp = tl.load(dyb_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :],
                         mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        at = tl.load(a_ptr + rr[:, None] * K + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        dyb_s = (dyb_lp.to(tl.float32) * scale).to(dyb_lp.dtype)
        acc = tl.dot(dyb_s, at, acc, input_precision=PRECISION)
        if ACCUMULATE:
            acc += dx_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]).to(tl.float32)
        dx_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(dx_desc.dtype))


@triton.jit
def _lora_linear_fwd_pre_kernel(
    y_ptr,                                  # (N, O) out
    x_ptr, w_ptr, xa_ptr, b_ptr, bias_ptr,  # (N, K) row stride stride_x; (O, K); (N, R) from the pre-pass; (O, R); (O,) or dummy
    N, K, O, R, stride_x, stride_y, scale, n_programs,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The pointer path's forward with xa from a pre-pass (lora_linear_pre.lora_xa, p = 0, 16-bit):
    gemm.py's _matmul_kmajor_kernel main loop (a persistent grid, rows and columns past the edges
    read wrapped, no load mask when BLOCK_K divides K), then _lora_linear_fwd_tma_pre_kernel's
    epilogue. The fused kernel above pays an N = 16 MMA every K step for xa inside its loop."""
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(O, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, O, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = dot_tile_kmajor(x_ptr, w_ptr, rm, rn, N, O, K, stride_x, K,      # b = W^T: column stride K
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, "tf32")
        m_ok, n_ok = rm < N, rn < O
        xa_lp = tl.load(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                        other=0.0)
        bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
        acc = tl.dot(xs, bt, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_linear_bwd_pre_kernel(
    dx_ptr,                                 # (N, K) out (ACCUMULATE: +=), row stride stride_dx
    dy_ptr, w_ptr, dyb_ptr, a_ptr,          # (N, O) row stride stride_dy; (O, K); (N, R) from the pre-pass; (R, K)
    N, K, O, R, stride_dx, stride_dy, scale,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The pointer path's backward kernel 1 with dyb from a pre-pass (lora_linear_pre.lora_dyb, p = 0,
    16-bit): gemm.py's _matmul_kernel main loop for dy W (one program per tile), then
    _lora_linear_bwd_tma_pre_kernel's epilogue. The fused kernel above pays an N = 16 MMA every O step
    for dy B inside its loop."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, K, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # columns of dx (K)
    rr = tl.arange(0, BLOCK_R)
    m_ok, n_ok, r_ok = rm < N, rn < K, rr < R
    acc = dot_tile(dy_ptr, w_ptr, rm, rn, N, K, O, stride_dy, 1, K, 1,  # dy (N, O) @ W (O, K)
                   BLOCK_M, BLOCK_N, BLOCK_O, "tf32")
    dyb_lp = tl.load(dyb_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                     other=0.0)
    at = tl.load(a_ptr + rr[:, None] * K + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    dyb_s = (dyb_lp.to(tl.float32) * scale).to(dyb_lp.dtype)
    acc = tl.dot(dyb_s, at, acc)
    dx_ptrs = dx_ptr + rm.to(tl.int64)[:, None] * stride_dx + rn[None, :]
    if ACCUMULATE:
        acc += tl.load(dx_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Launch configurations (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), 16-bit, H100.
# tools/lora_bench.py, H100, bf16, N = 8192, R = 16, CUDA-graph medians, whole ops (pre-pass
# included), x cuBLAS's base GEMM alone: forward 0.82-0.95x (Llama-3.2-1B q/o 0.79-0.85, gate/up
# 0.92-0.94, down 0.89-0.91; Qwen3-8B MLP 0.84-0.95), backward kernel 1 0.76-1.02x. The earlier
# form with the rank-R product inside the main loop (an N = 16 wgmma every K step) measured
# 0.73-0.81x forward and 0.74-0.85x backward on the same shapes, in the same runs; gemm.py's plain
# TMA loop (no LoRA) 0.87-1.06x. Loading the epilogue's xa / B tiles before the main loop instead
# of after it: within noise (+-4%, both signs). s4 within 3% of s3.
_TMA_PRE = (128, 256, 64, 8, 3)
# The forward's rank-R term first and y stored by TMA (LORA_FIRST): H200, tools/lora_bench.py
# ("first store" against "pre", x cuBLAS): 0.75-0.94x -> 0.77-0.95x over eight shapes, +4-6% at
# Qwen3-0.6B's (K 1024 / 3072), -4% at 8192 -> 2048, within 1% elsewhere; either change alone
# ("first", "store") less. Graph steps, LEAN_LORA_FIRST=1|0 interleaved, three pairs on one H200:
# Qwen3-0.6B 121,242 / 121,166 / 120,671 against 120,540 / 120,287 / 120,608 tok/s (+0.45%),
# Llama-3.2-1B 88,605 / 88,573 / 88,190 against 88,001 / 88,754 / 88,369 (+0.1%, the spread).
LORA_FIRST = os.environ.get("LEAN_LORA_FIRST", "1") != "0"
_TMA_PRE_FP32 = (64, 64, 32, 4, 2)      # fp32 test path (IEEE products): untuned
# The pointer kernels take gemm.py's tiles (gemm_config), whose main loops they share: the forward
# _matmul_kmajor_kernel's x W^T tile, the backward _matmul_kernel's dy W tile (128x256x64, 3 stages
# on sm_86: 98,304 B; H100 numbers in BENCHMARKS.md, "Every GPU").
# lora_xa / lora_dyb (BLOCK_M, BLOCK_K, num_warps, num_stages): untuned. Memory-bound: 64 rows a
# program gives 128 programs at N = 8192 (one wave on 132 SMs) with 4 stages of 16 KB x tiles in
# flight each (cp.async, 16-byte vectors); smaller N: 32 or 16 rows, >= 116 programs where N allows.
_LOWRANK = (64, 128, 4, 4)
_LOWRANK_FP32 = (64, 32, 4, 3)          # 4-byte tiles: within shared memory up to R = 128; untuned


def _n_programs(tiles, device):
    """Persistent grid: one program per SM; under the interpreter 3, so each walks several tiles
    (the GPU's path) and the CPU tests stay fast."""
    return min(tiles, 3 if interpreting() else arch(device).sms)


def _lowrank(out, u, v, more=()):
    """out (N, R) = u (N, K) v (K, R) on _lora_lowrank_kernel; v any 2-D view of a contiguous tensor.
    more: up to two further (out, v) pairs of the same shapes and strides, from the same read of u."""
    (N, K), R = u.shape, v.shape[1]
    outs, vs = [out] + [o for o, _ in more], [v] + [w for _, w in more]
    outs, vs = outs + [out] * (3 - len(outs)), vs + [v] * (3 - len(vs))  # unused slots: never read
    if interpreting():
        BM, _, BK, warps, stages = interpret_config(N, R, K)
    else:
        BM, BK, warps, stages = _LOWRANK_FP32 if u.dtype == torch.float32 else _LOWRANK
        sms = arch(u.device).sms
        while BM > 16 and triton.cdiv(N, BM) < sms - sms // 8:
            BM //= 2
    _lora_lowrank_kernel[(triton.cdiv(N, BM),)](
        *outs, u, *vs, N, K, R, u.stride(0), v.stride(0), v.stride(1), NV=1 + len(more),
        BLOCK_M=BM, BLOCK_K=BK, BLOCK_R=max(16, triton.next_power_of_2(R)),
        PRECISION="ieee" if u.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)


def lora_xa(xa, x, a):
    """xa (N, R) = x (N, K) A^T, a (R, K); x's dtype, fp32 accumulation rounded once."""
    check(x, "x", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    N, K = x.shape
    check(a, "a", shape=(None, K), dtype=x.dtype, device=x.device, contiguous=True)
    R = a.shape[0]
    check(xa, "xa", shape=(N, R), dtype=x.dtype, device=x.device, contiguous=True)
    if not 1 <= R <= 128:
        raise ValueError(f"a: LoRA rank R={R} outside the supported 1..128")
    if N > 0:
        _lowrank(xa, x, a.t())


def lora_xa_shared(xas, x, as_):
    """xas[i] (N, R) = x (N, K) as_[i]^T for up to three LoRA A (R, K) of projections that share
    their input (q/k/v, gate/up): one read of x. Each xa holds the bits lora_xa would write."""
    if not 1 <= len(xas) == len(as_) <= 3:
        raise ValueError(f"lora_xa_shared: 1 to 3 (xa, a) pairs, got {len(xas)} xa and {len(as_)} a")
    check(x, "x", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    N, K = x.shape
    R = as_[0].shape[0]
    for i, (xa, a) in enumerate(zip(xas, as_)):
        check(a, f"a[{i}]", shape=(R, K), dtype=x.dtype, device=x.device, contiguous=True)
        check(xa, f"xa[{i}]", shape=(N, R), dtype=x.dtype, device=x.device, contiguous=True)
    if not 1 <= R <= 128:
        raise ValueError(f"a: LoRA rank R={R} outside the supported 1..128")
    if N > 0:
        _lowrank(xas[0], x, as_[0].t(), [(xa, a.t()) for xa, a in zip(xas[1:], as_[1:])])


def lora_dyb(dyb, dy, b):
    """dyb (N, RP) = dy (N, O) B, b (O, RP); dy's dtype, fp32 accumulation rounded once."""
    check(dy, "dy", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    N, O = dy.shape
    check(b, "b", shape=(O, None), dtype=dy.dtype, device=dy.device, contiguous=True)
    RP = b.shape[1]
    check(dyb, "dyb", shape=(N, RP), dtype=dy.dtype, device=dy.device, contiguous=True)
    if not 1 <= RP <= 128:
        raise ValueError(f"b: LoRA rank {RP} outside the supported 1..128")
    if N > 0:
        _lowrank(dyb, dy, b)


def _pre_config(M, N, K, dtype, config):
    if config is not None:
        return config
    if interpreting():
        return interpret_config(M, N, K)
    return _TMA_PRE_FP32 if dtype == torch.float32 else _TMA_PRE


def _fwd_tma_pre(y, xa, x, w, a, b, scale, bias, BR, *, config=None, xa_ready=False):
    """lora_linear_fwd (p = 0) on the Hopper path: xa by lora_xa's kernel (unless xa_ready), then
    _lora_linear_fwd_tma_pre_kernel. config (BM, BN, BK, warps, stages): tools/lora_bench.py only."""
    (N, K), O, R = x.shape, w.shape[0], a.shape[0]
    if not xa_ready:
        _lowrank(xa, x, a.t())                                        # xa (N, R)
    BM, BN, BK, warps, stages = _pre_config(N, O, K, x.dtype, config)
    n_programs = _n_programs(triton.cdiv(N, BM) * triton.cdiv(O, BN), x.device)
    first = LORA_FIRST and tma_describable(y)
    _lora_linear_fwd_tma_pre_kernel[(n_programs,)](
        tma_desc(y, (BM, BN)) if first else y, tma_desc(x, (BM, BK)), tma_desc(w, (BN, BK)), xa, b,
        bias if bias is not None else y, N, K, O, R, y.stride(0), float(scale), n_programs,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=GROUP_M, FIRST=first,
        num_warps=warps, num_stages=stages)


def _bwd_tma_pre(dx, dyb, dy, w, a, b, scale, accumulate, *, config=None):
    """lora_linear_bwd's kernel 1 (p = 0, dx wanted; a, b padded to the rank RP of dyb) on the
    Hopper path: dyb by lora_dyb's kernel, then _lora_linear_bwd_tma_pre_kernel."""
    (N, O), K, RP = dy.shape, w.shape[1], dyb.shape[1]
    _lowrank(dyb, dy, b)                                              # dyb (N, RP)
    BM, BN, BO, warps, stages = _pre_config(N, K, O, dy.dtype, config)
    n_programs = _n_programs(triton.cdiv(N, BM) * triton.cdiv(K, BN), dy.device)
    _lora_linear_bwd_tma_pre_kernel[(n_programs,)](
        tma_desc(dx, (BM, BN)), tma_desc(dy, (BM, BO)), tma_desc(w, (BO, BN)), dyb, a,
        N, K, O, RP, float(scale), n_programs,
        ACCUMULATE=bool(accumulate), PRECISION="ieee" if dy.dtype == torch.float32 else "tf32",
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_O=BO, BLOCK_R=RP, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)


def _fwd_ptr_pre(y, xa, x, w, a, b, scale, bias, BR, *, xa_ready=False):
    """lora_linear_fwd (p = 0, 16-bit) on the pointer path: xa by lora_xa's kernel (unless
    xa_ready), then _lora_linear_fwd_pre_kernel on gemm.py's x W^T tiles."""
    (N, K), O, R = x.shape, w.shape[0], a.shape[0]
    if not xa_ready:
        lora_xa(xa, x, a)
    BM, BN, BK, warps, stages = gemm_config(N, O, x.dtype, arch(x.device), b_kmajor=True, K=K)
    n_programs = _n_programs(triton.cdiv(N, BM) * triton.cdiv(O, BN), x.device)
    _lora_linear_fwd_pre_kernel[(n_programs,)](
        y, x, w, xa, b, bias if bias is not None else y,
        N, K, O, R, x.stride(0), y.stride(0), float(scale), n_programs,
        HAS_BIAS=bias is not None, EVEN_K=K % BK == 0,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)


def _bwd_ptr_pre(dx, dyb, dy, w, a, b, scale, accumulate):
    """lora_linear_bwd's kernel 1 (p = 0, 16-bit, dx wanted; a, b padded to dyb's rank RP) on the
    pointer path: dyb by lora_dyb's kernel, then _lora_linear_bwd_pre_kernel on gemm.py's dy W tiles."""
    (N, O), K, RP = dy.shape, w.shape[1], dyb.shape[1]
    lora_dyb(dyb, dy, b)
    BM, BN, BO, warps, stages = gemm_config(N, K, dy.dtype, arch(dy.device), K=O)
    _lora_linear_bwd_pre_kernel[(triton.cdiv(N, BM) * triton.cdiv(K, BN),)](
        dx, dy, w, dyb, a, N, K, O, RP, dx.stride(0), dy.stride(0), float(scale),
        ACCUMULATE=bool(accumulate), BLOCK_M=BM, BLOCK_N=BN, BLOCK_O=BO, BLOCK_R=RP, GROUP_M=GROUP_M,
        num_warps=warps, num_stages=stages)
