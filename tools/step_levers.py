"""Candidate levers for lean's step, timed as CUDA-graph replays (GPU time, no launch cost), bf16.

    python tools/step_levers.py [--only now,eager,ce,cerow,swiglu,gemm,lora] [--out FILE]
    TRITON_INTERPRET=1 python tools/step_levers.py --check     # CPU: the variants' results, small shapes

Experiments, not lean's kernels (those stay in lean/kernels until a variant wins here and in the
step): each variant is checked against torch (relative Frobenius error, BAD above 2e-2) and timed
with triton.testing.do_bench_cudagraph (median).
  ce    the fused lm_head + CE at N=8192 (Qwen3-0.6B C1024 V151936, Llama-3.2-1B C2048 V128256):
        the whole op at the default and larger chunk_rows; its pieces at the default chunk (logits
        GEMM, row kernel, dh GEMM) against cuBLAS; a split-K dh GEMM (fp32 partials over S vocab
        slices, then a fixed-order sum: deterministic) for several S.
  gemm  x W^T (W K-contiguous) and dy W at the nine projection shapes: lean's matmul, cuBLAS, and
        a TMA variant (host tensor descriptors, non-persistent and persistent grids).
  now   lean's LoRA launchers as they stand (whole fwd, whole bwd) against cuBLAS, TMA configs swept.
  eager lean's eager Qwen3-0.6B step with the TMA kernels on and off (their host cost).
  lora  the fused LoRA forward with TMA loads against lean's; lean's LoRA backward split into its
        dx kernel and the da/db partial+reduce passes, and the partial pass at other tile configs.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]
import lean.kernels.gemm as G  # noqa: E402
import lean.kernels.gemm_splitk as SK  # noqa: E402
import lean.kernels.linear_ce as CE  # noqa: E402
import lean.kernels.lora_grad as LG  # noqa: E402
import lean.kernels.lora_linear as L  # noqa: E402
import lean.kernels.lora_linear_pre as LT  # noqa: E402
from lean.kernels.gemm import grouped_tile  # noqa: E402

SHAPES = [  # (K, O, name)
    (1024, 2048, "qwen q"), (1024, 1024, "qwen k/v"), (2048, 1024, "qwen o"), (1024, 3072, "qwen gate/up"),
    (3072, 1024, "qwen down"), (2048, 2048, "llama q/o"), (2048, 512, "llama k/v"), (2048, 8192, "llama gate/up"),
    (8192, 2048, "llama down"),
]
CE_SHAPES = [(1024, 151936, "qwen"), (2048, 128256, "llama")]
NUM_SMS = 132


# ---------------------------------------------------------------------------------------------
# variants
@triton.jit
def _tma_tile(a_desc, b_desc, pid_m, pid_n, K, B_KMAJOR: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        if B_KMAJOR:
            b = b_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc)
        else:
            b = b_desc.load([k0, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tma_store(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tma_matmul_kernel(c_ptr, a_desc, b_desc, M, N, K, stride_cm, B_KMAJOR: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tma_tile(a_desc, b_desc, pid_m, pid_n, K, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    _tma_store(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, BLOCK_M, BLOCK_N)


@triton.jit
def _tma_matmul_persistent_kernel(c_ptr, a_desc, b_desc, M, N, K, stride_cm, B_KMAJOR: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, N_PROGRAMS: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, N_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_tile(a_desc, b_desc, pid_m, pid_n, K, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
        _tma_store(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, BLOCK_M, BLOCK_N)


def tma_matmul(c, a, b, cfg, persistent=False):
    """c = a @ b; a (M, K) row-major; b (K, N) either row-major or the transpose of a row-major
    (N, K) weight (B_KMAJOR). cfg = (BM, BN, BK, warps, stages)."""
    BM, BN, BK, warps, stages = cfg
    M, K = a.shape
    N = b.shape[1]
    kmajor = b.stride(0) == 1
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [BM, BK])
    if kmajor:
        w = b.t()  # (N, K) row-major
        b_desc = TensorDescriptor(w, [N, K], [w.stride(0), 1], [BN, BK])
    else:
        b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [BK, BN])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    if persistent:
        n = min(NUM_SMS, tiles)
        _tma_matmul_persistent_kernel[(n,)](c, a_desc, b_desc, M, N, K, c.stride(0), B_KMAJOR=kmajor, BLOCK_M=BM,
                                            BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, N_PROGRAMS=n, num_warps=warps,
                                            num_stages=stages)
    else:
        _tma_matmul_kernel[(tiles,)](c, a_desc, b_desc, M, N, K, c.stride(0), B_KMAJOR=kmajor, BLOCK_M=BM,
                                     BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, num_warps=warps, num_stages=stages)


@triton.jit
def _tma_lora_fwd_kernel(y_ptr, xa_ptr, x_desc, w_desc, a_desc, b_ptr, N, K, O, R, stride_y, scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr):
    """lean's _lora_linear_fwd_kernel (p = 0, no bias) with TMA loads of x, W and A."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, O, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    m_ok, n_ok, r_ok = rm < N, rn < O, rr < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = x_desc.load([pid_m * BLOCK_M, k0])
        wt = w_desc.load([pid_n * BLOCK_N, k0])
        acc = tl.dot(xt, wt.T, acc)
        at = a_desc.load([0, k0])
        xa = tl.dot(xt, at.T, xa)
    xa_lp = xa.to(xa_ptr.dtype.element_ty)
    if pid_n == 0:
        tl.store(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], xa_lp, mask=m_ok[:, None] & r_ok[None, :])
    xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
    bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(xs, bt, acc)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tma_lora_fwd(y, xa, x, w, a, b, scale, cfg):
    BM, BN, BK, warps, stages = cfg
    N, K = x.shape
    O, R = w.shape[0], a.shape[0]
    BR = max(16, triton.next_power_of_2(R))
    x_desc = TensorDescriptor(x, [N, K], [x.stride(0), 1], [BM, BK])
    w_desc = TensorDescriptor(w, [O, K], [K, 1], [BN, BK])
    a_desc = TensorDescriptor(a, [R, K], [K, 1], [BR, BK])
    _tma_lora_fwd_kernel[(triton.cdiv(N, BM) * triton.cdiv(O, BN),)](
        y, xa, x_desc, w_desc, a_desc, b, N, K, O, R, y.stride(0), float(scale),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=8, num_warps=warps, num_stages=stages)


@triton.jit
def _splitk_partial_kernel(part_ptr, a_ptr, b_ptr, M, N, K, k_split, stride_am, stride_bk,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """part[s] (M, N) fp32 = a[:, ks] @ b[ks, :] over the K slice ks = [s*k_split, (s+1)*k_split)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = s * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + (k_lo + rk)[None, :]
    b_ptrs = b_ptr + (k_lo + rk).to(tl.int64)[:, None] * stride_bk + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        a = tl.load(a_ptrs, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    ptrs = part_ptr + s.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(ptrs, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _splitk_sum_kernel(c_ptr, part_ptr, S, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def splitk_matmul(c, a, b, S, cfg=(128, 256, 64, 8, 3)):
    """c (M, N) contiguous = a (M, K) @ b (K, N), both row-major, K split into S slices."""
    BM, BN, BK, warps, stages = cfg
    M, K = a.shape
    N = b.shape[1]
    k_split = BK * triton.cdiv(triton.cdiv(K, S), BK)
    S = triton.cdiv(K, k_split)
    part = torch.empty((S, M, N), device=a.device, dtype=torch.float32)
    _splitk_partial_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), S)](
        part, a, b, M, N, K, k_split, a.stride(0), b.stride(0), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8,
        num_warps=warps, num_stages=stages)
    _splitk_sum_kernel[(triton.cdiv(M * N, 1024),)](c, part, S, M * N, BLOCK=1024)


# ---------------------------------------------------------------------------------------------
# timing
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def bench(fn):
    if INTERP:
        fn()
        return float("nan")
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def relerr(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def mark(err):
    return "" if err < 2e-2 else f" BAD({err:.1e})"


def tf(flop, ms):
    return flop / ms / 1e9


def attempt(fn, log, what):
    try:
        return fn()
    except Exception as e:  # a variant that fails to compile is a result, not a crash
        log(f"    {what}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return None


def gemm_section(log, dev, M=8192, shapes=SHAPES, configs=None):
    bf = torch.bfloat16
    configs = configs or [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    for K, O, name in shapes:
        x = torch.randn(M, K, device=dev, dtype=bf)
        w = torch.randn(O, K, device=dev, dtype=bf) * K ** -0.5
        dy = torch.randn(M, O, device=dev, dtype=bf)
        for label, a, b, Nc, Kr in [("xW^T", x, w.t(), O, K), ("dyW", dy, w, K, O)]:
            c = torch.empty(M, Nc, device=dev, dtype=bf)
            ref = torch.matmul(a, b)
            flop = 2 * M * Nc * Kr
            t_cub = bench(lambda: torch.matmul(a, b, out=c))
            G.matmul(c, a, b)
            e_lean = relerr(c, ref)
            t_lean = bench(lambda: G.matmul(c, a, b))
            cells = []
            for cfg in configs:
                for pers in (False, True):
                    def run(cfg=cfg, pers=pers):
                        c.fill_(float("nan"))
                        tma_matmul(c, a, b, cfg, pers)
                        return relerr(c, ref), bench(lambda: tma_matmul(c, a, b, cfg, pers))
                    r = attempt(run, log, f"tma {cfg} persistent={pers}")
                    if r:
                        cells.append((r[1], cfg, pers, r[0]))
            best = min(cells, key=lambda z: z[0]) if cells else None
            log(f"gemm {name:14s} {label:5s} M{M} N{Nc} K{Kr}: cuBLAS {tf(flop, t_cub):6.1f} TF/s | lean "
                f"{tf(flop, t_lean):6.1f} ({t_cub / t_lean:.2f}x){mark(e_lean)}"
                + (f" | best TMA {tf(flop, best[0]):6.1f} ({t_cub / best[0]:.2f}x) {best[1]} pers={best[2]}{mark(best[3])}"
                   if best else ""))
            log("    " + "  ".join(f"{z[1][:3]}w{z[1][3]}s{z[1][4]}{'P' if z[2] else ''}:{tf(flop, z[0]):.0f}{mark(z[3])}"
                                   for z in cells))


def lora_section(log, dev, N=8192, R=16, shapes=SHAPES):
    bf = torch.bfloat16
    scale = 2.0
    fwd_cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    grad_cfgs = [None, (64, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4)]
    for K, O, name in shapes:
        x = torch.randn(N, K, device=dev, dtype=bf)
        w = torch.randn(O, K, device=dev, dtype=bf) * K ** -0.5
        a = torch.randn(R, K, device=dev, dtype=bf) * K ** -0.5
        b = torch.randn(O, R, device=dev, dtype=bf) * R ** -0.5
        dy = torch.randn(N, O, device=dev, dtype=bf)
        y = torch.empty(N, O, device=dev, dtype=bf)
        xa = torch.empty(N, R, device=dev, dtype=bf)
        dx = torch.empty(N, K, device=dev, dtype=bf)
        da = torch.zeros(R, K, device=dev)
        db = torch.zeros(O, R, device=dev)
        xa_ref = x @ a.t()
        y_ref = x @ w.t() + scale * (xa_ref @ b.t())
        t_base = bench(lambda: torch.matmul(x, w.t()))
        t_fwd = bench(lambda: L.lora_linear_fwd(y, xa, x, w, a, b, scale))
        e_fwd = max(relerr(y, y_ref), relerr(xa, xa_ref))
        cells = []
        for cfg in fwd_cfgs:
            def run(cfg=cfg):
                y.fill_(float("nan"))
                xa.fill_(float("nan"))
                tma_lora_fwd(y, xa, x, w, a, b, scale, cfg)
                return max(relerr(y, y_ref), relerr(xa, xa_ref)), bench(lambda: tma_lora_fwd(y, xa, x, w, a, b, scale, cfg))
            r = attempt(run, log, f"tma lora fwd {cfg}")
            if r:
                cells.append((r[1], cfg, r[0]))
        log(f"lora fwd {name:14s}: cuBLAS base {t_base * 1e3:6.1f} us | lean {t_fwd * 1e3:6.1f} us "
            f"({t_base / t_fwd:.2f}x){mark(e_fwd)} | TMA " + "  ".join(f"{z[1]}:{z[0] * 1e3:.1f}us{mark(z[2])}" for z in cells))
        # backward: the whole op, the dx kernel alone (grad passes stubbed), the grad passes alone
        xa.copy_(xa_ref)
        t_dbase = bench(lambda: torch.matmul(dy, w))
        t_bwd = bench(lambda: L.lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, scale))
        saved = L._lora_grad  # stubbed where lora_linear_bwd looks it up
        L._lora_grad = lambda *args, **kw: None
        try:
            t_k1 = bench(lambda: L.lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, scale))
        finally:
            L._lora_grad = saved
        dyb = (dy @ b).contiguous()
        grad_cells = []
        for cfg in grad_cfgs:
            old = LG._GRAD
            LG._GRAD = cfg or old
            try:
                da_ref = torch.zeros_like(da)
                da.zero_()
                LG._lora_grad(da, x, dyb, scale, 0, 0.0, "tf32", transposed=True)
                da_ref = scale * (dyb.float().t() @ x.float())
                err = relerr(da, da_ref)
                t_g = bench(lambda: (LG._lora_grad(da, x, dyb, scale, 0, 0.0, "tf32", transposed=True),
                                     LG._lora_grad(db, dy, xa, scale, 0, 0.0, "tf32", transposed=False)))
                grad_cells.append((t_g, cfg or old, err))
            except Exception as e:
                log(f"    grad {cfg}: {type(e).__name__}: {str(e)[:120]}")
            finally:
                LG._GRAD = old
        log(f"lora bwd {name:14s}: cuBLAS dyW {t_dbase * 1e3:6.1f} us | lean {t_bwd * 1e3:6.1f} us ({t_dbase / t_bwd:.2f}x) "
            f"= dx kernel {t_k1 * 1e3:6.1f} + da/db passes ~{(t_bwd - t_k1) * 1e3:6.1f} | da+db passes by _GRAD: "
            + "  ".join(f"{z[1]}:{z[0] * 1e3:.1f}us{mark(z[2])}" for z in grad_cells))


def ce_section(log, dev, N=8192, shapes=CE_SHAPES):
    bf = torch.bfloat16
    for C, V, name in shapes:
        h = torch.randn(N, C, device=dev, dtype=bf)
        w = torch.randn(V, C, device=dev, dtype=bf) * C ** -0.5
        t = torch.randint(0, V, (N,), device=dev, dtype=torch.int32)
        loss = torch.empty(2, device=dev)
        dh = torch.empty(N, C, device=dev, dtype=bf)
        gs = torch.full((1,), 1.0 / N, device=dev)
        rows = CE._default_chunk_rows(N, V, C, 2, INTERP)
        flop = 4 * N * C * V
        cells = []
        for cr in [rows, 1024, 2048, 4096]:
            ms = bench(lambda: CE.linear_ce_fwd_bwd(loss, dh, h, w, t, grad_scale=gs, chunk_rows=cr))
            cells.append(f"{cr}:{ms:.2f}ms({tf(flop, ms):.0f}TF/s, scratch {cr * V * 2 / 2**20:.0f}MiB)")
        log(f"ce {name} N{N} C{C} V{V}: whole op by chunk_rows " + "  ".join(cells))
        # pieces at the default chunk
        n_chunks = triton.cdiv(N, rows)
        hc = h[:rows]
        logits = torch.empty(rows, V, device=dev, dtype=bf)
        lref = hc @ w.t()
        t_lg = bench(lambda: G.matmul(logits, hc, w.t()))
        t_lg_cub = bench(lambda: torch.matmul(hc, w.t(), out=logits))
        G.matmul(logits, hc, w.t())
        t_row = bench(lambda: CE._linear_ce_fwd_bwd_kernel[(rows,)](
            logits, loss.new_empty(rows), t[:rows], rows, V, logits.stride(0), gs, -100,
            BLOCK_V=CE._GPU_BLOCK_V, WRITE_GRAD=True, REVERSE=False, num_warps=CE._GPU_ROW_WARPS))
        logits.copy_(lref)  # a softmax-like magnitude is not needed for timing a GEMM
        dhc = torch.empty(rows, C, device=dev, dtype=bf)
        dref = logits @ w
        t_dh = bench(lambda: G.matmul(dhc, logits, w))
        e_dh = relerr(dhc, dref)
        t_dh_cub = bench(lambda: torch.matmul(logits, w, out=dhc))
        split = []
        for S in (2, 4, 8, 11, 16):
            def run(S=S):
                dhc.fill_(float("nan"))
                splitk_matmul(dhc, logits, w, S)
                return relerr(dhc, dref), bench(lambda: splitk_matmul(dhc, logits, w, S))
            r = attempt(run, log, f"split-K S={S}")
            if r:
                split.append(f"S{S}:{r[1] * 1e3:.0f}us{mark(r[0])}")
        tma = []
        for cfg in [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]:
            def run(cfg=cfg):
                logits.fill_(float("nan"))
                tma_matmul(logits, hc, w.t(), cfg, persistent=True)
                return relerr(logits, lref), bench(lambda: tma_matmul(logits, hc, w.t(), cfg, persistent=True))
            r = attempt(run, log, f"tma logits {cfg}")
            if r:
                tma.append(f"{cfg[:2]}:{r[1] * 1e3:.0f}us{mark(r[0])}")
        log(f"ce {name} pieces at chunk_rows {rows} (x{n_chunks} chunks), us per chunk: logits GEMM lean {t_lg * 1e3:.0f} "
            f"cuBLAS {t_lg_cub * 1e3:.0f} TMA {' '.join(tma)} | row kernel {t_row * 1e3:.0f} | dh GEMM lean "
            f"{t_dh * 1e3:.0f}{mark(e_dh)} cuBLAS {t_dh_cub * 1e3:.0f} split-K {' '.join(split)}")


def cerow_section(log, dev, N=8192, shapes=CE_SHAPES):
    """The CE row kernel (pass 1 online lse, pass 2 the gradient in place) at the default chunk:
    one program per row against persistent walks (programs per SM) with pass 2 reversed (its
    first blocks are pass 1's last, likely still in L2), by BLOCK_V and warps; then the whole op
    with each candidate as its row_config."""
    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for C, V, name in shapes:
        rows = CE._default_chunk_rows(N, V, C, 2, INTERP)
        logits = torch.randn(rows, V, device=dev, dtype=bf) * 3
        t = torch.randint(0, V, (rows,), device=dev, dtype=torch.int32)
        gs = torch.full((1,), 1.0 / N, device=dev)
        rl = torch.empty(rows, device=dev)
        floor_us = 3 * rows * V * 2 / 3.0e12 * 1e6
        cells = []
        for bv, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16)):
            for per_sm in (0, 1, 2, 4):
                for rev in ((False, True) if per_sm else (False,)):
                    def run():
                        grid = min(rows, per_sm * sms) if per_sm else rows
                        return bench(lambda: CE._linear_ce_fwd_bwd_kernel[(grid,)](
                            logits, rl, t, rows, V, logits.stride(0), gs, -100,
                            BLOCK_V=bv, WRITE_GRAD=True, REVERSE=rev, num_warps=warps))
                    r = attempt(run, log, f"row {bv} w{warps} p{per_sm} r{rev}")
                    if r:
                        cells.append((r, bv, warps, per_sm, rev))
        cells.sort()
        log(f"cerow {name} rows {rows} V{V} (3 passes at 3.0 TB/s: {floor_us:.0f} us): "
            + "  ".join(f"{bv}w{wp}p{p}{'r' if rv else ''}:{ms * 1e3:.0f}us" for ms, bv, wp, p, rv in cells[:8])
            + f" ... worst {cells[-1][0] * 1e3:.0f}us")
        h = torch.randn(N, C, device=dev, dtype=bf)
        w = torch.randn(V, C, device=dev, dtype=bf) * C ** -0.5
        tt = torch.randint(0, V, (N,), device=dev, dtype=torch.int32)
        loss, dh = torch.empty(2, device=dev), torch.empty(N, C, device=dev, dtype=bf)
        whole = []
        for ms, bv, wp, p, rv in [min(c for c in cells if c[3] == 0)] + cells[:3]:
            cfg = (bv, wp, p * sms if p else None, rv)
            whole.append(f"{bv}w{wp}p{p}{'r' if rv else ''}:"
                         f"{bench(lambda: CE.linear_ce_fwd_bwd(loss, dh, h, w, tt, grad_scale=gs, row_config=cfg)):.2f}ms")
        log(f"cerow {name} whole op N{N}: " + "  ".join(whole))


def swiglu_section(log, dev, N=8192, R=16):
    """The MLP backward's swiglu + LoRA gradient passes (dropout 0): swiglu_bwd writing h, then
    lora_grad's db_gate, db_up and da_down passes (the separate kernels), against swiglu_bwd_lora
    (one pass) at launch variants (BLOCK_F, BLOCK_T, warps, stages); the gradients'
    largest relative difference from the separate passes' (none: the same bits)."""
    import lean.kernels.swiglu as SW
    bf = torch.bfloat16
    for F, name in ((8192, "llama F8192"), (3072, "qwen F3072")):
        g, u, dh = (torch.randn(N, F, device=dev, dtype=bf) for _ in range(3))
        xg, xu, dyb = (torch.randn(N, R, device=dev, dtype=bf) for _ in range(3))
        dbg, dbu, dad = torch.zeros(F, R, device=dev), torch.zeros(F, R, device=dev), torch.zeros(R, F, device=dev)
        dg, du, h = (torch.empty_like(g) for _ in range(3))

        def separate():
            SW.swiglu_bwd(dg, du, dh, g, u, h=h)
            LG._lora_grad(dbg, dg, xg, 2.0, 0, 0.0, "tf32", transposed=False)
            LG._lora_grad(dbu, du, xu, 2.0, 0, 0.0, "tf32", transposed=False)
            LG._lora_grad(dad, h, dyb, 2.0, 0, 0.0, "tf32", transposed=True)
        t_sep = bench(separate)
        t_plain = bench(lambda: SW.swiglu_bwd(dg, du, dh, g, u))
        for x in (dbg, dbu, dad):
            x.zero_()
        separate()
        ref = [x.clone() for x in (dbg, dbu, dad)]
        cells = []
        for launch in (None, *[(bf, bt, w, st, p) for bf, bt, w, st in ((128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3),
                                                                     (64, 32, 4, 3), (128, 16, 4, 3))
                               for p in (1, 2, 3, 4)]):
            SW._LORA_LAUNCH = launch
            try:
                def fused():
                    SW.swiglu_bwd_lora(dg, du, dh, g, u, scale=2.0, gate=(dbg, xg), up=(dbu, xu), down=(dad, dyb))
                for x in (dbg, dbu, dad):
                    x.zero_()
                if attempt(lambda: fused() or True, log, f"swiglu lora {launch}") is None:
                    continue
                err = max(relerr(a, b) for a, b in zip((dbg, dbu, dad), ref))
                tag = "" if err == 0 else f"(err {err:.0e})"
                cells.append(f"{'grad' if launch is None else ','.join(map(str, launch))}:"
                             f"{bench(fused) * 1e3:.0f}us{tag}")
            finally:
                SW._LORA_LAUNCH = None
        floor_us = 5 * N * F * 2 / 3.0e12 * 1e6
        log(f"swiglu {name} N{N} R{R}: separate (swiglu_bwd h= + 3 grad passes) {t_sep * 1e3:.0f} us, swiglu_bwd "
            f"alone {t_plain * 1e3:.0f} us, fused by launch: {'  '.join(cells)}; 5 tensors at 3 TB/s {floor_us:.0f} us")


def now_section(log, dev, N=8192, R=16, shapes=SHAPES):
    """lean's LoRA launchers as they stand (the TMA kernels on Hopper), whole ops, against cuBLAS;
    the TMA configs swept (LT._FWD_TMA / LT._BWD_TMA patched)."""
    bf = torch.bfloat16
    scale = 2.0
    cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    for K, O, name in shapes:
        x = torch.randn(N, K, device=dev, dtype=bf)
        w = torch.randn(O, K, device=dev, dtype=bf) * K ** -0.5
        a = torch.randn(R, K, device=dev, dtype=bf) * K ** -0.5
        b = torch.randn(O, R, device=dev, dtype=bf) * R ** -0.5
        dy = torch.randn(N, O, device=dev, dtype=bf)
        y, xa = torch.empty(N, O, device=dev, dtype=bf), torch.empty(N, R, device=dev, dtype=bf)
        dx = torch.empty(N, K, device=dev, dtype=bf)
        da, db = torch.zeros(R, K, device=dev), torch.zeros(O, R, device=dev)
        xa_ref = x @ a.t()
        y_ref = x @ w.t() + scale * (xa_ref @ b.t())
        dx_ref = dy @ w + scale * ((dy @ b) @ a)
        t_base = bench(lambda: torch.matmul(x, w.t()))
        t_dbase = bench(lambda: torch.matmul(dy, w))
        cells = []
        for which, attr, fn, out, ref in (("fwd", "_FWD_TMA", lambda: L.lora_linear_fwd(y, xa, x, w, a, b, scale), y, y_ref),
                                          ("bwd", "_BWD_TMA", lambda: L.lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, scale),
                                           dx, dx_ref)):
            old = getattr(LT, attr)
            for cfg in cfgs:
                setattr(LT, attr, cfg)
                try:
                    out.fill_(float("nan"))
                    xa.copy_(xa_ref)
                    fn()
                    err = relerr(out, ref)
                    cells.append(f"{which} {cfg[:2]}s{cfg[4]}:{bench(fn) * 1e3:.1f}us{mark(err)}"
                                 + ("*" if cfg == old else ""))
                except Exception as e:
                    cells.append(f"{which} {cfg}: {type(e).__name__} {str(e)[:80]}")
                finally:
                    setattr(LT, attr, old)
        log(f"now {name:14s} cuBLAS xW^T {t_base * 1e3:.1f}us dyW {t_dbase * 1e3:.1f}us | " + "  ".join(cells))


def eager_section(log, dev, rounds=3, steps=8):
    """lean's eager step (bench_step's lean row, Qwen3-0.6B packed) with the TMA kernels on and off
    (lean.kernels' tma_ok patched), interleaved rounds in one process: the host cost of the TMA
    launches (descriptors) shows where the eager step is launch-bound."""
    import bench_step

    lean, model, lora, opt, docs, batches, _ = bench_step.lean_setup("qwen3-0.6b", "packed")

    def step(i):
        lora.zero_grad()
        loss, n = lean.forward_backward(model, lora, batches[i % 2])
        opt.step()
        return loss / n

    on_l, on_g, on_s = L.tma_ok, G.tma_ok, SK.tma_ok
    res = {"tma on": [], "tma off": []}
    for _ in range(rounds):
        for key in res:
            L.tma_ok, G.tma_ok, SK.tma_ok = (on_l, on_g, on_s) if key == "tma on" else ((lambda *t, macs: False),) * 3
            try:
                res[key].append(bench_step.time_steps(step, 2, steps, True)[0] * 1e3)
            finally:
                L.tma_ok, G.tma_ok, SK.tma_ok = on_l, on_g, on_s
    log("eager qwen3-0.6b packed step ms (median of %d, per round): " % steps
        + "  ".join(f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in res.items()))


def check(log):
    """CPU interpreter: every variant on small odd shapes against torch (fp32 products)."""
    R = 16
    torch.manual_seed(0)
    for M, K, N in [(40, 96, 72), (130, 64, 256)]:
        a = torch.randn(M, K)
        w = torch.randn(N, K)
        for label, bmat in [("kmajor", w.t()), ("rowmajor", w.t().contiguous())]:
            for pers in (False, True):
                c = torch.full((M, N), float("nan"))
                tma_matmul(c, a, bmat, (32, 32, 32, 4, 1), pers)
                log(f"check tma {label} persistent={pers} {M}x{N}x{K}: err {relerr(c, a @ bmat):.1e}")
        c = torch.full((M, N), float("nan"))
        splitk_matmul(c, a, w.t().contiguous(), 3, (32, 32, 32, 4, 1))
        log(f"check split-K {M}x{N}x{K}: err {relerr(c, a @ w.t()):.1e}")
        a_l = torch.randn(R, K)
        b_l = torch.randn(N, R)
        y = torch.full((M, N), float("nan"))
        xa = torch.full((M, R), float("nan"))
        tma_lora_fwd(y, xa, a, w, a_l, b_l, 2.0, (32, 32, 32, 4, 1))
        log(f"check tma lora fwd {M}x{N}x{K}: err y {relerr(y, a @ w.t() + 2.0 * (a @ a_l.t()) @ b_l.t()):.1e} "
            f"xa {relerr(xa, a @ a_l.t()):.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="ce,gemm,lora")
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true", help="CPU interpreter correctness of the variants")
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None

    def log(s):
        print(s, flush=True)
        if out:
            out.write(s + "\n")
            out.flush()

    if args.check:
        return check(log)
    torch.manual_seed(0)
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    parts = args.only.split(",")
    for part, fn in (("now", now_section), ("eager", eager_section), ("ce", ce_section), ("cerow", cerow_section),
                     ("swiglu", swiglu_section), ("lora", lora_section),
                     ("gemm", gemm_section)):
        if part in parts:
            fn(log, "cuda")


if __name__ == "__main__":
    main()
