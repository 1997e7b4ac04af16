"""Grouped expert GEMM of a MoE MLP: every sorted slot's row times its own expert's weight (gmm),
routing read from the device. The weight gradient of the same grouping: gmm_wgrad.py.

Shape legend: P rows (slots, sorted by expert), E experts, O output columns, Kd the reduced dim,
X rows of x (N tokens when gathered, else P), R LoRA rank.

    offsets (E+1,) int32, on the device: rows offsets[e] .. offsets[e+1]-1 belong to expert e
            (sorted, offsets[0] = 0, offsets[E] = P; an expert may own no row)
    gmm:       y[p] = x[r(p)] @ w[e(p)]^T  [+ scale * xa[p] @ b[e(p)]^T]  [+ bias[e(p)]]  [+ y[p]]
               r(p) = gather[p] // gather_div, else p; fp32 accumulation, one rounding to y's dtype
               (the LoRA term first: its fp32 sum times scale, then the base products onto it)
      y  (P, O)      bf16 / fp16 / fp32, unit last-dim stride
      x  (X, Kd)     bf16 / fp16 / fp32, any strides
      w  (E, O, Kd)  x's dtype, a unit stride in one of its last two dims (w.transpose(1, 2) of an
                     (E, Kd, O) weight is taken without a copy)
      gather (P,) int32; lora = (xa (P, R), b (E, O, R) strided, scale: float), x's dtype
      bias (E, O)    x's dtype or fp32, unit last-dim stride: each row's expert's bias, added in the
                     epilogue in fp32 (frozen: no gradient is computed for it)

GPT-OSS (transformers 5.24 layout: gate_up_proj (E, C, 2F), down_proj (E, F, C), biases (E, 2F), (E, C)):
    gate/up  gmm(h_s, n2, gate_up_proj.transpose(1, 2), off, gather=order, gather_div=K, bias=gate_up_proj_bias)
    down     gmm(y_s, act_s, down_proj.transpose(1, 2), off, bias=down_proj_bias)
Uses (Qwen3-MoE, /work/moe-plan.md; n2 (N, C), order the slot order, K top-k):
    gate/up  gmm(h_s, n2, Wgu, off, gather=order, gather_div=K, lora=(xa_s, B, s))  Wgu (E, 2F, C)
    LoRA xa  gmm(xa_s, n2, A, off, gather=order, gather_div=K)        A (E, R, C): O = R, BLOCK_N 16
    down     gmm(y_s, act_s, Wd, off, lora=(xad_s, Bd, s))             Wd (E, C, F)
    dX       gmm(dX_s, dh_s, Wgu.transpose(1, 2), off, lora=(dhb_s, A.transpose(1, 2), s))
    G        gmm(G_s, g, Wd.transpose(1, 2), off, gather=order, gather_div=K)
    dB       gmm_wgrad(dB, dh_s, xa_s, off, alpha=s)                   M = 2F, Kd = R
    dA       gmm_wgrad(dA, dhb_s, n2, off, gather_b=order, gather_div=K, alpha=s)   M = R, Kd = C
    dBd      gmm_wgrad(dBd, g, xad_s, off, gather_a=order, gather_div=K, scale=(w, order), alpha=s)

gmm's grid: an upper bound of the M-tiles from P and E alone, (P + min(E, P) * (BLOCK_M - 1)) //
BLOCK_M (<= cdiv(P, BLOCK_M) + E), times the N-tiles, in gemm's grouped order. Each program loads
offsets, counts every expert's tiles and their prefix in registers, finds the expert and rows it
owns, and exits when past the last tile: no host read, so a step captures in a CUDA graph.
An expert's last M-tile holding at most TAIL_M = BLOCK_M / 2 rows runs as a (TAIL_M, BLOCK_N) tile
(the same body, _gmm_tile, at the shorter height; TAIL below): half the tensor-core work of the rows
it would otherwise spend on masked rows.
Loads (W_DESC): where the arch table takes the Hopper path (gemm.tma_ok: 16-bit, TMA-describable,
at least TMA_MIN_MACS multiply-adds or a step being captured), w's tiles come through one TMA
descriptor over the experts stacked as (E*O, Kd) rows (w contiguous) or (E*Kd, O) rows (w the
transpose of a contiguous weight), and x's through another when x is not gathered (a gathered x
keeps its pointer loads); the products and their order are the pointer loop's, so y is the same
bits (H100: 24 Qwen3-30B-A3B / gpt-oss-20b cases compared bitwise).

Supported: E <= 1024, any P, O, Kd, R, M >= 0; bf16/fp16 on the tensor cores with fp32
accumulation, fp32 with exact IEEE products (input_precision="ieee"), the correctness path.
Tested: tests/test_grouped_gemm.py: fp32 (tight) and fp16 (the tolerance rule) under the CPU
interpreter: P 1..37, odd O / Kd, E 1, 3, 8, empty experts (first, last, middle), all rows on one
expert, gather_div 1/2/4, transposed w, LoRA, accumulate, per-expert bias (model dtype and fp32,
with gather, LoRA, transposed w, accumulate), guard rows and columns around y, bitwise repeatability,
the rows the short tail tile takes (exactly the experts' last tiles of at most TAIL_M rows); gmm's
cases again on the descriptor
loads (forced on the CPU; row strides padded to 16 bytes, odd sizes), their tiles running into the
neighbouring experts' rows. Its bf16 GPU test (Qwen3-30B-A3B sizes) passes on the H100. Every launch of
those shapes, bf16 and fp32, compiles for sm_80/86/90/120 within shared memory (triton.compile with
GPUTarget, as tools/arch_compile.py; at most 65,536 B on sm_86/120, 196,608 B on sm_90 (its timed
128 x 256 tile), 131,088 B on sm_100).
Speed (H100, bf16, tools/gmm_tune.py: triton do_bench, L2 flushed; 8192 tokens, zipf routing; the
tile TUNED["sm_90"], against torch._grouped_mm on pre-gathered rows, + a second grouped GEMM and an
add for the LoRA), descriptor loads: Qwen3-30B-A3B (P 65,536, E 128, C 2048, F 768) gate/up + LoRA
0.840 ms (1.31x torch), down + LoRA 0.491 (1.75x), dX + LoRA 0.864 (1.42x), without LoRA gate/up
0.792 (0.93x; pointer loads 0.878, 0.86x), down 0.440 (1.07x; 0.507), dX 0.808 (0.814); gpt-oss-20b
(P 32,768, E 32, C = F = 2880) 1.932 (1.20x), 0.944 (1.29x), 1.938 (1.09x).
gmm's feature flags are GATHER, LORA, BIAS, ACCUMULATE: four, STYLE's limit (PRECISION follows the dtype
and W_DESC the arch and the weight's layout, not variants). BIAS is a flag of its own rather than folded
into ACCUMULATE (an epilogue mode) because GPT-OSS's gate_up and down both need it and dX may meet it; a fifth
variant (MXFP4 weights) is a new kernel (lean/kernels/mxfp4.py's gmm_mxfp4). With BIAS, gpt-oss-20b's
gate_up launch (gathered, LoRA, bias) compiles to 65,536 B on sm_86/120, 98,304 on sm_80, 196,608 on sm_90.
Caution:
  - y must not alias x, xa, w, b or bias. The kernels trust offsets (sorted, offsets[E] = P) and the
    gathers (every r(p) < X): nothing on the device checks them.
  - row offsets are int64; the per-step K advance BLOCK_K * stride is int32 (launcher checks it).
  - gmm's tile on the H100 (TUNED["sm_90"]) is timed: tools/gmm_tune.py, 128 x 256 x 64, 8 warps, 4
    stages won the eight cases of gpt-oss-20b and Qwen3-30B-A3B without LoRA (1.14-1.26x the tier's
    128 x 128) and the six with it (1.16-1.26x, the LoRA summed first);
    the tiers (sm90 on a B200, sm80, sm86) are chosen to fit, not timed.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import (FLOATS, GROUP_M, grouped_tile, interpret_config, interpret_big, interpreting, tma_desc,
                               tma_ok)

MAX_E = 1024


@triton.jit
def _expert_of_tile(off_ptr, E, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row, total M-tiles) of M-tile pid_m: experts' tiles laid end to end."""
    ar = tl.arange(0, BLOCK_E)
    lo = tl.load(off_ptr + ar, mask=ar < E, other=0)
    hi = tl.load(off_ptr + ar + 1, mask=ar < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M              # 0 for an empty expert and past E
    ends = tl.cumsum(tiles, 0)                              # inclusive prefix
    e = tl.sum((ends <= pid_m).to(tl.int32), 0)             # first expert whose tiles reach past pid_m
    mine = ar == e
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return e, row0, tl.sum(tl.where(mine, hi, 0), 0), tl.sum(tiles, 0)


@triton.jit
def _lora_first(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, e64, R, scale, stride_am, stride_ar, stride_be, stride_bo,
                stride_br, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                PRECISION: tl.constexpr):
    """scale * xa[rm] b[e]^T[:, rn], (BLOCK_M, BLOCK_N) fp32: the LoRA term's own fp32 sum, scaled in
    fp32, which gmm's main loop (and gmm_mxfp4's) then accumulates onto. One accumulator: a second
    one summed after the main loop doubled the live registers and spilled at the 128 x 256 tile
    (tools/gmm_tune.py on the H100: the +LoRA cases at 0.73x of the 128 x 128 tile with it)."""
    rr = tl.arange(0, BLOCK_R)
    a_ptrs = xa_ptr + rm.to(tl.int64)[:, None] * stride_am + rr[None, :] * stride_ar
    b_ptrs = b_ptr + e64 * stride_be + rr[:, None] * stride_br + rn.to(tl.int64)[None, :] * stride_bo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_ok = rr < R - r0
        at = tl.load(a_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(at, bt, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_R * stride_ar
        b_ptrs += BLOCK_R * stride_br
    return acc * scale


@triton.jit
def _gmm_kernel(
    y_ptr,                                  # (P, O) out, row stride stride_ym, unit col stride
    x_ptr, w_ptr, off_ptr, gather_ptr,      # x (X, Kd), w (E, O, Kd) strided; offsets (E+1,); gather (P,)
    xa_ptr, b_ptr,                          # LoRA: xa (P, R), b (E, O, R) strided
    bias_ptr,                               # bias (E, O), unit stride over O
    O, Kd, R, E, tiles_m, gather_div, scale,
    stride_ym, stride_xm, stride_xk, stride_we, stride_wo, stride_wk,
    stride_am, stride_ar, stride_be, stride_bo, stride_br, stride_biase,
    GATHER: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    W_DESC: tl.constexpr,                   # the Hopper loads (not a feature: the arch's path, as PRECISION
                                            # is the dtype's): 0 pointers; 1 w_ptr a descriptor of w as
                                            # (E*O, Kd) rows, 2 of w as (E*Kd, O) rows (w^T contiguous);
                                            # with 1 or 2 and no GATHER, x_ptr a descriptor of x (P, Kd)
    TAIL_M: tl.constexpr,                   # an expert's last tile of at most TAIL_M rows runs as a (TAIL_M,
    xt_ptr,                                 # BLOCK_N) tile (0: never); xt_ptr: x_ptr, or x's descriptor for it
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tiles_m * BLOCK_M, O, BLOCK_M, BLOCK_N, GROUP_M)
    e, row0, row_end, total = _expert_of_tile(off_ptr, E, pid_m, BLOCK_M, BLOCK_E)
    if pid_m >= total:                      # past the last tile of the last expert
        return
    if TAIL_M > 0:
        if row_end - row0 <= TAIL_M:        # the expert's short last tile: half the tensor-core work
            _gmm_tile(y_ptr, xt_ptr, w_ptr, gather_ptr, xa_ptr, b_ptr, bias_ptr, e, row0, row_end, pid_n,
                      O, Kd, R, gather_div, scale, stride_ym, stride_xm, stride_xk, stride_we, stride_wo,
                      stride_wk, stride_am, stride_ar, stride_be, stride_bo, stride_br, stride_biase,
                      GATHER, LORA, BIAS, ACCUMULATE, TAIL_M, BLOCK_N, BLOCK_K, BLOCK_R, PRECISION, W_DESC)
            return
    _gmm_tile(y_ptr, x_ptr, w_ptr, gather_ptr, xa_ptr, b_ptr, bias_ptr, e, row0, row_end, pid_n,
              O, Kd, R, gather_div, scale, stride_ym, stride_xm, stride_xk, stride_we, stride_wo,
              stride_wk, stride_am, stride_ar, stride_be, stride_bo, stride_br, stride_biase,
              GATHER, LORA, BIAS, ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, PRECISION, W_DESC)


@triton.jit
def _gmm_tile(y_ptr, x_ptr, w_ptr, gather_ptr, xa_ptr, b_ptr, bias_ptr, e, row0, row_end, pid_n,
              O, Kd, R, gather_div, scale, stride_ym, stride_xm, stride_xk, stride_we, stride_wo, stride_wk,
              stride_am, stride_ar, stride_be, stride_bo, stride_br, stride_biase,
              GATHER: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
              PRECISION: tl.constexpr, W_DESC: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) tile of y at rows row0.. (< row_end, expert e's) and column block pid_n."""
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < row_end
    n_ok = rn < O
    if GATHER:                              # the prologue gather: row r(p) of x
        rx = tl.load(gather_ptr + rm, mask=m_ok, other=0) // gather_div
    else:
        rx = rm
    e64 = e.to(tl.int64)
    if W_DESC == 0 or GATHER:
        x_ptrs = x_ptr + rx.to(tl.int64)[:, None] * stride_xm + rk[None, :] * stride_xk
    if W_DESC == 0:
        w_ptrs = w_ptr + e64 * stride_we + rk[:, None] * stride_wk + rn.to(tl.int64)[None, :] * stride_wo
    if LORA:                                # the LoRA term first, the main loop onto it (_lora_first)
        acc = _lora_first(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, e64, R, scale, stride_am, stride_ar,
                          stride_be, stride_bo, stride_br, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_DESC == 0:
        for k0 in range(0, Kd, BLOCK_K):
            k_ok = rk < Kd - k0
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)    # w[e]^T tile (BK, BN)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    else:
        # Descriptor tiles are not clipped to the expert: columns past O read the next expert's
        # weight rows (mode 1) and rows past row_end the next expert's x rows, all into outputs the
        # store masks; K past Kd reads zeros (mode 1, and x's descriptor) or the next expert's rows
        # (mode 2) against x columns that are zero, gathered (masked) or not (the descriptor's edge).
        for k0 in range(0, Kd, BLOCK_K):
            if GATHER:
                xt = tl.load(x_ptrs, mask=m_ok[:, None] & (rk < Kd - k0)[None, :], other=0.0)
                x_ptrs += BLOCK_K * stride_xk
            else:
                xt = x_ptr.load([row0, k0])
            if W_DESC == 1:
                wt = w_ptr.load([e * O + pid_n * BLOCK_N, k0]).T                     # (BK, BN)
            else:
                wt = w_ptr.load([e * Kd + k0, pid_n * BLOCK_N])
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
    if BIAS:                                # the expert's bias row, in fp32
        acc += tl.load(bias_ptr + e64 * stride_biase + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launch configuration (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for 16-bit inputs, per
# arch tier; untuned. Shared memory by the pipeline reckoning stages * (BM*BK + BK*BN) * 2 B:
# sm90 / sm80 128x128x64 s4: 131,072 B (232,448 / 166,912 B available); sm86 s3: 98,304 B even
# counting every stage (mma.sync keeps stages - 1 buffers: 65,536 B) under 101,376 B. gmm narrows
# BLOCK_N to the output (LoRA xa: O = R, down to 16); the LoRA loop's tiles (BLOCK_R <= 64) are
# smaller than the main loop's.
TILES = {
    "sm90": (128, 128, 64, 8, 4),
    "sm80": (128, 128, 64, 8, 4),
    "sm86": (128, 128, 64, 8, 3),
}
# By arch (Arch.name), ahead of the tier's: tiles timed on that GPU. sm_90: tools/gmm_tune.py on the
# H100, the best of 12 candidates in every case of gpt-oss-20b and Qwen3-30B-A3B without LoRA (1.14-
# 1.26x the tier's 128 x 128) and, with the LoRA summed first into the one accumulator, 1.16-1.26x
# with it. Not for sm_100, which reads the sm90 tier: ptxas-blackwell fails on this tile with LoRA
# (tools/arch_compile.py; with the LoRA's own accumulator, as before the change).
TUNED = {"sm_90": (128, 256, 64, 8, 4)}
# The short tail tile (gmm's TAIL_M = BLOCK_M / 2): an expert's rows rarely fill its last M-tile, and
# a full tile's tensor-core work is spent on masked rows. With P = 65,536 rows over 128 experts
# (Qwen3-30B-A3B, 8192 tokens, uniform routing) 128-row tiles compute 11.9% more rows than there are;
# with the expert's last tile at 64 rows where its rows fit, 5.9% (gpt-oss-20b: 5.1% -> 2.3%).
# H200, bf16, 128 x 256 tiles, ms off -> on (tools/gmm_tune.py --configs 128,256,64,8,4 --tail 0,1
# --zipf 0): Qwen3-30B-A3B gate_up+LoRA 0.828 -> 0.789, down+LoRA 0.482 -> 0.458, dX+LoRA 0.861 ->
# 0.790, G 0.393 -> 0.391; gpt-oss-20b 1.962 -> 1.899, 1.009 -> 0.940, 1.826 -> 1.872, 0.959 -> 0.999
# (its experts' 1,024 rows: fewer tails, the spread of a rerun). The cut steps, lean+graph tok/s in
# one call: Qwen3-30B-A3B packed 114,049 -> 114,798, padded 112,081 -> 113,977; gpt-oss-20b packed
# 67,142 -> 67,585 (BENCHMARKS.md). The env switch: before/after experiments.
TAIL = os.environ.get("LEAN_GMM_TAIL", "1") != "0"
# Narrow outputs (O <= 64: the LoRA's rank-R calls xa = x A^T, g B, dh B) take 4 warps: 8 warps on a
# 128 x 16 tile leave each warp a sliver. H200, bf16, Qwen3-30B-A3B, uniform routing (tools/gmm_tune.py
# --rank --models a3b --zipf 0), ms at w8 -> w4 (the tier's 128 x 64 s4 tile, BLOCK_N narrowed to O):
# xa down (O 16, Kd 768) 0.125 -> 0.039, xa gate_up (O 32) 0.059 -> 0.058, g Bd 0.049 -> 0.048, dh B
# 0.069 -> 0.069; the best of 10 candidates in any case within 6% of w4's. Untimed on the other
# tiers (the same rule). The env switch: before/after experiments.
NARROW_WARPS = 4 if os.environ.get("LEAN_GMM_NARROW", "1") != "0" else 0
_FP32 = (64, 64, 32, 4, 3)        # fp32: exact CUDA-core products, correctness path (49,152 B at s3)
_INTERPRET = (16, 32, 32, 4, 1)   # interpreter, test shapes: several tiles per expert and per dim


def _pow2(n, lo, hi):
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _config(rows, O, Kd, dtype, device):
    """gmm's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); rows: mean rows per expert."""
    if interpreting():  # few, large programs (the interpreter runs them one by one), as gemm's chooser
        return interpret_config(rows, O, Kd) if interpret_big(rows, O, Kd) else _INTERPRET
    a = arch(device)
    real, _, emulated = a.name.partition(" as ")  # LEAN_ARCH: "sm_90 as sm_86" chooses as sm_86 would
    tuned = TUNED.get(real) if emulated in ("", real) else None
    bm, bn, bk, warps, stages = _FP32 if dtype == torch.float32 else tuned or TILES[a.tier]
    if O <= 64 and NARROW_WARPS and dtype != torch.float32:
        warps = NARROW_WARPS
    return bm, _pow2(O, 16, bn), bk, warps, stages


def _check_unit(t, name):
    if t.stride(-1) != 1 and t.stride(-2) != 1 and min(t.shape[-2:]) > 1:
        raise ValueError(f"{name}: expected a unit stride in one of the last two dims, got strides {t.stride()}")


def _offsets(offsets, E, device):
    check(offsets, "offsets", shape=(E + 1,), dtype=torch.int32, device=device, contiguous=True)
    if not 1 <= E <= MAX_E:
        raise ValueError(f"offsets: expected 1..{MAX_E} experts, got {E}")


def _rows(t, name, P, device):
    if t is not None:
        check(t, name, shape=(P,), dtype=torch.int32, device=device, contiguous=True)


def gmm(y, x, w, offsets, *, gather=None, gather_div=1, lora=None, bias=None, accumulate=False):
    """y (P, O) = x[r(p)] (X, Kd) @ w[e(p)] (E, O, Kd)^T [+ scale * xa b[e(p)]^T] [+ bias[e(p)]] [+ y];
    see the module docstring."""
    check(x, "x", shape=(None, None), dtype=FLOATS)
    X, Kd = x.shape
    check(w, "w", shape=(None, None, Kd), dtype=x.dtype, device=x.device)
    E, O = w.shape[:2]
    _check_unit(w, "w")
    check(y, "y", shape=(None, O), dtype=FLOATS, device=x.device, last_contiguous=True)
    P = y.shape[0]
    _offsets(offsets, E, x.device)
    _rows(gather, "gather", P, x.device)
    if gather is None and X != P:
        raise ValueError(f"x: expected {P} rows (one per row of y, no gather), got {X}")
    if int(gather_div) < 1:
        raise ValueError(f"gather_div: expected >= 1, got {gather_div}")
    xa = b = None
    R, scale = 0, 0.0
    if lora is not None:
        xa, b, scale = lora
        check(xa, "lora xa", shape=(P, None), dtype=x.dtype, device=x.device)
        R = xa.shape[1]
        check(b, "lora b", shape=(E, O, R), dtype=x.dtype, device=x.device)
    if bias is not None:
        check(bias, "bias", shape=(E, O), dtype=(x.dtype, torch.float32), device=x.device, last_contiguous=True)
    if P == 0 or O == 0:
        return
    BM, BN, BK, warps, stages = _config(triton.cdiv(P, E), O, Kd, x.dtype, x.device)
    if BK * max(x.stride(1), w.stride(2)) >= 2**31:
        raise ValueError("gmm: K-stride too large for int32 pointer steps (call .contiguous())")
    tiles_m = (P + min(E, P) * (BM - 1)) // BM  # >= sum_e cdiv(rows_e, BM): sum of floors <= floor of sum
    BR = _pow2(R, 16, 64)
    nul = y  # unused pointer slots
    TM = tail_rows(BM)
    mode, x_src, w_src, xt_src = _loads(x, w, gather is not None, P * O * Kd, BM, BN, BK, TM)
    _gmm_kernel[(tiles_m * triton.cdiv(O, BN),)](
        y, x_src, w_src, offsets, gather if gather is not None else offsets,
        xa if xa is not None else nul, b if b is not None else nul, bias if bias is not None else nul,
        O, Kd, R, E, tiles_m, int(gather_div), float(scale),
        y.stride(0), x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        *(xa.stride() if xa is not None else (0, 0)), *(b.stride() if b is not None else (0, 0, 0)),
        bias.stride(0) if bias is not None else 0,
        GATHER=gather is not None, LORA=lora is not None, BIAS=bias is not None, ACCUMULATE=bool(accumulate),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, BLOCK_E=_pow2(E, 16, MAX_E), GROUP_M=GROUP_M,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", W_DESC=mode, TAIL_M=TM, xt_ptr=xt_src,
        num_warps=warps, num_stages=stages)


def tail_rows(BM):
    """gmm's TAIL_M for BLOCK_M = BM: half the tile where that is still a dot's height (16 on a GPU,
    8 under the interpreter), else 0 (no short tail tile). See TAIL."""
    tm = BM // 2 if TAIL else 0
    return tm if tm >= (8 if interpreting() else 16) else 0


def _loads(x, w, gathered, macs, BM, BN, BK, TM=0):
    """(W_DESC, x source, w source): descriptors where the arch takes the Hopper path and the
    operands are TMA-describable (gemm.tma_ok: 16-bit, 16-byte aligned rows, at least TMA_MIN_MACS
    multiply-adds or a step being captured): w's experts stacked as (E*O, Kd) rows (w contiguous) or
    (E*Kd, O) (w the transpose of a contiguous (E, Kd, O) weight), x's (P, Kd) rows when not
    gathered (a gathered x keeps its pointer loads), in (BM, BK) tiles and, for the short tail tile,
    (TM, BK) ones. Else (0, x, w, x): the pointer loop. The last item is the tail tile's x source."""
    E, O, Kd = w.shape
    if w.stride(2) == 1 and w.stride(0) == O * w.stride(1):
        mode, w2, block = 1, w.as_strided((E * O, Kd), (w.stride(1), 1)), (BN, BK)
    elif w.stride(1) == 1 and w.stride(0) == Kd * w.stride(2):
        mode, w2, block = 2, w.as_strided((E * Kd, O), (w.stride(2), 1)), (BK, BN)
    else:
        return 0, x, w, x
    if not tma_ok(w2, *(() if gathered else (x,)), macs=macs):
        return 0, x, w, x
    if gathered:
        return mode, x, tma_desc(w2, block), x
    return mode, tma_desc(x, (BM, BK)), tma_desc(w2, block), tma_desc(x, (TM, BK)) if TM else x
