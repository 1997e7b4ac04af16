"""bench step: one LoRA optimizer step over 8192 tokens, lean and its peers in one run.

The two device calls (the device has no internet: tools/fetch_wheels.sh, run here, puts the
peers' wheels in .whl/a and .whl/b; together they pass the 64 MiB one call may carry, so they
travel in two calls, and the machine keeps /tmp/site between calls while it stays warm, 30 s):

    run(command="tools/gpu_check.sh wheels", carry=[".whl/a"], timeout_s=300)   # unsloth & co
    run(command="tools/gpu_check.sh step", carry=[".whl/b"], timeout_s=600)     # at once after

The second alone still runs lean, HF+PEFT and Liger (.whl/b carries liger-kernel); Unsloth then
prints "unsloth not installed: skipped". A further call on the warm machine needs no carry, e.g.
`tools/gpu_check.sh step --models qwen3-8b`; if the default run nears the 10-minute cap, split it
the same way (`step --models qwen3-0.6b`, then `step --models llama-3.2-1b`). The MoE models' rows
(cut to 8 layers) take one call per model and layout, e.g. `tools/gpu_check.sh step --graph --models
qwen3-30b-a3b --layouts padded`, the peers split off (`--peers unsloth`) if that nears the cap.
On a CPU: `python tools/bench.py step --smoke` (tiny configs, the interpreter, no timing claims).

The work, the same in every row (../shared/PEERS.md): a random-init bf16 model of the named real
config; LoRA r=16 alpha=32 dropout=0 on q,k,v,o,gate,up,down; loss on every token; gradient
clipping at 1.0 and AdamW on the LoRA parameters (lean.AdamW for lean, torch's fused AdamW for
the peers); no checkpointing. Layouts: `packed` = 1 x 8192, document lengths exponential with
mean 512, at least 16 (seeded), position_ids restarting per document (Unsloth also gets
packed_seq_lengths); `padded` = 4 x 2048 full rows. Frameworks: lean, HF+PEFT, HF+PEFT (default
experts) on MoE models, HF+PEFT+Liger (liger-kernel 0.8.5), Unsloth 2026.10.9 (tools/bench_peers.py
builds and steps each); lean attn-LoRA (q,k,v,o only) with --lean-attn-only or when a peer needs it.

How a number is taken: each (framework, model, layout) runs in its own process (its peak memory
is its own, torch.cuda.max_memory_allocated from a reset at process start; Unsloth's global
patches of transformers stay in its process) and prints one JSON row. Time = median over
`--steps` timed steps (CUDA events around zero-grad + forward + backward + clip + optimizer
step) after 3 warm-up steps (Unsloth's compile warm-up falls in them). MFU = useful FLOPs /
(time x the bf16 matmul rate measured once by this process, as `bench.py kernels` does); useful
FLOPs per token = 4 x matmul params (lm_head included) + causal attention (forward once, backward
twice); recompute is not counted. Ratios: lean tok/s / peer tok/s (> 1: lean faster) and lean
peak / peer peak (< 1: lean smaller), from lean's fastest row of the same model, layout and LoRA
placement (row key `lora`).

lean's rows (the child runs them in one process, eager first):
  lean        the eager step: lora.zero_grad(); lean.forward_backward; opt.step(), on batches packed
              to their own shapes.
  lean+graph  (--graph) the whole step (zero-grad, forward, loss, backward, AdamW) replayed from
              lean.StepGraph over fixed shapes: 8192 tokens, max_docs = the layout's documents + 1
              rounded up to a multiple of 64 (MAX_DOCS). Before timing, one graph step and one
              eager step from the same state on the same fixed-shape batch are compared bit for bit
              (the note says "bit-equal to eager" or NOT). Its peak counts from a reset after the
              eager steps: weights, LoRA and AdamW state, the graph's warm-up, capture and replays
              (not the check's copies of the optimizer state).
  --budget G  both rows run under lean.runtime.planner.plan_for(model, lora, 8192, G GiB): the fewest
              recomputed / offloaded layers that fit G (the note names the plan and its predicted
              peak; recompute is flagged like the peers' checkpointing). A budget no plan fits
              fails the row with PlanError's message. Unsloth's row then runs with its offloaded
              gradient checkpointing (use_gradient_checkpointing="unsloth"), PEERS.md's memory-bound
              setting; HF and Liger ignore it.

MoE models (qwen3-30b-a3b, gpt-oss-20b, gpt-oss-20b-mxfp4): every framework runs the model cut to
the same DEFAULT_LAYERS (8 layers of each: the issue's truncated rows, where Unsloth and HF+PEFT fit
one H100 without checkpointing; `--layers N` sets another cut, for every model and framework named);
the note says "8 of 48 layers". LoRA r=16 alpha=32 goes on the attention's q,k,v,o and on every
expert's fused weights, each framework its own way: lean's "all" (gate_up and down per expert);
HF+PEFT (and Liger) with PEFT target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
(tools/bench_peers.py says how PEFT ranks gate_up); Unsloth with the 7 names, which it maps onto
the experts itself ("Unsloth's MoE LoRA"). Each peer row reports where its LoRA landed (the child
reads the trainable parameters' names; key `lora`: "all" or "attn"). HF+PEFT runs transformers'
`grouped_mm` experts (its fastest), and `hf-default` (HF+PEFT (default experts), MoE models only)
builds with transformers' default, which 5.17 resolves to grouped_mm as well (the note names what it
resolved to). A peer row that came back with attention-only LoRA is compared with lean's attention-only
row (`lean-attn`, "lean attn-LoRA": lean.LoRA targets q,k,v,o), which then runs for that model and
layout if `--lean-attn-only` did not already add it. GPT-OSS on HF: flex_attention (transformers has
no sdpa path for its sinks), packed rows masked per document by transformers' own mask functions;
gpt-oss-20b-mxfp4's peers train bf16 experts (HF fine-tunes MXFP4 dequantised; the note says so),
lean its MXFP4 ones. Useful FLOPs count the active parameters (router, k experts, windowed attention
on GPT-OSS's sliding layers); --budget plans them like the dense rows (MoE plans not yet measured
on a GPU).

Errors: a peer that is not importable is skipped with a note, never faked; a row whose process
fails (an OOM, a crash, the per-row --timeout) prints its error tail and the table says so.
Caution: --smoke numbers are CPU wall clock on tiny configs; they test the harness, not speed.
"""
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lean.models.presets import PRESETS  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
TOKENS = int(os.environ.get("BENCH_STEP_TOKENS") or 8192)  # per optimizer step (--tokens N: $BENCH_STEP_TOKENS)
QUANT_ENV = "BENCH_STEP_QUANT"  # --quant nf4: QLoRA rows (lean's NF4 base weights, Unsloth's load_in_4bit)


def quant():
    """The bench's base-weight quantisation: "nf4" (QLoRA rows) or "" (the model dtype)."""
    return os.environ.get(QUANT_ENV, "")
SMOKE_TOKENS = 64
WARMUP = 3
FRAMEWORKS = {"lean": "lean", "lean-attn": "lean attn-LoRA", "hf": "HF+PEFT", "hf-default": "HF+PEFT (default experts)",
              "liger": "HF+PEFT+Liger", "unsloth": "Unsloth"}
# importable = installed
PEER_MODULE = {"hf": "peft", "hf-default": "peft", "liger": "liger_kernel", "unsloth": "unsloth"}
MOE_ONLY = ("hf-default",)  # a dense model has no experts implementation: these peers run on MoE models only
ATTN_SUFFIX = " attn-LoRA"  # lean's rows with LoRA on q,k,v,o only (framework lean-attn)
PEERS = ("hf", "hf-default", "liger", "unsloth")  # bench.py step's default --peers

# HF config.json values (read by lean's config_from_hf and by transformers' AutoConfig).
CONFIGS = dict(PRESETS)
DEFAULT_MODELS = ("qwen3-0.6b", "llama-3.2-1b")
LAYOUTS = ("packed", "padded")
# --smoke: the same architecture and tying, tiny sizes (lean's interpreter runs them in seconds).
_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256)
_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # and E, k, F of one expert
_TINY_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8)  # GPT-OSS
# Models cut to their first N layers by default (--layers N overrides, for every model named; the row's
# note says "N of L layers"): the MoE models, to the count at which every framework fits one 80 GB
# H100 without checkpointing, the same for all of them (the truncated rows; PEERS.md measured
# Unsloth and HF+PEFT on Qwen3-30B-A3B at 8 layers: 20.7-22.6 and 36.8 GiB).
# Qwen3-30B-A3B, per layer, bf16 and 8192 tokens, lean: frozen weights 1.25 GB (experts 128 x 3 x 2048
# x 768 x 2 B = 1.21 GB, attention 0.04), expert LoRA r 16 (gate_up rank 32) 20.4M parameters x 18 B
# (fp32 param, grad, AdamW m and v; bf16 copy) = 0.37 GB, saved activations ~0.5 GB: ~2.1 GB, plus ~2.5
# GB for the untied embedding and lm_head and the step's transients: ~19 GB at 8 layers for the eager
# row, ~26 GB with the graph row's private pool and its check's copies of the LoRA and AdamW state.
# GPT-OSS-20B per layer: experts 32 x 3 x 2880^2 x 2 B = 1.59 GB in bf16 (0.42 GB as MXFP4), attention
# 0.05 GB; embedding + lm_head 2 x 201088 x 2880 x 2 B = 2.3 GB. HF+PEFT also keeps each layer's
# W + s B A expert stack (PEFT's parametrisation, the experts' size again) for the backward.
DEFAULT_LAYERS = {"qwen3-30b-a3b": 8, "gpt-oss-20b": 8, "gpt-oss-20b-mxfp4": 8}
LAYERS_ENV = "BENCH_STEP_LAYERS"  # --layers N, seen by the row processes (bench_peers.py) too


def model_config(name, smoke=False):
    """The HF config dict of a bench model (tiny under smoke), cut to layers(name) layers. Raises
    KeyError naming the choices."""
    if name not in CONFIGS:
        raise KeyError(f"unknown model {name!r}: bench step knows {', '.join(CONFIGS)}")
    cfg = dict(CONFIGS[name])
    if smoke:
        cfg.update(_TINY, **(_TINY_MOE if "num_experts" in cfg else {}),
                   **(_TINY_OSS if "num_local_experts" in cfg else {}))
        if quant():  # NF4 blocks of 64 along every projection's input
            cfg["intermediate_size"] = 128
    cfg["num_hidden_layers"] = min(cfg["num_hidden_layers"], layers(name) or cfg["num_hidden_layers"])
    if "layer_types" in cfg:  # GPT-OSS: transformers' config checks one type per layer
        cfg["layer_types"] = cfg["layer_types"][:cfg["num_hidden_layers"]]
    return cfg


def layers(name):
    """The layer cut of a model: --layers N ($BENCH_STEP_LAYERS), else DEFAULT_LAYERS; None = all."""
    n = os.environ.get(LAYERS_ENV)
    return int(n) if n else DEFAULT_LAYERS.get(name)


def layers_note(name, smoke=False):
    """'8 of 48 layers' when the bench cuts the model, else ''."""
    full = {**CONFIGS[name], **(_TINY if smoke else {})}["num_hidden_layers"]
    n = model_config(name, smoke)["num_hidden_layers"]
    return f"{n} of {full} layers" if n < full else ""


def is_moe(name):
    return "num_experts" in CONFIGS[name] or "num_local_experts" in CONFIGS[name]


def doc_lengths(layout, total=TOKENS, seed=0):
    """Document lengths of a layout: padded = 4 equal rows; packed = exponential(total / 16), at
    least total / 512 (16 at 8192 tokens), seeded, summing to exactly `total`."""
    if layout == "padded":
        return [total // 4] * 4
    if layout != "packed":
        raise ValueError(f"unknown layout {layout!r}: packed or padded")
    from lean.check.case import doc_lengths as exponential_lengths

    return exponential_lengths(total, total / 16, max(2, total // 512), seed)


def useful_flops(cfg, lens):
    """PEERS.md's rule: 4 x matmul params per token (lm_head once) + causal attention, forward
    once and backward twice. An MoE layer counts its active parameters: the router (E x C) and k
    experts of width moe_intermediate, not intermediate_size; a sliding-window layer (GPT-OSS) the
    key pairs inside its window. cfg: lean's ModelConfig."""
    C, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    attn = C * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * C
    moe = cfg.n_experts * C + cfg.top_k * 3 * C * cfg.moe_intermediate
    matmul_params = sum(attn + (moe if cfg.is_moe(i) else 3 * C * F) for i in range(cfg.n_layers)) + V * C
    tokens = sum(lens)

    def pairs(L, W):  # causal key pairs of an L-token document, each query seeing at most W keys
        return L * (L + 1) / 2 if not W or W >= L else W * (W + 1) / 2 + (L - W) * W

    attn_fwd = sum(4 * pairs(L, cfg.window(i)) * cfg.head_dim * cfg.n_heads for L in lens for i in range(cfg.n_layers))
    return 4 * matmul_params * tokens + 3 * attn_fwd


def time_steps(step, warmup, steps, cuda):
    """Median seconds of step(i) over `steps` timed calls after `warmup` untimed ones, and the
    last loss. CUDA events on a GPU (one sync per step, after the end event), wall clock on CPU."""
    times, loss = [], None
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(i)
            end.record()
            torch.cuda.synchronize()  # host sync: read this step's time
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            loss = step(i)
            dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times), float(loss)  # host sync: the last loss, after timing


# =============================================================================================
# lean's row (run in a child process by tools/bench_peers.py)
# =============================================================================================
def random_model(name, device="cuda", dtype=torch.bfloat16, smoke=False, stage_tables=False):
    import lean
    from lean.models.config import config_from_hf
    from lean.kernels.nf4 import Nf4, nf4_quantize
    from lean.models.weights import empty_model, random_mxfp4_

    cfg = config_from_hf(model_config(name, smoke))
    if quant():
        cfg = dataclasses.replace(cfg, weight_quant=quant())
    model = empty_model(cfg, dtype, device, stage_tables=stage_tables)  # staged: the tables on the host
    g = torch.Generator(device=device).manual_seed(0)
    for name, t in model.hf_tensors():  # in place: no fp32 temporary in the row's peak (2.4 GiB at 8B)
        if t.device.type != torch.device(device).type:  # a staged table: drawn on the GPU 4096 rows at a time
            for r in range(0, t.shape[0], 4096):
                t[r:r + 4096].copy_(torch.empty_like(t[r:r + 4096], device=device).normal_(0.0, 0.02, generator=g))
        elif isinstance(t, Nf4):  # a projection drawn in the model dtype, quantised, let go
            w = torch.empty(t.shape, dtype=dtype, device=device)
            nf4_quantize(t, w.normal_(0.0, 0.02, generator=g))
            del w
        elif t.dtype == torch.uint8:  # MXFP4 experts
            random_mxfp4_(t, name, g)
        elif t.dim() == 1:
            t.normal_(1.0, 0.1, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
    return lean, model


MAX_DOCS = 64  # StepGraph's document slots: the layout's document count rounded up to a multiple of 64


LEAN_TARGETS = {"lean": "all", "lean-attn": "q,k,v,o"}  # lean.LoRA.init's targets per lean framework key


def lean_setup(name, layout, smoke=False, targets="all", budget_gib=None):
    """Everything lean's row steps: (lean, model, lora, opt, docs, batches, device). docs: two
    batches of random token ids in the layout's document lengths; batches: them packed for the
    eager step (lean.pack, shapes of the batch itself). targets: lean.LoRA.init's ("all": q,k,v,o,
    gate,up,down, an MoE layer's experts; "q,k,v,o": attention only)."""
    cuda = torch.cuda.is_available() and not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    staged = budget_gib is not None and cuda  # as lean-train: the tables load to the host, the plan places them
    lean, model = random_model(name, device, dtype, smoke, stage_tables=staged)
    total = SMOKE_TOKENS if smoke else TOKENS
    state = os.environ.get("LEAN_LORA_STATE", "auto")  # lean-train's --lora-state
    host_state = state == "host"
    if staged:  # as lean-train: the embedding leaves before the LoRA state arrives (or goes to the host)
        from lean.runtime.planner import early_plan
        host_state = early_plan(model, 16, targets, 0.0, total, budget_gib, lora_state=state)
    lora = lean.LoRA.init(model, r=16, alpha=32, targets=targets, dropout=0.0, seed=0, host_state=host_state)
    opt = lean.AdamW(lora, lr=1e-4, max_grad_norm=1.0)
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, model.config.vocab, n).tolist() for n in doc_lengths(layout, total)] for _ in range(2)]
    batches = [lean.pack(d, max_tokens=total, device=device) for d in docs]
    return lean, model, lora, opt, docs, batches, device


def lean_plan(model, lora, n_tokens, budget_gib):
    """The activation plan for a VRAM budget in GiB (lean.runtime.planner.plan_for), or None (keep
    everything). Raises PlanError when no plan fits, naming the smallest peak."""
    if budget_gib is None:
        return None
    from lean.runtime.planner import plan_for

    return plan_for(model, lora, n_tokens, int(budget_gib * 2**30))


def plan_note(plan):
    """'plan: 2 recompute, 0 offload, 0 offload_up of 36 layers (predicted 10.5 GiB)' (', embedding on
    the host' when the plan moved the table, ', lm_head streamed from the host' the head) or '' for no
    plan."""
    if plan is None:
        return ""
    n = {m: plan.modes.count(m) for m in ("recompute", "offload", "offload_up")}
    return (f"plan: {n['recompute']} recompute, {n['offload']} offload, {n['offload_up']} offload_up of "
            f"{len(plan.modes)} layers{', embedding on the host' if plan.embed_host else ''}"
            f"{', lm_head streamed from the host' if plan.head_host else ''} "
            f"(predicted {plan.memory.peak / 2**30:.2f} GiB)")


def make_step_graph(lean, model, lora, opt, n_tokens, max_docs, plan=None):
    """lean.StepGraph over (n_tokens, max_docs); with a plan, the captured step runs it (recompute
    and offload capture like the eager step: lean/runtime/offload.py)."""
    return lean.StepGraph(model, lora, opt, n_tokens, max_docs, plan=plan)


def graph_equals_eager(lean, graph, model, lora, opt, docs, plan):
    """One graph step and one eager step (lora.zero_grad; forward_backward; opt.step) from the same
    state on the same fixed-shape batch: True when the loss and the updated LoRA parameters are
    bit-equal. The state is put back after each (the timed steps start where they would have)."""
    state = [lora.params, opt.m, opt.v, opt.grad_norm]
    lora.sync()  # the LoRA state on the host: no update still writing it (a no-op otherwise)
    saved, count = [t.clone() for t in state], opt.step_count

    def restore():
        lora.sync()
        for t, s in zip(state, saved):
            t.copy_(s)
        lora.sync_lowp()
        opt.step_count = count

    loss_g, _ = graph.step(graph.pack(docs))
    lora.sync()
    params_g = lora.params.clone()
    restore()
    eager_batch = lean.pack(docs, graph.budget, pad_to=graph.budget, max_docs=graph.max_docs, device="cuda")
    lora.zero_grad()
    from lean.kernels.gemm import tma_at_every_size

    with tma_at_every_size():  # the kernels StepGraph captured
        loss_e, _ = lean.forward_backward(model, lora, eager_batch, seed=0, plan=plan)
    opt.step()
    lora.sync()
    same = torch.equal(loss_g, loss_e) and torch.equal(params_g, lora.params)  # host sync: a check, before timing
    restore()
    return bool(same)


def run_lean_graph(lean, model, lora, opt, docs, warmup, steps, plan=None):
    """lean+graph: the whole step replayed from lean.StepGraph. Returns {ms, loss, peak_gib,
    equals_eager, max_docs}; peak_gib counts from here (the weights, LoRA and optimizer state,
    the graph's warm-up, capture and replays), not the eager steps before nor the bit-equality
    check's copies of the optimizer state."""
    n_tokens = sum(len(d) for d in docs[0])
    max_docs = MAX_DOCS * -(-(len(docs[0]) + 1) // MAX_DOCS)  # a slot for the padding document too
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph's private pool cannot reuse them
    torch.cuda.reset_peak_memory_stats()
    graph = make_step_graph(lean, model, lora, opt, n_tokens, max_docs, plan)
    peak = torch.cuda.max_memory_allocated()
    same = graph_equals_eager(lean, graph, model, lora, opt, docs[0], plan)
    batches = [graph.pack(d) for d in docs]

    def step(i):
        loss, n = graph.step(batches[i % 2])
        return loss / n

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t, loss = time_steps(step, warmup, steps, cuda=True)
    peak = max(peak, torch.cuda.max_memory_allocated())
    return dict(ms=t * 1e3, loss=loss, peak_gib=peak / 2**30, equals_eager=same, max_docs=max_docs)


def run_lean(name, layout, warmup=WARMUP, steps=8, graph=False, smoke=False, budget_gib=None, targets="all"):
    """lean's row: {tokens, ms, loss, checkpointing, note, lora, peak_gib, [graph]}. targets: the LoRA
    targets (LEAN_TARGETS; lora = "attn" for q,k,v,o, else "all"). graph: also the
    whole step from lean.StepGraph (the `graph` sub-row, its own peak). budget_gib: run under
    plan_for's activation plan for that VRAM budget (recompute / offload; flagged as checkpointing
    when any layer is not kept). smoke: fp32 on the CPU through the interpreter (TRITON_INTERPRET=1
    must be set before triton is imported); no graph there."""
    lean, model, lora, opt, docs, batches, device = lean_setup(name, layout, smoke, targets, budget_gib)
    cuda = device == "cuda"
    total = batches[0].n_tokens
    plan = lean_plan(model, lora, total, budget_gib)

    def step(i):
        lora.zero_grad()
        loss, n = lean.forward_backward(model, lora, batches[i % 2], plan=plan)
        opt.step()
        return loss / n

    t, loss = time_steps(step, warmup, steps, cuda)
    attn = targets != "all"
    row = dict(tokens=total, ms=t * 1e3, loss=loss, lora="attn" if attn else "all",
               note=" ".join(filter(None, ["QLoRA NF4 base" * bool(quant()), "LoRA q,k,v,o only" * attn,
                                           plan_note(plan), "LoRA state on the host" * lora.host_state])),
               checkpointing=plan is not None and any(m != "keep" for m in plan.modes))
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30  # since the process start
    if graph and cuda:
        row["graph"] = run_lean_graph(lean, model, lora, opt, docs, warmup, steps, plan)
    return row


# =============================================================================================
# the parent: one child process per row, then the table
# =============================================================================================
def _tail(text, n=15):
    return [ln[:200] for ln in text.strip().splitlines()[-n:]]


def run_child(framework, model, layout, steps, warmup, smoke, graph, timeout, budget=None, env=None):
    """Start tools/bench_peers.py for one row; its last `ROW {json}` line, or an error row with
    the tail of what it printed. graph and budget apply to lean's rows only (lean, lean-attn); env:
    extra variables (LEAN_PORTABLE=1 for lean's portable rows)."""
    cmd = [sys.executable, os.path.join(TOOLS, "bench_peers.py"), framework, model, layout,
           "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--smoke"] * smoke + ["--graph"] * (graph and framework in LEAN_TARGETS)
    if budget is not None and framework in LEAN_TARGETS:
        cmd += ["--budget", str(budget)]
    if budget is not None and framework == "unsloth":  # the memory-bound row on both sides
        cmd += ["--checkpointing"]
    # Unsloth writes unsloth_compiled_cache/ into its working directory: keep it out of the repo.
    cwd = os.path.join("/tmp", "bench_step") if framework == "unsloth" else ROOT
    os.makedirs(cwd, exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, **(env or {})))  # its own group: a timeout ends its workers too
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err += f"\nkilled after the per-row timeout of {timeout} s (--timeout)"
    wall = time.perf_counter() - t0
    rows = [ln[4:] for ln in out.splitlines() if ln.startswith("ROW ")]
    if p.returncode == 0 and rows:
        return dict(json.loads(rows[-1]), wall_s=wall)
    tail = _tail(err or out)
    oom = any("OutOfMemoryError" in ln or "out of memory" in ln for ln in tail)
    return dict(status="oom" if oom else "error", note=(tail[-1] if tail else f"exit {p.returncode}"),
                error_tail=tail, wall_s=wall)


def measure_matmul(smoke):
    """The bf16 matmul rate (TFLOP/s), measured as `bench.py kernels` does (its Bench); the
    device-to-device copy it also measures is printed, not used."""
    import bench

    B = bench.Bench(smoke)
    B.measure_machine()
    rate = B.matmul_flops / 1e12
    del B
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the children need the memory, not this process's cache
    return rate


def split_lean_row(raw, suffix=""):
    """lean's child row -> [eager row, lean+graph row if measured] (the graph row shares tokens and
    the LoRA placement), named "lean" and "lean+graph" with the suffix (" portable", ATTN_SUFFIX)."""
    raw = dict(raw)
    g = raw.pop("graph", None)
    rows = [(raw, "lean" + suffix)]
    if g is not None:
        rows.append((dict(g, tokens=raw["tokens"], checkpointing=raw["checkpointing"], wall_s=raw.get("wall_s", 0),
                          lora=raw.get("lora", "all"),
                          note=" ".join(filter(None, [raw.get("note", ""), f"max_docs {g['max_docs']}",
                                                      "bit-equal to eager" if g["equals_eager"]
                                                      else "NOT BIT-EQUAL TO EAGER"]))), "lean+graph" + suffix))
    return rows


def finish_row(row, framework, model, layout, rate, smoke):
    """Add the row's keys, tok/s and MFU (PEERS.md's useful FLOPs over the parent's matmul rate).
    framework: a FRAMEWORKS key, or a display name (lean+graph)."""
    from lean.models.config import config_from_hf

    row = dict(dict(status="ok", note=""), **row, framework=FRAMEWORKS.get(framework, framework), model=model,
               layout=layout)
    if row.get("checkpointing"):
        row["note"] = ("CHECKPOINTING ON (not the bench's work) " + row["note"]).strip()
    if row["status"] == "ok" and layers_note(model, smoke):
        row["note"] = " ".join(filter(None, [layers_note(model, smoke), row["note"]]))
    if row["status"] == "ok":
        lens = doc_lengths(layout, row["tokens"])
        t = row["ms"] / 1e3
        row["tokens_per_s"] = row["tokens"] / t
        row["mfu"] = useful_flops(config_from_hf(model_config(model, smoke)), lens) / t / (rate * 1e12)
    return row


def lora_scope(r):
    """A row's LoRA placement: "attn" (q,k,v,o only) or "all" (the 7 projections; an MoE model's
    attention and experts)."""
    return r.get("lora") or "all"


def fmt_table(rows):
    """The table: one line per row; the ratio columns compare lean's fastest row of the same model,
    layout and LoRA placement (lean+graph where measured, else lean; a peer with attention-only LoRA
    against lean's attn-LoRA rows) with this row's peer. A row that did not run says why after its
    first three cells; a row's note follows its cells."""
    head = ["model", "layout", "framework", "tok/s", "MFU", "peak GiB", "lean/peer tok/s", "lean/peer peak"]
    lean = {}
    for r in rows:
        if r["framework"].startswith("lean") and not r["framework"].endswith(" portable") and r["status"] == "ok":
            key = (r["model"], r["layout"], lora_scope(r))
            if key not in lean or r["tokens_per_s"] > lean[key]["tokens_per_s"]:
                lean[key] = r
    lines = [head]
    for r in rows:
        cells = [r["model"], r["layout"], r["framework"]]
        if r["status"] != "ok":
            why = r["note"] if r["status"] == "skipped" else f"{r['status']}: {r['note']}"
            lines.append(cells + [why[:120]])
            continue
        peak = r.get("peak_gib")
        cells += [f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%", "-" if peak is None else f"{peak:.2f}"]
        base = lean.get((r["model"], r["layout"], lora_scope(r)))
        if r["framework"].startswith("lean") or base is None:
            cells += ["-", "-"]
        else:
            lp = base.get("peak_gib")
            cells += [f"{base['tokens_per_s'] / r['tokens_per_s']:.2f}x", f"{lp / peak:.2f}x" if lp and peak else "-"]
        if r.get("note"):
            cells.append(r["note"])
        lines.append(cells)
    widths = [max(len(ln[i]) for ln in lines if len(ln) >= len(head) or i < 3) for i in range(len(head))]
    out = []
    for ln in lines:
        n = len(head) if len(ln) >= len(head) else 3
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(ln[:n], widths))]
        out.append("  ".join(cells + ln[n:]).rstrip())
    return "\n".join(out)


def write_json(path, rows, rate, device, smoke):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, smoke=smoke, matmul_tflops=rate, rows=rows), f, indent=1)


def main(models=DEFAULT_MODELS, layouts=LAYOUTS, peers=PEERS, steps=8, json_path=None,
         graph=False, smoke=False, timeout=300, budget=None, portable=False, n_layers=None, lean_attn=False,
         lean=True):
    """Run every (model, layout) x (lean, peers) row, each in its own process; print the table.
    graph: lean's rows also as lean+graph (lean.StepGraph); budget: lean's VRAM budget in GiB;
    portable: lean's rows once more with LEAN_PORTABLE=1 ("lean portable", "lean+graph portable");
    n_layers: every model cut to its first n_layers layers (default DEFAULT_LAYERS); lean_attn (or
    "lean-attn" among peers): lean's rows once more with LoRA on q,k,v,o only ("lean attn-LoRA"),
    which also run by themselves after an MoE model's peer row that came back attention-only.
    MOE_ONLY peers (hf-default) run on MoE models only. lean=False: the peers' rows alone (a full-depth
    row pair that outlasts one device call: lean's row in the next call, on the same warm machine)."""
    import importlib.util

    if n_layers is not None:
        if n_layers < 1:
            raise SystemExit(f"bench step: --layers {n_layers}: expected >= 1")
        os.environ[LAYERS_ENV] = str(n_layers)  # the row processes inherit it

    unknown = [f for f in peers if f not in FRAMEWORKS] + [m for m in models if m not in CONFIGS] + \
        [la for la in layouts if la not in LAYOUTS]
    if unknown:
        raise SystemExit(f"bench step: unknown {unknown}: frameworks {list(FRAMEWORKS)}, models "
                         f"{list(CONFIGS)}, layouts {list(LAYOUTS)}")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench step: no CUDA GPU here; use --smoke for the CPU harness check")
    lean_attn = lean_attn or "lean-attn" in peers
    peers = [p for p in peers if p not in LEAN_TARGETS]
    warmup = 0 if smoke else WARMUP  # smoke: the interpreter is slow and no time is claimed
    device = "CPU (interpreter, tiny configs)" if smoke else torch.cuda.get_device_name()
    names = ["lean"] * lean + ["lean-attn"] * lean_attn + peers
    print(f"# bench step on {device}; torch {torch.__version__}; {steps} timed steps after {warmup} "
          f"warm-up; frameworks {', '.join(FRAMEWORKS[f] for f in names)}")
    rate = measure_matmul(smoke)
    rows = []

    def run_row(fw, m, layout):
        suffix, env = (" portable", {"LEAN_PORTABLE": "1"}) if fw == "lean portable" else \
            (ATTN_SUFFIX, None) if fw == "lean-attn" else ("", None)
        if fw.startswith("lean"):
            raw = run_child("lean" if fw == "lean portable" else fw, m, layout, steps, warmup, smoke, graph, timeout,
                            budget, env)
        elif not smoke and importlib.util.find_spec(PEER_MODULE[fw]) is None:
            raw = dict(status="skipped", note=f"{PEER_MODULE[fw]} not installed: skipped")
        else:
            raw = run_child(fw, m, layout, steps, warmup, smoke, graph, timeout, budget)
        parts = split_lean_row(raw, suffix) if fw.startswith("lean") and raw.get("status", "ok") == "ok" \
            else [(raw, fw)]
        for part, name in parts:
            r = finish_row(part, name, m, layout, rate, smoke)
            rows.append(r)
            print_row(r)
        if json_path:  # after every row: a run cut short keeps what it measured
            write_json(json_path, rows, rate, device, smoke)

    for m in models:
        for layout in layouts:
            first = len(rows)
            for fw in ["lean"] * lean + ["lean-attn"] * lean_attn + ["lean portable"] * portable + \
                    [p for p in peers if is_moe(m) or p not in MOE_ONLY]:
                run_row(fw, m, layout)
            attn_peers = [r["framework"] for r in rows[first:] if r["status"] == "ok"
                          and not r["framework"].startswith("lean") and lora_scope(r) == "attn"]
            if attn_peers and not lean_attn:  # the rule: a peer without expert LoRA: lean both ways
                print(f"# {', '.join(attn_peers)}: attention-only LoRA on {m}: lean's attention-only row too",
                      flush=True)
                run_row("lean-attn", m, layout)
    print()
    print(fmt_table(rows))
    if portable:
        print()
        print(fmt_portable(rows))
    return rows


def fmt_portable(rows):
    """Per model and layout: each portable lean row against the same row on the Hopper path and
    against Unsloth (ratios of tok/s)."""
    ok = {(r["model"], r["layout"], r["framework"]): r for r in rows if r["status"] == "ok"}
    out = ["portable path (LEAN_PORTABLE=1) vs the arch path and Unsloth, tok/s ratios:"]
    for (m, layout, fw), r in ok.items():
        if not fw.endswith(" portable"):
            continue
        base, uns = ok.get((m, layout, fw[:-len(" portable")])), ok.get((m, layout, "Unsloth"))
        cells = [f"{m} {layout} {fw}: {r['tokens_per_s']:,.0f} tok/s"]
        if base:
            cells.append(f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x {base['framework']}")
        if uns:
            cells.append(f"{r['tokens_per_s'] / uns['tokens_per_s']:.2f}x Unsloth")
        out.append("  " + ", ".join(cells))
    return "\n".join(out)


def print_row(r):
    if r["status"] == "ok":
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f} GiB"
        print(f"row {r['model']} | {r['layout']} | {r['framework']} | {r['tokens_per_s']:,.0f} tok/s | "
              f"{100 * r['mfu']:.1f}% MFU | {peak} | loss {r['loss']:.3f} | {r['wall_s']:.0f} s | {r['note']}",
              flush=True)
        return
    why = r["note"] if r["status"] == "skipped" else f"{r['status']}: {r['note']}"
    print(f"row {r['model']} | {r['layout']} | {r['framework']} | {why}", flush=True)
    for ln in r.get("error_tail", []):
        print(f"    {ln}")
