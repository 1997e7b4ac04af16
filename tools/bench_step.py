"""bench step: one LoRA optimizer step over 8192 tokens, timed (lean only so far).

Same work as ../shared/PEERS.md's rows: a random-init bf16 model of the named real config, LoRA
r=16 alpha=32 dropout=0 on q,k,v,o,gate,up,down, AdamW (with clipping) on the LoRA parameters,
loss on every token; layouts `packed` (1 x 8192, document lengths exponential with mean 512, at
least 16, seeded) and `padded` (4 x 2048 documents). Warm-up steps, then the median of timed steps
(CUDA events around forward_backward + optimizer step). MFU = useful FLOPs / (time x the bf16
matmul rate measured in the same run); useful FLOPs per token = 4 x matmul params (lm_head
included) + causal attention (forward once, backward twice), recompute not counted.
The peers (HF+PEFT, Liger, Unsloth) join this mode with the performance issue.
"""
import math
import statistics

import numpy as np
import torch

CONFIGS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
}


def doc_lengths(layout, total=8192, seed=0):
    if layout == "padded":
        return [2048] * 4
    rng = np.random.default_rng(seed)
    lens, left = [], total
    while left > 0:
        n = min(left, max(16, int(rng.exponential(512))))
        if 0 < left - n < 16:
            n = left
        lens.append(n)
        left -= n
    return lens


def useful_flops(cfg, lens):
    C, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    per_layer = C * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * C + 3 * C * F
    matmul_params = cfg.n_layers * per_layer + V * C
    tokens = sum(lens)
    attn_fwd = sum(4 * (L * (L + 1) / 2) * cfg.head_dim * cfg.n_heads for L in lens) * cfg.n_layers
    return 4 * matmul_params * tokens + 3 * attn_fwd


def random_model(name, device="cuda"):
    import lean
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model

    cfg = config_from_hf(CONFIGS[name])
    model = empty_model(cfg, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(0)
    for _, t in model.hf_tensors():
        if t.dim() == 1:
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g, device=device))
        else:
            t.copy_(0.02 * torch.randn(t.shape, generator=g, device=device))
    return lean, model


def graph_step_ms(lean, model, lora, opt, batch, steps):
    """Experiment: the forward + backward of one fixed batch captured once in a CUDA graph and
    replayed (the optimizer step runs eagerly after each replay). Returns the median ms of
    replay + optimizer step; the loss of a replay is checked against an eager step's."""
    lora.zero_grad()
    eager_loss, _ = lean.forward_backward(model, lora, batch, seed=0)
    eager_grads = lora.grads.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lora.zero_grad()
        with torch.cuda.graph(g, stream=side):
            lora.zero_grad()
            loss, _ = lean.forward_backward(model, lora, batch, seed=0)
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    same = torch.equal(loss, eager_loss) and torch.equal(lora.grads, eager_grads)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), same


def run(name, layout, matmul_tflops, warmup=3, steps=8, graph=False):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    lean, model = random_model(name)
    lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", dropout=0.0, seed=0)
    opt = lean.AdamW(lora, lr=1e-4, max_grad_norm=1.0)
    lens = doc_lengths(layout)
    rng = np.random.default_rng(1)
    batches = [lean.pack([rng.integers(0, model.config.vocab, n).tolist() for n in lens], max_tokens=8192)
               for _ in range(2)]
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lora.zero_grad()
        loss, _ = lean.forward_backward(model, lora, batches[i % 2])
        opt.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    assert math.isfinite(loss.item())
    graph_ms = None
    if graph:
        graph_ms = graph_step_ms(lean, model, lora, opt, batches[0], steps)
    t = statistics.median(times)
    tokens = sum(lens)
    extra = {}
    if graph_ms is not None:
        extra = dict(graph_ms=graph_ms[0], graph_tokens_per_s=tokens / (graph_ms[0] / 1e3),
                     graph_equals_eager=graph_ms[1])
    return dict(model=name, layout=layout, tokens_per_s=tokens / t, ms=t * 1e3, **extra,
                mfu=useful_flops(model.config, lens) / t / (matmul_tflops * 1e12),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=loss.item())


def main(models=("qwen3-0.6b", "llama-3.2-1b"), layouts=("packed", "padded"), json_path=None, graph=False):
    import json

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        a @ b
    ev[1].record()
    torch.cuda.synchronize()
    rate = 2 * 8192**3 * 10 / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e12
    del a, b
    print(f"# bench step on {torch.cuda.get_device_name()}; bf16 matmul 8192^3: {rate:.1f} TFLOP/s")
    rows = []
    print(f"{'model':14s} {'layout':7s} {'tokens/s':>10s} {'ms':>8s} {'MFU':>6s} {'peak GiB':>9s}  peers")
    for m in models:
        for layout in layouts:
            r = run(m, layout, rate, graph=graph)
            rows.append(r)
            g = (f"  graph: {r['graph_tokens_per_s']:,.0f} tok/s ({r['graph_ms']:.1f} ms), "
                 f"bit-equal to eager: {r['graph_equals_eager']}") if graph else ""
            print(f"{m:14s} {layout:7s} {r['tokens_per_s']:10,.0f} {r['ms']:8.1f} {100 * r['mfu']:5.1f}% "
                  f"{r['peak_gib']:9.2f}  peers not run yet{g}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(matmul_tflops=rate, rows=rows), f, indent=1)
    return rows
