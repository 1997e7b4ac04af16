"""The captured step (lean/runtime/graph.py) and what it rests on: fixed-shape packing whose padding
changes nothing, grad_scale as a device tensor, the optimizer's host/device halves. The CPU tests
run the kernels through the interpreter; the gpu-marked ones replay the captured step against the
eager step bit for bit and under torch's sync debug mode."""
import numpy as np
import pytest
import torch

import lean
from lean.kernels.gemm import tma_at_every_size
from lean.kernels.linear_ce import linear_ce_fwd_bwd
from lean.runtime.batch import IGNORE, PinnedUpload
from tests.hf_models import build_hf, tiny_config
from tests.util import DEVICE, fresh_generator, fresh_seed


def _docs(rng, vocab, lens, masked=False):
    """Random documents; with masked=True each has a random loss mask whose last token counts."""
    docs = []
    for n in lens:
        ids = rng.integers(0, vocab, n).tolist()
        mask = (rng.random(n) < 0.7).tolist()
        mask[-1] = True
        docs.append((ids, mask) if masked else ids)
    return docs


# ---- fixed-shape packing (host only) -------------------------------------------------------------

def test_fixed_shape_pack_keeps_shapes_and_content():
    rng = np.random.default_rng(fresh_seed())
    T, D = 64, 6
    for n_docs in (1, 3, 5, 6):
        lens = rng.multinomial(T - n_docs, np.ones(n_docs) / n_docs) + 1  # n_docs lengths >= 1, sum T
        if n_docs < D and rng.random() < 0.8:
            lens = np.maximum(1, lens - rng.integers(0, 6, n_docs))  # leave room for a padding document
        docs = _docs(rng, 100, [int(n) for n in lens], masked=True)
        plain = lean.pack(docs, T, device="cpu")
        fixed = lean.pack(docs, T, pad_to=T, max_docs=D, device="cpu")
        n = plain.n_tokens
        assert (fixed.n_tokens, fixed.cu_seqlens.shape[0], fixed.max_seqlen, fixed.host.shape[0]) == \
            (T, D + 1, T, 3 * T + D + 1)
        assert fixed.n_targets == plain.n_targets
        for name in ("ids", "positions", "targets"):
            assert getattr(fixed, name)[:n].tolist() == getattr(plain, name).tolist(), name
        assert fixed.targets[n:].tolist() == [IGNORE] * (T - n)
        assert fixed.positions[n:].tolist() == list(range(T - n))  # the padding document attends to itself
        cu = fixed.cu_seqlens.tolist()
        B = plain.cu_seqlens.shape[0] - 1
        assert cu[:B + 1] == plain.cu_seqlens.tolist()
        pad_slots = 1 if n < T else 0
        assert cu[B + pad_slots:] == [T] * (D + 1 - B - pad_slots)  # empty documents at the end


def test_fixed_shape_pack_errors():
    with pytest.raises(lean.BatchError, match="needs pad_to"):
        lean.pack([[1, 2]], 8, max_docs=2, device="cpu")
    with pytest.raises(lean.BatchError, match="and the padding document need 3 document slots"):
        lean.pack([[1, 2], [3, 4]], 8, pad_to=8, max_docs=2, device="cpu")
    lean.pack([[1, 2, 3, 4], [5, 6, 7, 8]], 8, pad_to=8, max_docs=2, device="cpu")  # full: no padding slot
    with pytest.raises(lean.BatchError, match="3 documents need 3 document slots"):
        lean.pack([[1, 2], [3, 4], [5, 6, 7, 8]], 8, pad_to=8, max_docs=2, device="cpu")


def test_pinned_upload_and_optimizer_halves():
    up = PinnedUpload(3, torch.float32, DEVICE)
    for vals in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.5]):  # both buffers, then the first again
        assert up.write(vals).tolist() == vals
    model = lean.model_from_tensors(tiny_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]},
                                    build_hf("qwen3", 0).state_dict(), dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=2, alpha=4)
    opt = lean.AdamW(lora, lr=0.25)
    lora.grads.copy_(torch.randn(lora.numel, generator=fresh_generator("cpu")))
    opt.begin_step(lr=0.5)
    assert opt.hyper.tolist() == [0.5, 1.0] and opt.step_count == 1
    before = lora.params.clone()
    opt.update()
    assert not torch.equal(before, lora.params)
    opt.step()
    assert opt.hyper.tolist() == [0.25, 2.0] and opt.step_count == 2


def test_step_graph_refusals():
    model = lean.model_from_tensors(tiny_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]},
                                    build_hf("qwen3", 0).state_dict(), dtype=torch.float32, device="cpu")
    lora = lean.LoRA.init(model, r=2, alpha=4, dropout=0.1)
    with pytest.raises(lean.StepGraphError, match="dropout 0"):
        lean.StepGraph(model, lora, lean.AdamW(lora), budget=16, max_docs=2)
    lora = lean.LoRA.init(model, r=2, alpha=4)
    with pytest.raises(lean.StepGraphError, match="another LoRA"):
        lean.StepGraph(model, lora, lean.AdamW(lean.LoRA.init(model, r=2, alpha=4)), budget=16, max_docs=2)
    with pytest.raises(lean.StepGraphError, match="CUDA device"):
        lean.StepGraph(model, lora, lean.AdamW(lora), budget=16, max_docs=2)
    from lean.runtime.planner import plan_for
    with pytest.raises(lean.StepGraphError, match="plan was made for 8 tokens, the graph's budget is 16"):
        lean.StepGraph(model, lora, lean.AdamW(lora), budget=16, max_docs=2, plan=plan_for(model, lora, 8))


# ---- padding changes nothing; grad_scale on the device (interpreter) --------------------------------

def test_grad_scale_tensor_equals_number():
    g = fresh_generator(DEVICE)
    N, V, C = 37, 97, 64
    h, w = torch.randn(N, C, generator=g, device=DEVICE), torch.randn(V, C, generator=g, device=DEVICE)
    targets = torch.randint(0, V, (N,), generator=g, device=DEVICE, dtype=torch.int32)
    targets[::5] = IGNORE
    scale = float(torch.rand(1, generator=g, device=DEVICE)) + 0.1
    out = []
    for s in (scale, torch.tensor([scale], dtype=torch.float32, device=DEVICE)):
        loss, dh = torch.empty(2, device=DEVICE), torch.empty(N, C, device=DEVICE)
        linear_ce_fwd_bwd(loss, dh, h, w, targets, grad_scale=s)
        out.append((loss, dh))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][1].abs().max() > 0
    with pytest.raises(TypeError, match="grad_scale: expected dtype torch.float32"):
        linear_ce_fwd_bwd(loss, dh, h, w, targets, grad_scale=torch.ones(1, dtype=torch.float64, device=DEVICE))


def test_fixed_shape_padding_changes_no_loss_or_gradient():
    """The same documents packed plainly and with fixed shapes (a padding document and empty
    slots): equal loss, target count and LoRA gradients. The padded run takes grad_scale as a
    device tensor, as the captured step does."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = lean.model_from_tensors(tiny_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]},
                                    build_hf("qwen3", seed).state_dict(), dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=4, alpha=8, seed=seed)
    lora.params.copy_(lora.params + 0.05 * torch.randn(lora.numel, generator=torch.Generator().manual_seed(seed)))
    docs = _docs(rng, model.config.vocab, [int(n) for n in rng.integers(2, 14, 3)], masked=True)
    T = sum(len(d[0]) for d in docs) + int(rng.integers(3, 20))
    D = len(docs) + 1 + int(rng.integers(0, 4))

    lora.zero_grad()
    plain = lean.pack(docs, T, device=DEVICE)
    loss, n = lean.forward_backward(model, lora, plain)
    grads = lora.grads.clone()
    lora.zero_grad()
    fixed = lean.pack(docs, T, pad_to=T, max_docs=D, device=DEVICE)
    scale = torch.tensor([1.0 / n], dtype=torch.float32, device=DEVICE)
    loss_p, n_p = lean.forward_backward(model, lora, fixed, grad_scale=scale)
    assert n_p == n > 0
    torch.testing.assert_close(loss_p, loss, rtol=1e-6, atol=0)
    assert grads.abs().max() > 0
    torch.testing.assert_close(lora.grads, grads, rtol=1e-5, atol=1e-6 * grads.abs().max().item())


# ---- the captured step on the GPU ---------------------------------------------------------------------

QWEN3_06B_2L = dict(  # Qwen3-0.6B's shapes with 2 of its 28 layers
    architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)


def _gpu_setup(seed, n_loras):
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model

    model = empty_model(config_from_hf(QWEN3_06B_2L), torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _, t in model.hf_tensors():
        noise = torch.randn(t.shape, generator=g, device="cuda")
        t.copy_(1.0 + 0.1 * noise if t.dim() == 1 else 0.02 * noise)
    noise = 0.02 * torch.randn(lean.LoRA.init(model, r=16, alpha=32).numel, generator=g, device="cuda")
    pairs = []
    for _ in range(n_loras):
        lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
        lora.params.copy_(lora.params + noise)  # B != 0, so every gradient is non-trivial from step 1
        lora.sync_lowp()
        pairs.append((lora, lean.AdamW(lora, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)))
    return model, pairs


def _gpu_batches(rng, vocab, T, D):
    """Three batches of other shapes inside: padding + empty slots; exactly full; one masked doc."""
    lens = [[int(n) for n in rng.integers(20, 200, 5)], None, [int(rng.integers(T // 2, T))]]
    lens[1] = [int(n) + 1 for n in rng.multinomial(T - (D - 1), np.ones(D - 1) / (D - 1))]
    return [_docs(rng, vocab, ls, masked=(i == 2)) for i, ls in enumerate(lens)]


@pytest.mark.gpu
def test_graph_step_equals_eager_bitwise():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T, D = 1024, 12
    model, ((lora_e, opt_e), (lora_g, opt_g)) = _gpu_setup(seed, 2)
    graph = lean.StepGraph(model, lora_g, opt_g, budget=T, max_docs=D)
    losses = []
    for i, docs in enumerate(_gpu_batches(rng, model.config.vocab, T, D)):
        lr = 1e-3 * (i + 1)
        lora_e.zero_grad()
        with tma_at_every_size():  # the kernels the graph captured (graph.py: Cautions)
            loss_e, n_e = lean.forward_backward(model, lora_e, lean.pack(docs, T, pad_to=T, max_docs=D, device="cuda"))
        opt_e.step(lr=lr)
        loss_g, n_g = graph.step(graph.pack(docs), lr=lr)
        assert n_g == n_e
        assert torch.equal(loss_g, loss_e), f"step {i}: loss {loss_g.item()} vs eager {loss_e.item()}"
        assert lora_e.grads.abs().max() > 0
        for name, a, b in (("grads", lora_g.grads, lora_e.grads), ("params", lora_g.params, lora_e.params),
                           ("lowp", lora_g.lowp, lora_e.lowp), ("m", opt_g.m, opt_e.m), ("v", opt_g.v, opt_e.v),
                           ("grad_norm", opt_g.grad_norm, opt_e.grad_norm)):
            assert torch.equal(a, b), f"step {i}: {name} differs, max |diff| {(a - b).abs().max().item()}"
        losses.append(loss_g.item() / n_g)
    assert len(set(losses)) == 3, f"replays gave repeated losses {losses}: new batches not read?"
    assert (lora_g.steps, opt_g.step_count) == (lora_e.steps, opt_e.step_count)


@pytest.mark.gpu
def test_graph_step_makes_no_host_sync():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T, D = 1024, 12
    model, ((lora, opt),) = _gpu_setup(seed, 1)
    graph = lean.StepGraph(model, lora, opt, budget=T, max_docs=D)
    docs = _gpu_batches(rng, model.config.vocab, T, D)
    graph.step(graph.pack(docs[0]))
    with pytest.raises(lean.StepGraphError, match="pack it with graph.pack"):
        graph.step(lean.pack(docs[0], T, device="cpu"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [graph.step(graph.pack(d), lr=2e-4)[0] for d in docs * 2]  # both pinned buffers, twice
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(x).all() for x in losses)
