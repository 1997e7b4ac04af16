"""The portable x W^T main loop in several launch forms, against cuBLAS, at the nine projection shapes
(H100, bf16, M = 8192 tokens; CUDA-graph medians, as bench.py kernels times them).

    python tools/gemm_forms.py                      # every form x config x shape, then each shape's best
    python tools/gemm_forms.py --forms persist1,persist2 --configs 128x128x64w4s3

Forms (pointer loads only: the code an RTX / A100 card runs; on an H100 the dots are still wgmma):
  persist1   gemm._matmul_kmajor_kernel, one program per SM (what lean runs today)
  persist2   the same kernel, two programs per SM: where two fit (shared memory, registers), one
             program's epilogue runs beside the other's main loop
  tile       one program per tile on dot_tile_kmajor (the hardware schedules as many as fit)
  persist2nk persist2 with w's tile loaded (BLOCK_N, BLOCK_K) as it lies and transposed in the dot
  pflat      one program per SM over one flat loop of (tile, K step) pairs, the epilogue under an `if`
             at each tile's last step: the software pipeliner then loads the next tile's first K
             steps while this tile's last ones and its epilogue run (no fill and drain per tile)
  tma        gemm._matmul_tma_kernel: the Hopper path's TMA loads (not portable; the reference the
             forms below change one thing of)
  tmaflat    the same with tl.range(flatten=True) over (tile, K step): the pipeliner issues the next
             tile's first loads under this tile's last steps and epilogue
  tmastore   the same with the epilogue through a TMA store (the tile staged in shared memory and
             stored asynchronously, so the next tile's loads need not wait behind it)
  tmaflatstore   both (gemm.TMA_FLAT: lean's _matmul_tma_kernel on sm_90 since)
  lean       gemm.matmul itself (the config column is ignored; LEAN_TMA_FLAT=0 for the earlier loop)
dy W rows (gemm._matmul_kernel, one program per tile) run the same configs.
--lmhead adds the fused linear+CE's logits chunks (1024 rows x 151,936 columns over K 2048 and 1024:
Qwen3-30B-A3B's and Qwen3-0.6B's lm_head, the TMA path in the step).
A config that does not compile or fit prints its error and is skipped. Standalone: imports lean's
jit helpers, nothing else of lean runs.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.gemm as G  # noqa: E402
from gemm_tune import N_TOKENS, SHAPES, relerr  # noqa: E402  (the nine shapes, one list)

CONFIGS = ["128x256x64w8s4", "128x256x64w8s3", "256x128x64w8s3", "128x128x64w4s3", "128x128x64w8s3",
           "128x128x64w4s4", "128x128x32w4s5", "128x128x128w8s2", "128x64x64w4s4", "64x256x64w4s4",
           # BLOCK_K 128 at three stages (196,608 B on sm_90): half the CTA barriers per K of the
           # 64-wide steps; H200: 0.68-0.80x against 0.84-0.96x (the barriers do not bind: gemm_ws.py)
           "128x128x128w8s3", "128x128x128w4s3", "128x256x128w8s2"]
FORMS = ["persist1", "persist2", "tile", "persist2nk", "pflat"]
TMA_FORMS = ["tma", "tmaflat", "tmastore", "tmaflatstore"]     # Hopper only; not in the default run
LM_HEAD = [(1024, 2048, 151936, "lm_head C2048"), (1024, 1024, 151936, "lm_head C1024")]  # (M, K, O, name)


def parse(cfg):
    dims, rest = cfg.split("w")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    w, s = (int(v) for v in rest.split("s"))
    return bm, bn, bk, w, s


@triton.jit
def _tile_kernel(c_ptr, a_ptr, b_ptr, M, N, K, stride_am, stride_bn, stride_cm, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = G.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = G.dot_tile_kmajor(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, "tf32")
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _persist_nk_kernel(c_ptr, a_ptr, b_ptr, M, N, K, stride_am, stride_bn, stride_cm, n_programs,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = G.grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am
        w_rows = b_ptr + (rn % N).to(tl.int64)[:, None] * stride_bn       # w (N, K) rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                                    # K % BLOCK_K == 0 here
            a = tl.load(a_rows + (k0 + rk)[None, :])
            w = tl.load(w_rows + (k0 + rk)[None, :])
            acc = tl.dot(a, w.T, acc)
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _persist_flat_kernel(c_ptr, a_ptr, b_ptr, M, N, K, stride_am, stride_bn, stride_cm, n_programs,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    start = tl.program_id(0)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K                                                 # K % BLOCK_K == 0 here
    my_tiles = (tiles - start + n_programs - 1) // n_programs
    rk = tl.arange(0, BLOCK_K)
    tile = start - n_programs
    ki = -1
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_tiles * my_tiles):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            tile += n_programs
            pid_m, pid_n = G.grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            a_rows = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am
            b_cols = b_ptr + (rn % N).to(tl.int64)[None, :] * stride_bn
        kk = ki * BLOCK_K + rk
        a = tl.load(a_rows + kk[None, :])
        b = tl.load(b_cols + kk[:, None])
        acc = tl.dot(a, b, acc)
        if ki == k_tiles - 1:
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _tma_forms_kernel(c_ptr, c_desc, a_desc, b_desc, M, N, K, stride_cm, n_programs,
                      FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """gemm._matmul_tma_kernel (B K-major, no bias, alpha 1) with the tile loop flattened and/or the
    epilogue through a TMA store."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs, flatten=FLATTEN):
        pid_m, pid_n = G.grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            acc = tl.dot(a, b_desc.load([pid_n * BLOCK_N, k0]).T, acc)
        if TMA_STORE:
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def launch(form, cfg, c, a, w, sms):
    """c = a @ w^T in `form` at config cfg; a (M, K), w (N, K) row-major."""
    bm, bn, bk, warps, stages = parse(cfg)
    (M, K), N = a.shape, w.shape[0]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if form in ("persist1", "persist2"):
        n = min(tiles, sms * (2 if form == "persist2" else 1))
        G._matmul_kmajor_kernel[(n,)](c, a, w.t(), c, M, N, K, a.stride(0), w.stride(0), c.stride(0), 1.0, n,
                                      HAS_BIAS=False, ACCUMULATE=False, EVEN_K=K % bk == 0, BLOCK_M=bm,
                                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PRECISION="tf32",
                                      num_warps=warps, num_stages=stages)
    elif form == "tile":
        _tile_kernel[(tiles,)](c, a, w.t(), M, N, K, a.stride(0), w.stride(0), c.stride(0), EVEN_K=K % bk == 0,
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    elif form == "persist2nk":
        n = min(tiles, sms * 2)
        _persist_nk_kernel[(n,)](c, a, w, M, N, K, a.stride(0), w.stride(0), c.stride(0), n,
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    elif form == "pflat":
        n = min(tiles, sms)
        _persist_flat_kernel[(n,)](c, a, w.t(), M, N, K, a.stride(0), w.stride(0), c.stride(0), n,
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    elif form == "tma":
        n = min(tiles, sms)
        G._matmul_tma_kernel[(n,)](c, G.tma_desc(a, (bm, bk)), G.tma_desc(w, (bn, bk)), c, M, N, K, c.stride(0),
                                   1.0, n, B_KMAJOR=True, HAS_BIAS=False, ACCUMULATE=False, BLOCK_M=bm,
                                   BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FLAT=False,
                                   num_warps=warps, num_stages=stages)
    elif form == "lean":   # gemm.matmul as the step calls it (its own config; LEAN_TMA_FLAT applies)
        G.matmul(c, a, w.t())
    elif form in ("tmaflat", "tmastore", "tmaflatstore"):
        n = min(tiles, sms)
        _tma_forms_kernel[(n,)](c, G.tma_desc(c, (bm, bn)), G.tma_desc(a, (bm, bk)), G.tma_desc(w, (bn, bk)),
                                M, N, K, c.stride(0), n, FLATTEN="flat" in form, TMA_STORE="store" in form,
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    elif form == "dyW":   # c (M, K) = a (M, N) @ w (N, K): the per-tile pointer kernel, b row-major
        M, Nn = a.shape
        Kk = w.shape[1]
        grid = (triton.cdiv(M, bm) * triton.cdiv(Kk, bn),)
        G._matmul_kernel[grid](c, a, w, c, M, Kk, Nn, a.stride(0), 1, w.stride(0), 1, c.stride(0), 1.0,
                               HAS_BIAS=False, ACCUMULATE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                               PRECISION="tf32", num_warps=warps, num_stages=stages)
    else:
        raise ValueError(form)


def bench(fn):
    return do_bench_cudagraph(fn, rep=30, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--forms", default=",".join(FORMS + ["dyW"]))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--shapes", default="", help="comma-separated shape indices (default all)")
    p.add_argument("--lmhead", action="store_true", help="also the linear+CE logits chunks (LM_HEAD)")
    args = p.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    forms, configs = args.forms.split(","), args.configs.split(",")
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    shapes = [(N_TOKENS, K, O, name) for K, O, name in shapes] + (LM_HEAD if args.lmhead else [])
    best = {}
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; x cuBLAS (CUDA-graph medians)", flush=True)
    for M, K, O, name in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(O, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        dy = torch.randn(M, O, device="cuda", dtype=torch.bfloat16)
        y, ref = (torch.empty(M, O, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dx, dref = (torch.empty(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        t_fwd = bench(lambda: torch.mm(x, w.t(), out=ref))
        t_bwd = bench(lambda: torch.mm(dy, w, out=dref))
        for form in forms:
            row = []
            for cfg in configs:
                out, refo, args_ = (dx, dref, (dy, w)) if form == "dyW" else (y, ref, (x, w))
                try:
                    out.fill_(float("nan"))
                    launch(form, cfg, out, *args_, sms)
                    torch.cuda.synchronize()
                    err = relerr(out, refo)
                    if not err < 2e-2:
                        row.append(f"{cfg} BAD{err:.0e}")
                        continue
                    ms = bench(lambda: launch(form, cfg, out, *args_, sms))
                except Exception as e:  # noqa: BLE001 (a config that does not fit: say so, go on)
                    row.append(f"{cfg} ERR {type(e).__name__}")
                    continue
                ratio = (t_bwd if form == "dyW" else t_fwd) / ms
                row.append(f"{cfg} {ratio:.3f}")
                key = (name, "dyW" if form == "dyW" else "xWt")
                if ratio > best.get(key, (0,))[0]:
                    best[key] = (ratio, form, cfg)
            print(f"{name:20s} {form:10s} " + " | ".join(row), flush=True)
    print("\nbest per shape (x cuBLAS):")
    for (name, op), (r, form, cfg) in best.items():
        print(f"  {name:20s} {op:4s} {r:.3f}  {form} {cfg}")


if __name__ == "__main__":
    main()
