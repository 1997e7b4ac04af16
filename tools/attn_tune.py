"""GPU timing for lean's varlen causal attention (bf16) against torch's flash attention.

    python tools/attn_tune.py                  # time the configs in lean/kernels/attention.py
    python tools/attn_tune.py --sweep          # also sweep BLOCK_M/BLOCK_N/warps/stages per kernel
    python tools/attn_tune.py --sweep --compile-only   # fill Triton's cache in parallel workers
    python tools/attn_tune.py --tma [--sweep]  # the TMA loops (a captured step's) and their table
    python tools/attn_tune.py --split          # the backward at each dk/dv split (DKDV_SPLIT), per model

Cases: N = 8192 tokens packed from documents with exponential lengths (mean 512, fixed seed), bench
step's packed batch and 4 x 2048, for H=16/KVH=8/D=128 and H=32/KVH=8/D=64. FLOPs count causal work only:
fwd = 4 * sum(L_i^2) / 2 * D * H, bwd = 2.5 * fwd (the 5-matmul convention; lean's deterministic
backward actually runs 7). Times are triton.testing.do_bench medians.
Peers: torch's flash kernel called in varlen form (aten._flash_attention_forward/backward with
cu_seqlens, the same packed work) and SDPA's flash backend on the padded (B, H, Lmax, D) batch.
"""
import argparse
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lean.kernels import attention as A  # noqa: E402
from lean.kernels import attention_config as AC  # noqa: E402

HEADS = [(16, 8, 128), (32, 8, 64)]             # (H, KVH, D)
SWEEP = {   # (BLOCK_M, BLOCK_N, num_warps, num_stages); the neighbourhood of the chosen configs.
    # Blocks must nest (fwd/dq: BLOCK_M % BLOCK_N == 0, dkdv: BLOCK_N % BLOCK_M == 0).
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (128, 128, 8, 3), (64, 32, 4, 3),
            (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3)],
    "dkdv": [(32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 8, 3), (16, 64, 4, 3),
             (64, 64, 4, 2), (16, 32, 4, 3), (32, 32, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3),
             (64, 128, 8, 3), (64, 128, 8, 2), (16, 128, 4, 3),
             # no spill inside the loop on sm_90 (tools/ptxas_report.py, D = 128, TMA loops),
             # 64 query rows a step, never timed: (64, 64, 4, 2) above spills in its loop (14)
             (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2)],
    "dq": [(64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (64, 32, 4, 4), (64, 64, 4, 2),
           (64, 32, 8, 3), (32, 32, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3),
           (128, 64, 8, 2), (128, 128, 8, 2)],
}
TABLES = {"fwd": "FWD_CONFIG", "dkdv": "DKDV_CONFIG", "dq": "DQ_CONFIG"}
TMA = {"on": False}  # --tma: every lean call forced onto the TMA loops, the sweep edits TMA_TABLES


def table(kernel):
    """The config dict (keyed by D) lean reads for `kernel` on the path being timed."""
    return AC.TMA_TABLES[kernel] if TMA["on"] else getattr(AC, TABLES[kernel])


def packed_lengths(total=8192, mean=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        L = max(1, int(-mean * math.log1p(-torch.rand(1, generator=g).item())))
        lens.append(min(L, left))
        left -= lens[-1]
    return lens


def bench_step_lengths():
    """bench step's packed batch (tools/bench_step.py: 11 documents, the longest 3101)."""
    import bench_step
    return bench_step.doc_lengths("packed")


CASES = {"packed8192": packed_lengths(), "bench_step": bench_step_lengths(), "4x2048": [2048] * 4}


def fwd_flops(lengths, H, D):
    return 4 * sum(L * L for L in lengths) / 2 * D * H


def make(lengths, H, KVH, D, dtype=torch.bfloat16):
    N = len(lengths) and sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qkv = torch.randn(N, H + 2 * KVH, D, device="cuda", dtype=dtype)  # (N, H + 2 KVH, D) fused
    t = dict(q=qkv[:, :H], k=qkv[:, H:H + KVH], v=qkv[:, H + KVH:], cu=cu, M=max(lengths),
             scale=D ** -0.5, do=torch.randn(N, H, D, device="cuda", dtype=dtype))
    t["o"] = torch.empty(N, H, D, device="cuda", dtype=dtype)
    t["lse"] = torch.empty(H, N, device="cuda", dtype=torch.float32)
    t["delta"] = torch.empty(H, N, device="cuda", dtype=torch.float32)
    dqkv = torch.empty_like(qkv)
    t["dq"], t["dk"], t["dv"] = dqkv[:, :H], dqkv[:, H:H + KVH], dqkv[:, H + KVH:]
    return t


def lean_fwd(t):
    A.attention_fwd(t["o"], t["lse"], t["q"], t["k"], t["v"], t["cu"], t["M"], t["scale"], tma=TMA["on"])


def lean_bwd(t):
    A.attention_bwd(t["dq"], t["dk"], t["dv"], t["delta"], t["do"], t["q"], t["k"], t["v"], t["o"],
                    t["lse"], t["cu"], t["M"], t["scale"], tma=TMA["on"])


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def flash_varlen(t):
    """(fwd, fwd+bwd) callables for torch's flash kernel on the same packed varlen work, or None."""
    op_f, op_b = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
    q, k, v = (x.contiguous() for x in (t["q"], t["k"], t["v"]))
    cu, M, s = t["cu"], t["M"], t["scale"]

    def fwd():
        return op_f(q, k, v, cu, cu, M, M, 0.0, True, False, scale=s)

    def fwd_bwd():
        o, lse, rng, unused, _ = fwd()
        op_b(t["do"], q, k, v, o, lse, cu, cu, M, M, 0.0, True, rng, unused, scale=s)
    try:
        fwd_bwd()
        return fwd, fwd_bwd
    except Exception as e:  # noqa: BLE001  (older/newer torch: report and go on)
        print(f"  (flash varlen unavailable: {type(e).__name__}: {str(e)[:120]})")
        return None


def flash_padded(lengths, H, KVH, D):
    """SDPA flash backend on the (B, H, Lmax, D) padded batch: causal + end padding gives the
    same valid rows, at B * Lmax^2 / 2 work instead of sum(L^2) / 2."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, L = len(lengths), max(lengths)
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # kv repeated to H
    v = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    F = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            F(q, k, v, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F(q, k, v, is_causal=True).backward(do)
    return fwd, fwd_bwd


def report(tag, flops, ms_f, ms_fb):
    print(f"  {tag:<28} fwd {ms_f:7.3f} ms {flops / ms_f / 1e9:6.1f} TFLOP/s | fwd+bwd {ms_fb:7.3f} ms "
          f"{3.5 * flops / ms_fb / 1e9:6.1f} TFLOP/s")


def compare():
    for H, KVH, D in HEADS:
        for name, lengths in CASES.items():
            flops = fwd_flops(lengths, H, D)
            print(f"H={H} KVH={KVH} D={D} {name} ({len(lengths)} docs, max {max(lengths)})")
            t = make(lengths, H, KVH, D)
            report("lean", flops, bench(lambda: lean_fwd(t)), bench(lambda: (lean_fwd(t), lean_bwd(t))))
            fl = flash_varlen(t)
            if fl:
                report("torch flash (varlen)", flops, bench(fl[0]), bench(fl[1]))
            pf, pfb = flash_padded(lengths, H, KVH, D)
            report("torch SDPA flash (padded)", flops, bench(pf), bench(pfb))
            del t
            torch.cuda.empty_cache()


def _max_rel_diff(t):
    """Sanity check of one config's results against torch's flash kernel on the same inputs."""
    q, k, v = (x.contiguous() for x in (t["q"], t["k"], t["v"]))
    o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, t["cu"], t["cu"], t["M"], t["M"], 0.0, True, False, scale=t["scale"])
    grads = torch.ops.aten._flash_attention_backward(
        t["do"], q, k, v, o, lse, t["cu"], t["cu"], t["M"], t["M"], 0.0, True, rng, unused, scale=t["scale"])
    pairs = zip((t["o"], t["dq"], t["dk"], t["dv"]), (o, *grads))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)


def _run_config(kernel, D, cfg, time_it):
    """Set one kernel's config for D, run (and time) every case; returns {case: ms} or an error."""
    table(kernel)[D] = cfg
    H, KVH, _ = next(h for h in HEADS if h[2] == D)
    out = {}
    try:
        for name, lengths in CASES.items():
            t = make(lengths, H, KVH, D)
            lean_fwd(t)
            fn = (lambda: lean_fwd(t)) if kernel == "fwd" else (lambda: lean_bwd(t))
            fn()
            torch.cuda.synchronize()
            out[name] = bench(fn) if time_it else 0.0
            if time_it:
                lean_bwd(t)
                out["diff"] = max(out.get("diff", 0.0), _max_rel_diff(t))
    except Exception as e:  # noqa: BLE001  (out of shared memory / registers: report and go on)
        return f"{type(e).__name__}: {str(e)[:100]}"
    return out


def _compile_job(job):
    TMA["on"] = job[-1]   # a spawned worker starts with the module's default: the pointer loops
    return _run_config(*job[:-1], time_it=False)


def sweep(compile_only, workers, kernels=tuple(SWEEP)):
    jobs = [(kernel, D, cfg) for kernel, cfgs in SWEEP.items() if kernel in kernels for _, _, D in HEADS for cfg in cfgs]
    if compile_only:   # fill the on-disk Triton cache in parallel; timing runs serially afterwards
        import multiprocessing as mp
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for job, res in zip(jobs, ex.map(_compile_job, [j + (TMA["on"],) for j in jobs])):
                if isinstance(res, str):
                    print("compile failed", job, res)
        return
    defaults = {k: dict(table(k)) for k in TABLES}
    for kernel, D, cfg in jobs:
        res = _run_config(kernel, D, cfg, time_it=True)
        table(kernel)[D] = defaults[kernel][D]
        if isinstance(res, str):
            shown, total = res, ""
        else:   # diff: max |lean - torch flash| / max |torch flash| over o, dq, dk, dv (bf16 noise ~1e-2)
            diff = res.pop("diff")
            shown = "  ".join(f"{c} {ms:.3f} ms" for c, ms in res.items())
            total = f"  sum {sum(res.values()):.3f}  diff {diff:.1e}{'  MISMATCH' if diff > 5e-2 else ''}"
        print(f"sweep {kernel:<4} D={D:<3} {cfg}: {shown}{total}")


# (H, KVH, D, window) of the models whose G = H // KVH the dk/dv split is for (DKDV_SPLIT)
SPLIT_HEADS = {"qwen3-30b-a3b": (32, 4, 128, 0), "gpt-oss-20b": (64, 8, 64, 0),
               "gpt-oss-20b window": (64, 8, 64, 128), "qwen3-8b": (32, 8, 128, 0),
               "llama3.2-1b": (32, 8, 64, 0), "qwen3-0.6b": (16, 8, 128, 0)}


def split_sweep():
    """The backward (delta + dk/dv + dq) at each dk/dv split S dividing G, CUDA-graph medians of
    the TMA loops (a captured step's path), on bench step's packed batch and 4 x 2048; dk/dv at
    S > 1 against S = 1 (max |diff| / max |ref|: partial sums in another order)."""
    for model, (H, KVH, D, window) in SPLIT_HEADS.items():
        G = H // KVH
        for name in ("bench_step", "4x2048"):
            t = make(CASES[name], H, KVH, D)
            A.attention_fwd(t["o"], t["lse"], t["q"], t["k"], t["v"], t["cu"], t["M"], t["scale"], window=window)
            row, ref = [], None
            for S in (1, 2, 4, 8):
                if G % S:
                    continue
                A.dkdv_split = lambda group, head_dim, window=0, S=S: S  # the window layers too

                def bwd():
                    A.attention_bwd(t["dq"], t["dk"], t["dv"], t["delta"], t["do"], t["q"], t["k"], t["v"],
                                    t["o"], t["lse"], t["cu"], t["M"], t["scale"], window=window, tma=True)
                bwd()
                got = torch.cat([t["dk"].float().flatten(), t["dv"].float().flatten()])
                ref = got if ref is None else ref
                diff = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = triton.testing.do_bench_cudagraph(bwd, rep=200, return_mode="median")
                row.append(f"S={S} {ms:.3f} ms (diff {diff:.1e})")
            print(f"split {model} H={H} KVH={KVH} D={D} window={window} {name}: " + " | ".join(row), flush=True)
            del t
            torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--kernels", default="fwd,dkdv,dq", help="the sweep's kernels, comma-separated")
    ap.add_argument("--no-compare", action="store_true", help="skip the comparison with torch's flash")
    ap.add_argument("--tma", action="store_true", help="time (and sweep) the TMA loops: lean's path in a captured step")
    ap.add_argument("--split", action="store_true", help="time the backward at each dk/dv split (DKDV_SPLIT)")
    ap.add_argument("--heads", help="H/KVH/D,... in place of HEADS (one per head dim), e.g. 32/4/128: "
                    "Qwen3-30B-A3B's heads (G = 8, where DKDV_SPLIT splits dk/dv)")
    ap.add_argument("--cases", help="comma-separated names of CASES to time (default: all)")
    args = ap.parse_args()
    TMA["on"] = args.tma
    if args.heads:
        HEADS[:] = [tuple(int(v) for v in h.split("/")) for h in args.heads.split(",")]
    if args.cases:
        for name in [c for c in CASES if c not in args.cases.split(",")]:
            del CASES[name]
    if args.split:
        print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
        split_sweep()
        sys.exit(0)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    print("configs:", {k: table(k) for k in TABLES}, "(TMA loops)" if args.tma else "(pointer loops)")
    if args.sweep:
        sweep(args.compile_only, args.workers, tuple(args.kernels.split(",")))
    if not (args.compile_only or args.no_compare):
        compare()
