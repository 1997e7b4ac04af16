"""Split-K for under-filled GEMMs (lean/kernels/gemm_splitk.py) on the H100, bf16: is it faster, and which
slice count and tiles win?

    python tools/splitk_bench.py              # on the GPU, < 2 minutes
    python tools/splitk_bench.py --no-ce      # the GEMM table only
    python tools/splitk_bench.py --ce-chunks 512,640,1024,2048 [--ce-models qwen3-30b-a3b,...]
                                              # the whole op at these chunk rows only (no GEMM table)

1. The GEMM c (M, N) = a (M, K) @ b (K, N), a and b row-major: the fused linear-CE's dh chunk
   (dlogits (rows, V) @ w (V, C)) at the lm_head shapes, per variant:
     old        matmul with the split-K path switched off (gemm.py's pointer kernel, small tiles)
     lean       matmul as it stands (split-K with splitk_count's slices, marked *)
     S=s cfg    SK._matmul_splitk with s slices and tiles cfg = BMxBNxBK wWARPS sSTAGES
     cuBLAS     torch.matmul(a, b, out=c)
   time = median of triton.testing.do_bench (L2 flushed between calls; the split-K workspace is
   allocated inside every call, as in lean); TF/s = 2 M N K / time; err = max|c - cuBLAS| /
   max|cuBLAS|.
2. The whole linear_ce_fwd_bwd at N = 8192 tokens for the lm_heads of Qwen3-0.6B, Llama-3.2-1B
   and Qwen3-8B: split-K off ("before") and on ("after") at the default chunk rows, and "after" at
   a few other chunk sizes; TF/s counts 4 N C V (two GEMMs); err = dh's max difference to "before".

Each variant runs inside try/except: a failure prints its error and the table goes on. A time
budget (BUDGET_S) skips what is left rather than run past 2 minutes.
"""
import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lean.kernels.gemm as G  # noqa: E402
import lean.kernels.gemm_splitk as SK  # noqa: E402
import lean.kernels.linear_ce as CE  # noqa: E402

# (M, N, K) = (chunk rows, C, V): Qwen3-0.6B, Llama-3.2-1B, Qwen3-8B at their default chunks, then
# other chunk sizes of the same lm_heads and Llama-3.2-3B (C 3072).
SHAPES = [(768, 1024, 151936), (640, 2048, 128256), (512, 4096, 151936),
          (512, 1024, 151936), (1024, 2048, 128256), (384, 4096, 151936), (512, 3072, 128256)]
SPLITS = (2, 3, 4, 6, 8)
# Tiles swept on the first three shapes; the others time lean's tiles (SK._SPLITK) only.
CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]
SWEPT_SHAPES = 3
CE_MODELS = [("qwen3-0.6b", 1024, 151936), ("llama3.2-1b", 2048, 128256), ("qwen3-8b", 4096, 151936)]
CE_MORE = {"qwen3-30b-a3b": (2048, 151936), "gpt-oss-20b": (2880, 201088)}  # --ce-models may name these too
CE_CHUNKS = (512, 1024)
N_TOKENS = 8192
DTYPE = torch.bfloat16
WARMUP_MS, REP_MS = 10, 40
# Stop starting new measurements after these many seconds: the GEMM table, then the whole (< 2 min).
GEMM_BUDGET_S, BUDGET_S = 65, 95


class SplitOff:
    """Context: matmul never takes the split-K path (the old pointer kernel serves these shapes).
    matmul calls gemm_splitk._use_splitk through the module, so patching it there takes effect."""

    def __enter__(self):
        self.saved = SK._use_splitk
        SK._use_splitk = lambda *args: 1

    def __exit__(self, *exc):
        SK._use_splitk = self.saved


def bench(fn):
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def relerr(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def cfg_name(cfg):
    return "{}x{}x{} w{} s{}".format(*cfg)


class Table:
    def __init__(self, start):
        self.start = start
        self.budget = BUDGET_S

    def over(self):
        return time.time() - self.start > self.budget

    def row(self, label, fn, flop, ref=None, out=None):
        """Time fn (after one checked call) and print ms, TF/s and the error of out against ref."""
        if self.over():
            print(f"  {label:34s} skipped (time budget)")
            return None
        try:
            if out is not None:
                out.fill_(float("nan"))
            fn()
            err = relerr(out, ref) if ref is not None else float("nan")
            ms = bench(fn)
            print(f"  {label:34s} {ms * 1e3:9.1f} us {flop / ms / 1e9:7.1f} TF/s  err {err:.1e}")
            return ms
        except Exception as e:  # a variant that fails to compile or run is a result, not a crash
            msg = str(e).splitlines()[0][:150] if str(e) else ""
            print(f"  {label:34s} FAILED {type(e).__name__}: {msg}")
            return None


def gemm_section(T, dev):
    bf = DTYPE
    print(f"\n== dh chunk GEMM c (M, N) = a (M, K) @ b (K, N), {DTYPE}, a and b row-major ==")
    for i, (M, N, K) in enumerate(SHAPES):
        if T.over():
            print(f"({M}, {N}, {K}) skipped (time budget)")
            continue
        a = torch.randn(M, K, device=dev, dtype=bf)  # (M, K), like dlogits
        b = torch.randn(K, N, device=dev, dtype=bf) * K ** -0.5  # (K, N), like w
        c = torch.empty(M, N, device=dev, dtype=bf)
        ref = torch.matmul(a, b)
        flop = 2 * M * N * K
        chosen = SK.splitk_count(M, N, K)
        tiles = triton.cdiv(M, SK._SPLITK[0]) * triton.cdiv(N, SK._SPLITK[1])
        print(f"({M}, {N}, {K}): {tiles} tiles of {SK._SPLITK[0]}x{SK._SPLITK[1]}, splitk_count = {chosen}")
        t_cub = T.row("cuBLAS torch.matmul", lambda: torch.matmul(a, b, out=c), flop, ref, c)
        with SplitOff():
            T.row("old (split-K off)", lambda: G.matmul(c, a, b), flop, ref, c)
        t_lean = T.row(f"lean matmul (S={chosen}) *", lambda: G.matmul(c, a, b), flop, ref, c)
        for cfg in CONFIGS if i < SWEPT_SHAPES else [SK._SPLITK]:
            for S in sorted(set(SPLITS) | {chosen}):
                if S < 2:
                    continue
                T.row(f"S={S} {cfg_name(cfg)}",
                      lambda S=S, cfg=cfg: SK._matmul_splitk(c, a, b, None, False, 1.0, S, config=cfg), flop, ref, c)
        if t_cub and t_lean:
            print(f"  lean / cuBLAS time: {t_lean / t_cub:.2f}x")


def ce_section(T, dev, models=None, chunks=None):
    """models: [(name, C, V)] (default CE_MODELS); chunks: chunk rows to time besides the default
    (default CE_CHUNKS). With chunks given, the split-K-off "before" rows are skipped."""
    bf = DTYPE
    models, sweep = models or CE_MODELS, chunks is not None
    N = N_TOKENS
    print(f"\n== linear_ce_fwd_bwd, N = {N}, {DTYPE}, ~10% ignored targets ==")
    for name, C, V in models:
        if T.over():
            print(f"{name} skipped (time budget)")
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(N, C, device=dev, dtype=bf, generator=g)  # (N, C)
        w = (torch.randn(V, C, device=dev, generator=g) * (2.0 / C ** 0.5)).to(bf)  # (V, C)
        t = torch.randint(0, V, (N,), device=dev, generator=g)
        t[torch.rand(N, device=dev, generator=g) < 0.1] = -100
        loss = torch.empty(2, device=dev)
        dh = torch.empty(N, C, device=dev, dtype=bf)
        gs = torch.full((1,), 1.0 / N, device=dev)
        flop = 4 * N * C * V
        rows = CE._default_chunk_rows(N, V, C, 2, False)
        print(f"{name} C={C} V={V}: default chunk_rows {rows}, dh split {SK.splitk_count(min(rows, N), C, V)}")

        def run(cr=None):
            CE.linear_ce_fwd_bwd(loss, dh, h, w, t, grad_scale=gs, chunk_rows=cr)
        if sweep:  # the default, then each chunk size: the same dh bits are not expected (split-K slices differ)
            fixed = " (LEAN_CE_CHUNK_ROWS)" if os.environ.get("LEAN_CE_CHUNK_ROWS") else ""
            if T.row(f"default{fixed}, chunk_rows {rows}", run, flop) is None:
                continue
            ref = dh.clone()
            for cr in chunks:
                if cr != rows:
                    T.row(f"chunk_rows {cr}", lambda cr=cr: run(cr), flop, ref, dh)
            continue
        try:
            with SplitOff():
                run()
                base_loss, base_dh = loss.clone(), dh.clone()
        except Exception as e:
            print(f"  before: FAILED {type(e).__name__}: {str(e)[:150]}")
            base_loss = base_dh = None
        with SplitOff():
            t_before = T.row(f"before (split-K off, {rows} rows)", run, flop)
        t_after = T.row(f"after (split-K on, {rows} rows)", run, flop, base_dh, dh if base_dh is not None else None)
        if base_loss is not None and not T.over():
            try:
                run()
                print(f"  loss before {base_loss[0].item():.6f} after {loss[0].item():.6f} "
                      f"(count {loss[1].item():.0f})")
            except Exception as e:
                print(f"  loss check FAILED {type(e).__name__}: {str(e)[:150]}")
        for cr in CE_CHUNKS:
            if cr != rows:
                T.row(f"after, chunk_rows {cr}", lambda cr=cr: run(cr), flop)
        if t_before and t_after:
            print(f"  speedup {t_before / t_after:.2f}x ({(t_before - t_after) * 1e3:.0f} us per {N} tokens)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-ce", action="store_true", help="skip the linear_ce section")
    ap.add_argument("--ce-chunks", help="comma-separated chunk rows: only the linear_ce section, at these")
    ap.add_argument("--ce-models", help="comma-separated models for --ce-chunks (CE_MODELS' names and "
                    + ", ".join(CE_MORE) + ")")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds before what is left is skipped")
    args = ap.parse_args()
    if (args.ce_models or args.budget != BUDGET_S) and not args.ce_chunks:
        ap.error("--ce-models and --budget go with --ce-chunks")
    known = {n: (n, C, V) for n, C, V in CE_MODELS} | {n: (n, *cv) for n, cv in CE_MORE.items()}
    unknown = [m for m in (args.ce_models or "").split(",") if m and m not in known]
    if unknown:
        ap.error(f"--ce-models: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if not torch.cuda.is_available():
        sys.exit("splitk_bench: needs a CUDA GPU (an H100: the split-K path is Hopper-only)")
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    T = Table(time.time())
    if args.ce_chunks:
        models = [known[m] for m in args.ce_models.split(",")] if args.ce_models else None
        T.budget = args.budget
        ce_section(T, dev, models, [int(c) for c in args.ce_chunks.split(",")])
        print(f"\ntotal {time.time() - T.start:.0f} s")
        return
    T.budget = GEMM_BUDGET_S if not args.no_ce else BUDGET_S
    gemm_section(T, dev)
    T.budget = BUDGET_S
    if not args.no_ce:
        ce_section(T, dev)
    print(f"\ntotal {time.time() - T.start:.0f} s")


if __name__ == "__main__":
    main()
