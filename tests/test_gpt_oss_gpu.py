"""GPT-OSS on the GPU: the step at gpt-oss-20b's shapes (random init, 2 sliding + 2 full layers,
bf16 experts, and MXFP4 experts quantised from the random bf16 ones, HF holding their dequantised
values) against HF + PEFT by the project's rule, without host syncs, and captured == eager."""
import numpy as np
import pytest
import torch

import lean
from lean.kernels.gemm import tma_at_every_size
from lean.models.presets import PRESETS
from lean.reference.hf_peft import hf_loss_and_grads, lean_token_losses, peft_wrap
from lean.reference.mxfp4 import mxfp4_dequant_ref, mxfp4_quantize_ref
from lean.reference.rule import l2_rule
from tests.util import check_step_loss, fresh_seed

pytestmark = pytest.mark.gpu


def oss20b(layers):
    return dict(PRESETS["gpt-oss-20b"], num_hidden_layers=layers,
                layer_types=PRESETS["gpt-oss-20b"]["layer_types"][:layers])


def _docs(rng, vocab, total, mean=300):
    docs, left = [], total
    while left > 0:
        n = min(left, max(1, int(rng.exponential(mean))))
        docs.append(rng.integers(0, vocab, n).tolist())
        left -= n
    return docs


def _hf(config, seed):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # HF inits router, sinks and biases at zero: draw them
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.router.weight", "self_attn.sinks")):
                p.normal_(0.0, 0.5 if "sinks" in name else 0.02)
            elif name.endswith(("_bias", "router.bias")):
                p.normal_(0.0, 0.02)
    return hf_cfg, hf


def _hf_step(hf, lora, docs):
    """HF + PEFT's loss and gradients, brought to the host (the GPU's memory freed for the next)."""
    pm = peft_wrap(hf, lora)
    loss, n, grads, tokens = hf_loss_and_grads(pm, docs, device="cuda", token_losses=True)
    out = loss.cpu(), n, {k: v.cpu() for k, v in grads.items()}, tokens.cpu()
    del pm, grads
    torch.cuda.empty_cache()
    return out


@pytest.mark.timeout(400)  # lean's step, then HF+PEFT's fp32 and bf16 steps at 20b shapes: ~150 s alone on the H100
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpt_oss_step_bf16_20b_shapes(mxfp4):
    """lean bf16 vs HF+PEFT fp32 (the reference) and HF+PEFT bf16 (parameters cast, buffers fp32):
    within 2x torch's bf16 error + 1e-3 (relative L2) for the loss and every LoRA gradient."""
    from transformers import AutoModelForCausalLM

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    config = oss20b(4)
    hf_cfg, hf = _hf(config, seed)
    quant = {}
    if mxfp4:  # experts quantised from the random ones; HF holds the dequantised (bf16-exact) values
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                    b, s = mxfp4_quantize_ref(p.transpose(1, 2).cuda())
                    quant[name + "_blocks"], quant[name + "_scales"] = b.cpu(), s.cpu()
                    p.copy_(mxfp4_dequant_ref(b, s, torch.float32).transpose(1, 2).cpu())
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    lean_sd = {k: v for k, v in sd.items() if k + "_blocks" not in quant} | quant
    model = lean.model_from_tensors(config, lean_sd, dtype=torch.bfloat16, device="cuda")
    assert model.config.windows == (128, 0, 128, 0) and (model.config.expert_quant == "mxfp4") == mxfp4
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lora.params.copy_(lora.params + 0.02 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    docs = _docs(rng, model.config.vocab, 512, mean=150)
    lora.zero_grad()
    batch = lean.pack(docs, max_tokens=512, device="cuda")
    loss, n = lean.forward_backward(model, lora, batch)
    ours = {k: v.cpu() for k, v in lora.grad_state_dict().items()}
    loss = loss.cpu()
    tokens = lean_token_losses(model, lora, batch).cpu()
    lora_cpu = lean.LoRA.init(lean.model_from_tensors(config, {k: v for k, v in sd.items()}, dtype=torch.float32,
                                                      device="cpu"), r=16, alpha=32, seed=seed)
    lora_cpu.params.copy_(lora.params.cpu())
    lora_cpu.sync_lowp()
    del model, lora
    torch.cuda.empty_cache()  # HF's fp32 step with PEFT's expert deltas needs the room
    ref_loss, ref_n, ref_grads, ref_tokens = _hf_step(hf.cuda(), lora_cpu, docs)
    del hf
    torch.cuda.empty_cache()
    hf16 = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager")
    hf16.load_state_dict(sd)
    for p in hf16.parameters():
        p.data = p.data.to(torch.bfloat16)
    lp_loss, _, lp_grads, lp_tokens = _hf_step(hf16.cuda().eval(), lora_cpu, docs)
    assert n == ref_n
    v = check_step_loss(loss, tokens, ref_tokens, lp_tokens)
    print(v.text, f"(summed: lean {loss.item():.4f}, HF bf16 {lp_loss.item():.4f}, HF fp32 {ref_loss.item():.4f})")
    worst = []
    for k, ref in ref_grads.items():
        v = l2_rule(ours[k], ref, lp_grads[k], name=k)
        worst.append((v.err - v.bound, v.text))
        assert v.ok, v.text
    print(sorted(worst)[-3:])


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpt_oss_graph_step_equals_eager_and_makes_no_sync(mxfp4):
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model, random_mxfp4_

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T, D = 1024, 12
    config = dict(oss20b(2), quantization_config=PRESETS["gpt-oss-20b-mxfp4"]["quantization_config"]) if mxfp4 \
        else oss20b(2)
    model = empty_model(config_from_hf(config), torch.bfloat16, "cuda")
    assert (model.config.expert_quant == "mxfp4") == mxfp4
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, t in model.hf_tensors():
        if t.dtype == torch.uint8:
            random_mxfp4_(t, name, g)
            continue
        noise = torch.randn(t.shape, generator=g, device="cuda")
        t.copy_(1.0 + 0.1 * noise if t.dim() == 1 and t.shape[0] == model.config.hidden else 0.02 * noise)
    state = None
    pairs = []
    for _ in range(2):
        lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
        if state is None:
            state = (lora.params + 0.02 * torch.randn(lora.numel, generator=g, device="cuda")).clone()
        lora.params.copy_(state)
        lora.sync_lowp()
        pairs.append((lora, lean.AdamW(lora, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)))
    (lora_e, opt_e), (lora_g, opt_g) = pairs
    graph = lean.StepGraph(model, lora_g, opt_g, budget=T, max_docs=D)
    for i in range(3):
        docs = _docs(rng, model.config.vocab, int(rng.integers(T // 2, T)), mean=200)[:D - 1]
        lora_e.zero_grad()
        with tma_at_every_size():
            loss_e, n_e = lean.forward_backward(model, lora_e, lean.pack(docs, T, pad_to=T, max_docs=D, device="cuda"))
        opt_e.step(lr=1e-3)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss_g, n_g = graph.step(graph.pack(docs), lr=1e-3)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert n_g == n_e
        assert torch.equal(loss_g, loss_e), f"step {i}: loss {loss_g.item()} vs eager {loss_e.item()}"
        assert torch.equal(lora_g.grads, lora_e.grads) and torch.equal(lora_g.params, lora_e.params), f"step {i}"
