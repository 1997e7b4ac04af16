"""QLoRA on the GPU: a bitsandbytes 4-bit checkpoint saved by transformers loads in lean bit for bit;
lean's own quantisation at load gives the same packed codes and an offset within 8 ulps of
bitsandbytes' (given bitsandbytes' offset, every byte); the bf16 step on it (fused NF4 decode and
scratch copy) is within 2x the error of HF + PEFT on the same bnb-4bit model, both against the fp32
step on the dequantised weights. The step makes no host sync and replays from a CUDA graph."""
import numpy as np
import pytest
import torch

import lean
import lean.kernels.nf4 as nf4mod
from lean.kernels.nf4 import Nf4, empty_nf4, nf4_quantize
from lean.models.weights import PROJECTIONS
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from lean.reference.rule import l2_rule
from tests.test_step_gpu import LLAMA_32_1B, _docs
from tests.util import fresh_seed

QWEN3_8B_4L = dict(  # Qwen3-8B's shapes, 4 of its 36 layers
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


def _bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", [LLAMA_32_1B, QWEN3_8B_4L], ids=["llama-3.2-1b", "qwen3-8b-4-layers"])
def test_qlora_step_bf16_against_bnb(tmp_path, config, monkeypatch):
    """(HF's side runs once; lean's step both ways: nf4.FUSED True and False.)"""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoConfig, AutoModelForCausalLM

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("cuda"):  # random init on the GPU (minutes on the host at these sizes)
        hf16 = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    hf16.save_pretrained(tmp_path / "bf16")
    sd16 = {k: v.cpu() for k, v in hf16.state_dict().items()}
    del hf16
    hfq = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=_bnb_config(),
                                               dtype=torch.bfloat16, device_map="cuda").eval()
    hfq.save_pretrained(tmp_path / "bnb")

    model = lean.load_model(tmp_path / "bnb", dtype=torch.bfloat16, device="cuda")  # bitsandbytes' own bytes
    assert model.config.weight_quant == "nf4" and model.config.quant_dense == ()
    own = lean.load_model(tmp_path / "bf16", dtype=torch.bfloat16, device="cuda", quant="nf4")  # lean's quantiser
    for li, (a, b) in enumerate(zip(model.layers, own.layers)):
        for t, m in PROJECTIONS:
            qa, qb = getattr(a, t), getattr(b, t)
            assert isinstance(qa, Nf4) and torch.equal(qa.packed, qb.packed), t
            assert torch.equal(qa.code, qb.code) and torch.equal(qa.code2, qb.code2)
            # lean's offset (a float64 mean) against bitsandbytes' (torch.mean's float32 tree sum)
            assert abs(qa.offset.view(torch.int32).item() - qb.offset.view(torch.int32).item()) <= 8, t
            redo = empty_nf4(*qa.shape, "cuda")  # lean's quantiser given bitsandbytes' offset: its bytes
            nf4_quantize(redo, sd16[f"model.layers.{li}.{m}.weight"].cuda(), offset=qa.offset)
            for x, y in zip(redo[:4], qa[:4]):  # packed, absmax, absmax2, offset
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (li, t)
    del own

    lora = lean.LoRA.init(model, r=16, alpha=32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lora.params.copy_(lora.params + 0.02 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    docs = _docs(rng, model.config.vocab, 2048)
    batch = lean.pack(docs, max_tokens=2048, device="cuda")
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(nf4mod, "FUSED", fused)
        lora.zero_grad()
        loss, n = lean.forward_backward(model, lora, batch)
        runs[fused] = (loss.clone(), {k: v.clone() for k, v in lora.grad_state_dict().items()})

    # the reference: fp32 on the dequantised projections (the rest as stored, widened)
    with torch.device("cuda"):
        ref = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = {k: v.float() for k, v in sd16.items()}
    sd.update({name: t for name, t in model.hf_tensors(dequantised=True) if name.endswith("_proj.weight")})
    ref.load_state_dict(sd)
    ref_loss, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(ref.eval(), lora), docs, device="cuda")
    del ref
    pm = peft_wrap(hfq, lora)
    lp_loss, _, lp_grads = hf_loss_and_grads(pm, docs, device="cuda")  # HF + PEFT on bnb-4bit
    assert n == ref_n
    # lean's saved adapter loads on the bnb-4bit checkpoint in PEFT and gives PEFT's own logits
    from peft import PeftModel

    lora.save(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "bnb", device_map="cuda"),
                                       tmp_path / "adapter").eval()
    ids = torch.tensor([docs[0][:64]], device="cuda")
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits.float(), pm(input_ids=ids).logits.float()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()  # the same model: equal up to kernel choice
    del loaded
    for fused, (loss, ours) in runs.items():
        v = l2_rule(loss.reshape(1), ref_loss.reshape(1), lp_loss.reshape(1), name=f"loss (fused {fused})")
        assert v.ok, v.text
        worst = []
        for k, r in ref_grads.items():
            v = l2_rule(ours[k], r, lp_grads[k], name=f"{k} (fused {fused})")
            worst.append((v.err - v.bound, v.text))
            assert v.ok, v.text
        print(sorted(worst)[-3:])


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_qlora_step_no_sync_and_graph(tmp_path, fused, monkeypatch):
    """An NF4 model's step under set_sync_debug_mode("error"), and its StepGraph replay equal to the
    eager step bit for bit."""
    from tests.hf_models import build_hf, tiny_config

    monkeypatch.setattr(nf4mod, "FUSED", fused)
    cfg = tiny_config("qwen3")
    cfg.intermediate_size, cfg.hidden_size = 256, 128
    build_hf("qwen3", 0, config=cfg).save_pretrained(tmp_path / "m")
    model = lean.load_model(tmp_path / "m", dtype=torch.bfloat16, device="cuda", quant="nf4")
    lora = lean.LoRA.init(model, r=16, alpha=32, seed=0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, model.config.vocab, int(k)).tolist() for k in (100, 1, 300, 111)]
    batch = lean.pack(docs, max_tokens=512, device="cuda")
    lean.forward_backward(model, lora, batch)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora.zero_grad()
        lean.forward_backward(model, lora, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt = lean.AdamW(lora, lr=1e-3)
    graph = lean.StepGraph(model, lora, opt, budget=512, max_docs=64)
    state = [lora.params, opt.m, opt.v]
    saved, count = [t.clone() for t in state], opt.step_count
    loss_g, _ = graph.step(graph.pack(docs))
    params_g = lora.params.clone()
    for t, s in zip(state, saved):
        t.copy_(s)
    lora.sync_lowp()
    opt.step_count = count
    from lean.kernels.gemm import tma_at_every_size

    lora.zero_grad()
    with tma_at_every_size():  # the kernels StepGraph captured
        loss_e, _ = lean.forward_backward(model, lora, lean.pack(docs, 512, pad_to=512, max_docs=64, device="cuda"),
                                          seed=0)
    opt.step()
    assert torch.equal(loss_g, loss_e) and torch.equal(params_g, lora.params)
