"""Split-K GEMM: c = alpha * (a @ b) [+ bias] [+ c] for outputs too small to fill the GPU but
reduced over a long K, cut into `split` K slices that run side by side. gemm.py's matmul takes this
path by itself (_use_splitk); nothing else calls it.

Shape legend (this file): M rows of the output, N columns of the output, K the reduced dimension,
S = split the number of K slices.

    a    (M, K)     bf16 / fp16 (fp32 when called directly, as tests do), row-major; TMA-describable
                    (16-byte aligned base and row stride) on the Hopper path
    b    (K, N)     a's dtype, row-major or the transpose of a row-major weight (TMA-describable there)
    part (S, M, N)  fp32 workspace, allocated by the launcher on every call
    c    (M, N)     written (or accumulated into), as matmul's c

    part[s] = a[:, K slice s] @ b[K slice s, :]                      (_matmul_splitk_kernel)
    c = alpha * (part[0] + ... + part[S-1]) + bias [+ c]            (_matmul_splitk_reduce_kernel)
  fp32 throughout, one rounding to c's dtype at the end; the partials are summed in fixed order
  (no atomics): bit-reproducible for a given shape and S.

When it runs: 16-bit row-major a, at least TMA_MIN_MACS multiply-adds, fewer than a wave of tiles and
a K long enough to slice (splitk_count), on every arch: the slices load their tiles by TMA where the
arch table takes the Hopper path (and a and b are TMA-describable), else by pointers (TMA=False:
the same loop, masked loads; RTX and A100 cards, LEAN_PORTABLE=1). Above all it serves
the fused linear-CE's dh chunk = dlogits @ w: (768, 1024) over K = V = 151936 for
Qwen3-0.6B is 24 tiles, which the pointer kernel ran at ~360 TF/s (639 us; H100 step profile);
splitk_count cuts it into 11 slices (264 programs).
Tested: tests/test_gemm.py: the kernels in fp32 and fp16 under the interpreter (called directly,
and chosen by matmul with the Hopper conditions forced, TMA and pointer loads: odd sizes, uneven and
empty K slices, both b layouts, the epilogue, bitwise repeatability), splitk_count's choices at
lm_head shapes, and bf16 on the H100 at the lm_head dh shapes through matmul (both paths under
LEAN_PORTABLE=1); tests/test_linear_ce.py: linear_ce's dh GEMM through this path.
Speed (H100, bf16, tools/splitk_bench.py, do_bench medians): 768 x 1024 x 151936 in 11 slices
337 us (the pointer kernel 636, cuBLAS 315); 640 x 2048 x 128256 in 3 slices 479 us (909; cuBLAS
472); 512 x 4096 x 151936 in 2 slices 936 us (1451; cuBLAS 871). Neighbouring slice counts and
tiles (128x128, 256x128, 4 stages) measured no better by more than 5%.
Caution:
  - the workspace (S x M x N fp32, e.g. 33 MiB for 768 x 1024 in 11 slices) comes from torch's
    caching allocator on every call; splitk_workspace_bytes gives its size (the activation planner
    reads it through linear_ce).
  - splitk_count is a coarse model: it picked within 5% of the best measured count on the
    three lm_head shapes above; other shapes are untimed.
"""
import torch
import triton
import triton.language as tl

from lean.kernels.arch import arch
from lean.kernels.gemm import GROUP_M, TILES, TMA_MIN_MACS, _INTERPRET, _TMA, grouped_tile, interpreting, tma_desc, tma_ok


@triton.jit
def _matmul_splitk_kernel(
    part_ptr,                               # (split, M, N) fp32 out: part[s] = a[:, K slice s] @ b[K slice s, :]
    a_src, b_src,                           # TMA: descriptors of a (M, K) and b ((N, K) if B_KMAJOR, else (K, N));
                                            # else the (M, K) and (K, N) strided views' pointers
    M, N, K, split, stride_am, stride_bk, stride_bn,
    B_KMAJOR: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Split-K main loop, one program per (output tile, K slice): the K blocks are dealt out
    evenly (slice s covers blocks [s * kb // split, (s + 1) * kb // split)), loaded by TMA (rows
    past the edges read as zero) or by masked pointer loads, and the fp32 tile goes to the
    workspace unrounded; _matmul_splitk_reduce_kernel finishes."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    s = tl.program_id(1)
    k_blocks = tl.cdiv(K, BLOCK_K)
    k_lo = s * k_blocks // split * BLOCK_K
    k_hi = (s + 1) * k_blocks // split * BLOCK_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = a_src.load([pid_m * BLOCK_M, k0])
            if B_KMAJOR:
                acc = tl.dot(a, b_src.load([pid_n * BLOCK_N, k0]).T, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b_src.load([k0, pid_n * BLOCK_N]), acc, input_precision=PRECISION)
    else:  # a row-major (unit K stride); b either layout through its two strides
        a_ptrs = a_src + rm.to(tl.int64)[:, None] * stride_am + (k_lo + rk)[None, :]
        b_ptrs = b_src + (k_lo + rk).to(tl.int64)[:, None] * stride_bk + rn.to(tl.int64)[None, :] * stride_bn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
    rows = (s * M + rm).to(tl.int64)        # split * M * N can pass 2^31
    tl.store(part_ptr + rows[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _matmul_splitk_reduce_kernel(
    c_ptr,                                  # (M, N) output, row stride stride_cm, unit col stride
    part_ptr, bias_ptr,                     # (split, M, N) fp32 partials; bias (N,) or dummy
    M, N, stride_cm, split, alpha,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c = alpha * (part[0] + part[1] + ... + part[split - 1]) [+ bias] [+ c]: the partials summed
    in fixed order in fp32 (bit-reproducible, no atomics), then _matmul_kernel's epilogue."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    mask = (rm < M)[:, None] & n_ok[None, :]
    acc = tl.load(part_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], mask=mask, other=0.0)
    for s in range(1, split):
        rows = (s * M + rm).to(tl.int64)    # split * M * N can pass 2^31
        acc += tl.load(part_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0.0)
    acc = acc * alpha
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launch configuration (when the path runs: the module docstring). Tiles: gemm._TMA's on the Hopper
# path (the dy W layout's best there, gemm.py's evidence), else gemm.TILES' `wide` tile of the arch's
# tier (the same layout's); untuned for split-K (tools/splitk_bench.py times others); under the
# interpreter gemm._INTERPRET's. Slice count: splitk_count's model.
_SPLITK_MAX = 16                  # slices at most (workspace split x M x N fp32)
_SPLITK_MIN_STEPS = 16            # K steps of BLOCK_K per slice at least (the pipeline is 3 deep)
_REDUCE = (16, 256, 4)            # reduce kernel (BLOCK_M, BLOCK_N, num_warps): untuned, memory-bound
_INTERPRET_REDUCE = (32, 32, 4)


def _splitk_config(at, tma):
    if interpreting():
        return _INTERPRET
    return _TMA if tma else TILES[at.tier]["wide"]


def splitk_count(M, N, K, at=None):
    """How many K slices the split-K path cuts an (M, N) output reduced over K into on Arch `at`
    (None: the current device's); 1: no split. Only outputs under a wave of tiles with at least
    TMA_MIN_MACS multiply-adds are split. The count minimises a coarse time model in units of one
    main-loop step of one SM (a 128 x 256 x 64 wgmma step, ~0.85 us at ~650 TF/s over 132 SMs):
    waves x (K steps per slice + 3 to fill the pipeline), plus the workspace traffic: per tile,
    each partial written and read once and c read and written, (2 split + 2) fp32 tiles of 128 KB,
    ~1/16 step each at ~2.5 TB/s machine-wide. The fewest slices within 3% of the best win (the
    model is coarse; fewer slices, less workspace). Untuned. On an H100, Qwen3-0.6B's dh chunk
    768 x 1024 x 151936: 11 slices (264 programs, two full waves); Llama-3.2-1B's 640 x 2048 x
    128256: 3 (120 programs, one wave). The model reads the arch's SM count, so a 24-SM laptop
    GPU splits less."""
    at = at or arch()
    BM, BN, BK = _splitk_config(at, at.tma)[:3]
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    steps = triton.cdiv(K, BK)
    if tiles >= at.sms or M * N * K < TMA_MIN_MACS:
        return 1

    def cost16(s):  # 16 x the model's time
        workspace = tiles * (2 * s + 2) if s > 1 else 0
        return 16 * triton.cdiv(tiles * s, at.sms) * (triton.cdiv(steps, s) + 3) + workspace
    costs = {s: cost16(s) for s in range(1, _SPLITK_MAX + 1) if s == 1 or steps // s >= _SPLITK_MIN_STEPS}
    best = min(costs.values())
    return min(s for s, t in costs.items() if 100 * t <= 103 * best)


def splitk_workspace_bytes(M, N, K, elsize, at=None):
    """Bytes of the (split, M, N) fp32 workspace matmul allocates for an (M, N) output over K with
    inputs of elsize bytes on Arch `at` (None: the current device's): 0 under the interpreter, for
    fp32 inputs or no split; elsewhere it assumes what the launcher also checks (row-major a), so it
    is an upper bound (for the activation planner)."""
    if interpreting() or elsize != 2 or M * N * K == 0:
        return 0
    split = splitk_count(M, N, K, at)
    return split * M * N * 4 if split > 1 else 0


def _matmul_splitk(c, a, b, bias, accumulate, alpha, split, config=None, tma=None):
    """matmul in `split` K slices: _matmul_splitk_kernel writes fp32 partials into a (split, M, N)
    workspace, _matmul_splitk_reduce_kernel sums them in order and applies the epilogue. a row-major,
    b row-major or the transpose of a row-major weight. tma: load by TMA (both TMA-describable;
    None: where tma_ok says). config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): tests and
    tools/splitk_bench.py only."""
    (M, K), N = a.shape, b.shape[1]
    kmajor = b.stride(0) == 1 and N > 1
    if tma is None:
        tma = _tma_loads(a, b, M, N, K)
    BM, BN, BK, warps, stages = config or _splitk_config(arch(a.device), tma)
    if tma:
        a_src, b_src = tma_desc(a, (BM, BK)), tma_desc(b.t(), (BN, BK)) if kmajor else tma_desc(b, (BK, BN))
    else:
        a_src, b_src = a, b
    part = torch.empty((split, M, N), dtype=torch.float32, device=a.device)  # (split, M, N) fp32 partials
    _matmul_splitk_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), split)](
        part, a_src, b_src,
        M, N, K, split, a.stride(0), b.stride(0), b.stride(1),
        B_KMAJOR=kmajor, PRECISION="ieee" if a.dtype == torch.float32 else "tf32", TMA=bool(tma),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    reduce_partials(c, part, alpha, accumulate, bias)


def reduce_partials(c, part, alpha=1.0, accumulate=False, bias=None):
    """c (M, N) = alpha * (part[0] + ... + part[S-1]) [+ bias] [+ c], the (S, M, N) fp32 partials
    summed in fixed order (_matmul_splitk_reduce_kernel). c: any float dtype (rounded once), a row
    stride and a unit column stride. Split-K's second pass, and the same for the other kernels that
    split a reduction over programs (attention's dK/dV, grouped_gemm's weight gradient)."""
    S, M, N = part.shape
    RBM, RBN, rwarps = _INTERPRET_REDUCE if interpreting() else _REDUCE
    _matmul_splitk_reduce_kernel[(triton.cdiv(M, RBM), triton.cdiv(N, RBN))](
        c, part, bias if bias is not None else c,
        M, N, c.stride(0), S, float(alpha),
        HAS_BIAS=bias is not None, ACCUMULATE=bool(accumulate),
        BLOCK_M=RBM, BLOCK_N=RBN, num_warps=rwarps)


def _tma_loads(a, b, M, N, K):
    """The slices load by TMA: the arch takes the Hopper path and a, b are TMA-describable (tma_ok)."""
    return tma_ok(a, b.t() if b.stride(0) == 1 and N > 1 else b, macs=M * N * K)


def _use_splitk(a, b, M, N, K):
    """Slices for the split-K path, 1 when it is not taken: row-major a, 16-bit on a GPU (the
    tiles are sized for it), b's K stride small enough for int32 pointer steps, and splitk_count's
    verdict (an under-filled output, a long K) on a's arch."""
    if a.stride(1) != 1 or (a.dtype == torch.float32 and not interpreting()) or b.stride(0) * 256 >= 2**31:
        return 1
    return splitk_count(M, N, K, arch(a.device))
