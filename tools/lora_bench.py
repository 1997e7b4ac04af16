"""The fused LoRA GEMMs' Hopper path against cuBLAS: H100, bf16, N = 8192 tokens, R = 16.

    python tools/lora_bench.py                 # the table below (< 2 minutes on an H100)
    python tools/lora_bench.py --only 2048x2048,4096x12288
    TRITON_INTERPRET=1 python tools/lora_bench.py --smoke   # CPU: every variant runs once, tiny sizes

Rows per (K, O) projection shape, forward (y = x W^T + s xa B^T, xa = x A^T) and backward kernel 1
(dx = dy W + s dyb A, dyb = dy B; da/db passes not included):
  cuBLAS      torch x @ w.t() / dy @ w alone: the base GEMM, the reference for "x cuBLAS"
  tma gemm    gemm.py's _matmul_tma alone (no LoRA): the main loop the pre-pass kernels share
  pre         _fwd_tma_pre / _bwd_tma_pre: the whole op, pre-pass included (lean's defaults)
  pre s4 / 256x128   the same with num_stages 4 / 256x128 tiles
  prepass     lora_xa / lora_dyb alone (memory-bound: GB/s of the one read of x or dy)
  first, store, first store, first flat, tma first, tma first flat   variants defined here of
              "pre"'s kernel as it was: the rank-R term first (the accumulator starts from it), y
              stored by TMA, both (what "pre" runs since: lora_linear_pre.LORA_FIRST;
              LEAN_LORA_FIRST=0 for the earlier form), both with the tile loop flattened into the K
              loop (gemm.TMA_FLAT's form); "tma": the rank-R term's xa and B tiles by TMA
              descriptors instead of pointer loads
  aug gemm, aug   the rank-R term as R more K columns of one plain TMA GEMM (gemm._matmul_tma):
              [x | s xa] (N, K + R) against [w | b] (O, K + R), and [dy | s dyb] (N, O + R) against
              [w ; a] (O + R, K), the augmented operands built outside the timing (a layout lean
              would keep); "aug" adds the pre-pass that computes xa (dyb)
  tmaepi      a variant defined here: the pre-pass, then a kernel whose epilogue loads the xa (dyb)
              and B (A) tiles by TMA too; "tmaepi ws": with tl.range(warp_specialize=True) on the
              K loop, 4 warps (Triton 3.6 compiles Hopper warp specialisation only at 4 warps and
              only without 2-D pointer loads in the epilogue; this variant hung compiling on the
              H100 once: leave it out with --variants)
--lowrank: instead, the rank-R pre-pass alone (lora_linear_pre._lowrank: lora_xa, lora_xa_shared,
lora_dyb) at each of LOWRANK_CANDIDATES (monkeypatched over _LOWRANK), for u widths 1024..8192 and
one to three outputs sharing the read (q,k,v; gate,up), GB/s of the read of u and the writes; the
best per case ends the table. The pre-pass runs at ~64% of copy bandwidth in the H200 step profile
(Qwen3-0.6B: 308 calls, 10.3 us each, 4.6% of the step).
(The earlier fused form, with the rank-R product inside the main loop, is gone from lean: it
measured 0.73-0.81x cuBLAS forward, 0.74-0.85x backward, against "pre"'s 0.82-0.95x / 0.76-1.02x.)
Times: "eager" = triton.testing.do_bench median (L2 flushed between calls; includes Python launch
and TMA descriptor encoding, ~45 us a descriptor'd launch); "graph" = do_bench_cudagraph median
(GPU time only, what a captured step pays). TFLOP/s and x cuBLAS use the graph time; TFLOP/s
count the useful flops (2NKO + 2NKR + 2NRO). err = max|out - torch bf16| / max|torch bf16| over
y (dx); "tol" is torch bf16's own error against fp32 the same way (err should be of that order).
A variant that fails prints its exception and the table goes on.
"""
import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.gemm as G  # noqa: E402
import lean.kernels.lora_linear_pre as LT  # noqa: E402
from lean.kernels.gemm import GROUP_M, grouped_tile, tma_desc  # noqa: E402

N_TOKENS, RANK, SCALE = 8192, 16, 2.0
SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (1024, 2048), (1024, 1024), (1024, 3072),
          (3072, 1024), (4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)]   # (K, O)
SMOKE_SHAPES = [(96, 80), (160, 272)]


@triton.jit
def _fwd_tmaepi_kernel(y_ptr, x_desc, w_desc, xa_desc, b_desc, N, K, O, stride_y, scale, n_programs,
                       WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    """y = x W^T + (scale * xa) B^T; xa (N, R) and b (O, R) tiles by TMA (R padded by zero fill)."""
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(O, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, O, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS):
            acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
        xa_lp = xa_desc.load([pid_m * BLOCK_M, 0])
        xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
        acc = tl.dot(xs, b_desc.load([pid_n * BLOCK_N, 0]).T, acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm < N)[:, None] & (rn < O)[None, :])


@triton.jit
def _bwd_tmaepi_kernel(dx_ptr, dy_desc, w_desc, dyb_desc, a_desc, N, K, O, stride_dx, scale, n_programs,
                       WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr,
                       GROUP_M: tl.constexpr):
    """dx = dy W + (scale * dyb) A; dyb (N, RP) and a (RP, K) tiles by TMA."""
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(K, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, K, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for o0 in tl.range(0, O, BLOCK_O, warp_specialize=WS):
            acc = tl.dot(dy_desc.load([pid_m * BLOCK_M, o0]), w_desc.load([o0, pid_n * BLOCK_N]), acc)
        dyb_lp = dyb_desc.load([pid_m * BLOCK_M, 0])
        dyb_s = (dyb_lp.to(tl.float32) * scale).to(dyb_lp.dtype)
        acc = tl.dot(dyb_s, a_desc.load([0, pid_n * BLOCK_N]), acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(dx_ptr + rm.to(tl.int64)[:, None] * stride_dx + rn[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=(rm < N)[:, None] & (rn < K)[None, :])


@triton.jit
def _fwd_where_kernel(y_ptr, x_desc, w_desc, xa_ptr, b_ptr, N, K, O, R, stride_y, scale, n_programs,
                      FIRST: tl.constexpr, FLAT: tl.constexpr, STORE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                      LORA_TMA: tl.constexpr = False):
    """lean's _lora_linear_fwd_tma_pre_kernel (pointer loads of xa and B) with the rank-R term first
    (FIRST: the accumulator starts from it, the epilogue only stores), the tile loop flattened into
    the K loop (FLAT) and/or y's tiles stored by TMA (STORE: y_ptr a descriptor); LORA_TMA (with
    FIRST): xa_ptr and b_ptr descriptors of xa (N, R) and b (O, R), tiles (BM, BR) and (BN, BR)."""
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(O, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs, flatten=FLAT):
        pid_m, pid_n = grouped_tile(tile, N, O, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < N, rn < O
        if FIRST and LORA_TMA:
            xa_lp = xa_ptr.load([pid_m * BLOCK_M, 0])
            acc = tl.dot((xa_lp.to(tl.float32) * scale).to(xa_lp.dtype), b_ptr.load([pid_n * BLOCK_N, 0]).T)
        elif FIRST:
            xa_lp = tl.load(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                            other=0.0)
            bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot((xa_lp.to(tl.float32) * scale).to(xa_lp.dtype), bt)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
        if not FIRST:
            xa_lp = tl.load(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                            other=0.0)
            bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot((xa_lp.to(tl.float32) * scale).to(xa_lp.dtype), bt, acc)
        if STORE:
            y_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype))
        else:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])


def fwd_where(y, xa, x, w, a, b, scale, cfg, first, flat, store, lora_tma=False):
    (N, K), O, R = x.shape, w.shape[0], a.shape[0]
    BM, BN, BK, warps, stages = cfg
    BR = max(16, triton.next_power_of_2(R))
    LT.lora_xa(xa, x, a)
    n = LT._n_programs(triton.cdiv(N, BM) * triton.cdiv(O, BN), x.device)
    xa_src, b_src = (tma_desc(xa, (BM, BR)), tma_desc(b, (BN, BR))) if lora_tma else (xa, b)
    _fwd_where_kernel[(n,)](tma_desc(y, (BM, BN)) if store else y, tma_desc(x, (BM, BK)), tma_desc(w, (BN, BK)),
                            xa_src, b_src, N, K, O, R, y.stride(0), float(scale), n, FIRST=first, FLAT=flat,
                            STORE=store, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=GROUP_M,
                            LORA_TMA=lora_tma, num_warps=warps, num_stages=stages)


def fwd_tmaepi(y, xa, x, w, a, b, scale, cfg, ws):
    (N, K), O, R = x.shape, w.shape[0], a.shape[0]
    BM, BN, BK, warps, stages = cfg
    LT.lora_xa(xa, x, a)
    n = LT._n_programs(triton.cdiv(N, BM) * triton.cdiv(O, BN), x.device)
    _fwd_tmaepi_kernel[(n,)](y, tma_desc(x, (BM, BK)), tma_desc(w, (BN, BK)), tma_desc(xa, (BM, R)),
                             tma_desc(b, (BN, R)), N, K, O, y.stride(0), float(scale), n, WS=ws,
                             BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)


def bwd_tmaepi(dx, dyb, dy, w, a, b, scale, cfg, ws):
    (N, O), K, RP = dy.shape, w.shape[1], dyb.shape[1]
    BM, BN, BO, warps, stages = cfg
    LT.lora_dyb(dyb, dy, b)
    n = LT._n_programs(triton.cdiv(N, BM) * triton.cdiv(K, BN), dy.device)
    _bwd_tmaepi_kernel[(n,)](dx, tma_desc(dy, (BM, BO)), tma_desc(w, (BO, BN)), tma_desc(dyb, (BM, RP)),
                             tma_desc(a, (RP, BN)), N, K, O, dx.stride(0), float(scale), n, WS=ws,
                             BLOCK_M=BM, BLOCK_N=BN, BLOCK_O=BO, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)


def timer(smoke):
    """(eager ms, graph ms) of fn: do_bench / do_bench_cudagraph medians; on the CPU one call."""
    if smoke:
        def once(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3, float("nan")
        return once
    from triton.testing import do_bench, do_bench_cudagraph
    # short reps keep the 12 shapes x 21 variants (and ~20 compiles) under 2 minutes
    return lambda fn: (do_bench(fn, warmup=3, rep=12, return_mode="median"),
                       do_bench_cudagraph(fn, rep=10, return_mode="median"))


def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def shape_rows(K, O, N, dev, bench, log, only_variants=()):
    lp, R, s = (torch.float16 if dev == "cpu" else torch.bfloat16), RANK, SCALE
    g = torch.Generator(device=dev).manual_seed(K * 100003 + O)
    rnd = lambda *sh, sc=1.0: (torch.randn(*sh, generator=g, device=dev) * sc).to(lp)  # noqa: E731
    x, dy = rnd(N, K), rnd(N, O)
    w, a, b = rnd(O, K, sc=K ** -0.5), rnd(R, K, sc=K ** -0.5), rnd(O, R, sc=R ** -0.5)
    y, xa = torch.empty(N, O, device=dev, dtype=lp), torch.empty(N, R, device=dev, dtype=lp)
    dx, dyb = torch.empty(N, K, device=dev, dtype=lp), torch.empty(N, R, device=dev, dtype=lp)
    # torch references: low precision (what err compares with) and fp32 (torch's own error, "tol")
    xa_t, dyb_t = x @ a.t(), dy @ b
    y_t = torch.addmm(x @ w.t(), (xa_t.float() * s).to(lp), b.t())
    dx_t = torch.addmm(dy @ w, (dyb_t.float() * s).to(lp), a)
    f = lambda t: t.float()  # noqa: E731
    tol = {"fwd": rel(y_t, f(x) @ f(w).t() + s * (f(x) @ f(a).t()) @ f(b).t()),
           "bwd": rel(dx_t, f(dy) @ f(w) + s * (f(dy) @ f(b)) @ f(a))}
    flops = {"fwd": 2 * N * K * O + 2 * N * K * R + 2 * N * R * O, "bwd": 2 * N * O * K + 2 * N * O * R + 2 * N * R * K}
    # "aug": the rank-R term as R more columns of the one GEMM, [x | s xa] [w | b]^T and [dy | s dyb]
    # [w ; a], in layouts that would be kept (built here outside the timing)
    x_aug, w_aug = torch.cat([x, (xa_t.float() * s).to(lp)], 1), torch.cat([w, b], 1)
    dy_aug, w_augb = torch.cat([dy, (dyb_t.float() * s).to(lp)], 1), torch.cat([w, a], 0)
    if dev == "cpu":   # interpreter: small tiles for every variant
        base = s4 = wide = ws = (32, 32, 32, 4, 1)
    else:
        base, s4, wide = (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)
        ws = (128, 256, 64, 4, 3)
    rows = {  # op: [(variant, fn, out, ref)]
        "fwd": [
            ("cuBLAS", lambda: torch.matmul(x, w.t(), out=y), None, None),
            ("tma gemm", lambda: G._matmul_tma(y, x, w.t(), None, False, 1.0), None, None),
            ("pre", lambda: LT._fwd_tma_pre(y, xa, x, w, a, b, s, None, R), y, y_t),
            ("pre s4", lambda: LT._fwd_tma_pre(y, xa, x, w, a, b, s, None, R, config=s4), y, y_t),
            ("pre 256x128", lambda: LT._fwd_tma_pre(y, xa, x, w, a, b, s, None, R, config=wide), y, y_t),
            ("prepass", lambda: LT.lora_xa(xa, x, a), xa, xa_t),
            ("tmaepi", lambda: fwd_tmaepi(y, xa, x, w, a, b, s, base, False), y, y_t),
            ("tmaepi ws", lambda: fwd_tmaepi(y, xa, x, w, a, b, s, ws, True), y, y_t),
            ("first", lambda: fwd_where(y, xa, x, w, a, b, s, base, True, False, False), y, y_t),
            ("store", lambda: fwd_where(y, xa, x, w, a, b, s, base, False, False, True), y, y_t),
            ("first store", lambda: fwd_where(y, xa, x, w, a, b, s, base, True, False, True), y, y_t),
            ("first flat", lambda: fwd_where(y, xa, x, w, a, b, s, base, True, True, True), y, y_t),
            ("tma first", lambda: fwd_where(y, xa, x, w, a, b, s, base, True, False, True, True), y, y_t),
            ("tma first flat", lambda: fwd_where(y, xa, x, w, a, b, s, base, True, True, True, True), y, y_t),
            ("aug gemm", lambda: G._matmul_tma(y, x_aug, w_aug.t(), None, False, 1.0), y, y_t),
            ("aug", lambda: (LT.lora_xa(xa, x, a), G._matmul_tma(y, x_aug, w_aug.t(), None, False, 1.0)), y, y_t),
        ],
        "bwd": [
            ("cuBLAS", lambda: torch.matmul(dy, w, out=dx), None, None),
            ("tma gemm", lambda: G._matmul_tma(dx, dy, w, None, False, 1.0), None, None),
            ("pre", lambda: LT._bwd_tma_pre(dx, dyb, dy, w, a, b, s, False), dx, dx_t),
            ("pre s4", lambda: LT._bwd_tma_pre(dx, dyb, dy, w, a, b, s, False, config=s4), dx, dx_t),
            ("prepass", lambda: LT.lora_dyb(dyb, dy, b), dyb, dyb_t),
            ("tmaepi", lambda: bwd_tmaepi(dx, dyb, dy, w, a, b, s, base, False), dx, dx_t),
            ("tmaepi ws", lambda: bwd_tmaepi(dx, dyb, dy, w, a, b, s, ws, True), dx, dx_t),
            ("aug gemm", lambda: G._matmul_tma(dx, dy_aug, w_augb, None, False, 1.0), dx, dx_t),
            ("aug", lambda: (LT.lora_dyb(dyb, dy, b), G._matmul_tma(dx, dy_aug, w_augb, None, False, 1.0)), dx, dx_t),
        ],
    }
    for op, variants in rows.items():
        t_cub, read = None, x if op == "fwd" else dy
        for name, fn, out, ref in variants:
            if only_variants and name not in only_variants:
                continue
            try:
                if out is not None:
                    out.fill_(float("nan"))
                fn()
                err = "" if ref is None else f"{rel(out, ref):.1e}"
                eager, graph = bench(fn)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the table goes on
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                log(f"{K:6d} {O:6d} {op} {name:14s} FAILED {type(e).__name__}: {msg}")
                continue
            t = eager if graph != graph else graph                    # NaN graph time on the CPU
            if name == "cuBLAS":
                t_cub = t
            if name == "prepass":   # the one read of x (dy) and the write of xa (dyb)
                rate = f"{(read.numel() + out.numel()) * read.element_size() / (t * 1e-3) / 1e9:7.0f} GB/s"
            else:
                rate = f"{flops[op] / (t * 1e-3) / 1e12:7.1f} TF/s"
            ratio = f"{t_cub / t:6.2f}x" if t_cub and name != "prepass" else " " * 7
            log(f"{K:6d} {O:6d} {op} {name:14s} {eager * 1e3:9.1f} {graph * 1e3:9.1f} {rate} {ratio} {err:>8s}"
                + (f"  (torch tol {tol[op]:.1e})" if name == "cuBLAS" else ""))


# (BLOCK_M, BLOCK_K, num_warps, num_stages); the first is lora_linear_pre._LOWRANK (BLOCK_M still
# halves where the rows give fewer programs than ~7/8 of the SMs, as _lowrank does).
LOWRANK_CANDIDATES = [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4), (64, 64, 4, 6),
                      (64, 256, 8, 3), (32, 128, 8, 4), (16, 128, 4, 6), (32, 64, 4, 8)]
LOWRANK_WIDTHS = [1024, 2048, 3072, 4096, 8192]


def lowrank_rows(N, dev, bench, log, smoke):
    """The pre-pass alone at each candidate config: one to three (N, R) outputs from one read of u."""
    lp = torch.float16 if dev == "cpu" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    widths = [96, 160] if smoke else LOWRANK_WIDTHS
    cands = LOWRANK_CANDIDATES[:2] if smoke else LOWRANK_CANDIDATES
    best, default = {}, LT._LOWRANK
    try:
        for K in widths:
            u = torch.randn(N, K, generator=g, device=dev).to(lp)
            vs = [(torch.randn(RANK, K, generator=g, device=dev) * K ** -0.5).to(lp) for _ in range(3)]
            refs = [u.float() @ v.float().t() for v in vs]
            for nv in (1, 2, 3):
                outs = [torch.empty(N, RANK, device=dev, dtype=lp) for _ in range(nv)]
                fn = lambda: LT._lowrank(outs[0], u, vs[0].t(), more=[(o, v.t()) for o, v in zip(outs[1:], vs[1:])])  # noqa: E731,B023
                for cfg in cands:
                    LT._LOWRANK = cfg
                    try:
                        for o in outs:
                            o.fill_(float("nan"))
                        fn()
                        err = max(rel(o, r) for o, r in zip(outs, refs))
                        eager, graph = bench(fn)
                    except Exception as e:  # noqa: BLE001 - a config that fails is reported, the table goes on
                        log(f"{K:6d} nv {nv} {str(cfg):20s} FAILED {type(e).__name__}")
                        continue
                    t = eager if graph != graph else graph
                    gbs = (u.numel() + nv * N * RANK) * u.element_size() / (t * 1e-3) / 1e9
                    log(f"{K:6d} nv {nv} {str(cfg):20s} {graph * 1e3:9.1f} us {gbs:7.0f} GB/s  err {err:.1e}")
                    if err < 2e-2 and gbs > best.get((K, nv), (0,))[0]:
                        best[(K, nv)] = (gbs, cfg, t)
    finally:
        LT._LOWRANK = default
    log("best per case (GB/s, config):")
    for (K, nv), (gbs, cfg, t) in best.items():
        log(f"{K:6d} nv {nv}  {gbs:7.0f} GB/s  {cfg}  {t * 1e3:.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lowrank", action="store_true", help="the rank-R pre-pass alone at LOWRANK_CANDIDATES")
    ap.add_argument("--only", default="", help="comma-separated KxO shapes, e.g. 2048x2048,4096x12288")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, one call per variant")
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: all; the ws ones "
                    "hung compiling on an H100 once)")
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run with TRITON_INTERPRET=1 ... --smoke")
    dev, N = ("cpu", 131) if smoke else ("cuda", N_TOKENS)
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.only:
        want = {tuple(int(v) for v in s.split("x")) for s in args.only.split(",")}
        shapes = [sh for sh in shapes if sh in want]
    where = "CPU interpreter (smoke)" if smoke else torch.cuda.get_device_name()
    if args.lowrank:
        print(f"N = {N}, R = {RANK}, {where}: the rank-R pre-pass, graph us and GB/s (read of u + writes)")
        lowrank_rows(N, dev, timer(smoke), lambda s: print(s, flush=True), smoke)
        return
    print(f"N = {N}, R = {RANK}, scale = {SCALE}, {where}, triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'K':>6s} {'O':>6s} op  {'variant':14s} {'eager us':>9s} {'graph us':>9s} {'rate':>12s} "
          f"{'xcuBLAS':>7s} {'err':>8s}")
    t0 = time.time()
    for K, O in shapes:
        shape_rows(K, O, N, dev, timer(smoke), lambda s: print(s, flush=True),
                   tuple(v for v in args.variants.split(",") if v))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
