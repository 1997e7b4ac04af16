"""The lm_head in host memory (lean/runtime/head_host.py): the fetch plan, the step with the head
streamed in chunks against the step with it on the device, the planner's walk against the step's
real allocations, and the planner taking the head off the GPU where nothing else fits.

CPU: the copies run synchronously through the same plan and buffers (the GPU path adds streams and
events: tests/test_head_host.py's gpu case and tests/test_offload.py's capture test)."""
import pytest
import torch

import lean
from lean.kernels.linear_ce_vchunk import DeviceChunks, linear_ce_vchunks
from lean.models.config import config_from_hf
from lean.models.presets import PRESETS
from lean.runtime import head_host, offload
from lean.runtime.head_host import HostHead, fetch_plan, head_to_host
from lean.runtime.plan import (
    GiB, KEEP, OFFLOAD, OFFLOAD_UP, SLACK, head_host_cost, make_plan,
)
from lean.runtime.plan_bytes import head_host_bytes, moe_step_bytes
from lean.runtime.planner import format_plan, plan_step
from lean.runtime.step import rope_tables
from tests.test_linear_ce import make_inputs
from tests.test_offload import LiveBytes, _batch, _lora, _model, _tiny
from tests.util import fresh_generator

K, O, U = KEEP, OFFLOAD, OFFLOAD_UP


def _visits(n):
    return list(range(n)) + list(reversed(range(n)))


@pytest.mark.parametrize("order", [_visits(n) for n in range(1, 7)] + [list(range(n)) for n in (1, 2, 5)]
                         + [[0, 2, 1, 0, 2, 2, 1]])
def test_fetch_plan_reads_the_right_chunk_and_never_refills_early(order):
    """Replay the plan: every visit finds its chunk in its buffer, a copy starts only after the last
    visit that read the buffer before it, and the training order copies 2n - 2 chunks (n >= 2)."""
    buf, copies = fetch_plan(order)
    holder, last_read, by_visit = [None, None], [-1, -1], {k: (c, b, after) for k, c, b, after in copies}
    for k, c in enumerate(order):
        if k in by_visit:
            cc, b, after = by_visit[k]
            assert cc == c and b == buf[k]
            assert after == last_read[b] and after < k  # issued once the buffer's last reader is done
            holder[b] = c
        assert holder[buf[k]] == c, f"visit {k} reads buffer {buf[k]} holding {holder[buf[k]]}, wants {c}"
        last_read[buf[k]] = k
    n = len(set(order))
    if order == _visits(n):
        assert len(copies) == max(n, 2 * n - 2)
    if order == list(range(n)):
        assert len(copies) == n


@pytest.mark.parametrize("chunk_v,with_dh", [(40, True), (131, True), (29, False), (7, True)])
def test_host_head_gives_the_device_chunks_bits(chunk_v, with_dh):
    """The same kernels over the same chunks: HostHead's copies change nothing, bit for bit."""
    g = fresh_generator("cpu")
    h, w, targets = make_inputs(17, 131, 48, torch.float32, g)
    outs = []
    for src in (DeviceChunks(w, chunk_v), HostHead(w.clone(), "cpu", chunk_v)):
        loss, dh = torch.empty(2), torch.empty_like(h) if with_dh else None
        linear_ce_vchunks(loss, dh, h, src, targets, grad_scale=0.3)
        outs.append((loss, dh))
    assert torch.equal(outs[0][0], outs[1][0])
    if with_dh:
        assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("arch,modes", [("qwen3", (U, K)), ("llama", (O, K, U))], ids=["qwen3-untied", "llama-tied"])
def test_step_with_the_head_on_the_host(monkeypatch, arch, modes):
    """A tiny model's step and greedy logits with the head streamed in 3-4 chunks equal the step with
    the head on the device (fp32: the loss's sum-exp and dh add their terms in another order), and the
    walk's peak equals the bytes the step allocates. A tied table moves with the head."""
    gen = fresh_generator("cpu")
    config = _tiny(arch, len(modes)) | {"tie_word_embeddings": arch == "llama"}
    model = _model(config, gen)
    lora = _lora(model, 4, 0.0, gen)
    batch = _batch(model, gen, 30 + int(torch.randint(0, 20, (1,), generator=gen)))
    cfg, N = model.config, batch.n_tokens
    rope_tables(model, batch)
    lora.zero_grad()
    loss0, _ = lean.forward_backward(model, lora, batch, seed=3)
    grads0, logits0 = lora.grads.clone(), lean.forward(model, lora, batch)

    rows = -(-cfg.vocab // 3) + 1  # 3 or 4 chunks, the last one short
    monkeypatch.setattr(head_host, "CHUNK_BYTES", rows * cfg.hidden * 4)
    tied = model.embed is model.lm_head
    head_to_host(model)
    src = model.cache["head"]
    assert src.chunk_v == rows and src.n in (3, 4) and (model.embed is model.lm_head) == tied
    plan = make_plan(cfg, N, modes, lora_rank=4, lora_targets=lora.targets, act_bytes=4, head_host=True)
    assert plan.embed_host == tied and plan.memory.weights == head_host_bytes(cfg, 4)
    offload.scheduler(model, plan, N)  # its buffers, made before the step (as a warm-up would)
    lora.zero_grad()
    with LiveBytes() as lb:
        loss1, _ = lean.forward_backward(model, lora, batch, seed=3, plan=plan)
    assert lb.peak - moe_step_bytes(cfg) == plan.memory.activations, (
        f"allocated peak {lb.peak} B != predicted {plan.memory.activations} B (at {plan.peak_at})")
    assert torch.allclose(loss1, loss0, rtol=1e-6, atol=0), (loss1, loss0)
    err = (lora.grads - grads0).abs().max() / grads0.abs().max()
    assert err < 1e-5, err
    logits1 = lean.forward(model, lora, batch)
    assert (logits1 - logits0).abs().max() <= 1e-6 * logits0.abs().max()


def _qwen3_14b_nf4():
    cfg = config_from_hf(PRESETS["qwen3-14b"])
    from dataclasses import replace
    return replace(cfg, weight_quant="nf4")


def test_planner_streams_the_head_only_where_it_pays():
    """Qwen3-14B in NF4 at 2048 tokens (weights: the NF4 layers, 6.35 GiB, plus the bf16 embedding and
    lm_head): 12 GiB fits with the head on the GPU; 8.5 GiB fits only with it on the host, which the
    plan says; 7 GiB fits nothing, and the error says how far the head-on-host plan is."""
    cfg = _qwen3_14b_nf4()
    N, table = 2048, cfg.vocab * cfg.hidden * 2
    w = int(6.35 * GiB) + 2 * table
    kw = dict(embed_bytes=table, head_bytes=table)
    roomy = plan_step(cfg, N, 16, 12 * GiB, w, **kw)
    assert not roomy.head_host
    tight = plan_step(cfg, N, 16, int(8.5 * GiB), w, **kw)
    assert tight.head_host and tight.embed_host and tight.memory.peak + SLACK <= 8.5 * GiB, format_plan(tight)
    assert tight.memory.weights == w - 2 * table + head_host_bytes(cfg, 2)
    assert tight.cost > head_host_cost(cfg, N, 2, tight.rates) > 0
    assert "lm_head: pinned host memory (1.45 GiB off the GPU" in format_plan(tight)
    # without the option the same budget fails: the head is what makes it fit
    with pytest.raises(lean.runtime.plan.PlanError, match="too small"):
        plan_step(cfg, N, 16, int(8.5 * GiB), w, embed_bytes=table)
    with pytest.raises(lean.runtime.plan.PlanError, match="too small"):
        plan_step(cfg, N, 16, 7 * GiB, w, **kw)
    # a head already on the host: every plan streams it, the weights count its buffers only
    again = plan_step(cfg, N, 16, int(8.5 * GiB), w - table, embed_bytes=table, head_on_host=True)
    assert again.head_host and again.memory == tight.memory


@pytest.mark.gpu
def test_streamed_head_step_equals_the_device_head_step_gpu():
    """bf16, Qwen3-8B's width and 151936-row vocabulary, 2 layers, 4096 packed tokens: the streamed
    loss and gradients against the head on the device (the same math; sum-exp and dh add their terms
    in another order), no host sync in the streamed step, and the captured step's loss equal to the
    eager one's on the same parameters."""
    from lean.runtime.graph import StepGraph

    gen = fresh_generator("cuda")
    model = _model(dict(PRESETS["qwen3-8b"], num_hidden_layers=2), gen, dtype=torch.bfloat16, device="cuda")
    lora = _lora(model, 16, 0.0, gen)
    batch = _batch(model, gen, 4096, device="cuda", mean=512)
    lora.zero_grad()
    loss0, _ = lean.forward_backward(model, lora, batch, seed=1)
    grads0 = lora.grads.clone()
    head_to_host(model)
    assert model.lm_head.device.type == "cpu" and model.lm_head.is_pinned() and model.cache["head"].n > 2
    lora.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss1, _ = lean.forward_backward(model, lora, batch, seed=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert abs(loss1.item() - loss0.item()) <= 1e-4 * abs(loss0.item()), (loss1.item(), loss0.item())
    err = ((lora.grads - grads0).norm() / grads0.norm()).item()
    assert err < 1e-2, err  # bf16 dh: one rounding either way, of sums added in another order
    graph = StepGraph(model, lora, lean.AdamW(lora, lr=1e-4), budget=4096, max_docs=64)
    ids = batch.host[:batch.n_tokens].tolist()
    docs, start = [], 0
    for n in batch.doc_lens:
        docs.append(ids[start:start + n])
        start += n
    loss2 = graph.step(graph.pack(docs))[0]
    assert abs(loss2.item() - loss1.item()) <= 1e-4 * abs(loss1.item()), (loss2.item(), loss1.item())


@pytest.mark.gpu
def test_staged_tables_go_where_the_plan_puts_them_gpu():
    """A model loaded with stage_tables (lean-train under --vram-budget) holds its embedding and lm_head
    in pinned host memory until the first plan_for: with no budget both go to the GPU and the step is
    bit-equal to an unstaged model's; under a budget that only fits with them on the host, they stay
    there, and the process never holds them on the GPU: the peak from before the load is the plan's."""
    from lean.models.weights import empty_model
    from lean.runtime.plan import DEFAULT_RATES
    from lean.runtime.planner import plan_for

    gen = fresh_generator("cuda")
    config = dict(PRESETS["qwen3-8b"], num_hidden_layers=2)
    model = _model(config, gen, dtype=torch.bfloat16, device="cuda")
    lora = _lora(model, 16, 0.0, gen)
    batch = _batch(model, gen, 4096, device="cuda", mean=512)

    def staged_copy():
        m = empty_model(model.config, torch.bfloat16, "cuda", stage_tables=True)
        assert m.cache["staged"] and m.embed.device.type == m.lm_head.device.type == "cpu" and m.embed.is_pinned()
        for (_, dst), (_, src) in zip(m.hf_tensors(), model.hf_tensors()):
            dst.copy_(src)
        return m

    lora.zero_grad()
    loss0, _ = lean.forward_backward(model, lora, batch, seed=1)
    grads0 = lora.grads.clone()
    roomy = staged_copy()
    plan = plan_for(roomy, lora, 4096, rates=DEFAULT_RATES)
    assert not (plan.head_host or plan.embed_host) and "staged" not in roomy.cache
    assert roomy.embed.device.type == roomy.lm_head.device.type == "cuda"
    lora.zero_grad()
    loss1, _ = lean.forward_backward(roomy, lora, batch, seed=1)
    assert loss1.item() == loss0.item() and torch.equal(lora.grads, grads0)
    del roomy
    # the highest budget (128 MiB steps down from the all-on-GPU peak) at which the plan streams the head
    table = model.embed.numel() * 2
    weights = sum(b.numel() * b.element_size() for layer in model.layers for b in (layer.buf, layer.qbuf))
    weights += 2 * table + model.norm.numel() * 2
    kw = dict(lora_targets=lora.targets, act_bytes=2, rates=DEFAULT_RATES, embed_bytes=table, head_bytes=table)
    budget = plan_step(model.config, 4096, 16, None, weights, **kw).memory.peak
    tight = None
    while tight is None or not tight.head_host:
        budget -= 128 * 2**20
        tight = plan_step(model.config, 4096, 16, budget, weights, **kw)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # the first model, its LoRA and batch
    torch.cuda.reset_peak_memory_stats()
    small = staged_copy()
    plan = plan_for(small, lora, 4096, budget_bytes=budget, rates=DEFAULT_RATES)
    assert plan.head_host and plan.embed_host, format_plan(plan)
    assert small.lm_head.device.type == small.embed.device.type == "cpu" and "head" in small.cache
    lora.zero_grad()
    loss2, _ = lean.forward_backward(small, lora, batch, plan=plan, seed=1)
    torch.cuda.synchronize()
    assert abs(loss2.item() - loss0.item()) <= 1e-4 * abs(loss0.item()), (loss2.item(), loss0.item())
    # this model's own bytes above base (its LoRA state is the first model's): the plan's peak less the
    # LoRA part, to the allocator's rounding; a table on the GPU at any point would add 1.16 GiB
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= plan.memory.peak - plan.memory.lora + 64 * 2**20, (peak, plan.memory)


def test_tables_on_host_flag_and_its_cpu_no_op():
    """lean-train --tables-on-host reaches TrainConfig; on a CPU device tables_to_host moves nothing."""
    from lean.cli import build_parser, config_from_args
    from lean.runtime.head_host import tables_to_host

    args = build_parser().parse_args(["--model", "m", "--data", "d.jsonl", "--tables-on-host"])
    assert config_from_args(args).tables_on_host is True
    assert config_from_args(build_parser().parse_args(["--model", "m", "--data", "d.jsonl"])).tables_on_host is False
    gen = fresh_generator("cpu")
    model = _model(_tiny("qwen3", 1), gen)
    embed, head = model.embed, model.lm_head
    assert tables_to_host(model) == 0 and "head" not in model.cache
    assert model.embed is embed and model.lm_head is head


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [False, True])
def test_tables_to_host_gpu(tied):
    """tables_to_host: both tables (one when tied) in pinned host memory, their bytes freed on the GPU,
    and the step equal to the step with them on the device (the streamed loss adds in another order)."""
    from lean.runtime.head_host import tables_to_host

    gen = fresh_generator("cuda")
    model = _model(dict(PRESETS["qwen3-0.6b"], num_hidden_layers=2, tie_word_embeddings=tied), gen,
                   dtype=torch.bfloat16, device="cuda")
    assert (model.embed is model.lm_head) == tied
    lora = _lora(model, 16, 0.0, gen)
    batch = _batch(model, gen, 2048, device="cuda", mean=300)
    lora.zero_grad()
    loss0, _ = lean.forward_backward(model, lora, batch, seed=1)
    grads0 = lora.grads.clone()
    table = model.embed.numel() * model.embed.element_size()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = tables_to_host(model)
    torch.cuda.synchronize()
    assert freed == table * (1 if tied else 2)
    assert model.embed.is_pinned() and model.lm_head.is_pinned() and (model.embed is model.lm_head) == tied
    assert before - torch.cuda.memory_allocated() >= freed - 2 * model.cache["head"].chunk_v * model.config.hidden * 2
    lora.zero_grad()
    loss1, _ = lean.forward_backward(model, lora, batch, seed=1)
    assert abs(loss1.item() - loss0.item()) <= 1e-4 * abs(loss0.item()), (loss1.item(), loss0.item())
    err = ((lora.grads - grads0).norm() / grads0.norm()).item()
    assert err < 1e-2, err
