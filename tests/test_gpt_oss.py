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


@pytest.mark.parametrize("E,K", [(4, 2), (8, 2)])
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
