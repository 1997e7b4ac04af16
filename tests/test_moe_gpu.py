"""Qwen3-MoE on the GPU: the step at Qwen3-30B-A3B's shapes (random init, a few layers) in bf16
against HF + PEFT by the project's rule; the MoE step without host syncs; the captured MoE step
equal to the eager one, bit for bit."""
import numpy as np
import pytest
import torch

import lean
from lean.kernels.gemm import tma_at_every_size
from lean.models.config import config_from_hf
from lean.models.presets import PRESETS
from lean.models.weights import empty_model
from lean.reference.hf_peft import hf_loss_and_grads, lean_token_losses, peft_wrap
from lean.reference.rule import l2_rule
from tests.util import check_step_loss, fresh_seed

pytestmark = pytest.mark.gpu


def a3b(layers):
    """Qwen3-30B-A3B's config (C 2048, 128 experts, k 8, moe_intermediate 768, 32/4 heads,
    head_dim 128) with `layers` of its 48 layers."""
    return dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=layers)


def _docs(rng, vocab, total, mean=256):
    docs, left = [], total
    while left > 0:
        n = min(left, max(1, int(rng.exponential(mean))))
        docs.append(rng.integers(0, vocab, n).tolist())
        left -= n
    return docs


def test_moe_step_bf16_a3b_shapes():
    """lean bf16 vs HF+PEFT fp32 (the reference) and HF+PEFT bf16 (torch's own bf16 error): within
    2x torch's error + 1e-3 (L2, lean.reference.rule.l2_rule) for the loss and every LoRA gradient,
    attention and experts. The bf16 HF model casts its parameters only (RoPE's inv_freq stays fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    config = a3b(2)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits the router at zero (every token ties): draw it
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    model = lean.model_from_tensors(config, sd, dtype=torch.bfloat16, device="cuda")
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lora.params.copy_(lora.params + 0.02 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    docs = _docs(rng, model.config.vocab, 2048)
    batch = lean.pack(docs, max_tokens=2048, device="cuda")
    lora.zero_grad()
    loss, n = lean.forward_backward(model, lora, batch)
    ours = {k: v.clone() for k, v in lora.grad_state_dict().items()}
    load = model.cache["moe"].counts
    assert int(load.sum().item()) == 2 * 2048 * 8
    tokens = lean_token_losses(model, lora, batch)

    ref_loss, ref_n, ref_grads, ref_tokens = hf_loss_and_grads(peft_wrap(hf.cuda(), lora), docs, device="cuda",
                                                               token_losses=True)
    hf16 = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    hf16.load_state_dict(sd)
    for p in hf16.parameters():  # parameters only: buffers (inv_freq) stay fp32
        p.data = p.data.to(torch.bfloat16)
    lp_loss, _, lp_grads, lp_tokens = hf_loss_and_grads(peft_wrap(hf16.cuda().eval(), lora), docs, device="cuda",
                                                        token_losses=True)
    assert n == ref_n
    v = check_step_loss(loss, tokens, ref_tokens, lp_tokens)
    print(v.text, f"(summed: lean {loss.item():.4f}, HF bf16 {lp_loss.item():.4f}, HF fp32 {ref_loss.item():.4f})")
    assert any("experts" in k for k in ref_grads)
    worst = []
    for k, ref in ref_grads.items():
        v = l2_rule(ours[k], ref, lp_grads[k], name=k)
        worst.append((v.err - v.bound, v.text))
        assert v.ok, v.text
    print(sorted(worst)[-3:])


def _a3b_model(seed, layers=2):
    model = empty_model(config_from_hf(a3b(layers)), torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _, t in model.hf_tensors():
        noise = torch.randn(t.shape, generator=g, device="cuda")
        t.copy_(1.0 + 0.1 * noise if t.dim() == 1 else 0.02 * noise)
    return model, g


def _lora(model, seed, g):
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
    lora.params.copy_(lora.params + 0.02 * torch.randn(lora.numel, generator=g, device="cuda"))
    lora.sync_lowp()
    return lora


def test_moe_step_makes_no_host_sync():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model, g = _a3b_model(seed)
    lora = _lora(model, seed, g)
    opt = lean.AdamW(lora, lr=1e-3)
    lean.forward_backward(model, lora, lean.pack(_docs(rng, model.config.vocab, 1000), 1024, device="cuda"))
    opt.step()  # warm-up: compiles the kernels
    batch = lean.pack(_docs(rng, model.config.vocab, 1000), 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora.zero_grad()
        loss, _ = lean.forward_backward(model, lora, batch)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).all()


def test_moe_graph_step_equals_eager_bitwise():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T, D = 1024, 12
    model, g = _a3b_model(seed)
    state = _lora(model, seed, g).params.clone()
    pairs = []
    for _ in range(2):
        lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
        lora.params.copy_(state)
        lora.sync_lowp()
        pairs.append((lora, lean.AdamW(lora, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)))
    (lora_e, opt_e), (lora_g, opt_g) = pairs
    graph = lean.StepGraph(model, lora_g, opt_g, budget=T, max_docs=D)
    for i in range(3):
        docs = _docs(rng, model.config.vocab, int(rng.integers(T // 2, T)), mean=100)[:D - 1]
        lora_e.zero_grad()
        with tma_at_every_size():  # the kernels the graph captured (graph.py: Cautions)
            loss_e, n_e = lean.forward_backward(model, lora_e, lean.pack(docs, T, pad_to=T, max_docs=D, device="cuda"))
        opt_e.step(lr=1e-3)
        loss_g, n_g = graph.step(graph.pack(docs), lr=1e-3)
        assert n_g == n_e
        assert torch.equal(loss_g, loss_e), f"step {i}: loss {loss_g.item()} vs eager {loss_e.item()}"
        for name, a, b in (("grads", lora_g.grads, lora_e.grads), ("params", lora_g.params, lora_e.params)):
            assert torch.equal(a, b), f"step {i}: {name} differs, max |diff| {(a - b).abs().max().item()}"
