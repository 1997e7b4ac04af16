"""The step on real model configs (random init) in bf16 on the GPU, and the step's house rules:
zero host syncs, and torch dispatching no compute op (it only holds tensors)."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lean
import lean.kernels.arch as A
from lean.kernels import attention, gemm, gemm_splitk, lora_linear_pre
from lean.kernels.gemm import tma_at_every_size
from lean.models.config import config_from_hf
from lean.models.weights import empty_model
from lean.reference.hf_peft import hf_loss_and_grads, lean_token_losses, peft_wrap
from lean.reference.rule import l2_rule
from tests.hf_models import build_hf, tiny_config
from tests.util import DEVICE, check_step_loss, fresh_generator

QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
LLAMA_32_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)

LLAMA_32_3B_2L = dict(LLAMA_32_1B, hidden_size=3072, num_hidden_layers=2, num_attention_heads=24, head_dim=128)


def _docs(rng, vocab, total, mean=256):
    docs, left = [], total
    while left > 0:
        n = min(left, max(1, int(rng.exponential(mean))))
        docs.append(rng.integers(0, vocab, n).tolist())
        left -= n
    return docs


def _params_to(module, dtype):
    """Cast a module's parameters only: Module.to(dtype) would also round its float buffers (RoPE's
    inv_freq), and the bf16 reference would then carry a frequency error that grows with the position
    into "torch's own bf16 error"."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("config", [QWEN3_06B, LLAMA_32_1B], ids=["qwen3-0.6b", "llama-3.2-1b"])
def test_step_bf16_real_configs(config):
    """lean bf16 vs HF+PEFT fp32 (the reference) and HF+PEFT bf16 (torch's own bf16 error):
    lean's relative error (L2) must be within 2x torch's bf16 error + 1e-3, for the loss and every
    LoRA gradient."""
    seed = int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))
    rng = np.random.default_rng(seed)
    _bf16_step_within_the_rule(config, seed, lambda vocab: _docs(rng, vocab, 2048), 2048)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_step_bf16_one_8192_token_document_llama_3b_shape():
    """One document of 8192 tokens (positions up to 8191, where a bf16-rounded inv_freq would be far
    off) on Llama-3.2-3B's shapes cut to 2 layers: the same rule, the reference's buffers in fp32."""
    seed = int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))
    rng = np.random.default_rng(seed)
    _bf16_step_within_the_rule(LLAMA_32_3B_2L, seed, lambda vocab: [rng.integers(0, vocab, 8192).tolist()], 8192)


def _bf16_step_within_the_rule(config, seed, make_docs, max_tokens):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    sd = {k: v for k, v in hf.state_dict().items()}
    model = lean.model_from_tensors(config, sd, dtype=torch.bfloat16, device="cuda")
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lora.params.copy_(lora.params + 0.02 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    docs = make_docs(model.config.vocab)
    batch = lean.pack(docs, max_tokens=max_tokens, device="cuda")
    lora.zero_grad()
    loss, n = lean.forward_backward(model, lora, batch)
    ours = {k: v.clone() for k, v in lora.grad_state_dict().items()}
    tokens = lean_token_losses(model, lora, batch)

    pm = peft_wrap(hf.cuda(), lora)
    ref_loss, ref_n, ref_grads, ref_tokens = hf_loss_and_grads(pm, docs, device="cuda", token_losses=True)
    hf16 = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    hf16.load_state_dict(sd)
    pm16 = peft_wrap(_params_to(hf16, torch.bfloat16).cuda().eval(), lora)  # PEFT keeps the adapters in fp32
    assert all(b.dtype == torch.float32 for b in pm16.buffers() if b.is_floating_point())
    lp_loss, _, lp_grads, lp_tokens = hf_loss_and_grads(pm16, docs, device="cuda", token_losses=True)
    assert n == ref_n
    v = check_step_loss(loss, tokens, ref_tokens, lp_tokens)
    print(v.text, f"(summed: lean {loss.item():.4f}, HF bf16 {lp_loss.item():.4f}, HF fp32 {ref_loss.item():.4f})")
    worst = []
    for k, ref in ref_grads.items():
        v = l2_rule(ours[k], ref, lp_grads[k], name=k)
        worst.append((v.err - v.bound, v.text))
        assert v.ok, v.text
    print(sorted(worst)[-3:])


@pytest.mark.gpu
def test_step_makes_no_host_sync(tmp_path):
    hf = build_hf("qwen3", 0)
    model = lean.model_from_tensors(tiny_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]},
                                    hf.state_dict(), dtype=torch.bfloat16, device="cuda")
    lora = lean.LoRA.init(model, r=8, alpha=16, dropout=0.1, seed=0)
    opt = lean.AdamW(lora, lr=1e-3)
    rng = np.random.default_rng(0)
    batch = lean.pack(_docs(rng, model.config.vocab, 200, mean=30), max_tokens=256, device="cuda")
    lean.forward_backward(model, lora, batch)  # warm-up: compiles kernels, builds per-model tables
    opt.step()
    torch.cuda.synchronize()
    batch = lean.pack(_docs(rng, model.config.vocab, 200, mean=30), max_tokens=256, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora.zero_grad()
        loss, _ = lean.forward_backward(model, lora, batch)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).all()


# aten ops that only allocate, view, copy or fill: what a tensor container does.
CONTAINER_OPS = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros", "zeros_like",
    "view", "_unsafe_view", "as_strided", "slice", "select", "t", "transpose", "permute", "reshape",
    "unsqueeze", "squeeze", "expand", "alias", "detach", "unbind", "split", "narrow",
    "copy_", "fill_", "zero_", "clone", "_to_copy", "lift_fresh", "_pin_memory", "is_pinned",
    "contiguous", "set_", "resize_", "_local_scalar_dense",
}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_step_dispatches_no_torch_compute_op():
    """Record every aten op the step dispatches: only allocation, views, copies and fills."""
    hf = build_hf("qwen2", 1)
    cfg = tiny_config("qwen2").to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    model = lean.model_from_tensors(cfg, hf.state_dict(), dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=4, alpha=8, dropout=0.1, seed=0)
    opt = lean.AdamW(lora, lr=1e-3)
    batch = lean.pack([[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=16, device=DEVICE)
    with OpRecorder() as rec:
        lora.zero_grad()
        lean.forward_backward(model, lora, batch)
        opt.step()
    compute = sorted(set(rec.ops) - CONTAINER_OPS)
    assert rec.ops, "the recorder saw nothing: the test would be vacuous"
    assert not compute, f"torch did compute inside the step: {compute}"


@pytest.mark.gpu
@pytest.mark.parametrize("portable", [False, True], ids=["arch-path", "portable"])
def test_step_takes_the_arch_tables_path(portable, monkeypatch):
    """A captured-style step (tma_at_every_size) on the Qwen3-0.6B config builds TMA descriptors
    exactly when the arch table says the GPU takes the Hopper path: none under portable() (the code
    an RTX card runs), some on an H100 otherwise."""
    made = []
    for mod in (gemm, gemm_splitk, lora_linear_pre, attention):
        real = mod.tma_desc
        monkeypatch.setattr(mod, "tma_desc", lambda t, block, real=real: made.append(1) or real(t, block))
    cfg = dict(QWEN3_06B, num_hidden_layers=2)
    model = empty_model(config_from_hf(cfg), torch.bfloat16, DEVICE)
    g = fresh_generator()
    for _, t in model.hf_tensors():
        t.normal_(1.0 if t.dim() == 1 else 0.0, 0.1 if t.dim() == 1 else 0.02, generator=g)
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=0)
    batch = lean.pack(_docs(np.random.default_rng(0), cfg["vocab_size"], 4096), max_tokens=4096, device=DEVICE)
    with A.portable(False):
        arch_has_tma = A.arch().tma  # this GPU's row, or the one LEAN_ARCH emulates
    with A.portable(portable), tma_at_every_size():
        takes_tma = A.arch().tma
        loss, n = lean.forward_backward(model, lora, batch)
    torch.cuda.synchronize()
    assert torch.isfinite(loss).all()
    if portable or not arch_has_tma:
        assert not takes_tma and not made, f"{len(made)} TMA descriptors built on the portable path"
    else:
        assert takes_tma and made, "the Hopper path built no TMA descriptor"
