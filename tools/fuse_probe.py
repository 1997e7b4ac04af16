"""Projections that share an input, one GEMM or several: q/k/v and gate/up, with LoRA, bf16.

    python tools/fuse_probe.py [--models qwen3-0.6b,llama-3.2-1b] [--rank 16] [--dx [only]]
    TRITON_INTERPRET=1 python tools/fuse_probe.py --check      # CPU: the two forms agree (fp32, tiny)

A question for the step (issue 17), asked with lean's own launchers: what would the LoRA GEMMs of
one layer cost if q, k and v (and gate, up) were one projection, against the step's way today?
  split  the step's calls (lean/models/dense.py): the q/k/v xa in one shared pre-pass, then one
         lora_linear_fwd per projection; backward one lora_linear_bwd per projection with its dA
         deferred (dx accumulated into one buffer), then the shared lora_linear_bwd_da.
  fused  one lora_linear_fwd over the stacked weight [Wq; Wk; Wv] (O = the three widths) whose LoRA
         has rank 3R: A stacked, B block-diagonal (zeros elsewhere: the same product); backward
         one lora_linear_bwd over the concatenated dy, then one lora_linear_bwd_da.
Gate/up alike at rank 2R (their dB is swiglu_bwd_lora's in the step: timed on both sides here), and
k/v alone at 2R. q/k/v runs at R / 2: its 3R = 48 pads to 64, past the TMA pre-pass kernel's
shared memory (245,784 B on the H200).
Each row: CUDA-graph medians (triton.testing.do_bench_cudagraph) of the forward and the backward,
and the fused outputs against the split ones (max |diff| / max |ref|: the same math, other sums).
--dx: the backward's dx GEMMs alone (dx_only). Measured on the H200: BENCHMARKS.md, the step section.
"""
import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lean.kernels.gemm import tma_at_every_size  # noqa: E402
from lean.kernels.lora_linear import dyb_width, lora_linear_bwd, lora_linear_bwd_da, lora_linear_fwd  # noqa: E402
from lean.kernels.lora_linear_pre import lora_xa_shared  # noqa: E402

MODELS = {  # hidden C, (q, k, v) widths, intermediate F
    "qwen3-0.6b": (1024, (2048, 1024, 1024), 3072), "llama-3.2-1b": (2048, (2048, 512, 512), 8192),
    "qwen3-8b": (4096, (4096, 1024, 1024), 12288), "qwen3-30b-a3b": (2048, (4096, 512, 512), None),
}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def group(N, C, widths, R, dt, dev, scale=2.0):
    """(split fwd, split bwd, fused fwd, fused bwd, check) for projections of `widths` sharing x."""
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt)  # noqa: E731
    x = rnd(N, C)
    ws = [rnd(o, C) * C ** -0.5 for o in widths]
    As = [rnd(R, C) * C ** -0.5 for _ in widths]
    Bs = [rnd(o, R) * 0.1 for o in widths]
    O, RR = sum(widths), R * len(widths)
    wf, af = torch.cat(ws), torch.cat(As)                                   # (O, C), (RR, C)
    bf = torch.zeros(O, RR, device=dev, dtype=dt)                           # block-diagonal (O, RR)
    o0 = 0
    for i, (o, b) in enumerate(zip(widths, Bs)):
        bf[o0:o0 + o, i * R:(i + 1) * R] = b
        o0 += o
    ys = [torch.empty(N, o, device=dev, dtype=dt) for o in widths]
    xas = [torch.empty(N, R, device=dev, dtype=dt) for _ in widths]
    yf, xaf = torch.empty(N, O, device=dev, dtype=dt), torch.empty(N, RR, device=dev, dtype=dt)
    dy = rnd(N, O)
    dys = list(dy.split(list(widths), 1))                                   # strided views, as the step's
    dx_s, dx_f = torch.empty(N, C, device=dev, dtype=dt), torch.empty(N, C, device=dev, dtype=dt)
    das = [torch.zeros(R, C, device=dev) for _ in widths]
    dbs = [torch.zeros(o, R, device=dev) for o in widths]
    daf, dbf = torch.zeros(RR, C, device=dev), torch.zeros(O, RR, device=dev)
    dybs = [torch.empty(N, dyb_width(R), device=dev, dtype=dt) for _ in widths]
    dybf = torch.empty(N, dyb_width(RR), device=dev, dtype=dt)

    def split_fwd():
        if len(widths) > 1:
            lora_xa_shared(xas, x, As)
        for y, xa, w, a, b in zip(ys, xas, ws, As, Bs):
            lora_linear_fwd(y, xa, x, w, a, b, scale, xa_ready=len(widths) > 1)

    def split_bwd():
        for i, (d, xa, w, a, b, da, db, dyb) in enumerate(zip(dys, xas, ws, As, Bs, das, dbs, dybs)):
            lora_linear_bwd(dx_s, da, db, d, None, xa, w, a, b, scale, accumulate_dx=i > 0, dyb=dyb)
        lora_linear_bwd_da(das[0], dybs[0], x, scale, more=list(zip(das[1:], dybs[1:])))

    def fused_fwd():
        lora_linear_fwd(yf, xaf, x, wf, af, bf, scale)

    def fused_bwd():
        lora_linear_bwd(dx_f, daf, dbf, dy, None, xaf, wf, af, bf, scale, dyb=dybf)
        lora_linear_bwd_da(daf, dybf, x, scale)

    def check():
        for t in das + dbs + [daf, dbf]:
            t.zero_()
        split_fwd(), fused_fwd(), split_bwd(), fused_bwd()
        if x.is_cuda:
            torch.cuda.synchronize()
        db_diag = torch.cat([dbf[sum(widths[:i]):sum(widths[:i + 1]), i * R:(i + 1) * R] for i in range(len(widths))])
        return max(_rel(yf, torch.cat(ys, 1)), _rel(dx_f, dx_s), _rel(daf, torch.cat(das)), _rel(db_diag, torch.cat(dbs)))
    return split_fwd, split_bwd, fused_fwd, fused_bwd, check


def dx_only(N, C, widths, R, dt, dev, scale=2.0):
    """(split, stacked) callables of the backward's dx GEMMs alone on the Hopper path: split, the
    step's _bwd_tma_pre per projection (its dy B pre-pass, then dx += dy_t W_t + s dyb_t A_t);
    stacked, the same pre-passes, then one dx GEMM over [dy_q dy_k dy_v] and [Wq; Wk; Wv] whose
    rank-R term has rank 3R (dyb side by side, A stacked). Timing only: the pre-passes write one
    buffer a projection and the GEMM reads a stacked one of the same bytes; dx is not checked
    (group's check covers the math)."""
    import triton as tr

    from lean.kernels import lora_linear_pre as LP
    g = torch.Generator(device=dev).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt)  # noqa: E731
    O, RR = sum(widths), R * len(widths)
    wf, af, dy = rnd(O, C) * C ** -0.5, rnd(RR, C) * C ** -0.5, rnd(N, O)
    bs = [rnd(o, R) * 0.1 for o in widths]
    ws, As, dys = wf.split(list(widths)), af.split(R), dy.split(list(widths), 1)
    dx = torch.empty(N, C, device=dev, dtype=dt)
    dybs = [torch.empty(N, R, device=dev, dtype=dt) for _ in widths]
    dyb3 = torch.empty(N, RR, device=dev, dtype=dt)

    def split():
        for i, (d, w, a, b, y) in enumerate(zip(dys, ws, As, bs, dybs)):
            LP._bwd_tma_pre(dx, y, d, w, a.contiguous(), b, scale, i > 0)

    a_st = af.contiguous()
    BM, BN, BO, warps, stages = LP._pre_config(N, C, O, dt, None)
    n_programs = LP._n_programs(tr.cdiv(N, BM) * tr.cdiv(C, BN), dx.device)

    def stacked():
        for d, b, y in zip(dys, bs, dybs):
            LP._lowrank(y, d, b)
        LP._lora_linear_bwd_tma_pre_kernel[(n_programs,)](
            LP.tma_desc(dx, (BM, BN)), LP.tma_desc(dy, (BM, BO)), LP.tma_desc(wf, (BO, BN)), dyb3, a_st,
            N, C, O, RR, float(scale), n_programs, ACCUMULATE=False, PRECISION="tf32",
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_O=BO, BLOCK_R=max(16, tr.next_power_of_2(RR)), GROUP_M=LP.GROUP_M,
            num_warps=warps, num_stages=stages)
    return split, stacked


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dx", nargs="?", const="also", help="the backward's dx GEMMs alone, split and stacked "
                    "(--dx only: nothing else)")
    ap.add_argument("--check", action="store_true", help="CPU (TRITON_INTERPRET=1): the diffs at tiny sizes, fp32")
    args = ap.parse_args()
    if args.check:
        for widths in ((48, 16, 16), (40, 40)):
            print(widths, f"diff {group(37, 32, widths, 4, torch.float32, 'cpu')[-1]():.1e}")
        return
    dev, dt, N, R = "cuda", torch.bfloat16, args.tokens, args.rank
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; N {N}, R {R}")
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")  # noqa: E731
    with tma_at_every_size():  # the captured step's paths
        for model in args.models.split(","):
            C, qkv, F = MODELS[model]
            # rank 3R = 48 pads to 64, past the TMA pre-pass kernel's shared memory: q/k/v at R / 2
            for name, widths, r in (("k/v", qkv[1:], R), ("q/k/v", qkv, R // 2), ("gate/up", (F, F) if F else None, R)):
                if widths is None:
                    continue
                name = f"{name} r{r}"
                if args.dx != "only":
                    sf, sb, ff, fb, check = group(N, C, widths, r, dt, dev)
                    err = check()
                    t = [bench(f) for f in (sf, sb, ff, fb)]
                    print(f"{model:<14} {name:<11} split fwd {t[0]:.3f} bwd {t[1]:.3f} = {t[0] + t[1]:.3f} ms | "
                          f"fused fwd {t[2]:.3f} bwd {t[3]:.3f} = {t[2] + t[3]:.3f} ms | "
                          f"{(t[0] + t[1]) / (t[2] + t[3]):.3f}x  diff {err:.1e}", flush=True)
                    torch.cuda.empty_cache()
                if args.dx:  # at the full rank R (the stacked rank-R term at 3R = 48: BLOCK_R 64)
                    try:
                        sp, st = dx_only(N, C, widths, R, dt, dev)
                        t = [bench(f) for f in (sp, st)]
                        print(f"{model:<14} {name.split()[0] + ' r' + str(R):<11} dx alone: split {t[0]:.3f} ms | "
                              f"stacked {t[1]:.3f} ms | {t[0] / t[1]:.3f}x", flush=True)
                    except Exception as e:  # noqa: BLE001  (out of shared memory: say so and go on)
                        print(f"{model:<14} {name:<11} dx alone: {type(e).__name__}: {str(e)[:120]}")
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
