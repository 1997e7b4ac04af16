"""GEMM: c = alpha * (a @ b) [+ bias] [+ c], the one matmul behind every frozen projection and
every gradient product that is not fused elsewhere.

Shape legend (this file): M rows of the output, N columns of the output, K the reduced dimension.

    a    (M, K)  bf16 / fp16 / fp32, any 2-D strided view with a unit stride in either dimension
    b    (K, N)  same dtype as a, same freedom of strides
    bias (N,)    optional, a's dtype or fp32, contiguous
    c    (M, N)  bf16 / fp16 / fp32 with a unit last-dim stride; written (or accumulated into)

    c = alpha * (a @ b) + bias + (c if accumulate else 0), fp32 accumulation, one rounding to
    c's dtype at the end.

Because a and b are strided views, the transposes a LoRA model needs cost no copy:
    y  = x W^T      matmul(y, x, w.t())        w: HF weight (O, K)
    dx = dy W       matmul(dx, dy, w)
    dW = dy^T x     matmul(dw, dy.t(), x)
Nothing is saved (the op has no backward of its own: its gradients are two more matmuls).

Program order: tiles "grouped" GROUP_M row-blocks at a time (Triton tutorial 03), for L2 reuse.

Supported: every M, N, K >= 0 (K == 0 gives bias [+ c]); bf16/fp16 on the tensor cores, fp32
accumulation; fp32 inputs as exact IEEE products summed in K slices (dot_tile), for tests and small
fp32 reductions. Tested: tests/test_gemm.py, fp32/fp16 under the interpreter, bf16 on the GPU: odd
sizes, transposed views, bias, accumulate, alpha, bad arguments, the TMA kernel (forced on the CPU).
Three main loops. On the Hopper path (arch.py: sm_90/sm_100), for 16-bit row-major a, TMA-describable
a and b (16-byte aligned base and row stride), TMA_MIN_MACS and at least a wave of 128 x 256 tiles:
_matmul_tma_kernel, tiles loaded by TMA, one persistent program per SM walking the tiles; fewer
tiles over a K long enough to slice: split-K (gemm_splitk.py, fp32 partials of K slices summed in
fixed order). Otherwise (the portable path, fp32, transposed a, odd strides, small outputs, the
interpreter) pointer loads: x W^T with row-major a on _matmul_kmajor_kernel (persistent), the rest
on _matmul_kernel, one program per tile. Speed: the configuration notes below.
Caution:
  - c must not alias a or b (tiles of c are written while other programs still read a and b).
  - the split-K path allocates an fp32 workspace on every call (gemm_splitk.py's Caution).
  - row offsets are int64; the per-step K advance BLOCK_K * stride is int32, so the launcher
    rejects views whose K-stride times BLOCK_K reaches 2^31 (needs a stride above 2^25).
"""
import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lean.kernels._check import check
from lean.kernels.arch import arch

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (pid_m, pid_n), walking GROUP_M row-blocks down one column panel
    before moving right (L2 reuse of the b panel). Shared with lora_linear.py."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def dot_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """The fp32 (BLOCK_M, BLOCK_N) tile a[rm, :] @ b[:, rn] of a (M, K) @ b (K, N), strided views, edges
    masked: _matmul_kernel's main loop, and lora_linear.py's backward on a pre-pass. fp32 ("ieee") sums
    each slice of IEEE_STEPS K steps into a fresh partial (one accumulator: test_linear_ce's note)."""
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # int64 row/column offsets: M * stride can pass 2^31 (e.g. 8192 tokens x 151936 logits).
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRECISION == "ieee":
        for k1 in range(0, K, IEEE_STEPS * BLOCK_K):
            part, a_ptrs, b_ptrs = _k_steps(tl.zeros_like(acc), a_ptrs, b_ptrs, rk, m_ok, n_ok, k1,
                                            tl.minimum(K, k1 + IEEE_STEPS * BLOCK_K), K, stride_ak, stride_bk,
                                            BLOCK_K, PRECISION)
            acc += part
    else:
        acc, a_ptrs, b_ptrs = _k_steps(acc, a_ptrs, b_ptrs, rk, m_ok, n_ok, 0, K, K, stride_ak, stride_bk,
                                       BLOCK_K, PRECISION)
    return acc


@triton.jit
def _k_steps(acc, a_ptrs, b_ptrs, rk, m_ok, n_ok, k_lo, k_hi, K, stride_ak, stride_bk,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """dot_tile's K steps k_lo, k_lo + BLOCK_K, ... below k_hi into acc; returns acc and the advanced pointers."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, a_ptrs, b_ptrs


@triton.jit
def dot_tile_kmajor(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_bn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """dot_tile for a and b both K-contiguous (x W^T: a row-major, b = w.t()), the form
    _matmul_kmajor_kernel's persistent loop wants: each K step's pointers computed afresh, rows and
    columns past the edges read wrapped (row M reads row 0; the caller never stores them), so no
    load carries an M or N mask and, when BLOCK_K divides K (EVEN_K), no mask at all. Unit K strides
    keep the int32 K offsets from overflowing. Shared with lora_linear.py's forward on a pre-pass."""
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am   # int64: M * stride can pass 2^31
    b_cols = b_ptr + (rn % N).to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :])
            b = tl.load(b_cols + kk[:, None])
        else:
            a = tl.load(a_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            b = tl.load(b_cols + kk[:, None], mask=(kk < K)[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _matmul_kernel(
    c_ptr,                                  # (M, N) output, row stride stride_cm, unit col stride
    a_ptr, b_ptr, bias_ptr,                 # (M, K), (K, N) strided views; bias (N,) or dummy
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    alpha,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,                # "ieee" for fp32 inputs, "tf32" (ignored) for 16-bit
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = dot_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)

    acc = acc * alpha
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kmajor_kernel(
    c_ptr,                                  # (M, N) output, row stride stride_cm, unit col stride
    a_ptr, b_ptr, bias_ptr,                 # (M, K), (K, N) views, both K-contiguous (x W^T); bias or dummy
    M, N, K,
    stride_am, stride_bn, stride_cm,        # a's row stride, b's column stride (w's row stride), c's
    alpha, n_programs,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_matmul_kernel for the pointer path's x W^T (a and b K-contiguous): a persistent grid of
    n_programs walking the tiles in grouped order, each tile's main loop dot_tile_kmajor's; the same
    epilogue. Why this shape: in the per-tile form with pointer increments ptxas serialises the
    128x256 wgmmas of this layout (C7515) on sm_90; this loop nest compiles without it (speed below)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = dot_tile_kmajor(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_bn,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)

        acc = acc * alpha
        n_ok = rn < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        mask = (rm < M)[:, None] & n_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_tma_kernel(
    c_ptr,                                  # (M, N) output, row stride stride_cm, unit col stride;
                                            # with FLAT a descriptor of it, tiles (BLOCK_M, BLOCK_N)
    a_desc, b_desc, bias_ptr,               # TMA descriptors of a (M, K) and b: (N, K) if B_KMAJOR, else (K, N)
    M, N, K, stride_cm, alpha, n_programs,
    B_KMAJOR: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLAT: tl.constexpr,
):
    """_matmul_kernel for 16-bit row-major a on Hopper: tiles loaded by TMA (rows and columns
    past the edges read as zero), a persistent grid of n_programs walking the tiles in grouped
    order; the same epilogue. FLAT (TMA_FLAT): the tile loop flattened with its K loop, so the
    pipeliner loads the next tile's first K steps under this tile's last ones and its epilogue, and
    the tile leaves by a TMA store (asynchronous; rows and columns past M, N clipped)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs, flatten=FLAT):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            if B_KMAJOR:
                acc = tl.dot(a, b_desc.load([pid_n * BLOCK_N, k0]).T, acc)
            else:
                acc = tl.dot(a, b_desc.load([k0, pid_n * BLOCK_N]), acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = acc * alpha
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if FLAT:                            # never with ACCUMULATE (_matmul_tma: c's tile loaded too
            c_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_ptr.dtype))   # needs 278,568 B)
        else:
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
            mask = (rm < M)[:, None] & (rn < N)[None, :]
            if ACCUMULATE:
                acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# Launch configuration: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for 16-bit inputs, per
# arch tier (lean/kernels/arch.py); every entry fits its arch's shared memory by the compiler's own
# measure (tests/test_arch.py compiles each one for sm_80/86/89/90/100/120/121).
# sm90 (H100, tuned; tools/gemm_tune.py --sweep, bf16, M = 8192, the nine Qwen3-0.6B / Llama-3.2-1B
# projection shapes, 2026-11-27): x W^T on _matmul_kmajor_kernel 128x256x64 w8 s4 0.83-0.95x cuBLAS
# (geomean 0.87x; best of 11; the per-tile kernel 0.66-0.76x, its 128x256 wgmmas serialise, C7515);
# dy W on _matmul_kernel 0.84-0.99x (0.91x; the persistent nest 0.87x). Why not 0.9x: BENCHMARKS.md.
# sm80 (A100): the sm90 tiles (147,456 B); sm86 (RTX 30/40/50, DGX Spark): 3 stages, 98,304 B. Untuned.
TILES = {
    "sm90": {"kmajor": (128, 256, 64, 8, 4), "wide": (128, 256, 64, 8, 4), "small": (64, 128, 64, 4, 4)},
    "sm80": {"kmajor": (128, 256, 64, 8, 4), "wide": (128, 256, 64, 8, 4), "small": (64, 128, 64, 4, 4)},
    "sm86": {"kmajor": (128, 256, 64, 8, 3), "wide": (128, 256, 64, 8, 3), "small": (64, 128, 64, 4, 4)},
}
# kmajor: b K-contiguous (x W^T); wide: b row-major; both from half a wave of 128x256 tiles up; small: smaller outputs.
_FP32 = (64, 64, 32, 4, 3)        # fp32 inputs: exact CUDA-core products, correctness path, untuned
IEEE_STEPS: tl.constexpr = tl.constexpr(32)   # dot_tile's fp32 K slice, in K steps (1024 of K at _FP32)
# TRITON_INTERPRET=1 (CPU): small tiles for test shapes, so they span several tiles per dim ...
_INTERPRET = (32, 32, 32, 4, 1)
# ... and, for model-sized problems, the fewest programs and K steps (a fit over 100 timed SmolLM2
# lora_linear_fwd configs on the CPU: ~5 ms a program, ~0.8 ms a K step): one row block of up to
# 512 rows, the whole output width (up to 2^20 accumulator elements), K steps of ~2^18 weight
# elements. fp32, 1 core: lora_linear_fwd 497x576x1536 0.70 s at 64x256x128 -> 0.10 s.
GROUP_M = 8
# Hopper TMA path (_matmul_tma_kernel, 16-bit, row-major a, TMA-describable a/b, a full wave of
# 128x256 tiles): tools/step_levers.py, H100, bf16, M = 8192, the nine projection shapes, CUDA-graph
# medians: x W^T 567-645 TF/s (0.94-1.03x cuBLAS; the pointer kernel above 448-519, 0.74-0.79x),
# dy W 449-665 (0.88-0.98x; pointer 440-640). s3 vs s4 within 5%, s3 ahead on 6 of 9 x W^T shapes.
_TMA = (128, 256, 64, 8, 3)
# FLAT (TMA_FLAT): the tile loop flattened into the K loop, tiles stored by TMA (H200, gemm_forms.py:
# nine shapes 0.912-1.010 -> 0.959-1.043x cuBLAS, logits chunks +2-5%). x W^T only (dy W flattened
# needs 278,552 B), sm_90 only, 3 stages. LEAN_TMA_FLAT=0: the A/B switch.
TMA_FLAT = os.environ.get("LEAN_TMA_FLAT", "1") != "0"
TMA_FLAT_ARCHS = ("sm_90", "interpreter")


def tma_flat(device):
    """True where the TMA x W^T kernels flatten their tile loop and store by TMA (TMA_FLAT)."""
    return TMA_FLAT and arch(device).name in TMA_FLAT_ARCHS


# A TMA launch costs the host ~45 us more than a pointer one (a tensor map per descriptor; Qwen3-0.6B's
# host-bound eager step 110-150 ms with TMA everywhere, 94-132 without), so eager TMA serves GEMMs of
# at least TMA_MIN_MACS multiply-adds (Llama-3.2-1B q/o and MLP, the lm_head chunks). A captured step
# pays it once: lean.StepGraph warms up and captures inside tma_at_every_size().
TMA_MIN_MACS = 2**35
_TMA_MIN = {"macs": TMA_MIN_MACS}  # the threshold in force (tma_at_every_size lowers it)


def interpreting():
    """True when kernels run in the Triton CPU interpreter (read at launch time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpret_big(M, N, K):
    """Model-sized under the interpreter: a weight of at least 128 x 512 (the unit tests' stay
    under 2^16 elements or 64 wide) or at least 8M multiply-adds."""
    return (min(N, K) >= 128 and N * K >= 2**16) or M * N * K >= 2**23


def interpret_config(M, N, K):
    """The interpreter's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an (M, N) output
    reduced over K: small tiles for test shapes (every edge exercised), big ones otherwise."""
    if not interpret_big(M, N, K):
        return _INTERPRET
    bm = min(512, max(16, triton.next_power_of_2(M)))            # M = 1 (decode): 16 rows
    bn = max(16, min(triton.next_power_of_2(N), 2**20 // bm, 2**14))
    bk = min(max(2**18 // bn, 32), 256, max(16, triton.next_power_of_2(K)))
    return bm, bn, bk, 4, 1


def gemm_config(M, N, dtype, at, b_kmajor=False, K=0):
    """Pick (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an (M, N) output on Arch `at`;
    b_kmajor: b's unit stride runs along K (b is a transposed row-major weight, as in x W^T)."""
    if interpreting():
        return interpret_config(M, N, K)
    if dtype == torch.float32:
        return _FP32
    tiles = TILES[at.tier]
    if triton.cdiv(M, 128) * triton.cdiv(N, 256) >= at.sms // 2:
        return tiles["kmajor" if b_kmajor else "wide"]
    return tiles["small"]


@contextlib.contextmanager
def tma_at_every_size():
    """Within: the TMA main loops take GEMMs of any size (for a step captured in a CUDA graph,
    where a launch's host cost is paid once). Not reentrant across threads."""
    old, _TMA_MIN["macs"] = _TMA_MIN["macs"], 0
    try:
        yield
    finally:
        _TMA_MIN["macs"] = old


def in_tma_at_every_size():
    """True inside tma_at_every_size (a step being captured or warmed up for capture)."""
    return _TMA_MIN["macs"] == 0


def worth_a_prepass(macs):
    """True for GEMMs of at least the threshold in force (TMA_MIN_MACS; 0 inside tma_at_every_size):
    big enough that a launch's extra host time (a TMA descriptor, a pre-pass kernel) pays."""
    return macs >= _TMA_MIN["macs"]


def tma_ok(*tensors, macs):
    """True when a TMA main loop should run: at least TMA_MIN_MACS multiply-adds (0 inside
    tma_at_every_size), an arch that takes the TMA path (arch.py; never the interpreter) and 2-D 16-bit tensors with a unit
    last stride and 16-byte aligned bases and row strides."""
    return worth_a_prepass(macs) and not interpreting() and arch(tensors[0].device).tma and all(
        map(tma_describable, tensors))


def tma_describable(t):
    """A 2-D 16-bit tensor a TMA descriptor can cover: unit last stride, 16-byte aligned base and
    row stride (the TMA kernels' outputs: their tiles then leave by TMA stores)."""
    return (t.dim() == 2 and t.dtype in (torch.bfloat16, torch.float16) and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def tma_desc(t, block):
    """Host TMA descriptor of a 2-D tensor (unit last stride) for tiles of shape `block`."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block))


def _matmul_tma(c, a, b, bias, accumulate, alpha):
    """matmul on _matmul_tma_kernel; a row-major, b row-major or the transpose of a row-major weight."""
    (M, K), N = a.shape, b.shape[1]
    BM, BN, BK, warps, stages = _TMA
    kmajor = b.stride(0) == 1 and N > 1
    b_desc = tma_desc(b.t(), (BN, BK)) if kmajor else tma_desc(b, (BK, BN))
    n_programs = min(arch(a.device).sms, triton.cdiv(M, BM) * triton.cdiv(N, BN))
    # c's tiles leave by TMA stores; accumulating, c's tile would arrive by TMA too: 278,568 B of
    # shared memory at _TMA on sm_90 (232,448 there), so an accumulating x W^T takes the unflattened loop
    flat = kmajor and not accumulate and tma_flat(a.device) and tma_describable(c)
    _matmul_tma_kernel[(n_programs,)](
        tma_desc(c, (BM, BN)) if flat else c, tma_desc(a, (BM, BK)), b_desc, bias if bias is not None else c,
        M, N, K, c.stride(0), float(alpha), n_programs,
        B_KMAJOR=kmajor, HAS_BIAS=bias is not None, ACCUMULATE=bool(accumulate),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, FLAT=flat,
        num_warps=warps, num_stages=stages)


def _use_tma(a, b, M, N):
    """The TMA path: row-major a, b TMA-describable either way, and at least a wave of tiles."""
    if triton.cdiv(M, _TMA[0]) * triton.cdiv(N, _TMA[1]) < arch(a.device).sms or a.stride(1) != 1:
        return False
    return tma_ok(a, b.t() if b.stride(0) == 1 and N > 1 else b, macs=M * N * a.shape[1])



def kmajor_programs(tiles, at):
    """Programs of _matmul_kmajor_kernel's persistent grid: one per SM, or one per tile when fewer."""
    return min(tiles, at.sms)


def _check_strided(t, name):
    """a and b may be transposed views, but one of their two strides must be 1."""
    if t.dim() == 2 and t.stride(0) != 1 and t.stride(1) != 1 and min(t.shape) > 1:
        raise ValueError(f"{name}: expected a unit stride in one dimension, got strides {t.stride()} "
                         "(call .contiguous())")


def matmul(c, a, b, *, bias=None, accumulate=False, alpha=1.0):
    """c (M, N) = alpha * (a (M, K) @ b (K, N)) [+ bias (N,)] [+ c if accumulate]."""
    check(a, "a", shape=(None, None), dtype=FLOATS)
    M, K = a.shape
    check(b, "b", shape=(K, None), dtype=a.dtype, device=a.device)
    N = b.shape[1]
    check(c, "c", shape=(M, N), dtype=FLOATS, device=a.device, last_contiguous=True)
    _check_strided(a, "a")
    _check_strided(b, "b")
    if bias is not None:
        check(bias, "bias", shape=(N,), dtype=(a.dtype, torch.float32), device=a.device, contiguous=True)
    if M == 0 or N == 0:
        return
    if K > 0 and _use_tma(a, b, M, N):
        return _matmul_tma(c, a, b, bias, accumulate, alpha)
    # Imported here, not at the top: gemm_splitk imports this module's helpers by name, so a top-level
    # import either way round would be circular. Here it works whichever module loads first, costs
    # ~0.2 us a call (a sys.modules lookup), and calls through the module, so patches of
    # gemm_splitk's names (tests, tools/splitk_bench.py) take effect.
    from lean.kernels import gemm_splitk
    split = gemm_splitk._use_splitk(a, b, M, N, K) if K > 0 else 1
    if split > 1:
        return gemm_splitk._matmul_splitk(c, a, b, bias, accumulate, alpha, split)
    at = arch(a.device)
    kmajor = b.stride(0) == 1 and N > 1
    BM, BN, BK, warps, stages = gemm_config(M, N, a.dtype, at, b_kmajor=kmajor, K=K)
    if kmajor and a.stride(1) == 1:
        tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        n_programs = kmajor_programs(tiles, at)
        _matmul_kmajor_kernel[(n_programs,)](
            c, a, b, bias if bias is not None else c,
            M, N, K,
            a.stride(0), b.stride(1), c.stride(0),
            float(alpha), n_programs,
            HAS_BIAS=bias is not None, ACCUMULATE=bool(accumulate), EVEN_K=K % BK == 0,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages,
        )
        return
    if max(a.stride(1), b.stride(0)) * BK >= 2**31:
        raise ValueError(f"matmul: K-stride {max(a.stride(1), b.stride(0))} too large for int32 "
                         "pointer steps (call .contiguous())")
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _matmul_kernel[grid](
        c, a, b, bias if bias is not None else c,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        float(alpha),
        HAS_BIAS=bias is not None, ACCUMULATE=bool(accumulate),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
