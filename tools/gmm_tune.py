"""GPU sweep of gmm's block configs (lean/kernels/grouped_gemm.py) at the MoE models' shapes, against
torch._grouped_mm on the same rows pre-gathered, bf16, 8192 tokens.

    python tools/gmm_tune.py                 # both models, every case, every candidate
    python tools/gmm_tune.py --models oss    # gpt-oss-20b only (a3b: Qwen3-30B-A3B)
    python tools/gmm_tune.py --configs 128,256,64,8,4 --tail 0,1 --zipf 0   # the short tail tile
                                             # off / on (grouped_gemm.TAIL), near-uniform routing
    python tools/gmm_tune.py --rank --models a3b --zipf 0    # the rank-R gmm calls (x A^T, g Bd, dh B)
    python tools/gmm_tune.py --wgrad --models a3b --zipf 0   # gmm_wgrad's four LoRA weight gradients
                                             # at WGRAD_CANDIDATES x splits 1, 4 (and WGRAD_SPLIT)

Cases (models/moe.py's forward and backward GEMMs; "+LoRA": with the adapter's rank-R epilogue,
s xa[p] b[e]^T, in the same program at the same tile, as the step runs gate_up, down and dX):
  gate_up  y (P, 2F) = n2[order // K] Wgu[e]^T     gathered,     Wgu (E, 2F, C)     +LoRA r 32
  down     y (P, C)  = act Wd[e]^T                                Wd (E, C, F)       +LoRA r 16
  dX       y (P, C)  = dh Wgu[e]                   w transposed   (unit stride on its O dim), +LoRA r 32
  G        y (P, F)  = g[order // K] Wd[e]         gathered, w transposed
Routing: tools/bench.py's zipf_experts (s = 0.5 unless --zipf, seeded, one empty expert; --zipf 0:
uniform over the others, as a random-init router routes). Each candidate replaces
grouped_gemm._config for its runs (monkeypatched), is checked against torch (relative Frobenius
error <= 1e-2, else BAD; torch's +LoRA: a second grouped GEMM and an add) and timed by triton.testing.do_bench (median ms, L2 flushed). The table
gives ms, TFLOP/s, the ratio to torch._grouped_mm and the first candidate's row (the sm90 tier's
tile), and the best per
case ends the output. Candidates that do not fit this GPU's shared memory fail to compile and are
reported as such.
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lean.kernels.gmm_wgrad as GW  # noqa: E402
import lean.kernels.grouped_gemm as GG  # noqa: E402
from bench import zipf_experts  # noqa: E402
from lean.kernels.moe_group import group_slots  # noqa: E402

MODELS = {  # N tokens, C hidden, F expert intermediate, E experts, K per token
    "a3b": dict(N=8192, C=2048, F=768, E=128, K=8),
    "oss": dict(N=8192, C=2880, F=2880, E=32, K=4),
}
CANDIDATES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the first: the sm90 tier's
    (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 5), (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 4), (64, 128, 128, 4, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3),
]


# The rank-R calls' (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_N narrowed to R or 2R; the
# first: what the sm_90 tile gave them before grouped_gemm.NARROW_WARPS (8 warps; now 4).
RANK_CANDIDATES = [
    (128, 256, 64, 8, 4), (128, 32, 64, 4, 4), (128, 32, 128, 4, 3), (64, 32, 128, 4, 3),
    (64, 32, 256, 4, 2), (128, 32, 256, 4, 2), (256, 32, 64, 8, 3), (256, 32, 128, 8, 2),
    (64, 32, 64, 4, 4), (128, 32, 128, 8, 3),
]
# gmm_wgrad (BLOCK_M, BLOCK_K, BLOCK_T, num_warps, num_stages); BLOCK_M / BLOCK_K narrowed to the
# dims as gmm_wgrad._wgrad_config does. The first: the tile before WGRAD_TILE (the sm90 tier's).
WGRAD_CANDIDATES = [
    (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 4, 3), (128, 128, 128, 4, 3),
    (128, 128, 128, 8, 3), (128, 128, 32, 4, 4), (256, 256, 64, 8, 3), (256, 256, 64, 4, 3),
    (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (256, 256, 128, 8, 2), (64, 64, 256, 4, 2),
]


def wgrad_cases(m, dev, zipf=None):
    """models/moe.py's four expert LoRA weight gradients: (name, a, b, gather_a, gather_b, scaled)."""
    N, C, F, E, K = (m[k] for k in ("N", "C", "F", "E", "K"))
    P, R = N * K, 16
    ids, _ = zipf_experts(N, E, K) if zipf is None else zipf_experts(N, E, K, s=zipf)
    order, slot_pos = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(2))
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    group_slots(order, slot_pos, offsets, torch.tensor(ids, device=dev))
    r = lambda *s: torch.randn(*s, device=dev).to(torch.bfloat16)  # noqa: E731
    n2, g, act, dh = r(N, C), r(N, C), r(P, F), r(P, 2 * F)
    xa_gu, dhb, xa_d, gb = r(P, 2 * R), r(P, 2 * R), r(P, R), r(P, R)
    w = torch.rand(P, device=dev).to(torch.bfloat16)
    return offsets, order, K, (w, order), [
        ("gate_up dB", dh, xa_gu, False, False, False), ("gate_up dA", dhb, n2, False, True, False),
        ("down dB", g, xa_d, True, False, True), ("down dA", gb, act, False, False, True)]


def wgrad_main(a, dev):
    """Time gmm_wgrad's cases at each candidate (and split 1 / WGRAD_SPLIT where it splits)."""
    default_cfg, default_split = GW._wgrad_config, GW.wgrad_split
    candidates = [tuple(map(int, c.split(","))) for c in a.configs.split(";")] if a.configs else WGRAD_CANDIDATES
    pow2 = lambda n, hi: max(16, min(hi, 1 << (max(n, 1) - 1).bit_length()))  # noqa: E731
    for model in a.models.split(","):
        offsets, order, K, slot, todo = wgrad_cases(MODELS[model], dev, a.zipf)
        E = offsets.numel() - 1
        for name, x, y, ga, gb, scaled in todo:
            M, Kd = x.shape[1], y.shape[1]
            kw = dict(gather_a=order if ga else None, gather_b=order if gb else None, gather_div=K,
                      scale=slot if scaled else None, alpha=2.0)
            dw = torch.zeros(E, M, Kd, device=dev)
            GW._wgrad_config, GW.wgrad_split = default_cfg, default_split
            GW.gmm_wgrad(dw, x, y, offsets, **kw)
            ref = dw.clone()
            rows_x = x.shape[0]
            nbytes = 2 * (rows_x * M + y.shape[0] * Kd) + 8 * E * M * Kd
            print(f"\n{model} wgrad {name}: M{M} Kd{Kd} E{E}; default split {default_split(M, Kd)}; "
                  f"{nbytes / 1e6:.0f} MB", flush=True)
            for cfg in candidates:
                for split in sorted({1, 4, default_split(M, Kd)}):
                    GW._wgrad_config = lambda M_, Kd_, *_, c=cfg: (pow2(M_, c[0]), pow2(Kd_, c[1]), *c[2:])
                    GW.wgrad_split = lambda *_, s=split: s
                    try:
                        dw.zero_()
                        GW.gmm_wgrad(dw, x, y, offsets, **kw)
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 (a config that does not fit: reported)
                        print(f"  {cfg} split {split}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                        continue
                    err = ((dw - ref).norm() / ref.norm()).item()
                    ms = do_bench(lambda: GW.gmm_wgrad(dw, x, y, offsets, **kw))
                    print(f"  {cfg} split {split}: {ms * 1e3:.1f} us  {nbytes / ms / 1e6:.0f} GB/s"
                          f"{'  BAD err %.2e' % err if err > 1e-3 else ''}", flush=True)
    GW._wgrad_config, GW.wgrad_split = default_cfg, default_split


def cases(m, dev, zipf=None):
    N, C, F, E, K = (m[k] for k in ("N", "C", "F", "E", "K"))
    P = N * K
    ids, _ = zipf_experts(N, E, K) if zipf is None else zipf_experts(N, E, K, s=zipf)
    order, slot_pos = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(2))
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    group_slots(order, slot_pos, offsets, torch.tensor(ids, device=dev))
    r = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(torch.bfloat16)  # noqa: E731
    n2, act, dh, g = r(N, C), r(P, F), r(P, 2 * F), r(N, C)
    w_gu, w_d = r(E, 2 * F, C, scale=C**-0.5), r(E, C, F, scale=F**-0.5)
    R = 16  # the step's rank: gate_up's adapter is rank 2R (gate and up), down's R
    lora_gu = (r(P, 2 * R), r(E, 2 * F, 2 * R, scale=(2 * R) ** -0.5), 2.0)
    lora_d = (r(P, R), r(E, C, R, scale=R**-0.5), 2.0)
    lora_dx = (r(P, 2 * R), r(E, C, 2 * R, scale=(2 * R) ** -0.5), 2.0)
    return offsets, order, K, [
        ("gate_up", n2, w_gu, True, None), ("gate_up+LoRA", n2, w_gu, True, lora_gu),
        ("down", act, w_d, False, None), ("down+LoRA", act, w_d, False, lora_d),
        ("dX", dh, w_gu.transpose(1, 2), False, None), ("dX+LoRA", dh, w_gu.transpose(1, 2), False, lora_dx),
        ("G", g, w_d.transpose(1, 2), True, None),
    ], [  # the rank-R products (--rank): memory-bound reads of x, an output R or 2R wide
        ("xa gate_up", n2, r(E, 2 * R, C, scale=C**-0.5), True, None),              # x A^T, gathered
        ("xa down", act, r(E, R, F, scale=F**-0.5), False, None),
        ("g Bd", g, r(E, C, R, scale=R**-0.5).transpose(1, 2), True, None),        # B stored (E, C, R)
        ("dh B", dh, r(E, 2 * F, 2 * R, scale=(2 * R) ** -0.5).transpose(1, 2), False, None),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="a3b,oss")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--configs", default="", help="semicolon-separated BM,BN,BK,warps,stages (default: CANDIDATES)")
    p.add_argument("--zipf", type=float, help="routing popularity exponent (default tools/bench.py's MOE_ZIPF)")
    p.add_argument("--tail", default="", help="comma-separated grouped_gemm.TAIL values to run each config at "
                   "(0 off, 1 on; default: as the module has it)")
    p.add_argument("--wgrad", action="store_true", help="gmm_wgrad's cases instead (--configs: its 5-tuples)")
    p.add_argument("--rank", action="store_true", help="the rank-R gmm calls (x A^T, g Bd, dh B) at RANK_CANDIDATES")
    a = p.parse_args(argv)
    if a.wgrad:
        print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
        return wgrad_main(a, "cuda")
    tails = [bool(int(t)) for t in a.tail.split(",")] if a.tail else [GG.TAIL]
    dev = "cuda"
    default = GG._config
    candidates = ([tuple(map(int, c.split(","))) for c in a.configs.split(";")] if a.configs else
                  RANK_CANDIDATES if a.rank else CANDIDATES)
    best = []
    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for model in a.models.split(","):
        offsets, order, K, big, rank = cases(MODELS[model], dev, a.zipf)
        todo = rank if a.rank else big
        ends = offsets[1:]
        for name, x, w, gather, lora in todo:
            if a.cases and name not in a.cases.split(","):
                continue
            E, O, Kd = w.shape
            P = order.numel()
            kw = dict(gather=order, gather_div=K) if gather else {}
            xg = x[order.long() // K].contiguous() if gather else x
            ref = torch._grouped_mm(xg, w.transpose(1, 2), offs=ends)
            if lora:  # + s xa b[e]^T: torch's second grouped GEMM and the add
                ref = ref.float() + lora[2] * torch._grouped_mm(lora[0], lora[1].transpose(1, 2), offs=ends).float()
                kw["lora"] = lora
            t_ms = do_bench(lambda: torch._grouped_mm(xg, w.transpose(1, 2), offs=ends) if not lora else
                            torch._grouped_mm(xg, w.transpose(1, 2), offs=ends).add_(
                                torch._grouped_mm(lora[0], lora[1].transpose(1, 2), offs=ends), alpha=lora[2]))
            flops = 2.0 * P * O * Kd + (2.0 * P * O * lora[0].shape[1] if lora else 0.0)
            y = torch.empty(P, O, device=dev, dtype=torch.bfloat16)
            print(f"\n{model} {name}: P{P} O{O} K{Kd} E{E}{' gathered' if gather else ''}; torch._grouped_mm "
                  f"{t_ms:.3f} ms ({flops / t_ms / 1e9:.0f} TF/s)", flush=True)
            rows = []
            for cfg, tail in ((c, t) for c in candidates for t in tails):
                GG.TAIL = tail
                GG._config = lambda *_, c=cfg: (c[0], min(c[1], max(16, 1 << (O - 1).bit_length())), *c[2:])
                try:
                    GG.gmm(y, x, w, offsets, **kw)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a config that does not fit: reported, not fatal)
                    print(f"  {cfg} tail {int(tail)}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                    continue
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = do_bench(lambda: GG.gmm(y, x, w, offsets, **kw))
                rows.append((ms, cfg, err))
                print(f"  {cfg} tail {int(tail)}: {ms:.3f} ms  {flops / ms / 1e9:4.0f} TF/s  vs grouped_mm {t_ms / ms:.2f}x"
                      f"{'  BAD err %.2e' % err if err > 1e-2 else ''}", flush=True)
            GG._config = default
            good = sorted(r for r in rows if r[2] <= 1e-2)
            if good:
                d = next((r for r in rows if r[1] == candidates[0]), None)
                best.append((model, name, good[0][1], good[0][0], d[0] if d else float("nan"), t_ms))
    print("\nbest per case: model case config  ms  (first candidate ms, grouped_mm ms)")
    for model, name, cfg, ms, d, t in best:
        print(f"  {model:4} {name:8} {cfg}  {ms:.3f}  (first {d:.3f}: {d / ms:.2f}x; grouped_mm {t:.3f}: {t / ms:.2f}x)")


if __name__ == "__main__":
    main()
