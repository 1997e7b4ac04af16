"""The LoRA GEMMs on an NF4 weight (QLoRA) against the same on the bf16 weight: H100, bf16, N = 8192
tokens, R = 16, the Qwen3-8B / Llama-3.1-8B projection shapes.

    python tools/nf4_bench.py                      # the table (about a minute on an H100)
    LEAN_PORTABLE=1 python tools/nf4_bench.py      # the path an RTX 30/40/50 card takes (no TMA)
    TRITON_INTERPRET=1 python tools/nf4_bench.py --smoke   # CPU: every variant once, tiny sizes

Rows per (K, O) shape, forward (lora_linear_fwd: y = x W^T + s xa B^T) and backward (lora_linear_bwd:
dx, dA, dB):
  bf16      the bf16 weight, lean's own path (the Hopper TMA kernels where they apply)
  fused     the NF4 weight decoded in the GEMM's registers (nf4.FUSED = True)
  scratch   the NF4 weight dequantised into an (O, K) bf16 buffer, then the bf16 path (FUSED = False)
  dequant   nf4_dequant alone
Times: triton.testing.do_bench_cudagraph medians (GPU time, as a captured step pays). "x bf16" is
bf16's time over the row's; "%floor" the row's floor (the larger of its flops at the bf16 matmul rate
and its bytes at the copy rate, both measured here; NF4 bytes for the weight: O K / 2 + O K / 64)
over its time. --json writes the rows (kernels/nf4.nf4_fused's choice cites them).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.nf4 as NF  # noqa: E402
from lean.kernels.lora_linear import lora_linear_bwd, lora_linear_fwd  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (5120, 17408), (17408, 5120)]  # (K, O)
SMOKE = [(128, 96), (192, 64)]
N_TOKENS, RANK = 8192, 16


def timer(smoke):
    if smoke:
        return lambda fn: (fn(), None)[1]
    import triton.testing

    return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def rates(smoke):
    """(bf16 matmul FLOP/s, copy B/s) measured here."""
    if smoke:
        return None, None
    t = timer(False)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = t(lambda: torch.matmul(a, a))
    src = torch.empty(2**30 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms_c = t(lambda: dst.copy_(src))
    return 2 * 8192**3 / (ms * 1e-3), 2 * src.numel() * 2 / (ms_c * 1e-3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev, dt = ("cpu", torch.float32) if a.smoke else ("cuda", torch.bfloat16)
    N, R = (37, 8) if a.smoke else (N_TOKENS, RANK)
    t = timer(a.smoke)
    flops_rate, bw = rates(a.smoke)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    portable = os.environ.get("LEAN_PORTABLE") == "1"
    print(f"NF4 LoRA GEMMs, N={N} R={R} {dt} {'portable path' if portable else 'default path'}"
          + (f"; bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s" if flops_rate else ""))
    print(f"{'K x O':>12} {'op':>4} {'bf16 ms':>8} {'fused ms':>9} {'x bf16':>7} {'%floor':>7} {'scratch ms':>10} "
          f"{'x bf16':>7} {'dequant ms':>10}")
    for K, O in (SMOKE if a.smoke else SHAPES):
        r = lambda *s, sc=1.0: (torch.randn(*s, generator=g, device=dev) * sc).to(dt)  # noqa: E731
        x, w, am, bm, dy = r(N, K), r(O, K, sc=0.02), r(R, K, sc=0.02), r(O, R, sc=0.02), r(N, O)
        q = NF.empty_nf4(O, K, dev)
        NF.nf4_quantize(q, w)
        y, xa, dx = torch.empty(N, O, device=dev, dtype=dt), torch.empty(N, R, device=dev, dtype=dt), \
            torch.empty(N, K, device=dev, dtype=dt)
        da, db = torch.zeros(R, K, device=dev), torch.zeros(O, R, device=dev)
        wd = torch.empty(O, K, device=dev, dtype=dt)
        row = dict(K=K, O=O, N=N)
        for op in ("fwd", "bwd"):
            def run(weight, op=op):
                if op == "fwd":
                    return lambda: lora_linear_fwd(y, xa, x, weight, am, bm, 2.0)
                return lambda: lora_linear_bwd(dx, da, db, dy, x, xa, weight, am, bm, 2.0)
            times = {}
            for name, weight, fused in (("bf16", w, None), ("fused", q, True), ("scratch", q, False)):
                NF.FUSED = fused
                try:
                    times[name] = t(run(weight))
                except Exception as e:  # a variant that fails is reported, the table goes on
                    print(f"  {name} {op} {K}x{O}: {type(e).__name__}: {str(e)[:200]}")
                    times[name] = None
            NF.FUSED = None
            times["dequant"] = t(lambda: NF.nf4_dequant(wd, q))
            row[op] = times
            if a.smoke:
                continue
            # W frozen: one (N, K, O) GEMM each way (y; dx). LoRA: xa, xa B^T forward; dyb, dx += dyb A, dA, dB backward
            flops = 2 * N * K * O + (2 if op == "fwd" else 4) * N * R * (K + O)
            moved = 2 * N * (K + O) + O * K // 2 + O * K // 64
            floor = max(flops / flops_rate, moved / bw) * 1e3
            f, s, b = times["fused"], times["scratch"], times["bf16"]
            row[op]["floor_ms"] = floor
            fmt = lambda v: f"{v:.3f}" if v else "fail"  # noqa: E731
            ratio = lambda v: f"{b / v:.2f}" if v and b else "-"  # noqa: E731
            print(f"{K:>5}x{O:<6} {op:>4} {fmt(b):>8} {fmt(f):>9} {ratio(f):>7} "
                  f"{100 * floor / f if f else 0:>6.0f}% {fmt(s):>10} {ratio(s):>7} {fmt(times['dequant']):>10}")
        rows.append(row)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(portable=portable, rows=rows, device=torch.cuda.get_device_name() if not a.smoke else "cpu"),
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
