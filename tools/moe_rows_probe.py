"""The MoE row passes at other launch tiles: moe_act_bwd, moe_combine, moe_glu_fwd / _bwd (bf16, GPU).

    python tools/moe_rows_probe.py

Each pass at its chooser's tile ("default") and at fixed (BLOCK_R, BLOCK_F, num_warps) tiles, at the
bench step's shapes (8192 tokens: Qwen3-30B-A3B top-8, F 768, C 2048; gpt-oss-20b top-4, F = C =
2880): CUDA-graph medians (triton.testing.do_bench_cudagraph) and the bytes they move per second.
The tiles are forced by replacing moe_group._rows_config / act_bwd_config (and moe_glu's names for
them) for the duration of a row. Measured on the H200 (2026-11-29, with this loop as a one-off
script before it moved here; this file has not run on a GPU since): moe_group.act_bwd_config's
docstring and BENCHMARKS.md.
"""
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.moe_glu as GL  # noqa: E402
import lean.kernels.moe_group as MG  # noqa: E402

TILES = [(2, 1024, 4), (4, 256, 4), (8, 256, 4), (8, 256, 8), (16, 256, 8), (4, 512, 4), (8, 512, 8),
         (16, 128, 4), (32, 128, 8), (32, 256, 8), (16, 512, 8), (1, 1024, 4), (4, 1024, 8)]
NAMES = ("_rows_config", "act_bwd_config")


def run(name, fn, nbytes):
    print(name)
    saved = {(m, n): getattr(m, n) for m in (MG, GL) for n in NAMES if hasattr(m, n)}
    for tile in [None] + TILES:
        if tile is not None:
            for m, n in saved:
                setattr(m, n, lambda *a, t=tile, **k: t)
        try:
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            print(f"    {'default' if tile is None else tile}: {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s")
        except Exception as e:  # noqa: BLE001  (a tile that does not compile: say so and go on)
            print(f"    {tile}: {type(e).__name__}")
        finally:
            for (m, n), f in saved.items():
                setattr(m, n, f)


def main():
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for N, K, F, C, glu in ((8192, 8, 768, 2048, False), (8192, 4, 2880, 2880, True)):
        P = N * K
        h = torch.randn(P, 2 * F, device=dev, dtype=dt)
        G = torch.randn(P, F, device=dev, dtype=dt)
        w = torch.rand(N, K, device=dev, dtype=dt)
        order = torch.randperm(P, device=dev).to(torch.int32)
        dh, dw = torch.empty_like(h), torch.empty(N, K, device=dev)
        act = torch.empty(P, F, device=dev, dtype=dt)
        io = 2 * P * (F + 2 * F + 2 * F + F)  # read G, h; write dh, act
        if glu:
            run(f"moe_glu_bwd P={P} F={F}", lambda: GL.moe_glu_bwd(dh, dw, G, h, w, order, act=act), io)
            run(f"moe_glu_fwd P={P} F={F}", lambda: GL.moe_glu_fwd(act, h), 2 * P * 3 * F)
        else:
            run(f"moe_act_bwd P={P} F={F}", lambda: MG.moe_act_bwd(dh, dw, G, h, w, order, act=act), io)
        ys, out = torch.randn(P, C, device=dev, dtype=dt), torch.empty(N, C, device=dev, dtype=dt)
        run(f"moe_combine N={N} K={K} C={C}", lambda: MG.moe_combine(out, ys, order, w), 2 * (P * C + N * C))


if __name__ == "__main__":
    main()
