"""The activation plan, the VRAM-budget planner and the offload scheduler.

CPU (interpreter, float32, tiny models): offload + recompute give the same loss and LoRA gradients
as keeping everything, bit for bit; the planner's walk equals the bytes the step really allocates,
allocation by allocation; the plan's kept and host bytes equal what the tape and the scheduler hold.
Planner unit tests on real configs (pure arithmetic). GPU (`gpu` marker): bit equality with the
asynchronous scheduler on a real-size config, no host sync, measured peak <= budget and within 10%
of the prediction, and a CUDA-graph capture of the planned step equal to the eager one.
"""
import weakref

import numpy as np
import pytest
import torch

import lean
from lean.models.config import config_from_hf
from lean.models.weights import empty_model
from lean.runtime import offload
from lean.runtime.plan import (
    DEFAULT_RATES, GiB, KEEP, OFFLOAD, OFFLOAD_UP, OFFLOADED, PLAN, RECOMPUTE, SLACK, PlanError, Rates,
    embed_gather_cost, layer_bytes, make_plan, plan_cost, row_bytes,
)
from lean.runtime.plan_bytes import moe_step_bytes
from lean.runtime.planner import candidates, format_plan, ordered_modes, plan_for, plan_step
from lean.runtime.step import Tape, _forward_layers, make_ctx, rope_tables
from tests.hf_models import build_hf, tiny_config
from tests.test_moe import moe_config
from tests.util import fresh_generator

K, R, O, U = KEEP, RECOMPUTE, OFFLOAD, OFFLOAD_UP
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
LLAMA_32_3B = dict(
    architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
    num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
    tie_word_embeddings=True, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192},
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)


def _tiny(arch, n_layers):
    d = tiny_config(arch).to_dict()
    d.pop("layer_types", None)
    return d | {"num_hidden_layers": n_layers, "architectures": [HF_ARCH[arch]]}


def _randint(gen, high):
    return int(torch.randint(0, high, (1,), generator=gen, device=gen.device))


def _model(config, gen, dtype=torch.float32, device="cpu"):
    """A lean model with random weights (norms near 1) and nothing of HF but the config."""
    model = empty_model(config_from_hf(config), dtype, device)
    for _, t in model.hf_tensors():
        r = torch.randn(t.shape, generator=gen, device=gen.device)
        t.copy_((1.0 + 0.1 * r) if t.dim() == 1 else 0.02 * r)
    return model


def _moe_model(tmp_path, gen, config):
    """A lean Qwen3-MoE model from HF's random init (as tests/test_moe.py), the router drawn N(0, 0.5)
    (HF's zeros would tie every expert)."""
    hf = build_hf("qwen3_moe", _randint(gen, 2**30), config=config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "model")
    return lean.load_model(tmp_path / "model", dtype=torch.float32, device="cpu")


def _held(records):
    """data_ptr -> bytes of every tensor the tape's records hold (Saved, Kept, an MoE layer's MoeSaved)."""
    held = {}

    def visit(t):
        if isinstance(t, torch.Tensor):
            held[t.data_ptr()] = t.numel() * t.element_size()
        elif isinstance(t, dict):
            for u in t.values():
                visit(u)
        elif isinstance(t, tuple):
            for u in t:
                visit(u)
    for _, saved, _ in records:
        visit(saved)
    return held


def _lora(model, r, dropout, gen, targets="all"):
    lora = lean.LoRA.init(model, r=r, alpha=2 * r, dropout=dropout, seed=_randint(gen, 2**30), targets=targets)
    lora.params.add_(0.02 * torch.randn(lora.params.shape, generator=gen, device=gen.device))
    lora.sync_lowp()
    return lora


def _batch(model, gen, total, device="cpu", mean=None):
    rng = np.random.default_rng(_randint(gen, 2**30))
    docs, left = [], total
    while left > 0:
        n = min(left, max(1, int(rng.exponential(mean or total / 3))))
        docs.append(rng.integers(0, model.config.vocab, n).tolist())
        left -= n
    return lean.pack(docs, max_tokens=total, device=device)


def _weights_bytes(cfg, act_bytes=2):
    C, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    per = C * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * C + 3 * C * F + 2 * C + 2 * cfg.head_dim * cfg.qk_norm
    return act_bytes * (cfg.n_layers * per + V * C * (1 if cfg.tie_embeddings else 2) + C)


class LiveBytes:
    """The CPU stand-in for torch.cuda.max_memory_allocated: counts every tensor torch's factories
    make while active, until the tensor dies."""
    FACTORIES = ("empty", "zeros", "empty_like", "zeros_like")

    def __init__(self):
        self.live = self.peak = self.count = 0

    def _free(self, n):
        self.live -= n

    def _wrap(self, fn):
        def made(*args, **kwargs):
            t = fn(*args, **kwargs)
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            self.count += 1
            weakref.finalize(t, self._free, n)
            return t
        return made

    def __enter__(self):
        self.orig = {f: getattr(torch, f) for f in self.FACTORIES}
        for f, fn in self.orig.items():
            setattr(torch, f, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for f, fn in self.orig.items():
            setattr(torch, f, fn)


# ---------------------------------------------------------------------------------------------
# CPU: the scheduler's logic with synchronous copies, and the walk against real allocations

@pytest.mark.parametrize("arch,r,dropout,modes", [
    ("qwen3", 16, 0.0, (U, O, U)),  # QK-norm; three slots share two reload buffers; last layer offloaded
    ("qwen2", 8, 0.0, (O, O, O)),  # every input offloaded, no up
    ("llama", 8, 0.1, (U, O, R, K)),  # dropout masks regenerated in the rebuild; padded rank 8; every mode
    ("qwen3", 4, 0.0, (U, K)),  # the peak in the kept layer's forward, while layer 0's rows are still held
], ids=["qwen3-offload-up", "qwen2-offload-all", "llama-mixed", "qwen3-peak-while-held"])
def test_offload_recompute_bitwise_and_peak_exact(arch, r, dropout, modes):
    gen = fresh_generator("cpu")
    model = _model(_tiny(arch, len(modes)), gen)
    lora = _lora(model, r, dropout, gen)
    batch = _batch(model, gen, 40 + _randint(gen, 24))
    _bitwise_and_peak_exact(model, lora, batch, modes, r, dropout)


def test_offload_peak_exact_with_dkdv_split(monkeypatch):
    """attention_bwd's dk/dv partials (a split over G = 4 query heads) make the step's peak: the
    walk prices them at the attention moment."""
    import lean.kernels.attention_config as attention_config
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(4, 32): 4})
    gen = fresh_generator("cpu")
    model = _model(_tiny("qwen3", 2), gen)
    lora = _lora(model, 4, 0.0, gen)
    batch = _batch(model, gen, 40 + _randint(gen, 24))
    plan = make_plan(model.config, batch.n_tokens, (U, K), lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    assert "(attention)" in plan.peak_at, plan.peak_at
    _bitwise_and_peak_exact(model, lora, batch, (U, K), 4, 0.0)


def test_loss_chunk_rows_from_the_plan_same_bits_peak_exact(monkeypatch):
    """The loss's chunk rows (plan.loss_rows; here fast_loss_rows gives 16, fewer than the interpreter's
    64, so no peak can rise) reach linear_ce_fwd_bwd with and without a plan, one value per model
    (step.loss_rows): a keep step and an offload plan's give the same bits, each peak as walked;
    against the default chunks the loss is the same bits (each row's loss is computed alone), the
    LoRA gradients within fp32 rounding (dh's GEMM tiles its chunk by its row count)."""
    import lean.kernels.linear_ce as CE
    import lean.runtime.plan as P
    from lean.runtime.step import loss_rows
    gen = fresh_generator("cpu")
    model = _model(_tiny("qwen3", 2), gen)
    lora = _lora(model, 4, 0.0, gen)
    batch = _batch(model, gen, 40 + _randint(gen, 24))
    N = batch.n_tokens
    rope_tables(model, batch)
    seen, fwd_bwd = [], CE.linear_ce_fwd_bwd

    def recorded(*args, chunk_rows=None, **kw):
        seen.append(chunk_rows)
        return fwd_bwd(*args, chunk_rows=chunk_rows, **kw)
    monkeypatch.setattr(CE, "linear_ce_fwd_bwd", recorded)
    lora.zero_grad()
    loss0, _ = lean.forward_backward(model, lora, batch, seed=7)  # the interpreter's default chunks
    grads0 = lora.grads.clone()
    assert seen == [None] and model.cache.pop("loss_rows") is None
    monkeypatch.setattr(P, "fast_loss_rows", lambda *a, **k: 16)
    plan = make_plan(model.config, N, (U, O), lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    assert plan.loss_rows == 16 and loss_rows(model, lora, N + 5) == 16 == model.cache["loss_rows"]
    assert make_plan(model.config, N, (U, O), lora_rank=4, lora_targets=lora.targets, act_bytes=4,
                     loss_rows=None).loss_rows is None  # a model's own rows, given
    seen.clear()
    _bitwise_and_peak_exact(model, lora, batch, (U, O), 4, 0.0)  # keep vs the plan: bits and peaks
    assert seen == [16, 16], seen
    monkeypatch.setattr(P, "fast_loss_rows", lambda *a, **k: None)  # the rule now says the default ...
    assert plan_for(model, lora, N).loss_rows == 16  # ... a model keeps the rows its steps run
    lora.zero_grad()
    loss1, _ = lean.forward_backward(model, lora, batch, seed=7)
    assert torch.equal(loss0, loss1), f"16-row loss chunks: loss {loss1.item()} != {loss0.item()}"
    rel = ((lora.grads - grads0).abs().max() / grads0.abs().max()).item()
    assert rel <= 1e-5, f"16-row loss chunks: LoRA gradients differ by {rel:.2e} (relative to the largest)"


def test_loss_chunk_rows_kept_only_where_the_peak_is_elsewhere(monkeypatch):
    """At real shapes (the GPU's chunk rule, arithmetic only): Qwen3-30B-A3B's 8-layer step peaks
    inside a layer's experts, so its loss takes CE_FAST_ROWS rows at the same predicted peak;
    Qwen3-0.6B's and Llama-3.2-1B's peak is the loss's own moment, so they keep the default."""
    import lean.runtime.plan as P
    import lean.runtime.plan_walk as PW
    from lean.models.presets import PRESETS
    from lean.runtime.lora import TARGETS
    monkeypatch.setattr(P, "interpreting", lambda: False)
    monkeypatch.setattr(PW, "interpreting", lambda: False)  # the walk's kernel scratch, as on a GPU
    monkeypatch.delenv("LEAN_CE_CHUNK_ROWS", raising=False)
    for name, layers, kept in (("qwen3-30b-a3b", 8, True), ("qwen3-0.6b", None, False), ("llama-3.2-1b", None, False)):
        cfg = config_from_hf(dict(PRESETS[name], **({"num_hidden_layers": layers} if layers else {})))
        plan = make_plan(cfg, 8192, (K,) * cfg.n_layers, lora_rank=16, lora_targets=TARGETS)
        default = P.walk(cfg, plan.modes, 8192, 2, 16, plan.lora_targets)
        assert plan.loss_rows == (P.CE_FAST_ROWS if kept else None), (name, plan.loss_rows, plan.peak_at)
        assert plan.memory.activations == default[0], (name, plan.memory.activations, default)  # no rise, either way
        fast = P.walk(cfg, plan.modes, 8192, 2, 16, plan.lora_targets, loss_rows=P.CE_FAST_ROWS)
        assert (fast[0] <= default[0]) == kept, (name, fast, default)


def _bitwise_and_peak_exact(model, lora, batch, modes, r, dropout):
    """A keep step and a step under `modes`: the same loss and LoRA gradients bit for bit, each
    step's allocated peak equal to the walk's."""
    N, cfg = batch.n_tokens, model.config
    plan = make_plan(cfg, 64, modes, lora_rank=r, lora_targets=lora.targets, act_bytes=4)  # buffers for 64
    sched = offload.scheduler(model, plan, N)  # built once, before the step (as a warm-up would)
    for t in [sched.host, sched.host_up, *sched.reload, *sched.reload_up]:
        t.fill_(float("nan"))  # a skipped copy cannot pass unnoticed
    rope_tables(model, batch)  # per-batch constants, built before counting
    moe = moe_step_bytes(cfg)  # an MoE model's per-step buffers: made by the step, held after it

    results = []
    for p in (None, plan):
        lora.zero_grad()
        with LiveBytes() as lb:
            loss, _ = lean.forward_backward(model, lora, batch, seed=7, plan=p)
        results.append((loss.clone(), lora.grads.clone(), lb.peak,
                        model.cache["moe"].counts.clone() if moe else None))
        predicted = make_plan(cfg, N, p.modes if p else (K,) * cfg.n_layers, lora_rank=r,
                              lora_targets=lora.targets, act_bytes=4, lora_dropout=dropout)
        assert lb.peak - moe == predicted.memory.activations, (
            f"{p and p.modes}: allocated peak {lb.peak - moe} B != predicted {predicted.memory.activations} B "
            f"(at {predicted.peak_at}): plan.py's walk and the step disagree")
        assert lb.live == 2 * 4 + moe, f"{lb.live} B alive after the step: only the (2,) loss buffer should be"
    (loss0, grads0, peak0, counts0), (loss1, grads1, peak1, counts1) = results
    assert torch.isfinite(grads0).all() and grads0.abs().max() > 0
    assert torch.equal(loss0, loss1), f"loss {loss0.item()} (keep) vs {loss1.item()} (plan {modes})"
    diff = (grads0 - grads1).abs().max().item()
    assert torch.equal(grads0, grads1), f"LoRA gradients differ by up to {diff:.3e} under plan {modes}"
    assert peak1 < peak0
    if moe:
        assert torch.equal(counts0, counts1), "the rebuild counted the slots again"


@pytest.mark.parametrize("config,targets,modes", [
    # MoE, dense, MoE; all targets (the experts' gate_up and down); the dense layer's offload_up
    (moe_config(8, 2, True, [1], layers=3), "all", (O, U, R)),
    # dense, MoE, MoE; the aux loss on (route_topk_fwd's partials); down only; offload_up on an
    # MoE layer runs as offload, the last layer's input offloaded
    (moe_config(4, 1, False, [0], layers=3, output_router_logits=True), "q,k,down", (R, K, U)),
], ids=["moe-offload-recompute", "moe-aux-keep-down-only"])
def test_moe_offload_recompute_bitwise_and_peak_exact(tmp_path, config, targets, modes):
    """Qwen3-MoE with a dense layer mixed in: the walk prices each layer as its kind, allocation by
    allocation (routing, grouping scratch, expert rows), and offloaded / recomputed MoE layers give
    the keep step's bits."""
    gen = fresh_generator("cpu")
    model = _moe_model(tmp_path, gen, config)
    cfg = model.config
    assert 0 < len(cfg.moe_layers) < cfg.n_layers
    lora = _lora(model, 4, 0.0, gen, targets)
    batch = _batch(model, gen, 24 + _randint(gen, 16))
    plan = make_plan(cfg, 64, modes, lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    assert all(not (m == U and cfg.is_moe(li)) for li, m in enumerate(plan.modes)), plan.modes
    _bitwise_and_peak_exact(model, lora, batch, modes, 4, 0.0)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["gpt-oss-bf16", "gpt-oss-mxfp4"])
def test_gpt_oss_offload_recompute_bitwise_and_peak_exact(mxfp4):
    """GPT-OSS (sinks, a window, biased router and experts, the clamped GLU; MXFP4 experts with
    their transient dequantised weights): the walk's peak is the step's, offloaded and recomputed
    layers give the keep step's bits."""
    from lean.models.weights import random_mxfp4_
    from tests.test_gpt_oss import oss_config

    gen = fresh_generator("cpu")
    config = oss_config(5, 2, window=4, layers=3, intermediate_size=64).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    model = empty_model(config_from_hf(config), torch.float32, "cpu")
    assert (model.config.expert_quant == "mxfp4") == mxfp4
    for name, t in model.hf_tensors():
        if t.dtype == torch.uint8:
            random_mxfp4_(t, name, gen)
        else:
            r = torch.randn(t.shape, generator=gen)
            t.copy_((1.0 + 0.1 * r) if name.endswith("norm.weight") else (0.3 if "router" in name else 0.05) * r)
    lora = _lora(model, 4, 0.0, gen)
    _bitwise_and_peak_exact(model, lora, _batch(model, gen, 24 + _randint(gen, 16)), (O, R, K), 4, 0.0)


def test_plan_bytes_equal_what_the_tape_and_scheduler_hold():
    gen = fresh_generator("cpu")
    model = _model(_tiny("qwen2", 4), gen)
    lora = _lora(model, 4, 0.0, gen)
    batch = _batch(model, gen, 23)
    plan = make_plan(model.config, batch.n_tokens, (U, O, R, K), lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    sched = offload.scheduler(model, plan, batch.n_tokens)
    tape = Tape()
    _forward_layers(model, lora, batch, make_ctx(model, lora, batch), tape, plan, sched)
    held = _held(tape.records)
    assert [type(s).__name__ for _, s, _ in tape.records] == ["Kept", "Kept", "Kept", "Saved"]
    assert [s.x is None for _, s, _ in tape.records[:3]] == [True, True, False]
    assert sum(held.values()) == plan.kept_bytes
    assert sum(t.numel() * t.element_size() for t in (sched.host, sched.host_up)) == plan.host_bytes
    assert sched.host_up.shape[0] == 1 and len(sched.reload_up) == 2
    # what went to the host is layer 0's input: the embedding rows of the batch
    assert torch.equal(sched.host[0], model.embed[batch.ids.long()])
    with pytest.raises(offload.OffloadError, match="made for at most"):
        offload.scheduler(model, plan, batch.n_tokens + 1)
    with pytest.raises(offload.OffloadError, match="make it for this model"):
        offload.scheduler(model, make_plan(config_from_hf(_tiny("qwen2", 2)), 8, (O, K), lora_rank=4), 8)
    # a plan without offload_up allocates no up buffers
    plan = make_plan(model.config, batch.n_tokens, (O, O, R, K), lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    sched = offload.scheduler(model, plan, batch.n_tokens)
    assert sched.host_up.numel() == 0 and sched.reload_up == []


# ---------------------------------------------------------------------------------------------
# The planner (arithmetic only)

@pytest.mark.parametrize("config,n_layers", [
    (QWEN3_8B, 12), (LLAMA_32_3B, 10), (QWEN3_30B_A3B | {"mlp_only_layers": [2]}, 8),
], ids=["qwen3-8b", "llama-3.2-3b", "qwen3-30b-a3b-one-dense"])
def test_planner_picks_the_cheapest_plan_that_fits(config, n_layers):
    """Real layer shapes, fewer layers (every candidate is walked here): the plan fits, and every
    ordered plan that costs less does not."""
    cfg = config_from_hf(config | {"num_hidden_layers": n_layers})
    L, N, w = cfg.n_layers, 8192, _weights_bytes(cfg)
    gen = fresh_generator("cpu")
    rates = Rates(*(r * (0.5 + float(u)) for r, u in zip(DEFAULT_RATES, torch.rand(3, generator=gen))))
    keep = make_plan(cfg, N, (K,) * L, lora_rank=16, weights_bytes=w)
    least = make_plan(cfg, N, (O,) * L, lora_rank=16, weights_bytes=w)
    assert plan_step(cfg, N, 16, None, w).modes == (K,) * L
    assert plan_step(cfg, N, 16, keep.memory.peak + SLACK, w).modes == (K,) * L
    every = [make_plan(cfg, N, ordered_modes(L, *c), lora_rank=16, weights_bytes=w, rates=rates) for c in candidates(L)]
    assert len(every) == (L + 1) * (L + 2) * (L + 3) // 6
    picked = set()
    for frac in torch.rand(6, generator=gen).tolist():
        budget = int(least.memory.peak + SLACK + frac * (keep.memory.peak - least.memory.peak))
        plan = plan_step(cfg, N, 16, budget, w, rates=rates)
        assert plan.memory.peak + SLACK <= budget, format_plan(plan)
        assert plan.cost == plan_cost(cfg, plan.modes, N, 2, rates) > 0
        assert not any(m == U and cfg.is_moe(li) for li, m in enumerate(plan.modes)), plan.modes
        cheaper = [p.modes for p in every if p.cost < plan.cost - 1e-12 and p.memory.peak + SLACK <= budget]
        assert not cheaper, f"{cheaper[0]} fits {budget} B and costs less than {plan.modes}"
        picked.add(plan.modes)
    print(f"{len(picked)} distinct plans: {sorted(picked)}")
    with pytest.raises(PlanError, match=r"too small .* needs \d+\.\d+ GiB"):
        plan_step(cfg, N, 16, least.memory.peak, w)
    # pinned host memory held to a limit: nothing offloaded beyond it
    budget = int(least.memory.peak + SLACK + 0.3 * (keep.memory.peak - least.memory.peak))
    limit = least.host_bytes // 2
    plan = plan_step(cfg, N, 16, budget, w, rates=rates, host_budget_bytes=limit)
    assert plan.host_bytes <= limit and plan.memory.peak + SLACK <= budget


def test_planner_prices_an_untied_embedding_table_off_the_gpu():
    """Qwen3-8B shapes (untied), fewer layers: with embed_bytes the planner may move the table to
    pinned host memory; every candidate of both kinds is walked, and no cheaper one fits. A budget
    that all-keep fits leaves the table on the GPU; at 17.5 GiB the full model moves it."""
    cfg = config_from_hf(QWEN3_8B | {"num_hidden_layers": 10})
    L, N, w = cfg.n_layers, 8192, _weights_bytes(cfg)
    table = cfg.vocab * cfg.hidden * 2
    gen = fresh_generator("cpu")
    rates = Rates(*(r * (0.5 + float(u)) for r, u in zip(DEFAULT_RATES, torch.rand(3, generator=gen))))
    gather = embed_gather_cost(cfg, N, 2, rates)
    assert gather == N * cfg.hidden * 2 / rates.h2d
    every = [make_plan(cfg, N, ordered_modes(L, *c), lora_rank=16, weights_bytes=w - table * eh, rates=rates,
                       embed_host=eh) for c in candidates(L) for eh in (False, True)]
    keep = every[0]
    assert keep.modes == (K,) * L and not keep.embed_host
    assert not plan_step(cfg, N, 16, keep.memory.peak + SLACK, w, rates=rates, embed_bytes=table).embed_host
    least = min(p.memory.peak for p in every)
    moved = 0
    for frac in torch.rand(6, generator=gen).tolist():
        budget = int(least + SLACK + frac * (keep.memory.peak - least))
        plan = plan_step(cfg, N, 16, budget, w, rates=rates, embed_bytes=table)
        assert plan.memory.peak + SLACK <= budget, format_plan(plan)
        assert plan.memory.weights == w - table * plan.embed_host
        assert plan.cost == pytest.approx(plan_cost(cfg, plan.modes, N, 2, rates) + gather * plan.embed_host, rel=1e-12)
        cheaper = [(p.modes, p.embed_host) for p in every if p.cost < plan.cost - 1e-12 and p.memory.peak + SLACK <= budget]
        assert not cheaper, f"{cheaper[0]} fits {budget} B and costs less than {plan.modes}, {plan.embed_host}"
        moved += plan.embed_host
    assert moved, "no budget moved the table"
    full = config_from_hf(QWEN3_8B)
    wf = _weights_bytes(full)
    plan = plan_step(full, N, 16, int(17.5 * GiB), wf, embed_bytes=table)
    stay = plan_step(full, N, 16, int(17.5 * GiB), wf)
    assert plan.embed_host and plan.cost < stay.cost and plan.memory.weights == wf - table
    assert "embedding table: pinned host memory (1.16 GiB off the GPU" in format_plan(plan)


def test_cost_model_prefers_offload_up_only_where_the_link_hides_it():
    """Qwen3-8B shapes: up's copy (x + up, 256 MiB) hides under a layer's forward at H100 rates,
    so offload_up costs less than offload; with a link 10x slower it costs more."""
    cfg = config_from_hf(QWEN3_8B)
    L, N = cfg.n_layers, 8192
    fast, slow = DEFAULT_RATES, DEFAULT_RATES._replace(d2h=5e9, h2d=5e9)
    for rates, up_wins in [(fast, True), (slow, False)]:
        up = plan_cost(cfg, (U,) * L, N, 2, rates)
        off = plan_cost(cfg, (O,) * L, N, 2, rates)
        rec = plan_cost(cfg, (R,) * L, N, 2, rates)
        assert (up < off) == up_wins, (up, off)
        assert rec <= off and plan_cost(cfg, (K,) * L, N, 2, rates) == 0
    # at 17.5 GiB the planner now rebuilds layers from reloaded up projections
    plan = plan_step(cfg, N, 16, int(17.5 * GiB), _weights_bytes(cfg))
    print(format_plan(plan))
    assert U in plan.modes and plan.memory.peak + SLACK <= 17.5 * GiB


def test_plan_bytes_are_the_sum_of_its_policies():
    gen = fresh_generator("cpu")
    cfg = config_from_hf(QWEN3_8B)
    N = 1 + _randint(gen, 9000)
    modes = tuple([U, O, R, K][i] for i in torch.randint(0, 4, (cfg.n_layers,), generator=gen).tolist())
    plan = make_plan(cfg, N, modes, lora_rank=16)
    rb = {r.name: row_bytes(r, cfg, N, 2, 16, 7) for r in PLAN}
    kept = sum(rb[r.name] for li in range(cfg.n_layers) for r in PLAN if plan.policy(li, r.name) == K)
    host = sum(rb[r.name] for li in range(cfg.n_layers) for r in PLAN if plan.policy(li, r.name) == O)
    assert plan.kept_bytes == kept
    xb, upb = N * cfg.hidden * 2, N * cfg.intermediate * 2
    assert plan.host_bytes == host == modes.count(O) * xb + modes.count(U) * (xb + upb)
    assert plan.memory.reload == 2 * xb * (O in modes or U in modes) + 2 * upb * (U in modes)
    assert layer_bytes(cfg, N, 2, 16, 7) == sum(rb.values())
    # an activation peak can never be below what the finished layers keep plus one layer's rows
    assert plan.memory.activations > kept
    text = format_plan(plan)
    assert "predicted peak" in text and f"N={N} tokens" in text and "| gate |" in text
    with pytest.raises(PlanError, match="expected 36"):
        make_plan(cfg, N, modes[:-1], lora_rank=16)


def test_llama_3b_fits_8_gib_and_plan_for_counts_the_model():
    cfg = config_from_hf(LLAMA_32_3B)
    plan = plan_step(cfg, 8192, 16, 8 * GiB, _weights_bytes(cfg))
    assert plan.memory.peak + SLACK <= 8 * GiB and any(m in OFFLOADED for m in plan.modes)
    print(format_plan(plan))
    gen = fresh_generator("cpu")
    model = _model(_tiny("llama", 2), gen, dtype=torch.float16)
    lora = lean.LoRA.init(model, r=4, alpha=8)
    p = plan_for(model, lora, 64)
    assert p.memory.weights == _weights_bytes(model.config) and p.act_bytes == 2
    assert offload.measure_rates(model, 64) is None and p.rates == DEFAULT_RATES  # CPU: nothing to measure
    assert p.memory.lora == lora.numel * (4 + 4 + 2 + 8)


def test_plan_for_an_moe_model_fits_and_counts_what_it_holds(tmp_path):
    """plan_for on a Qwen3-MoE model (one dense layer): the LoRA state counts the expert adapters,
    a budget between all-offload and all-keep gives a plan that fits, never offload_up on an MoE
    layer; its kept and host bytes are what the tape and the scheduler hold."""
    gen = fresh_generator("cpu")
    model = _moe_model(tmp_path, gen, moe_config(8, 2, True, [2], layers=4))
    cfg, L = model.config, model.config.n_layers
    lora = _lora(model, 4, 0.0, gen)
    batch = _batch(model, gen, 40)
    N = batch.n_tokens
    keep = plan_for(model, lora, N)
    assert keep.modes == (K,) * L and keep.memory.lora == lora.numel * (4 + 4 + 8)  # fp32: no compute copy
    weights = sum(t.numel() * 4 for t in [model.embed, model.lm_head, model.norm] + [w.buf for w in model.layers])
    assert keep.memory.weights == weights
    least = make_plan(cfg, N, (O,) * L, lora_rank=4, lora_targets=lora.targets, act_bytes=4, weights_bytes=weights)
    assert least.memory.peak < keep.memory.peak
    budget = least.memory.peak + SLACK + (keep.memory.peak - least.memory.peak) // 3
    plan = plan_for(model, lora, N, budget)
    print(format_plan(plan))
    assert plan.memory.peak + SLACK <= budget and plan.modes != keep.modes
    assert not any(m == U and cfg.is_moe(li) for li, m in enumerate(plan.modes)), plan.modes
    assert "| moe.h | (P,2*Fe) | act |" in format_plan(plan)
    with pytest.raises(PlanError, match="too small"):
        plan_for(model, lora, N, least.memory.peak)
    # what the plan says the layers keep and send is what they keep and send
    modes = (U, O, U, R)  # offload_up on MoE layers 0 and 1 runs as offload; layer 2 (dense) sends its up
    plan = make_plan(cfg, N, modes, lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    assert plan.modes == (O, O, U, R)
    sched = offload.scheduler(model, plan, N)
    tape = Tape()
    _forward_layers(model, lora, batch, make_ctx(model, lora, batch), tape, plan, sched)
    assert sum(_held(tape.records).values()) == plan.kept_bytes
    assert sum(t.numel() * t.element_size() for t in (sched.host, sched.host_up)) == plan.host_bytes
    assert sched.host_up.shape[0] == 1 and sched.up_slot == {2: 0}


# ---------------------------------------------------------------------------------------------
# GPU: the asynchronous scheduler on real sizes

def _gpu_setup(config, n_layers, tokens, dropout, seed_gen):
    model = _model(config | {"num_hidden_layers": n_layers}, seed_gen, torch.bfloat16, "cuda")
    lora = _lora(model, 16, dropout, seed_gen)
    batch = _batch(model, seed_gen, tokens, device="cuda", mean=512)
    return model, lora, batch


def _step(model, lora, batch, plan, opt=None):
    lora.zero_grad()
    loss, _ = lean.forward_backward(model, lora, batch, seed=11, plan=plan)
    if opt is not None:
        opt.step()
    return loss


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])  # 0: the Hopper TMA kernels (the rebuild skips xa's pre-pass)
def test_offload_bitwise_and_no_sync_gpu(dropout):
    gen = fresh_generator("cuda")
    model, lora, batch = _gpu_setup(QWEN3_8B, 4, 8192, dropout, gen)
    ref = _step(model, lora, batch, None).clone(), lora.grads.clone()
    for modes in [(O, O, O, O), (U, U, O, K), (U, O, R, K)]:
        plan = plan_for(model, lora, 8192)
        plan = make_plan(model.config, 8192, modes, lora_rank=16, lora_targets=lora.targets,
                         weights_bytes=plan.memory.weights)
        _step(model, lora, batch, plan)  # warm-up: builds the scheduler (pinned memory is a sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = _step(model, lora, batch, plan)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(loss, ref[0]), f"{modes}: loss {loss.item()} vs {ref[0].item()}"
        assert torch.equal(lora.grads, ref[1]), f"{modes}: max diff {(lora.grads - ref[1]).abs().max().item()}"


@pytest.mark.gpu
@pytest.mark.parametrize("config,n_layers", [(LLAMA_32_3B, 8), (QWEN3_8B, 5)], ids=["llama-3.2-3b", "qwen3-8b"])
def test_measured_peak_within_budget_and_prediction_gpu(config, n_layers):
    gen = fresh_generator("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what other tests in this process still hold
    print(f"memory held before this test: {base} B")
    model, lora, batch = _gpu_setup(config, n_layers, 8192, 0.0, gen)
    opt = lean.AdamW(lora, lr=1e-4)
    keep = plan_for(model, lora, 8192)
    full = layer_bytes(model.config, 8192, 2, 16, 7)
    budget = keep.memory.peak - int(2.5 * full)  # forces offload/recompute of about three layers
    plan = plan_for(model, lora, 8192, budget)
    print(format_plan(plan))
    assert any(m != K for m in plan.modes)
    untied = not model.config.tie_embeddings  # Qwen3-8B: the table goes to pinned host memory
    assert plan.embed_host == untied and model.embed.is_cuda == (not untied)
    assert not untied or (model.embed.is_pinned() and plan.memory.weights == keep.memory.weights - model.embed.nbytes)
    r = plan.rates  # measured by plan_for on the GPU (offload.measure_rates)
    assert r != DEFAULT_RATES and 1e9 < r.d2h < 1e12 and 1e9 < r.h2d < 1e12 and 1e12 < r.flops < 1e16, r
    _step(model, lora, batch, plan, opt)  # warm-up: compiles, builds the scheduler and RoPE tables
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() - base
    _step(model, lora, batch, plan, opt)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    act, pred = peak - before, plan.memory.activations
    print(f"measured peak {peak / GiB:.3f} GiB (activations {act / GiB:.3f}), predicted "
          f"{plan.memory.peak / GiB:.3f} GiB ({pred / GiB:.3f}), budget {budget / GiB:.3f} GiB")
    assert peak <= budget
    assert abs(act - pred) <= 0.10 * pred, f"activations measured {act} B vs predicted {pred} B"
    assert abs(peak - plan.memory.peak) <= 0.10 * plan.memory.peak
    assert abs(before - (plan.memory.peak - pred)) <= 0.01 * before, "persistent state mispredicted"


@pytest.mark.gpu
def test_planned_step_captures_in_a_cuda_graph_gpu():
    gen = fresh_generator("cuda")
    config = QWEN3_8B | dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, vocab_size=32000)
    model, lora, batch = _gpu_setup(config, 3, 2048, 0.0, gen)
    plan = make_plan(model.config, 2048, (U, O, R), lora_rank=16, lora_targets=lora.targets)
    eager = _step(model, lora, batch, plan).clone(), lora.grads.clone()
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            loss = _step(model, lora, batch, plan)
    torch.cuda.current_stream().wait_stream(side)
    lora.grads.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, eager[0]) and torch.equal(lora.grads, eager[1])
