"""QLoRA: models held in NF4 (quantised at load, or read from bitsandbytes' 4-bit layout), their LoRA
step against HF + PEFT on the same dequantised weights (CPU, float32), and the loader's refusals."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import lean
import lean.kernels.nf4 as nf4mod
from lean.kernels.nf4 import Nf4, empty_nf4, nf4_quantize
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from lean.runtime.loader import NF4_STATE, ModelLoadError
from tests.hf_models import build_hf, tiny_config
from tests.test_moe import _compare
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
    # one 24-token document always: short draws alone (every length <= 2) leave q and k no gradient
    docs = [rng.integers(0, model.config.vocab, int(k)).tolist() for k in [*rng.integers(1, 24, 3), 24]] + [[5]]
    batch = lean.pack(docs, max_tokens=128, device=DEVICE)
    lora.zero_grad()
    loss_sum, n_tok = lean.forward_backward(model, lora, batch)
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert _compare(lora, loss_sum, n_tok, ref_sum, ref_n, ref_grads) == {}


def _nf4_weights(model):
    """{HF module name: Nf4} of model's NF4 projections."""
    return {module: getattr(model.layers[li], t) for li in range(model.config.n_layers)
            for t, module, _ in lean.models.weights.nf4_projections(model.config, li)}


def _write_bnb(folder, weights, src, state_edit=None, edit=None):
    """A checkpoint in bitsandbytes' 4-bit layout (the names and shapes QuantState.as_dict(packed=True)
    gives, as transformers saves a load_in_4bit model) of `weights` ({module: Nf4}), every other
    tensor from src's checkpoint (a projection not in weights stays in src's dtype). state_edit(state)
    changes each quant state's JSON object, edit(tensors) the tensors, before they are written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    for name, q in weights.items():
        O, K = q.shape
        tensors[f"{name}.weight"] = q.packed.reshape(-1, 1).cpu().clone()
        tensors[f"{name}.weight.absmax"] = q.absmax.cpu().clone()
        tensors[f"{name}.weight.quant_map"] = q.code.cpu().clone()
        tensors[f"{name}.weight.nested_absmax"] = q.absmax2.cpu().clone()
        tensors[f"{name}.weight.nested_quant_map"] = q.code2.cpu().clone()
        state = {"quant_type": "nf4", "blocksize": q.blocksize, "dtype": "float32", "shape": [O, K],
                 "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": q.offset.item()}
        if state_edit:
            state_edit(state)
        tensors[f"{name}.weight{NF4_STATE}"] = _json_bytes(state)
    if edit:
        edit(tensors)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True}
    (folder / "config.json").write_text(json.dumps(cfg))


def _json_bytes(obj):
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def _assert_same_nf4(a, b, what):
    assert a.blocksize == b.blocksize, what
    for x, y in zip(a[:6], b[:6]):  # packed, absmax, absmax2, offset, code2, code
        assert torch.equal(x.cpu(), y.cpu()), what


def test_prequantised_checkpoint(tmp_path):
    """A checkpoint in bitsandbytes' layout loads as NF4 without quant=, the same bits as quantising at
    load; a projection stored in float stays dense (quant_dense); packed bytes stored as bf16
    (bnb_4bit_quant_storage=bfloat16, FSDP-QLoRA's exports) load as the same bytes."""
    hf = _hf("qwen3", fresh_seed())
    hf.save_pretrained(tmp_path / "src")
    ref = lean.load_model(tmp_path / "src", dtype=torch.float32, device=DEVICE, quant="nf4")
    keep = "model.layers.1.mlp.down_proj"
    weights = _nf4_weights(ref)
    _write_bnb(tmp_path / "bnb", {m: q for m, q in weights.items() if m != keep}, tmp_path / "src")
    got = lean.load_model(tmp_path / "bnb", dtype=torch.float32, device=DEVICE)
    assert got.config.weight_quant == "nf4" and got.config.quant_dense == (keep,)
    for li, (a, b) in enumerate(zip(ref.layers, got.layers)):
        for t in ("q", "k", "v", "o", "gate", "up", "down"):
            if li == 1 and t == "down":
                assert isinstance(getattr(b, t), torch.Tensor)
                assert torch.equal(b.down.cpu(), hf.model.layers[1].mlp.down_proj.weight.detach())
                continue
            _assert_same_nf4(getattr(a, t), getattr(b, t), (li, t))

    def as_bf16(tensors):  # bitsandbytes' (n/4, 1) bf16 tensor of the same bytes
        for m in weights:
            tensors[f"{m}.weight"] = tensors[f"{m}.weight"].reshape(-1).view(torch.bfloat16).reshape(-1, 1).clone()

    _write_bnb(tmp_path / "bf16_storage", weights, tmp_path / "src", edit=as_bf16)
    got = _nf4_weights(lean.load_model(tmp_path / "bf16_storage", dtype=torch.float32, device=DEVICE))
    assert got.keys() == weights.keys()
    for m, q in got.items():
        _assert_same_nf4(weights[m], q, m)


@pytest.mark.parametrize("blocksize", [32, 128])
def test_prequantised_blocksizes(tmp_path, blocksize):
    """A checkpoint quantised in blocks of 32 or 128 (bnb_4bit_blocksize) loads in the file's blocksize,
    every part as written."""
    cfg = tiny_config("qwen3")
    cfg.hidden_size = cfg.intermediate_size = 128  # every input width a multiple of 128 (heads x head_dim 128)
    hf = build_hf("qwen3", fresh_seed(), config=cfg)
    hf.save_pretrained(tmp_path / "src")
    weights = {}
    for name, p in hf.named_parameters():
        if name.endswith("_proj.weight"):
            q = empty_nf4(*p.shape, DEVICE, blocksize)
            nf4_quantize(q, p.detach().to(DEVICE).contiguous())
            weights[name.removesuffix(".weight")] = q
    assert len(weights) == 7 * cfg.num_hidden_layers
    _write_bnb(tmp_path / "bnb", weights, tmp_path / "src")
    model = lean.load_model(tmp_path / "bnb", dtype=torch.float32, device=DEVICE)
    assert model.config.quant_block == blocksize and model.config.quant_dense == ()
    got = _nf4_weights(model)
    assert got.keys() == weights.keys()
    for m, q in got.items():
        _assert_same_nf4(weights[m], q, m)


def test_prequantised_refusals(tmp_path):
    """What lean cannot read from a bitsandbytes checkpoint is refused in one line naming it: FP4, a
    broken or missing quant state, a missing packed weight, quant states on modules lean does not hold
    in NF4 (the lm_head, transformers 4's per-expert projections: the check reads names only, so a
    dense model serves), packed bytes of the wrong size in another dtype, blocks wider than the rows."""
    hf = _hf("qwen3", fresh_seed())
    hf.save_pretrained(tmp_path / "src")
    weights = _nf4_weights(lean.load_model(tmp_path / "src", dtype=torch.float32, device=DEVICE, quant="nf4"))
    W = "model.layers.0.self_attn.k_proj.weight"
    parts = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", NF4_STATE)

    def fp4(tensors):
        for n in [n for n in tensors if n.endswith(NF4_STATE)]:
            tensors[n.replace("__nf4", "__fp4")] = tensors.pop(n)

    def stored_like_w(*modules):  # W's packed bytes and parts under other modules' names
        def edit(tensors):
            for m in modules:
                tensors[f"{m}.weight"] = tensors[W].clone()
                for s in parts:
                    tensors[f"{m}.weight{s}"] = tensors[W + s].clone()
        return edit

    def drop_states(tensors):
        for n in [n for n in tensors if n.endswith(NF4_STATE)]:
            del tensors[n]

    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj")]
    cases = {  # folder: (state_edit, edit, the error's words)
        "fp4": (lambda s: s.update(quant_type="fp4"), fp4, "holds bitsandbytes FP4 weights; lean reads NF4 only"),
        "shape": (lambda s: s.update(shape=[1, 2]), None, "describes"),
        "single": (lambda s: s.pop("nested_offset"), None, "without double quantisation"),
        "json": (None, lambda t: t.update({W + NF4_STATE: torch.tensor(list(b"{oops"), dtype=torch.uint8)}),
                 f"{W}{NF4_STATE} is not a bitsandbytes quant state"),
        "no_part": (None, lambda t: t.pop(W + ".absmax"), rf"missing 1 tensor\(s\): {W}\.absmax:"),
        "no_state": (None, lambda t: t.pop(W + NF4_STATE), rf"missing 1 tensor\(s\): {W}{NF4_STATE}:"),
        "no_states": (None, drop_states, f"{NF4_STATE} is missing"),
        "no_packed": (None, lambda t: t.pop(W), rf"missing 1 tensor\(s\): {W}:"),
        "lm_head": (None, stored_like_w("lm_head"), r"^lm_head is stored in NF4, but lean reads NF4 only for the "
                    r"attention and dense-MLP projections: load the bf16 model with --load-in-4bit"),
        "experts": (None, stored_like_w(*experts), rf"^{experts[0]} \(and 3 more\) is stored in NF4, but"),
        "storage": (None, lambda t: t.update({W: torch.zeros(32, 64, dtype=torch.bfloat16)}),
                    r"torch.bfloat16 \(32, 64\) beside an NF4 quant state, not the 1024 packed bytes of \(32, 64\) "
                    "in a bnb_4bit_quant_storage dtype"),
        "wide": (lambda s: s.update(blocksize=128), None,
                 "this checkpoint's NF4 blocks of 128 do not divide every projection's input width"),
    }
    for folder, (state_edit, edit, words) in cases.items():
        _write_bnb(tmp_path / folder, weights, tmp_path / "src", state_edit=state_edit, edit=edit)
        with pytest.raises(ModelLoadError, match=words):
            lean.load_model(tmp_path / folder, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="quant='int8'"):
        lean.load_model(tmp_path / "src", dtype=torch.float32, device=DEVICE, quant="int8")


def test_refuses_widths_off_the_block(tmp_path):
    """intermediate_size 96 is no multiple of 64: --load-in-4bit says so before loading."""
    build_hf("llama", fresh_seed()).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="intermediate 96"):
        lean.load_model(tmp_path / "m", dtype=torch.float32, device=DEVICE, quant="nf4")


def test_lean_train_load_in_4bit_and_merge(tmp_path, capsys):
    """lean-train --load-in-4bit trains on the NF4 model, its checkpoint records quant, and --merge writes
    the dequantised base plus the adapter in the model dtype and says so; merged from a bnb-4bit
    checkpoint of the same NF4 bytes, the same tensors, and config.json without its quantization_config."""
    from safetensors import safe_open

    from lean.cli import main, merge_run
    from lean.runtime.train import TrainConfig
    from tests.test_train import _records, _write_tokenizer

    seed = fresh_seed()
    _hf("llama", seed).save_pretrained(tmp_path / "model")
    _write_tokenizer(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(np.random.default_rng(seed))))
    out = tmp_path / "run"
    rc = main(["--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out), "--steps", "2",
               "--max-tokens", "64", "--r", "2", "--save-every", "1", "--quiet", "--device", "cpu",
               "--load-in-4bit", "--merge", "--sample-tokens", "0", "--heldout", "0"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "NF4 projections were dequantised" in text.out
    assert json.loads((out / "checkpoint" / "state.json").read_text())["config"]["quant"] == "nf4"
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE, quant="nf4")
    lora = lean.LoRA.load(model, out / "adapter")
    with safe_open(str(out / "merged" / "model.safetensors"), framework="pt") as f:
        merged = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    ad = lora.layers[0]["q"]
    want = model.layers[0].q.dense().cpu() + lora.scale * (ad.b.cpu() @ ad.a.cpu())
    assert merged.dtype == torch.float32 and torch.allclose(merged, want, rtol=1e-5, atol=1e-6)
    _write_bnb(tmp_path / "bnb", _nf4_weights(model), tmp_path / "model")
    assert "quantization_config" in json.loads((tmp_path / "bnb" / "config.json").read_text())
    path, what, dtype = merge_run(TrainConfig(model=str(tmp_path / "bnb"), data=str(data), out_dir=str(tmp_path / "m"),
                                              device="cpu"), out / "adapter")
    assert what == "NF4 projections" and dtype == "float32"
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), merged)


def test_qlora_moe_step_matches_hf_peft(tmp_path):
    """Qwen3-MoE with quant="nf4": an MoE layer's q, k, v, o in NF4 (its experts in fp32), a dense layer's
    seven projections in NF4; the step against HF + PEFT on the dequantised weights."""
    from tests.test_moe import moe_config

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
    assert _compare(lora, loss_sum, n, ref_sum, ref_n, ref_grads) == {}


def _random_nf4_model(config, arch, g):
    """lean's model of an HF config with its projections in NF4, drawn (no checkpoint): an Nf4 quantised
    from N(0, 0.02), MXFP4 experts as random_mxfp4_ draws them, every other tensor N(0, 0.02)."""
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model, random_mxfp4_

    cfg = config_from_hf(config.to_dict() | {"architectures": [arch]})
    model = empty_model(dataclasses.replace(cfg, weight_quant="nf4"), torch.float32, DEVICE)
    for name, t in model.hf_tensors():
        if isinstance(t, Nf4):
            nf4_quantize(t, (torch.randn(t.shape, generator=g) * 0.02).to(DEVICE))
        elif t.dtype == torch.uint8:
            random_mxfp4_(t, name, g)
        else:
            t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    return model


def _nf4_models():
    """(name, HF config, architecture) of three tiny NF4 models: dense, all-MoE, all-MoE with MXFP4 experts."""
    from tests.test_gpt_oss import oss_config
    from tests.test_moe import moe_config

    dense = tiny_config("qwen3")
    dense.intermediate_size = 128
    oss = oss_config(4, 2, intermediate_size=64)
    oss.quantization_config = {"quant_method": "mxfp4"}
    return [("qwen3", dense, "Qwen3ForCausalLM"),
            ("qwen3-moe", moe_config(4, 2, True, [], intermediate_size=256), "Qwen3MoeForCausalLM"),
            ("gpt-oss-mxfp4", oss, "GptOssForCausalLM")]


@pytest.mark.parametrize("case", range(3), ids=["qwen3", "qwen3-moe", "gpt-oss-mxfp4"])
def test_rate_weight_of_nf4_models(case):
    """The weight offload.measure_rates times its GEMM on: a 2-D (<= F, C) tensor of the model's own values
    in the model dtype: the dense gate dequantised; F rows of an all-MoE layer's gate_up; the NF4 q
    dequantised, then sliced, where the experts are MXFP4."""
    from lean.models.weights import Mxfp4
    from lean.runtime.offload import rate_weight

    name, config, arch = _nf4_models()[case]
    model = _random_nf4_model(config, arch, torch.Generator().manual_seed(fresh_seed()))
    C, F, layer = model.config.hidden, model.config.intermediate, model.layers[0]
    w = rate_weight(model)
    assert isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == C and w.dtype == model.dtype
    if name == "qwen3":
        assert isinstance(layer.gate, Nf4) and torch.equal(w, layer.gate.dense())
    elif name == "qwen3-moe":
        assert layer.gate is None and torch.equal(w, layer.gate_up.reshape(-1, C)[:F])
    else:
        assert isinstance(layer.gate_up, Mxfp4) and isinstance(layer.q, Nf4)
        assert torch.equal(w, layer.q.dense()[:F])
    assert w.shape[0] == min(F, w.shape[0]) > 0 and bool(w.abs().amax() > 0)


def test_nf4_scratch_bytes_prices_the_nf4_projections(monkeypatch):
    """The planner's NF4 scratch copy is the largest projection held in NF4: an all-MoE model's q, k, v,
    o (not its config's intermediate_size, which no NF4 projection has), a dense model's MLP."""
    from lean.models.config import config_from_hf
    from lean.runtime.plan_bytes import nf4_scratch_bytes

    monkeypatch.setattr(nf4mod, "FUSED", False)  # every shape through the scratch copy, as on a GPU
    for name, config, arch in _nf4_models()[:2]:
        cfg = config_from_hf(config.to_dict() | {"architectures": [arch]})
        assert nf4_scratch_bytes(cfg, 64, 2) == 0  # not in NF4
        cfg = dataclasses.replace(cfg, weight_quant="nf4")
        want = cfg.intermediate * cfg.hidden if name == "qwen3" else cfg.q_dim * cfg.hidden
        assert nf4_scratch_bytes(cfg, 64, 2) == 2 * want, name
    assert cfg.intermediate * cfg.hidden > want  # the MoE case tells the two apart


def test_rates_measured_once_per_token_count(monkeypatch):
    """plan_for measures the machine's rates once per model and token count: early_plan's measurement
    serves lean-train's plan_for after it. (Measuring runs on a GPU only: the model here claims to be
    on one, and the measurement is counted, not run.)"""
    from lean.runtime import offload
    from lean.runtime.lora import TARGETS
    from lean.runtime.plan import DEFAULT_RATES
    from lean.runtime.planner import early_plan, plan_for

    name, config, arch = _nf4_models()[0]
    model = _random_nf4_model(config, arch, torch.Generator().manual_seed(fresh_seed()))
    calls = []
    monkeypatch.setattr(offload, "measure_rates", lambda m, n: calls.append(n) or DEFAULT_RATES)
    on_gpu = dataclasses.replace(model, device=torch.device("cuda"))
    early_plan(on_gpu, 4, TARGETS, 0.0, 64, 1.0)
    lora = lean.LoRA.init(model, r=4, alpha=8, seed=0)
    plan_for(on_gpu, lora, 64, budget_bytes=2**30)
    assert calls == [64]
    plan_for(on_gpu, lora, 128, budget_bytes=2**30)
    assert calls == [64, 128]
