"""GPT-OSS end to end against HF transformers + PEFT (CPU, float32): sinks, sliding-window and full
layers, YaRN, biased attention, the biased router (top-k then softmax), biased experts stored
(E, in, out) with interleaved gate/up and the clamped GLU; the loss and every LoRA gradient."""
import numpy as np
import pytest
import torch

import lean
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from tests.hf_models import build_hf
from tests.util import DEVICE, fresh_generator


def oss_config(E=4, K=2, window=5, layers=2, **kw):
    from transformers import GptOssConfig

    return GptOssConfig(**{**dict(
        hidden_size=64, intermediate_size=40, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=131, num_local_experts=E, num_experts_per_tok=K,
        sliding_window=window, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        dtype=torch.float32), **kw})


def _seed():
    return int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))


def _setup(tmp_path, config, seed, r=4, alpha=8):
    hf = build_hf("gpt_oss", seed, config=config)
    with torch.no_grad():  # draw what HF initialises to zero or one: router, sinks, expert biases
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.router.weight", "self_attn.sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith(("_bias", "router.bias")):
                p.normal_(0.0, 0.1)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "model")
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=r, alpha=alpha, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in lora.layers:
        for ad in layer.values():
            ad.b.copy_(torch.randn(ad.b.shape, generator=g) * 0.05)
    lora.sync_lowp()
    return hf, model, lora


def _rel_max(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("E,K", [(8, 2)])  # E 4: the adapters test below
def test_gpt_oss_step_matches_hf_peft(tmp_path, E, K):
    seed = _seed()
    rng = np.random.default_rng(seed)
    hf, model, lora = _setup(tmp_path, oss_config(E, K), seed)
    assert model.config.windows == (5, 0) and model.config.sinks
    lens = [int(x) for x in rng.integers(6, 20, 3)] + [1, 2]  # longer than the window, and length 1
    docs = [rng.integers(0, model.config.vocab, n).tolist() for n in lens]
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=96, device=DEVICE))
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert n == ref_n
    assert abs(loss_sum.item() - ref_sum.item()) <= 1e-5 * abs(ref_sum.item()), (loss_sum.item(), ref_sum.item())
    grads = lora.grad_state_dict()
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    assert any("experts" in k for k in ref_grads)
    bad = {}
    for k, ref in ref_grads.items():
        assert ref.abs().max() > 0, k
        err = _rel_max(grads[k], ref)
        if err > 1e-4:
            bad[k] = err
    assert not bad, f"seed {seed}: {bad}"


def test_gpt_oss_adapters_both_ways_merge_and_generate(tmp_path):
    """lean's adapter loads in PEFT with equal logits (target_parameters on the (E, in, out) experts),
    PEFT's file loads in lean, the merge (experts += scale (B A)^T) loads in transformers with the
    PEFT model's logits, and generation through the cache (sinks, window) equals a cache-free forward."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lean.runtime.generate import generate
    from lean.runtime.merge import merge_and_save

    seed = _seed()
    rng = np.random.default_rng(seed)
    hf, model, lora = _setup(tmp_path, oss_config(4, 2, window=3), seed)
    docs = [rng.integers(0, model.config.vocab, n).tolist() for n in (11, 6)]
    logits = lean.forward(model, lora, lean.pack(docs, max_tokens=32, device=DEVICE))
    lora.save(tmp_path / "ad")
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32),
                                   tmp_path / "ad")
    with torch.no_grad():
        ref = torch.cat([pm(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert _rel_max(logits, ref) <= 1e-5
    pm.save_pretrained(tmp_path / "ad_peft")
    back = lean.LoRA.load(model, tmp_path / "ad_peft")
    for k, v in lora.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    merged = AutoModelForCausalLM.from_pretrained(merge_and_save(model, lora, tmp_path / "merged", dtype="float32"),
                                                  dtype=torch.float32)
    with torch.no_grad():
        mref = torch.cat([merged(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert _rel_max(mref, ref) <= 1e-5
    prompt, steps = docs[0][:7], []
    out = generate(model, lora, prompt, max_new_tokens=5, on_logits=lambda i, lg: steps.append(lg.clone()))
    seq = prompt + out
    full = lean.forward(model, lora, lean.pack([seq], max_tokens=len(seq), device=DEVICE))
    for i, lg in enumerate(steps):  # positions past the window of 3: the cache's window is exercised
        assert _rel_max(lg[0], full[len(prompt) - 1 + i]) <= 1e-5, f"step {i}"
