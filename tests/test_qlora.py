"""QLoRA: models held in NF4 (quantised at load, or read from bitsandbytes' 4-bit layout), their LoRA
step against HF + PEFT on the same dequantised weights (CPU, float32), and the loader's refusals."""
import json

import numpy as np
import pytest
import torch

import lean
import lean.kernels.nf4 as nf4mod
from lean.kernels.nf4 import Nf4
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from lean.runtime.loader import ModelLoadError
from tests.hf_models import build_hf, tiny_config
from tests.test_step import _rel_max
from tests.util import DEVICE, fresh_seed


def _hf(arch, seed):
    cfg = tiny_config(arch)
    cfg.intermediate_size = 128  # every projection's input width a multiple of the NF4 block (64)
    return build_hf(arch, seed, config=cfg)


def _on_dequantised(hf, model, seed, r=8, alpha=16):
    """hf's projection weights set to model's NF4 ones, dequantised (fp32), and a LoRA of model with
    B drawn (PEFT inits it at zero: every dA then non-trivial). Returns the number of weights set."""
    params = dict(hf.named_parameters())
    n = 0
    with torch.no_grad():
        for name, t in model.hf_tensors(dequantised=True):
            if name.endswith("_proj.weight"):
                assert not torch.equal(params[name].cpu(), t.cpu())  # quantised: not the float weight
                params[name].copy_(t)
                n += 1
    lora = lean.LoRA.init(model, r=r, alpha=alpha, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in lora.layers:
        for ad in layer.values():
            ad.b.copy_(torch.randn(ad.b.shape, generator=g) * 0.05)
    lora.sync_lowp()
    return lora, n


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_qlora_step_matches_hf_peft(tmp_path, arch, fused, monkeypatch):
    """load_model(quant="nf4") holds the seven projections in NF4; its LoRA step (fused NF4 decode
    or the scratch copy) equals HF + PEFT's on the dequantised weights: loss 1e-5, every grad 1e-4."""
    monkeypatch.setattr(nf4mod, "FUSED", fused)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf = _hf(arch, seed)
    hf.save_pretrained(tmp_path / "model")
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE, quant="nf4")
    assert model.config.weight_quant == "nf4"
    for layer in model.layers:
        assert all(isinstance(getattr(layer, t), Nf4) for t in ("q", "k", "v", "o", "gate", "up", "down"))
    lora, n = _on_dequantised(hf, model, seed)
    assert n == 7 * model.config.n_layers
    docs = [rng.integers(0, model.config.vocab, int(k)).tolist() for k in rng.integers(1, 24, 4)] + [[5]]
    batch = lean.pack(docs, max_tokens=128, device=DEVICE)
    lora.zero_grad()
    loss_sum, n_tok = lean.forward_backward(model, lora, batch)
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert n_tok == ref_n
    assert abs(loss_sum.item() - ref_sum.item()) <= 1e-5 * abs(ref_sum.item())
    grads = lora.grad_state_dict()
    assert set(grads) == set(ref_grads)
    for k, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{k}: reference gradient is zero, test would be vacuous"
        err = _rel_max(grads[k], ref)
        assert err <= 1e-4, f"{k}: relative error {err:.2e}"


def _write_bnb(folder, model, src, dense=(), drop=None, state_edit=None):
    """A checkpoint in bitsandbytes' 4-bit layout (the names and shapes QuantState.as_dict(packed=True)
    gives, as transformers saves a load_in_4bit model) of `model`'s NF4 projections, the other
    tensors from src's checkpoint; `dense` projections (HF module names) kept in src's dtype."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    for li, layer in enumerate(model.layers):
        for t, m in lean.models.weights.PROJECTIONS:
            name = f"model.layers.{li}.{m}"
            if name in dense:
                continue
            q = getattr(layer, t)
            O, K = q.shape
            tensors[f"{name}.weight"] = q.packed.reshape(-1, 1).cpu().clone()
            tensors[f"{name}.weight.absmax"] = q.absmax.cpu().clone()
            tensors[f"{name}.weight.quant_map"] = q.code.cpu().clone()
            tensors[f"{name}.weight.nested_absmax"] = q.absmax2.cpu().clone()
            tensors[f"{name}.weight.nested_quant_map"] = q.code2.cpu().clone()
            state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [O, K],
                     "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": q.offset.item()}
            if state_edit:
                state_edit(state)
            tensors[f"{name}.weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()),
                                                                                   dtype=torch.uint8)
    if drop:
        del tensors[drop]
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_prequantised_checkpoint(tmp_path):
    """A checkpoint in bitsandbytes' layout loads as NF4 without quant=, the same bits as quantising at
    load; a projection stored in float stays dense (quant_dense); missing parts, FP4 and a mismatched
    quant state are refused by name."""
    hf = _hf("qwen3", fresh_seed())
    hf.save_pretrained(tmp_path / "src")
    ref = lean.load_model(tmp_path / "src", dtype=torch.float32, device=DEVICE, quant="nf4")
    keep = "model.layers.1.mlp.down_proj"
    _write_bnb(tmp_path / "bnb", ref, tmp_path / "src", dense=(keep,))
    got = lean.load_model(tmp_path / "bnb", dtype=torch.float32, device=DEVICE)
    assert got.config.weight_quant == "nf4" and got.config.quant_dense == (keep,)
    for li, (a, b) in enumerate(zip(ref.layers, got.layers)):
        for t in ("q", "k", "v", "o", "gate", "up", "down"):
            if li == 1 and t == "down":
                assert isinstance(getattr(b, t), torch.Tensor)
                assert torch.equal(b.down.cpu(), hf.model.layers[1].mlp.down_proj.weight.detach())
                continue
            for x, y in zip(getattr(a, t)[:6], getattr(b, t)[:6]):
                assert torch.equal(x, y), (li, t)
    _write_bnb(tmp_path / "missing", ref, tmp_path / "src", drop="model.layers.0.self_attn.k_proj.weight.absmax")
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\): model.layers.0.self_attn.k_proj.weight.absmax"):
        lean.load_model(tmp_path / "missing", dtype=torch.float32, device=DEVICE)
    _write_bnb(tmp_path / "block", ref, tmp_path / "src", state_edit=lambda s: s.update(shape=[1, 2]))
    with pytest.raises(ModelLoadError, match="describes"):
        lean.load_model(tmp_path / "block", dtype=torch.float32, device=DEVICE)
    _write_bnb(tmp_path / "single", ref, tmp_path / "src", state_edit=lambda s: s.pop("nested_offset"))
    with pytest.raises(ModelLoadError, match="without double quantisation"):
        lean.load_model(tmp_path / "single", dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="quant='int8'"):
        lean.load_model(tmp_path / "src", dtype=torch.float32, device=DEVICE, quant="int8")


def test_refuses_widths_off_the_block(tmp_path):
    """intermediate_size 96 is no multiple of 64: --load-in-4bit says so before loading."""
    build_hf("llama", fresh_seed()).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="intermediate 96"):
        lean.load_model(tmp_path / "m", dtype=torch.float32, device=DEVICE, quant="nf4")


def test_lean_train_load_in_4bit_and_merge(tmp_path, capsys):
    """lean-train --load-in-4bit trains on the NF4 model and --merge writes the dequantised base plus
    the adapter in the model dtype, without quantization_config, and says so."""
    from safetensors import safe_open

    from lean.cli import main
    from tests.test_train import _records, _write_tokenizer

    seed = fresh_seed()
    _hf("llama", seed).save_pretrained(tmp_path / "model")
    _write_tokenizer(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(np.random.default_rng(seed))))
    out = tmp_path / "run"
    rc = main(["--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out), "--steps", "2",
               "--max-tokens", "64", "--r", "2", "--save-every", "0", "--quiet", "--device", "cpu",
               "--load-in-4bit", "--merge"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "NF4 projections were dequantised" in text.out
    cfg = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE, quant="nf4")
    lora = lean.LoRA.load(model, out / "adapter")
    with safe_open(str(out / "merged" / "model.safetensors"), framework="pt") as f:
        merged = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    ad = lora.layers[0]["q"]
    want = model.layers[0].q.dense().cpu() + lora.scale * (ad.b.cpu() @ ad.a.cpu())
    assert merged.dtype == torch.float32 and torch.allclose(merged, want, rtol=1e-5, atol=1e-6)
    state = json.loads((out / "checkpoint" / "state.json").read_text()) if (out / "checkpoint").exists() else None
    assert state is None or state["config"]["quant"] == "nf4"


def test_qlora_moe_step_matches_hf_peft(tmp_path):
    """Qwen3-MoE with quant="nf4": an MoE layer's q, k, v, o in NF4 (its experts in fp32), a dense layer's
    seven projections in NF4; the step against HF + PEFT on the dequantised weights."""
    from tests.test_moe import _compare, moe_config

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf = build_hf("qwen3_moe", seed, config=moe_config(4, 2, True, [1], intermediate_size=128))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "model")
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE, quant="nf4")
    assert isinstance(model.layers[0].q, Nf4) and isinstance(model.layers[0].gate_up, torch.Tensor)
    assert isinstance(model.layers[1].down, Nf4)
    lora, _ = _on_dequantised(hf, model, seed, r=4, alpha=8)
    docs = [rng.integers(0, model.config.vocab, int(k)).tolist() for k in (7, 1, 30, 12)]
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=64, device=DEVICE))
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert _compare(lora, loss_sum, n, ref_sum, ref_n, ref_grads) == {}


def test_qlora_gpt_oss_mxfp4_step_matches_hf_peft(tmp_path):
    """gpt-oss with its experts in MXFP4 and quant="nf4": q, k, v, o (biased) in NF4 beside the MXFP4
    tensors in one qbuf; the step against HF + PEFT on the dequantised weights."""
    from lean.models.weights import Mxfp4
    from tests.test_gpt_oss import _setup as oss_setup
    from tests.test_gpt_oss import oss_config

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf, _, _ = oss_setup(tmp_path, oss_config(5, 2, intermediate_size=64), seed, mxfp4=True)
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE, quant="nf4")
    assert isinstance(model.layers[0].q, Nf4) and isinstance(model.layers[0].gate_up, Mxfp4)
    lora, _ = _on_dequantised(hf, model, seed, r=4, alpha=8)
    docs = [rng.integers(0, model.config.vocab, n).tolist() for n in (9, 1, 17)]
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=64, device=DEVICE))
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert n == ref_n and abs(loss_sum.item() - ref_sum.item()) <= 1e-5 * abs(ref_sum.item())
    grads = lora.grad_state_dict()
    bad = {k: e for k, ref in ref_grads.items() if (e := _rel_max(grads[k], ref)) > 1e-4}
    assert not bad, f"seed {seed}: {bad}"
