"""GPU timing of lean's matmul and fused LoRA linear against cuBLAS (torch), bf16, N = 8192 tokens.

    python tools/gemm_tune.py            # defaults only: the numbers quoted in the kernel files
    python tools/gemm_tune.py --sweep    # also every candidate block config per shape
    python tools/gemm_tune.py --graph    # CUDA-graph replays (not yet run on the device)
    python tools/gemm_tune.py --portable --sweep   # the portable path (pointer loads, no TMA), its tier's candidates
    LEAN_ARCH=8.6 python tools/gemm_tune.py        # the configs an RTX 30/40/50 card would pick, on this GPU

Shapes: the projections of Qwen3-0.6B and Llama-3.2-1B, (K, O) = (in, out) features, LoRA rank 16.
  matmul:  y = x W^T  (M=N, N=O, K=K)  and  dx = dy W  (M=N, N=K, K=O), vs torch.matmul.
  lora fwd: y = x W^T + s (x A^T) B^T  vs cuBLAS base GEMM alone and base + two LoRA GEMMs + add.
  lora bwd: dx, da, db                 vs cuBLAS dy W alone and the torch sequence of five GEMMs.
TFLOP/s count the useful flops of each op (2*M*N*K per GEMM). triton.testing.do_bench median,
L2 flushed between reps, random inputs. A config whose result strays from torch's (relative
Frobenius error > 2e-2) is marked BAD. Standalone: imports lean's kernels, monkeypatches their
config pickers for the sweep, nothing else.
"""
import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.arch as A  # noqa: E402
import lean.kernels.gemm as G  # noqa: E402
import lean.kernels.lora_linear as L  # noqa: E402

N_TOKENS, RANK, SCALE = 8192, 16, 2.0
DEV = "cuda"
SHAPES = [  # (K, O, name)
    (1024, 2048, "qwen3-0.6b q"), (1024, 1024, "qwen3-0.6b k/v"), (2048, 1024, "qwen3-0.6b o"),
    (1024, 3072, "qwen3-0.6b gate/up"), (3072, 1024, "qwen3-0.6b down"),
    (2048, 2048, "llama-1b q/o"), (2048, 512, "llama-1b k/v"), (2048, 8192, "llama-1b gate/up"),
    (8192, 2048, "llama-1b down"),
]
GEMM_CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]
FWD_CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
               (256, 128, 64, 8, 3)]
BWD_CONFIGS = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
               (128, 128, 128, 8, 3)]
# --portable: the pointer main loops (cp.async pipelining) an RTX / A100 card or LEAN_PORTABLE=1 runs;
# on an H100 they still issue wgmma, so more stages and both tile orientations are in the race.
PORTABLE_GEMM = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
                 (128, 128, 64, 4, 4), (128, 128, 64, 4, 5), (128, 128, 64, 8, 4), (128, 256, 32, 8, 5),
                 (256, 128, 32, 8, 5), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (256, 64, 64, 4, 4)]
PORTABLE_LORA = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                 (128, 128, 64, 8, 4), (128, 256, 32, 8, 5), (128, 128, 64, 4, 5), (64, 256, 64, 4, 4)]


GRAPH = False   # --graph: time CUDA-graph replays (GPU time without Python launch cost)


def bench(fn):
    if GRAPH:
        return do_bench_cudagraph(fn, rep=40, return_mode="median")   # ms
    return do_bench(fn, warmup=10, rep=40, return_mode="median")      # ms


def tflops(flop, ms):
    return flop / ms / 1e9


def relerr(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def mark(err):
    return "" if err < 2e-2 else f" BAD({err:.1e})"


def gemm_rows(K, O, name, sweep, log):
    dev, bf = DEV, torch.bfloat16
    x = torch.randn(N_TOKENS, K, device=dev, dtype=bf)
    w = torch.randn(O, K, device=dev, dtype=bf) * K ** -0.5
    dy = torch.randn(N_TOKENS, O, device=dev, dtype=bf)
    for label, a, b, M, Nc, Kr in [("y=xW^T", x, w.t(), N_TOKENS, O, K), ("dx=dyW", dy, w, N_TOKENS, K, O)]:
        kmajor = label == "y=xW^T"
        c = torch.empty(M, Nc, device=dev, dtype=bf)
        ref = torch.matmul(a, b)
        flop = 2 * M * Nc * Kr
        t_cub = bench(lambda: torch.matmul(a, b, out=c))
        configs = (PORTABLE_GEMM if A.portable_forced() else GEMM_CONFIGS) if sweep else [None]
        at = A.arch(a.device)
        cells = []
        for cfg in configs:
            pick = G.gemm_config if cfg is None else (lambda *_, cfg=cfg, **__: cfg)
            saved, G.gemm_config = G.gemm_config, pick
            try:
                G.matmul(c, a, b)
                err = relerr(c, ref)
                t = bench(lambda: G.matmul(c, a, b))
            finally:
                G.gemm_config = saved
            used = cfg or G.gemm_config(M, Nc, bf, at, b_kmajor=kmajor)
            cells.append((tflops(flop, t), used, err))
        best = max(cells, key=lambda z: z[0])
        default = G.gemm_config(M, Nc, bf, at, b_kmajor=kmajor)
        d = next((z for z in cells if z[1] == default), cells[0])
        log(f"matmul {name:20s} {label:7s} cuBLAS {tflops(flop, t_cub):6.1f}  lean {d[0]:6.1f} {d[1]}{mark(d[2])}"
            f"  ({d[0] / tflops(flop, t_cub):.2f}x)" + (f"  best {best[0]:6.1f} {best[1]}{mark(best[2])}" if sweep else ""))
        if sweep:
            log("    " + "  ".join(f"{z[1]}:{z[0]:.0f}{mark(z[2])}" for z in cells))


def lora_rows(K, O, name, sweep, log):
    dev, bf = DEV, torch.bfloat16
    N, R = N_TOKENS, RANK
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

    # torch baselines
    def t_fwd():
        yt = torch.matmul(x, w.t())
        xat = torch.matmul(x, a.t())
        return yt.addmm_(xat, b.t(), alpha=SCALE), xat

    def t_bwd():
        dxt = torch.matmul(dy, w)
        dyb = torch.matmul(dy, b)
        dxt.addmm_(dyb, a, alpha=SCALE)
        da.add_(torch.matmul(dyb.t(), x), alpha=SCALE)
        db.add_(torch.matmul(dy.t(), xa), alpha=SCALE)
        return dxt

    y_ref, xa_ref = t_fwd()
    flop_base = 2 * N * K * O
    flop_fwd = flop_base + 2 * N * K * R + 2 * N * R * O
    flop_bwd = flop_base + 2 * N * O * R + 4 * N * R * K + 2 * N * O * R
    t_base = bench(lambda: torch.matmul(x, w.t()))
    t_tfwd = bench(t_fwd)
    t_dbase = bench(lambda: torch.matmul(dy, w))
    xa.copy_(xa_ref)
    dx_ref = t_bwd()
    t_tbwd = bench(t_bwd)

    def run_fwd(p=0.0):
        L.lora_linear_fwd(y, xa, x, w, a, b, SCALE, dropout=p, seed=1)

    def run_bwd(p=0.0):
        L.lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, SCALE, dropout=p, seed=1)

    fwd_cells, bwd_cells = [], []
    at = A.arch(x.device)
    portable = A.portable_forced()
    for cfg in ((PORTABLE_LORA if portable else FWD_CONFIGS) if sweep else [None]):
        saved, L._fwd_config = L._fwd_config, (L._fwd_config if cfg is None else (lambda *_, cfg=cfg: cfg))
        try:
            run_fwd()
            err = max(relerr(y, y_ref), relerr(xa, xa_ref))
            t = bench(run_fwd)
        finally:
            L._fwd_config = saved
        fwd_cells.append((t, cfg or L._fwd_config(N, O, bf, at), err))
    xa.copy_(xa_ref)
    for cfg in ((PORTABLE_LORA if portable else BWD_CONFIGS) if sweep else [None]):
        saved, L._bwd_config = L._bwd_config, (L._bwd_config if cfg is None else (lambda *_, cfg=cfg: cfg))
        try:
            run_bwd()
            err = relerr(dx, dx_ref)
            t = bench(run_bwd)
        finally:
            L._bwd_config = saved
        bwd_cells.append((t, cfg or L._bwd_config(bf, at), err))
    t_fwd_p = bench(lambda: run_fwd(0.1))
    t_bwd_p = bench(lambda: run_bwd(0.1))
    t_bwd_nodx = bench(lambda: L.lora_linear_bwd(None, da, db, dy, x, xa, w, a, b, SCALE))

    df = next((z for z in fwd_cells if z[1] == L._fwd_config(N, O, bf, at)), fwd_cells[0])
    bf_ = min(fwd_cells, key=lambda z: z[0])
    log(f"lora fwd {name:20s} lean {tflops(flop_fwd, df[0]):6.1f} TF/s {df[0] * 1e3:7.1f} us {df[1]}{mark(df[2])} | "
        f"cuBLAS base {t_base * 1e3:7.1f} us ({t_base / df[0]:.2f}x) base+lora {t_tfwd * 1e3:7.1f} us "
        f"({t_tfwd / df[0]:.2f}x) | p=0.1 {t_fwd_p * 1e3:7.1f} us"
        + (f" | best {bf_[0] * 1e3:.1f} us {bf_[1]}{mark(bf_[2])}" if sweep else ""))
    db_ = next((z for z in bwd_cells if z[1] == L._bwd_config(bf, at)), bwd_cells[0])
    bb = min(bwd_cells, key=lambda z: z[0])
    log(f"lora bwd {name:20s} lean {tflops(flop_bwd, db_[0]):6.1f} TF/s {db_[0] * 1e3:7.1f} us {db_[1]}{mark(db_[2])} | "
        f"cuBLAS dyW {t_dbase * 1e3:7.1f} us ({t_dbase / db_[0]:.2f}x) torch bwd {t_tbwd * 1e3:7.1f} us "
        f"({t_tbwd / db_[0]:.2f}x) | p=0.1 {t_bwd_p * 1e3:7.1f} us | no dx {t_bwd_nodx * 1e3:7.1f} us"
        + (f" | best {bb[0] * 1e3:.1f} us {bb[1]}{mark(bb[2])}" if sweep else ""))
    if sweep:
        log("    fwd " + "  ".join(f"{z[1]}:{z[0] * 1e3:.0f}us{mark(z[2])}" for z in fwd_cells))
        log("    bwd " + "  ".join(f"{z[1]}:{z[0] * 1e3:.0f}us{mark(z[2])}" for z in bwd_cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time every candidate config")
    ap.add_argument("--only", choices=["gemm", "lora"], help="one half only")
    ap.add_argument("--portable", action="store_true", help="the portable path (as LEAN_PORTABLE=1): pointer loads")
    ap.add_argument("--configs", help="with --sweep: these candidates instead of the built-in lists, e.g. "
                    "128x256x32w8s6,256x128x32w8s5 (BLOCK_MxBLOCK_NxBLOCK_K, warps, stages)")
    ap.add_argument("--out", help="also write the lines to this file")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays: the kernels' GPU time without Python launch cost "
                         "(the default timings of the 5-launch backward are launch-bound on small shapes)")
    args = ap.parse_args()
    global GRAPH
    GRAPH = args.graph
    out = open(args.out, "w") if args.out else None

    def log(s):
        print(s, flush=True)
        if out:
            out.write(s + "\n")
            out.flush()

    if args.portable:
        os.environ["LEAN_PORTABLE"] = "1"
    if args.configs:
        import re
        cands = [tuple(map(int, re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", c.strip()).groups()))
                 for c in args.configs.split(",")]
        global GEMM_CONFIGS, FWD_CONFIGS, BWD_CONFIGS, PORTABLE_GEMM, PORTABLE_LORA
        GEMM_CONFIGS = FWD_CONFIGS = BWD_CONFIGS = PORTABLE_GEMM = PORTABLE_LORA = cands
    torch.manual_seed(0)
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  N={N_TOKENS} R={RANK}")
    log(f"arch: {A.describe()}")
    for K, O, name in SHAPES:
        if args.only != "lora":
            gemm_rows(K, O, name, args.sweep, log)
        if args.only != "gemm":
            lora_rows(K, O, name, args.sweep, log)
    if out:
        out.close()


if __name__ == "__main__":
    main()
