"""LoRA linear: the base projection and its low-rank update in one GEMM, forward and backward.

Shape legend: N tokens in the packed batch, K input features, O output features, R LoRA rank.

Forward (PEFT semantics: dropout on the LoRA branch only, inverted, keep-probability 1 - p):
    xa = drop(x) A^T                                    (N, R)  saved for backward, x's dtype
    y  = x W^T + bias + scale * xa B^T                  (N, O)  x's dtype
  x (N, K) unit last-dim stride; w (O, K) frozen, a (R, K), b (O, R) contiguous, all in x's dtype
  (bf16 / fp16 / fp32); bias (O,) optional (Qwen2 q/k/v), x's dtype or fp32.
  p == 0: ONE kernel. Its K loop accumulates x W^T (BLOCK_M x BLOCK_N) and x A^T (BLOCK_M x R)
  from the same x tile; the epilogue adds scale * xa B^T and programs of the first column block
  store xa. The x A^T work is repeated per column block: R / BLOCK_N extra MMA (6% at R=16).
  p > 0: a small pre-pass (lora_dropout.py) writes xa = drop(x) A^T, then the same kernel reads xa
  in its epilogue.
  Generating the mask inside the fused K loop would run Philox O / BLOCK_N times per x element;
  Philox costs ~100 integer ops per element, several times the GEMM's own time (napkin math).

Backward (the forward read bottom-up; dy B is the gradient flowing into xa):
    dyb = dy B                                          (N, R)  scratch, x's dtype (rounded as torch)
    dx  = dy W + scale * drop'(dyb A)          (=)      (N, K)  x's dtype; dx=None skips it
    da += scale * dyb^T drop(x)                (+=)     (R, K)  fp32
    db += scale * dy^T xa                      (+=)     (O, R)  fp32
  Kernel 1 (grid over dx tiles): the O loop accumulates dy W and dy B from one dy tile; the
  epilogue adds scale * (dy B) A into the same accumulator (p > 0: a separate product times the
  regenerated mask of its tile) and writes dx; programs of the first column block store dy B.
  Kernels 2 and 3 (lora_grad.py, twice): fp32 partials of x^T dyb (masked x) and dy^T xa over
  token chunks, then their fixed-order sum into da / db. No atomics: da and db are bit-identical
  from run to run for a given shape. += lets micro-batches accumulate; the caller zeroes da/db
  once per step.

Hopper: with p = 0, 16-bit TMA-describable inputs (16-byte aligned bases and row strides) and at
least gemm.TMA_MIN_MACS multiply-adds (N K O; below it the launch's host cost outweighs the gain;
a captured step lowers it to 0) the forward kernel and backward kernel 1 run on
lora_linear_pre.py's kernels: the rank-R product from a pre-pass, then gemm.py's TMA main loop
with the same epilogue (0.8-1.0x cuBLAS's base GEMM alone, against 0.75-0.8x with the product
inside the main loop). Elsewhere (the portable path: RTX, A100, LEAN_PORTABLE=1) 16-bit inputs
above the same threshold take the same split with pointer loads: xa from lora_xa's pre-pass, then
_lora_linear_fwd_pre_kernel (gemm.py's persistent x W^T loop and that epilogue); dyb from lora_dyb's,
then _lora_linear_bwd_pre_kernel (gemm.py's dy W loop and that epilogue).

Deferred dA (lora_linear_bwd with x=None, then lora_linear_bwd_da): a layer that does not keep a
projection's input (dense.py drops n1, n2, act) runs kernel 1 and the db partials first and the
da partials once a later backward kernel has rebuilt x; same kernels, same bits.

Dropout mask and the forward's p > 0 pre-pass: lora_dropout.py (the backward kernels regenerate
the same mask).

NF4 weights (QLoRA, kernels/nf4.py): w may be an Nf4. nf4.nf4_fused picks, per shape, between the
pointer kernels with the W tile decoded in registers (NF4=True: nf4.nf4_tile, the same bits as
nf4_dequant) and a dequantised (O, K) scratch copy the 16-bit path runs on (what a GPU takes:
measured 0.93-1.00x the bf16 weight against 0.04-0.07x fused). linear_fwd / linear_bwd always take
the scratch copy.

Supported: R in 1..128 (padded to a power of two >= 16 for tl.dot); p in [0, 1); any N, K, O.
Tested: tests/test_lora_linear.py: fp32 and fp16 (CPU interpreter), bf16 (H100); N, K, O odd
(37, 129, 257 ...); R 8 and 16 (64 on the GPU); bias on/off; p 0 and 0.1; accumulation; determinism;
rejections; both pre-pass paths (fp16 in the interpreter, the TMA choice forced; bf16 as chosen on
the GPU, portable forced for the pointer one). Timings: tools/gemm_tune.py (beside the configs below).
Caution:
  - R not a multiple of 16: the backward runs kernel 1 on zero-padded copies of a and b (rank
    RP). Unpadded, R = 8 gave a wrong dy B on an H100 (Triton 3.6; masked 16-byte B rows) while
    the interpreter and R = 16, 64 were right. The padded route is the R = 16 code path that
    passed on the H100, but was itself not rerun there.
  - dropout > 0 costs Philox per x element three times (forward pre-pass, dx epilogue, da
    partials): +50-150 us per projection at N = 8192 on an H100 (qwen3 down: 104 -> 249 us fwd).
  - fp32 inputs use IEEE products (no tf32): exact but slow on a GPU, meant for tests.
  - every call launches 1-2 (forward) or 5 (backward) kernels: small shapes are bound by
    Triton's Python launch cost (~30 us each) unless the step is captured in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import (FLOATS, grouped_tile, interpret_big, interpret_config, interpreting, matmul, tma_ok,
                               worth_a_prepass)
from lean.kernels.lora_dropout import lora_dropout_xa
from lean.kernels.lora_grad import _block_r, _keep, _lora_grad
from lean.kernels.lora_linear_pre import _bwd_ptr_pre, _bwd_tma_pre, _fwd_ptr_pre, _fwd_tma_pre
from lean.kernels.nf4 import Nf4, check_nf4, nf4_dequant, nf4_fused, nf4_tile, ptx


@triton.jit
def _lora_linear_fwd_kernel(
    y_ptr, xa_ptr,                          # (N, O) out; (N, R) out if COMPUTE_XA, else in
    x_ptr, w_ptr, a_ptr, b_ptr, bias_ptr,   # (N, K); (O, K) or NF4 (O, K/2) uint8; (R, K); (O, R); (O,) or dummy
    wq_absmax, wq_absmax2, wq_code2, wq_code, wq_offset,  # NF4 weight's tables (nf4.py), or dummies
    N, K, O, R, stride_x, stride_y, scale,
    HAS_BIAS: tl.constexpr, COMPUTE_XA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    NF4: tl.constexpr = False, QB: tl.constexpr = 64, QB2: tl.constexpr = 256, PTX: tl.constexpr = False,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, O, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    m_ok, n_ok, r_ok = rm < N, rn < O, rr < R
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]        # W^T tile (BLOCK_K, BLOCK_N)
    a_ptrs = a_ptr + rr[None, :] * K + rk[:, None]                     # A^T tile (BLOCK_K, BLOCK_R)
    woff = tl.load(wq_offset) if NF4 else 0.0

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NF4:  # the W^T tile decoded in registers from its bytes (nf4.nf4_tile), rounded like nf4_dequant
            wt = tl.trans(nf4_tile(w_ptr, wq_absmax, wq_absmax2, wq_code2, wq_code, woff, rn.to(tl.int64), n_ok,
                                   k0, K, COLS=BLOCK_K, QB=QB, QB2=QB2, PTX=PTX)).to(x_ptr.dtype.element_ty)
        else:
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if COMPUTE_XA:
            at = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            xa = tl.dot(xt, at, xa, input_precision=PRECISION)
            a_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # Epilogue: the low-rank term enters the same accumulator, from xa rounded like the saved xa.
    xa_ptrs = xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :]
    xa_mask = m_ok[:, None] & r_ok[None, :]
    if COMPUTE_XA:
        xa_lp = xa.to(xa_ptr.dtype.element_ty)
        if pid_n == 0:
            tl.store(xa_ptrs, xa_lp, mask=xa_mask)
    else:
        xa_lp = tl.load(xa_ptrs, mask=xa_mask, other=0.0)
    # scale folded into xa (exact for power-of-two scales) so the product accumulates in place:
    # a separate 128x256 fp32 result would spill on sm_90.
    xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
    bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(xs, bt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_linear_bwd_kernel(
    dx_ptr, dyb_ptr,                        # (N, K) out if HAS_DX; (N, R) out: dy B in dy's dtype
    dy_ptr, w_ptr, a_ptr, b_ptr,            # (N, O); (O, K) or NF4 (O, K/2) uint8; (R, K); (O, R)
    wq_absmax, wq_absmax2, wq_code2, wq_code, wq_offset,  # NF4 weight's tables (nf4.py), or dummies
    N, K, O, R, stride_dx, stride_dy, scale, seed, p, inv_keep,
    HAS_DX: tl.constexpr, DROPOUT: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    NF4: tl.constexpr = False, QB: tl.constexpr = 64, QB2: tl.constexpr = 256, PTX: tl.constexpr = False,
):
    if HAS_DX:
        pid_m, pid_n = grouped_tile(tl.program_id(0), N, K, BLOCK_M, BLOCK_N, GROUP_M)
    else:                                                              # one program per row block
        pid_m, pid_n = tl.program_id(0), 0
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # columns of dx (K)
    ro = tl.arange(0, BLOCK_O)
    rr = tl.arange(0, BLOCK_R)
    m_ok, n_ok, r_ok = rm < N, rn < K, rr < R
    dy_ptrs = dy_ptr + rm.to(tl.int64)[:, None] * stride_dy + ro[None, :]
    w_ptrs = w_ptr + ro.to(tl.int64)[:, None] * K + rn[None, :]        # W tile (BLOCK_O, BLOCK_N)
    b_ptrs = b_ptr + ro[:, None] * R + rr[None, :]                     # B tile (BLOCK_O, BLOCK_R)
    woff = tl.load(wq_offset) if NF4 else 0.0

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dyb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for o0 in range(0, O, BLOCK_O):
        o_ok = ro < O - o0
        dyt = tl.load(dy_ptrs, mask=m_ok[:, None] & o_ok[None, :], other=0.0)
        if HAS_DX:
            if NF4:  # the W tile decoded in registers (nf4.nf4_tile)
                wt = nf4_tile(w_ptr, wq_absmax, wq_absmax2, wq_code2, wq_code, woff, (o0 + ro).to(tl.int64), o_ok,
                              pid_n * BLOCK_N, K, COLS=BLOCK_N, QB=QB, QB2=QB2, PTX=PTX).to(dy_ptr.dtype.element_ty)
            else:
                wt = tl.load(w_ptrs, mask=o_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(dyt, wt, acc, input_precision=PRECISION)
            w_ptrs += BLOCK_O * K
        bt = tl.load(b_ptrs, mask=o_ok[:, None] & r_ok[None, :], other=0.0)
        dyb = tl.dot(dyt, bt, dyb, input_precision=PRECISION)
        dy_ptrs += BLOCK_O
        b_ptrs += BLOCK_O * R

    dyb_lp = dyb.to(dyb_ptr.dtype.element_ty)                         # rounded like torch's dy B
    if pid_n == 0:
        dyb_ptrs = dyb_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :]
        tl.store(dyb_ptrs, dyb_lp, mask=m_ok[:, None] & r_ok[None, :])
    if HAS_DX:
        at = tl.load(a_ptr + rr[:, None] * K + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if DROPOUT:
            low = tl.dot(dyb_lp, at, input_precision=PRECISION)          # (BLOCK_M, BLOCK_N)
            idx = rm.to(tl.int64)[:, None] * K + rn[None, :]
            acc += low * tl.where(_keep(seed, idx, p), scale * inv_keep, 0.0)
        else:
            # scale folded into dy B (exact for power-of-two scales): accumulates in place.
            dyb_s = (dyb_lp.to(tl.float32) * scale).to(dyb_lp.dtype)
            acc = tl.dot(dyb_s, at, acc, input_precision=PRECISION)
        dx_ptrs = dx_ptr + rm.to(tl.int64)[:, None] * stride_dx + rn[None, :]
        if ACCUMULATE:  # dx += : the input gradient of projections that share an input (q, k, v)
            acc += tl.load(dx_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Launch configuration, 16-bit inputs, per arch tier (lean/kernels/arch.py); every entry fits its
# arch's shared memory by the compiler's own measure (tests/test_arch.py, sm_80 ... sm_121).
# sm90 (H100, tuned). First evidence: tools/gemm_tune.py --sweep, bf16,
# N = 8192, R = 16, the nine Qwen3-0.6B / Llama-3.2-1B projection shapes, two runs (five configs):
#   forward (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): 128x256x64 w8 s4 fastest or tied
#     (within 2%) on 8 of 9 shapes; 256x128 +5-10%, 128x128 +20-30% time. The LoRA terms cost
#     ~1% over the same kernel's base GEMM (qwen q: 80.4 us vs 79.5 us for lean's plain x W^T).
#   backward kernel 1 (BLOCK_M, BLOCK_N over K, BLOCK_O, num_warps, num_stages): 128x256x64 w8 s3
#     1.27x faster than 128x128 s4 on the GPU-bound shapes (Llama gate/up 594 vs 755 us, down 646
#     vs 822 us); with dropout it spills 9 KB (ptxas), so p > 0 keeps 128x128 s4 (measured only
#     there). Smaller shapes measured launch-bound (5 launches, ~30 us of Python each).
#   Re-swept on the pointer kernels (the portable path, LEAN_PORTABLE=1, and eager steps below
#   gemm.TMA_MIN_MACS), H100, 2026-11-25, tools/gemm_tune.py --portable --sweep --only lora, eight
#   configs: 128x256x32 w8 s5 fastest on 8 of 9 forward shapes (Llama gate/up 500 us vs 559 at the
#   earlier 128x256x64 s4, down 470 vs 519, Qwen3 q 72 vs 81) and within 4% or first on every
#   backward shape (Qwen3 q 222 us vs 392 at 128x256x64 s3, down 206 vs 354, Llama gate/up 518 vs
#   612, k/v 201 vs 325). The Hopper path's TMA kernels (lora_linear_pre.py) are unchanged.
# sm80 (A100, 166,912 B) and sm86 (RTX 30/40/50, DGX Spark: 101,376 B): untuned, chosen by ptxas
#   (tools/ptxas_report.py, Triton 3.6's ptxas for sm_80/86/120, no GPU). mma.sync takes its
#   operands from registers, not shared memory as wgmma does, so the sm90 tile's 128x256 fp32
#   accumulator over 8 warps leaves too few of the 255 registers a thread: at 128x256x32 w8 the
#   forward (xa computed in its loop) spilled 172-192 B a thread with 38-48 spill instructions
#   inside the main loop, the backward 128-228 B with 30-55 (sm_80, 86, 120 alike). At 128x128x32
#   w8 s4 neither spills anywhere (forward 126-128 registers, 254 with an NF4 weight; backward
#   186-190), in 49,152-52,224 B of shared memory; 128x128x64 w8 s3 is spill-free too except the
#   NF4 forward (20 in the loop). Kept: 128x128x32 w8 s4 (measured on no such GPU yet).
_FWD = {"sm90": (128, 256, 32, 8, 5), "sm80": (128, 128, 32, 8, 4), "sm86": (128, 128, 32, 8, 4)}
_BWD = {"sm90": (128, 256, 32, 8, 5), "sm80": (128, 128, 32, 8, 4), "sm86": (128, 128, 32, 8, 4)}
_BWD_DROPOUT = {"sm90": (128, 128, 64, 8, 4), "sm80": (128, 128, 64, 8, 4), "sm86": (128, 128, 32, 8, 4)}
# An NF4 weight decoded in the backward kernel (nf4.py) takes _BWD's tiles (its byte tiles and decode
# scratch needed 104,448 B at 128 x 256 on sm86, which is why that tier was at 128 columns first).
_FP32 = (32, 64, 32, 4, 2)      # fp32 inputs: IEEE CUDA-core products, correctness path, untuned
GROUP_M = 8


def _fwd_config(N, O, dtype, at, K=0):
    if interpreting():
        return interpret_config(N, O, K)
    return _FP32 if dtype == torch.float32 else _FWD[at.tier]


def _bwd_config(dtype, at, dropout=0.0, N=0, K=0, O=0):
    if interpreting():
        return interpret_config(N, K, O)
    if dtype == torch.float32:
        return _FP32
    return (_BWD_DROPOUT if dropout > 0.0 else _BWD)[at.tier]


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_lora(x, w, a, b, dropout, seed, dy=None):
    """Shared checks of the forward and backward inputs; returns (N, K, O, R). x may be None in
    the backward (da deferred): N then comes from dy."""
    ref = x if x is not None else dy
    check(ref, "x" if x is not None else "dy", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    N, dev, dt = ref.shape[0], ref.device, ref.dtype
    if isinstance(w, Nf4):
        O, K = check_nf4(w, "w", device=dev)
    else:
        check(w, "w", shape=(None, None), dtype=dt, device=dev, contiguous=True)
        O, K = w.shape
    if x is not None and x.shape[1] != K:
        raise ValueError(f"x: expected {K} features (w is {tuple(w.shape)}), got shape {tuple(x.shape)}")
    check(a, "a", shape=(None, K), dtype=dt, device=dev, contiguous=True)
    R = a.shape[0]
    check(b, "b", shape=(O, R), dtype=dt, device=dev, contiguous=True)
    if not 1 <= R <= 128:
        raise ValueError(f"a: LoRA rank R={R} outside the supported 1..128")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"seed: expected an int in [0, 2^63), got {seed!r}")
    return N, K, O, R


def dyb_width(R):
    """Columns of the dy B buffer lora_linear_bwd writes for a deferred da: R padded for tl.dot."""
    return _block_r(R)


def _prepass_path(x, w, a, dropout):
    """"tma", "pointer" or None: how lora_linear_fwd runs with xa from a pre-pass (dropout 0). The
    Hopper path where tma_ok; else the pointer path for 16-bit inputs, from the same work threshold
    (a second launch costs host time: gemm.worth_a_prepass). An NF4 weight takes either through its
    dequantised scratch copy only."""
    if dropout != 0.0:
        return None
    macs = x.shape[0] * x.shape[1] * w.shape[0]
    nf4 = isinstance(w, Nf4)
    if nf4 and nf4_fused(x.shape[0], x.shape[1], w.shape[0]):
        return None
    if tma_ok(*((x, a) if nf4 else (x, w, a)), macs=macs):
        return "tma"
    return "pointer" if x.dtype in (torch.bfloat16, torch.float16) and worth_a_prepass(macs) else None


def fwd_prepass(x, w, a, dropout=0.0):
    """True when lora_linear_fwd computes xa in a pre-pass of its own (dropout 0, 16-bit, on the
    Hopper path or the pointer path): projections that share x may then get their xa from one read
    of it (lora_linear_pre.lora_xa_shared) and pass xa_ready."""
    return _prepass_path(x, w, a, dropout) is not None


def _nf4_scratch(w, dtype):
    """The NF4 weight w dequantised into a fresh (O, K) buffer of dtype (the scratch path)."""
    wd = torch.empty(w.shape, dtype=dtype, device=w.device)                # (O, K)
    nf4_dequant(wd, w)
    return wd


def _wq_args(w):
    """The five NF4 table pointers of the pointer kernels: w's, or dummies (NF4=False)."""
    return (w.absmax, w.absmax2, w.code2, w.code, w.offset) if isinstance(w, Nf4) else (w,) * 5


def lora_linear_fwd(y, xa, x, w, a, b, scale, *, bias=None, dropout=0.0, seed=0, xa_ready=False):
    """y (N, O) = x W^T + bias + scale * xa B^T and xa (N, R) = drop(x) A^T, both written.
    xa_ready: xa already holds drop(x) A^T (a layer rebuilt in backward): the paths that compute
    it in a pre-pass (dropout, fwd_prepass) skip it; the fused kernel writes it again, the same bits."""
    N, K, O, R = _check_lora(x, w, a, b, dropout, seed)
    check(y, "y", shape=(N, O), dtype=x.dtype, device=x.device, last_contiguous=True)
    check(xa, "xa", shape=(N, R), dtype=x.dtype, device=x.device, contiguous=True)
    if bias is not None:
        check(bias, "bias", shape=(O,), dtype=(x.dtype, torch.float32), device=x.device, contiguous=True)
    if N == 0:
        return
    nf4 = isinstance(w, Nf4)
    if nf4 and not nf4_fused(N, K, O):
        lora_linear_fwd(y, xa, x, _nf4_scratch(w, x.dtype), a, b, scale, bias=bias, dropout=dropout, seed=seed,
                        xa_ready=xa_ready)
        return
    BR, prec = _block_r(R), _precision(x.dtype)
    if dropout > 0.0 and not xa_ready:
        tile = None
        if interpreting():  # the main kernel's row block and K step
            BM, _, BK, warps, stages = _fwd_config(N, O, x.dtype, None, K)
            tile = (BM, BK, warps, stages)
        lora_dropout_xa(xa, x, a, seed, dropout, BR, prec, tile)
    path = _prepass_path(x, w, a, dropout)
    if path is not None:
        (_fwd_tma_pre if path == "tma" else _fwd_ptr_pre)(y, xa, x, w, a, b, scale, bias, BR, xa_ready=xa_ready)
        return
    BM, BN, BK, warps, stages = _fwd_config(N, O, x.dtype, arch(x.device), K)
    grid = (triton.cdiv(N, BM) * triton.cdiv(O, BN),)
    nf4_opts = dict(NF4=True, QB=w.blocksize, PTX=ptx()) if nf4 else {}
    _lora_linear_fwd_kernel[grid](
        y, xa, x, w.packed if nf4 else w, a, b, bias if bias is not None else y, *_wq_args(w),
        N, K, O, R, x.stride(0), y.stride(0), float(scale),
        HAS_BIAS=bias is not None, COMPUTE_XA=dropout == 0.0,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=GROUP_M, PRECISION=prec,
        num_warps=warps, num_stages=stages, **nf4_opts)


def lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, scale, *, dropout=0.0, seed=0, accumulate_dx=False,
                    dyb=None):
    """dx (N, K) = dy W + scale * drop'(dy B A) (skipped if dx is None; += if accumulate_dx);
    da (R, K) and db (O, R), fp32, += the LoRA gradients (db None: the caller sums it elsewhere,
    as swiglu.swiglu_bwd_lora does for gate/up). dropout and seed must be the forward's.
    x None defers da (the layer did not keep x): pass dyb (N, dyb_width(R)), which receives dy B,
    and call lora_linear_bwd_da(da, dyb, x, ...) once x is rebuilt."""
    N, K, O, R = _check_lora(x, w, a, b, dropout, seed, dy=dy)
    dev, dt = (x if x is not None else dy).device, (x if x is not None else dy).dtype
    check(dy, "dy", shape=(N, O), dtype=dt, device=dev, last_contiguous=True)
    check(xa, "xa", shape=(N, R), dtype=dt, device=dev, contiguous=True)
    if dx is not None:
        check(dx, "dx", shape=(N, K), dtype=dt, device=dev, last_contiguous=True)
    if x is None:
        check(dyb, "dyb", shape=(N, _block_r(R)), dtype=dt, device=dev, contiguous=True)
    elif dyb is not None:
        raise ValueError("lora_linear_bwd: dyb is the output of a deferred da (x=None); with x given it stays internal")
    check(da, "da", shape=(R, K), dtype=torch.float32, device=dev, contiguous=True)
    if db is not None:
        check(db, "db", shape=(O, R), dtype=torch.float32, device=dev, contiguous=True)
    if N == 0:
        return
    nf4 = isinstance(w, Nf4) and dx is not None  # without dx the kernel never reads W
    if nf4 and not nf4_fused(N, K, O):
        lora_linear_bwd(dx, da, db, dy, x, xa, _nf4_scratch(w, dt), a, b, scale, dropout=dropout, seed=seed,
                        accumulate_dx=accumulate_dx, dyb=dyb)
        return
    RP, prec = _block_r(R), _precision(dt)
    inv_keep = 1.0 / (1.0 - dropout)
    if RP != R:
        # Kernel 1 runs on zero-padded copies (RP = 16 for R = 8): see the Caution on ranks.
        a_pad = torch.zeros((RP, K), device=dev, dtype=dt)                # (RP, K)
        b_pad = torch.zeros((O, RP), device=dev, dtype=dt)                # (O, RP)
        a_pad[:R].copy_(a)
        b_pad[:, :R].copy_(b)
        a, b = a_pad, b_pad

    # Kernel 1: dx, and dy B for the da reduction (written by the first column block).
    BM, BN, BO, warps, stages = _bwd_config(dt, arch(dev), dropout, N, K, O)
    if dyb is None:
        dyb = torch.empty((N, RP), device=dev, dtype=dt)                  # (N, RP)
    col_blocks = triton.cdiv(K, BN) if dx is not None else 1
    if dx is not None and dropout == 0.0 and not nf4 and tma_ok(dy, w, b, dx, macs=N * K * O):
        _bwd_tma_pre(dx, dyb, dy, w, a, b, scale, accumulate_dx)
    elif dx is not None and dropout == 0.0 and not nf4 and dt != torch.float32 and worth_a_prepass(N * K * O):
        _bwd_ptr_pre(dx, dyb, dy, w, a, b, scale, accumulate_dx)
    else:
        wk = w.packed if isinstance(w, Nf4) else w
        nf4_opts = dict(NF4=True, QB=w.blocksize, PTX=ptx()) if nf4 else {}
        _lora_linear_bwd_kernel[(triton.cdiv(N, BM) * col_blocks,)](
            dx if dx is not None else dyb, dyb, dy, wk, a, b, *_wq_args(w if nf4 else wk),
            N, K, O, RP, dx.stride(0) if dx is not None else 0, dy.stride(0),
            float(scale), seed, float(dropout), inv_keep,
            HAS_DX=dx is not None, DROPOUT=dropout > 0.0, ACCUMULATE=accumulate_dx,
            BLOCK_M=BM, BLOCK_N=BN if dx is not None else 16, BLOCK_O=BO, BLOCK_R=RP, GROUP_M=GROUP_M,
            PRECISION=prec, num_warps=warps, num_stages=stages, **nf4_opts)

    # Kernels 2 and 3 (lora_grad.py, twice): partials over token chunks, then fixed-order sums into da / db.
    big = interpreting() and interpret_big(N, K, O)
    if x is not None:
        _lora_grad(da, x, dyb, scale * inv_keep, seed, dropout, prec, transposed=True, big=big)
    if db is not None:
        _lora_grad(db, dy, xa, scale, seed, 0.0, prec, transposed=False, big=big)


def lora_linear_bwd_da(da, dyb, x, scale, *, dropout=0.0, seed=0, more=()):
    """The deferred half of lora_linear_bwd: da (R, K) fp32 += scale * dyb^T drop(x), with dyb
    the (N, dyb_width(R)) buffer lora_linear_bwd(x=None, dyb=...) wrote and x the rebuilt input.
    more: up to two further (da, dyb) of projections sharing x (q/k/v, gate/up; dropout 0 only:
    their masks differ), summed from the same read of x; each da gets the bits it would alone."""
    check(x, "x", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    (N, K), dev, dt = x.shape, x.device, x.dtype
    if len(more) > 2 or (more and dropout > 0.0):
        raise ValueError(f"lora_linear_bwd_da: at most two more (da, dyb) pairs, and only without dropout "
                         f"(got {len(more)}, dropout {dropout})")
    for i, (d, y) in enumerate([(da, dyb)] + list(more)):
        check(d, f"da[{i}]", shape=(da.shape[0], K), dtype=torch.float32, device=dev, contiguous=True)
        check(y, f"dyb[{i}]", shape=(N, _block_r(da.shape[0])), dtype=dt, device=dev, contiguous=True)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
    if N == 0:
        return
    big = interpreting() and interpret_big(N, K, K)  # the interpreter's model-sized tiles; GPU: False
    _lora_grad(da, x, dyb, scale / (1.0 - dropout), seed, dropout, _precision(dt), transposed=True, big=big,
               more=more)


# ---------------------------------------------------------------------------------------------
# Frozen projections without LoRA: thin wrappers over matmul with the layer's names.

def linear_fwd(y, x, w, *, bias=None):
    """y (N, O) = x (N, K) W^T + bias, w (O, K) the HF weight (an NF4 one: through a dequantised
    scratch copy)."""
    check(x, "x", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    if isinstance(w, Nf4):
        check_nf4(w, "w", device=x.device)
        w = _nf4_scratch(w, x.dtype)
    check(w, "w", shape=(None, x.shape[1]), dtype=x.dtype, device=x.device, contiguous=True)
    check(y, "y", shape=(x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device, last_contiguous=True)
    matmul(y, x, w.t(), bias=bias)


def linear_bwd(dx, dy, w, *, accumulate=False):
    """dx (N, K) = dy (N, O) W, written (=), or added (+=) when accumulate (W NF4: as linear_fwd)."""
    check(dy, "dy", shape=(None, None), dtype=FLOATS, last_contiguous=True)
    if isinstance(w, Nf4):
        check_nf4(w, "w", device=dy.device)
        w = _nf4_scratch(w, dy.dtype)
    check(w, "w", shape=(dy.shape[1], None), dtype=dy.dtype, device=dy.device, contiguous=True)
    check(dx, "dx", shape=(dy.shape[0], w.shape[1]), dtype=dy.dtype, device=dy.device, last_contiguous=True)
    matmul(dx, dy, w, accumulate=accumulate)
