"""bench offload: the VRAM-budget planner and the offload scheduler on real configs (CUDA only).

    python tools/bench_offload.py                                  # both models, default budgets
    python tools/bench_offload.py --model llama-3.2-3b --budget 8 --steps 5

The planner prices its candidates with the pinned link and GEMM rates it measures first
(offload.measure_rates; printed under the plan). Per model (random-init bf16, LoRA r=16 alpha=32 dropout 0 on q,k,v,o,gate,up,down, AdamW, one packed
row of 8192 tokens, document lengths exponential with mean 512, at least 16, seeded), four plans:
  planned    plan_for(model, lora, 8192, budget): what --vram-budget runs (qwen3-8b 17.5 GiB,
             llama-3.2-3b 8 GiB); its table is printed first
  offload_up every layer's input and up projection offloaded, the rest rebuilt (without up's GEMM)
  offload    every layer's input offloaded, the rest rebuilt
  recompute  every layer's input kept, the rest recomputed (the same compute as offload, no copies)
  keep       everything kept (no plan), when it fits the GPU
Columns: tokens/s and ms of one optimizer step (forward_backward + AdamW, median of --steps after
--warmup, CUDA events); fwd = step start to the start of the layers' backward (forward, lm_head,
loss), bwd = the layers' backward (recomputes included), both median ms, timed by CUDA events
recorded around step._backward_layers (wrapped here, lean/ is untouched); peak =
torch.cuda.max_memory_allocated over the timed steps; pred = the plan's predicted peak.
Overlap: bwd(offload) / bwd(recompute) is what the copies cost beyond hiding under compute (the
goal: <= 1.10). Napkin: one layer input is 8192 x C x 2 bytes (64 MiB at C = 4096) each way, ~1.3 ms
at ~50 GB/s pinned, against several ms of a layer's backward.
Goals (issue #6): qwen3-8b planned >= 14,000 tok/s at peak <= 17.5 GiB; llama-3.2-3b planned peak
<= 8 GiB; predicted peak within 10% of measured.
"""
import argparse
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lean  # noqa: E402
from lean.models.config import config_from_hf  # noqa: E402
from lean.models.weights import empty_model  # noqa: E402
from lean.runtime import step as step_module  # noqa: E402
from lean.runtime.plan import GiB, OFFLOAD, OFFLOAD_UP, RECOMPUTE, make_plan  # noqa: E402
from lean.runtime.planner import format_plan, plan_for  # noqa: E402

TOKENS = 8192
CONFIGS = {
    "qwen3-8b": (dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 17.5),
    "llama-3.2-3b": (dict(architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192,
                          num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                          vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}), 8.0),
}


def random_model(config):
    model = empty_model(config_from_hf(config), torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for _, t in model.hf_tensors():
        r = torch.randn(t.shape, generator=g, device="cuda")
        t.copy_(1.0 + 0.1 * r if t.dim() == 1 else 0.02 * r)
        del r
    return model


def packed_batch(model, seed):
    rng = np.random.default_rng(seed)
    lens, left = [], TOKENS
    while left > 0:
        n = min(left, max(16, int(rng.exponential(512))))
        if 0 < left - n < 16:
            n = left
        lens.append(n)
        left -= n
    return lean.pack([rng.integers(0, model.config.vocab, n).tolist() for n in lens], max_tokens=TOKENS)


class PhaseEvents:
    """CUDA events at the start and the end of step._backward_layers, for every call while active."""

    def __enter__(self):
        self.orig, self.marks = step_module._backward_layers, []

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g = self.orig(*args, **kwargs)
            end.record()
            self.marks.append((start, end))
            return g

        step_module._backward_layers = timed
        return self

    def __exit__(self, *exc):
        step_module._backward_layers = self.orig


def run(model, lora, opt, batches, plan, warmup, steps):
    """{ms, fwd_ms, bwd_ms, peak} of the step under plan (None: keep everything)."""
    def one(i):
        lora.zero_grad()
        lean.forward_backward(model, lora, batches[i % 2], plan=plan)
        opt.step()

    for i in range(warmup):  # compiles kernels, builds the scheduler (pinned memory) and RoPE tables
        one(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rows = []
    with PhaseEvents() as ph:
        for i in range(steps):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            one(i)
            t1.record()
            torch.cuda.synchronize()  # host sync: read this step's times
            b0, b1 = ph.marks[-1]
            rows.append((t0.elapsed_time(t1), t0.elapsed_time(b0), b0.elapsed_time(b1)))
    med = [statistics.median(c) for c in zip(*rows)]
    return dict(ms=med[0], fwd_ms=med[1], bwd_ms=med[2], peak=torch.cuda.max_memory_allocated())


def bench_model(name, budget_gib, warmup, steps, with_keep):
    config, default_budget = CONFIGS[name]
    budget = int((budget_gib or default_budget) * GiB)
    model = random_model(config)
    lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", dropout=0.0, seed=0)
    opt = lean.AdamW(lora, lr=1e-4, max_grad_norm=1.0)
    batches = [packed_batch(model, s) for s in (1, 2)]
    planned = plan_for(model, lora, TOKENS, budget)
    print(format_plan(planned), flush=True)
    L, w = model.config.n_layers, planned.memory.weights
    plans = {"planned": planned}
    for mode in (OFFLOAD_UP, OFFLOAD, RECOMPUTE):
        plans[mode] = make_plan(model.config, TOKENS, (mode,) * L, lora_rank=16, lora_targets=lora.targets,
                                weights_bytes=w, rates=planned.rates)
    if with_keep:
        plans["keep"] = plan_for(model, lora, TOKENS)
    out = {}
    for label, plan in plans.items():
        try:
            r = run(model, lora, opt, batches, plan if label != "keep" else None, warmup, steps)
        except torch.OutOfMemoryError:
            print(f"{name} {label}: out of GPU memory (predicted {plan.memory.peak / GiB:.2f} GiB)", flush=True)
            torch.cuda.empty_cache()
            continue
        r.update(pred=plan.memory.peak, budget=budget if label == "planned" else None)
        out[label] = r
        print(row(name, label, r), flush=True)
    model.cache.clear()  # the scheduler's pinned and device buffers
    return out


HEADER = ("| model | plan | tok/s | step ms | fwd ms | bwd ms | peak GiB | pred GiB | pred/peak |\n"
          "|---|---|---|---|---|---|---|---|---|")


def row(name, label, r):
    return (f"| {name} | {label} | {TOKENS / (r['ms'] / 1e3):,.0f} | {r['ms']:.1f} | {r['fwd_ms']:.1f} | "
            f"{r['bwd_ms']:.1f} | {r['peak'] / GiB:.2f} | {r['pred'] / GiB:.2f} | {r['pred'] / r['peak']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), action="append", help="default: both")
    ap.add_argument("--budget", type=float, help="VRAM budget in GiB (default per model: qwen3-8b 17.5, llama 8)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-keep", action="store_true", help="skip the keep-everything row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_offload.py needs a CUDA GPU")
    results = {}
    for name in args.model or list(CONFIGS):
        results[name] = bench_model(name, args.budget, args.warmup, args.steps, not args.no_keep)
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, bf16, {TOKENS} tokens packed, LoRA r=16 all 7 projections\n{HEADER}")
    for name, res in results.items():
        for label, r in res.items():
            print(row(name, label, r))
    print()
    for name, res in results.items():
        p = res.get("planned")
        if p:
            ok = p["peak"] <= p["budget"]
            print(f"{name}: planned peak {p['peak'] / GiB:.2f} GiB {'<=' if ok else '>'} budget "
                  f"{p['budget'] / GiB:.2f} GiB; predicted/measured {p['pred'] / p['peak']:.3f}")
        if "offload" in res and "recompute" in res:
            print(f"{name}: overlap bwd(offload) / bwd(recompute) = "
                  f"{res['offload']['bwd_ms'] / res['recompute']['bwd_ms']:.3f} (goal <= 1.10)")
        if "offload" in res and "keep" in res:
            print(f"{name}: bwd(offload) / bwd(keep) = {res['offload']['bwd_ms'] / res['keep']['bwd_ms']:.3f} "
                  "(recompute included)")


if __name__ == "__main__":
    main()
