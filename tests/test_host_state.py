"""The LoRA state on the host (runtime/host_state.py): master weights, gradients and AdamW moments in
pinned host memory, each layer's gradient through a ring of two GPU slots.

CPU (interpreter, float32, tiny models): steps with the state on the host give the state-on-device
steps' gradients bit for bit (dense, Qwen3-MoE, GPT-OSS; with an offload plan; with two micro-batches
accumulated; the update in one launch (dense) and in chunks, layer by layer (the MoE models)), the
same parameters and moments bit for bit when clipping does not bind and within fp32 rounding of the
clip factor when it does; the norm the ring sums layer by layer is the gradient's norm. The planner
counts 2 bytes a parameter and the ring. GPU (`gpu`): two real-size steps without a host sync (the
second forward under the first update), bit-equal to the device state, and a captured graph equal
to the eager step.
"""
import pytest
import torch

import lean
from lean.kernels.adamw import adamw_partials
from lean.runtime.optim import AdamW
from lean.runtime.plan import KEEP, OFFLOAD, RECOMPUTE, make_plan
from lean.runtime.plan_bytes import lora_state_bytes
from tests.test_moe import moe_config
from tests.test_offload import QWEN3_8B, QWEN3_30B_A3B, _batch, _lora, _model, _moe_model, _randint, _tiny
from tests.util import fresh_generator


def _pair(model, lora, programs=None):
    """A LoRA with its state on the host holding the same parameters as `lora`; programs: its update
    in chunks of that many programs (the GPU's path: GradRing.update; on the CPU it runs them in
    order) instead of the CPU's one launch."""
    twin = lean.LoRA.init(model, r=lora.r, alpha=lora.alpha, targets=lora.targets, dropout=lora.dropout,
                          host_state=True)
    if programs is not None:
        twin.ring.programs = programs
    lora.sync()
    twin.params.copy_(lora.params.to(twin.params.device))
    twin.sync_lowp()
    return twin


def _run(model, lora, opt, batches, plan=None, accumulate=1, first=0):
    norms = []
    for i in range(0, len(batches), accumulate):
        lora.zero_grad()
        for b in batches[i:i + accumulate]:
            n = sum(x.n_targets for x in batches[i:i + accumulate])
            lean.forward_backward(model, lora, b, seed=7 + first + i, plan=plan, grad_scale=1.0 / n)
        opt.step()
        norms.append(opt.grad_norm.clone())
    lora.sync()
    return norms


def _compare(model, lora, batches, clip, plan=None, accumulate=1, programs=None):
    host = _pair(model, lora, programs)
    dev_opt, host_opt = AdamW(lora, lr=1e-2, max_grad_norm=clip), AdamW(host, lr=1e-2, max_grad_norm=clip)
    # Step by step. Without clipping every state is the same bits. A binding clip: the ring sums
    # the norm layer by layer, so its factor may differ in the last place; the step then moves
    # params a rounding apart, and a later step's gradients (seed 4, two steps: 3e-5 relative) and
    # updates (7.6e-7 at lr 1e-2) compound it. So there the host twin starts each step from the
    # device state: its gradients are the same bits and its update within the factor's rounding.
    for i in range(0, len(batches), accumulate):
        if i and clip is not None:
            host.params.copy_(lora.params.to(host.params.device))
            host.sync_lowp()
            host_opt.m.copy_(dev_opt.m.to(host_opt.m.device))
            host_opt.v.copy_(dev_opt.v.to(host_opt.v.device))
        step = batches[i:i + accumulate]
        n_dev = _run(model, lora, dev_opt, step, plan, accumulate, first=i)
        n_host = _run(model, host, host_opt, step, plan, accumulate, first=i)
        _check_states(lora, host, dev_opt, host_opt, n_dev, n_host, exact=clip is None)
    return host, host_opt


def _check_states(lora, host, dev_opt, host_opt, n_dev, n_host, exact):
    for a, b in zip(n_dev, n_host):
        assert torch.allclose(a.cpu(), b.cpu(), rtol=2e-6, atol=0), (a, b)
    assert torch.equal(lora.grads.cpu(), host.grads.cpu()), "grads differ"
    for name, a, b in (("params", lora.params, host.params), ("m", dev_opt.m, host_opt.m),
                       ("v", dev_opt.v, host_opt.v), ("lowp", lora.lowp, host.lowp)):
        a, b = a.cpu(), b.cpu()
        if exact:
            assert torch.equal(a, b), f"{name} differs"
        else:  # the factor's last place moves m, v by ~1e-7 of their scale, p = p - lr u by an ulp
            atol = 1e-8 if name in ("params", "lowp") else 1e-6 * b.abs().max().item()
            assert torch.allclose(a, b, rtol=5e-7, atol=atol), f"{name}: {(a - b).abs().max()}"


@pytest.mark.parametrize("arch,clip", [("qwen3", 1e-3)])
def test_dense_host_state_same_bits(arch, clip):
    """Two steps of a 3-layer dense model: the host state's gradients, norm and updates are the
    device state's (clip 1e-3 binds on every step: the updates within rounding of the factor; the
    bit-equal updates without clipping: the MoE test below)."""
    gen = fresh_generator("cpu")
    model = _model(_tiny(arch, 3), gen)
    lora = _lora(model, 4, 0.0, gen)
    batches = [_batch(model, gen, 12 + _randint(gen, 12)) for _ in range(2)]
    host, opt = _compare(model, lora, batches, clip)
    full = torch.linalg.vector_norm(host.grads.double())
    assert abs(float(opt.grad_norm) - float(full)) <= 2e-6 * float(full)  # the ring's norm is the norm
    assert host.params.device.type == "cpu" and opt.m.device.type == "cpu"


def test_moe_host_state_with_a_plan_and_accumulation(tmp_path):
    """Qwen3-MoE (a dense layer mixed in, experts adapted), an offload/recompute plan, and two
    micro-batches a step: the ring reloads the first micro-batch's gradient and adds the second's."""
    gen = fresh_generator("cpu")
    model = _moe_model(tmp_path, gen, moe_config(8, 2, True, [1], layers=3))
    lora = _lora(model, 4, 0.0, gen)
    plan = make_plan(model.config, 64, (OFFLOAD, RECOMPUTE, KEEP), lora_rank=4, lora_targets=lora.targets, act_bytes=4)
    batches = [_batch(model, gen, 12 + _randint(gen, 12)) for _ in range(2)]
    _compare(model, lora, batches, None, plan=plan, accumulate=2, programs=1)  # the update in chunks


def test_gpt_oss_host_state_same_bits():
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model
    from tests.test_gpt_oss import oss_config

    gen = fresh_generator("cpu")
    config = oss_config(5, 2, window=4, layers=2, intermediate_size=64).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    model = empty_model(config_from_hf(config), torch.float32, "cpu")
    for name, t in model.hf_tensors():
        r = torch.randn(t.shape, generator=gen)
        t.copy_((1.0 + 0.1 * r) if name.endswith("norm.weight") else (0.3 if "router" in name else 0.05) * r)
    lora = _lora(model, 4, 0.0, gen)
    _compare(model, lora, [_batch(model, gen, 12 + _randint(gen, 12)) for _ in range(2)], 5.0, programs=1)


def test_host_state_checkpoint_and_merge_read_the_host(tmp_path):
    """A checkpoint written from the host state restores into a device-state run, and merging reads
    the host master weights: the same merged tensors as the device state's."""
    from lean.runtime.checkpoint import CHECKPOINT, _read_checkpoint, restore_checkpoint, save_checkpoint
    from lean.runtime.merge import merged_tensors

    gen = fresh_generator("cpu")
    model = _model(_tiny("qwen3", 2), gen)
    lora = _lora(model, 4, 0.0, gen)
    host, opt = _compare(model, lora, [_batch(model, gen, 12)], None)
    state = {"step": opt.step_count, "lora_steps": host.steps, "epoch": 0, "batch_index": 0, "config": {}}
    save_checkpoint(tmp_path, host, opt, state | _rng_state())
    twin = lean.LoRA.init(model, r=4, alpha=8, targets=lora.targets)
    twin_opt = AdamW(twin)
    st, t = _read_checkpoint(tmp_path / CHECKPOINT)
    restore_checkpoint(st, t, twin, twin_opt)
    assert torch.equal(twin.params, host.params) and torch.equal(twin_opt.m, opt.m)
    a, b = merged_tensors(model, host, torch.float32), merged_tensors(model, lora, torch.float32)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rng_state():
    import random

    import numpy as np

    from lean.runtime.checkpoint import _np_state_to_json

    return {"python_rng": random.getstate(), "numpy_rng": _np_state_to_json(np.random.get_state())}


def test_planner_counts_the_host_state():
    """At Qwen3-30B-A3B's shapes (r=16 on attention and experts, bf16): the GPU keeps the compute
    copy (2 bytes a parameter) and two layers' fp32 gradients instead of 18 bytes a parameter."""
    from lean.models.config import config_from_hf

    cfg = config_from_hf(QWEN3_30B_A3B)
    dev = lora_state_bytes(cfg, 16, lean.runtime.lora.TARGETS, 2)
    host = lora_state_bytes(cfg, 16, lean.runtime.lora.TARGETS, 2, host_state=True)
    P = dev // 18
    layer = P // cfg.n_layers
    assert dev == 18 * P and 990e6 < P < 1000e6
    assert host == 2 * P + 2 * layer * 4 + 4 * adamw_partials(layer, P) * cfg.n_layers
    plan = make_plan(cfg, 8192, (OFFLOAD,) * cfg.n_layers, lora_rank=16, act_bytes=2, host_state=True,
                     embed_host=True, head_host=True,
                     weights_bytes=0)
    assert plan.memory.lora == host
    dense = config_from_hf(QWEN3_8B)
    assert lora_state_bytes(dense, 16, lean.runtime.lora.TARGETS, 2, host_state=True) < \
        lora_state_bytes(dense, 16, lean.runtime.lora.TARGETS, 2) / 8


def test_host_state_refuses_data_parallel():
    from lean.runtime.grad_reduce import GradReducer

    gen = fresh_generator("cpu")
    model = _model(_tiny("llama", 2), gen)
    lora = lean.LoRA.init(model, r=4, alpha=8, host_state=True)
    with pytest.raises(ValueError, match="host_state"):
        GradReducer(lora, None)


# ---------------------------------------------------------------------------------------------
# GPU

@pytest.mark.gpu
def test_host_state_bitwise_no_sync_graph_gpu():
    """Qwen3-8B shapes, 4 layers, bf16, 8192 tokens: two of the host state's steps (eager, no host
    sync; the second forward under the first update) are bit-equal to the device state's (clipping
    on, not binding); a captured graph of it replays
    the eager step's bits (both with the TMA GEMMs at every size, as graph.py says)."""
    from lean.kernels.gemm import tma_at_every_size
    from lean.runtime.graph import StepGraph

    gen = fresh_generator("cuda")
    model = _model(QWEN3_8B | {"num_hidden_layers": 4}, gen, torch.bfloat16, "cuda")
    lora = _lora(model, 16, 0.0, gen)
    batches = [_batch(model, gen, 8192, device="cuda", mean=512) for _ in range(2)]
    host = _pair(model, lora)
    dev_opt, host_opt = AdamW(lora, max_grad_norm=1e6), AdamW(host, max_grad_norm=1e6)
    _run(model, lora, dev_opt, batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # two steps: the second forward runs under the first update (GradRing.update, ready)
        assert host.ring.deferred()
        for i, b in enumerate(batches):
            host.zero_grad()
            lean.forward_backward(model, host, b, seed=7 + i)
            host_opt.step()
            assert host.ring.pending
    finally:
        torch.cuda.set_sync_debug_mode(0)
    host.sync()
    for a, b in ((lora.grads, host.grads), (lora.params, host.params), (dev_opt.m, host_opt.m),
                 (dev_opt.v, host_opt.v), (lora.lowp, host.lowp)):
        assert torch.equal(a.cpu(), b.cpu())
    assert host.params.is_pinned() and host_opt.v.is_pinned() and not host.grads.is_cuda
    # the captured step: replays equal the eager step (both from the same state, same batch)
    graph = StepGraph(model, host, host_opt, budget=8192, max_docs=64)
    eager = _pair(model, host)
    eager_opt = AdamW(eager, max_grad_norm=1e6)
    eager_opt.m.copy_(host_opt.m)
    eager_opt.v.copy_(host_opt.v)
    eager_opt.step_count = host_opt.step_count
    docs = [([int(x) for x in torch.randint(0, model.config.vocab, (n,), generator=gen, device="cuda")], None)
            for n in (3000, 2000, 1500, 1692)]
    gb = graph.pack([(d, [True] * len(d)) for d, _ in docs])
    graph.step(gb)
    eb = lean.pack([(d, [True] * len(d)) for d, _ in docs], 8192, pad_to=8192, max_docs=64, device="cuda")
    with tma_at_every_size():
        eager.zero_grad()
        lean.forward_backward(model, eager, eb, seed=0)
        eager_opt.step()
    host.sync()
    eager.sync()
    assert torch.equal(host.params, eager.params) and torch.equal(host_opt.v, eager_opt.v)
