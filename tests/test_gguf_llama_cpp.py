"""lean's GGUF files in llama.cpp itself (llama-cpp-python 0.3.36, built from its sdist: CI does not
build it, so these tests skip where `llama_cpp` does not import, saying so).

  - Q4_K_M: llama_model_quantize (llama-quantize's Q4_K_M, no imatrix) of lean's F32 export equals
    lean's own Q4_K_M export tensor for tensor, types and bytes (the same fp32 merged values go into
    both quantisers); of lean's F16 export (the issue's route: the 16-bit file llama.cpp's converter
    writes first), the types are the same.
  - Greedy tokens: llama.cpp on lean's BF16 export of every architecture generates lean's merged
    model's greedy tokens (lean.runtime.generate, fp32). A random tiny model's top two logits may sit
    closer than bf16 rounding moves them, so the logits are made peaked (_peaked), and a model counts
    when every step's logits of llama.cpp are within half lean's smallest top-1 / top-2 margin of
    lean's (then each argmax, and so each token, must agree); fresh models are drawn until one does
    (at most 8: none means llama.cpp computes something else than lean's merged model). llama.cpp
    runs with an F32 KV cache (KW): its default f16 cache rounds K and V, which on the MoE models'
    large activations moved logits by 0.2%, more than the file's bf16 rounding in some steps.
  - The GGUF LoRA adapter: llama.cpp with --lora (Llama(lora_path=)) on the base's BF16 export
    generates the merged model's tokens.
  - llama.cpp reads the chat template (Llama.metadata) and tokenizes a rendered chat as the model's
    tokenizer.json does.
"""
import numpy as np
import pytest
import torch

import lean
from lean.runtime.gguf_export import export_adapter, export_model
from lean.runtime.generate import generate
from tests.hf_models import build_hf, tiny_config
from tests.test_gguf_export import CHATML, V, _moe_hf, read_gguf, tiny_setup
from tests.util import fresh_generator

try:
    import llama_cpp
except ImportError as e:  # CI: llama-cpp-python is built from source on the machines that have it
    pytest.skip(f"llama_cpp does not import ({e}): pip install llama-cpp-python==0.3.36 to compare with "
                "llama.cpp", allow_module_level=True)

from tools.gguf_oracle import compare_gguf_files, llama_quantize  # noqa: E402

KW = dict(type_k=0, type_v=0)  # GGML_TYPE_F32 KV cache: llama.cpp's default f16 one rounds K and V
STEPS = 6
RTOL = 1e-4  # fp32 both sides (F32 file and KV cache); measured 2-4e-7 dense, 2e-6 Qwen3-MoE, 2e-5 GPT-OSS
PROMPT = [87, 220, 259, 84, 104, 68]  # byte-alphabet and merged ids of the test tokenizer


def _quiet():
    _quiet.cb = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_quiet.cb, None)


def _llama(path, **kw):
    _quiet()
    return llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False, logits_all=True, **{**KW, **kw})


def _llama_greedy(llm, prompt, steps=STEPS):
    """llama.cpp's greedy continuation and each step's logits (numpy)."""
    llm.reset()
    llm.eval(prompt)
    toks, all_logits = [], []
    for _ in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        toks.append(int(logits.argmax()))
        all_logits.append(logits)
        llm.eval([toks[-1]])
    return toks, all_logits


def _lean_greedy(model, lora, prompt, steps=STEPS):
    seen = []
    toks = generate(model, lora, prompt, max_new_tokens=steps, on_logits=lambda s, x: seen.append(x[0].clone()))
    margins = [float(torch.topk(x, 2).values.diff().abs()) for x in seen]
    return toks, [x.numpy() for x in seen], min(margins)


def _peaked(arch, seed):
    """A tiny model of `arch` with peaked logits: its lm_head scaled by 10 and 16 random tokens' rows by
    50, so that the argmax is one of those 16, spread ~5x wider than the rest (top-2 gaps ~1 against
    engine differences ~0.1). An MoE model routes every token to all 4 experts: with top-2 of 4, bf16
    rounding flipped a routing choice in about one sequence of four (logits off by up to 15%);
    test_f32_logits_equal_llama_cpp checks top-2 routing on the F32 file."""
    if arch in ("qwen3_moe", "gpt_oss"):
        hf = _moe_hf(arch, k=4)
    else:
        config = tiny_config(arch)
        config.vocab_size = V
        hf = build_hf(arch, seed, config=config)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
        hf.lm_head.weight[torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:16]] *= 5.0
        for name, p in hf.named_parameters():
            if "experts" in name:  # N(0, 0.02) as HF's init: _moe_hf's 0.1 made bf16's error 1-5% of the logits
                p.mul_(0.2)
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
def test_greedy_tokens_equal_llama_cpp(tmp_path, arch):
    """llama.cpp on lean's merged BF16 export, and on the base's BF16 export with the GGUF adapter, gives
    lean's greedy tokens (the llama model carries llama3 RoPE scaling: rope_freqs)."""
    rng = np.random.default_rng(int(torch.randint(1 << 30, (1,), generator=fresh_generator("cpu"))))
    seen = []
    for attempt in range(8):
        d = tmp_path / f"try{attempt}"
        d.mkdir()
        model_dir, adapter_dir, model, lora = tiny_setup(d, arch, hf=_peaked(arch, int(rng.integers(1 << 30))))
        want, want_logits, margin = _lean_greedy(model, lora, PROMPT)
        merged = export_model(model_dir, d / "m-BF16.gguf", "BF16", adapter_dir, progress=False)
        base = export_model(model_dir, d / "base-BF16.gguf", "BF16", progress=False)
        lora_file = export_adapter(model_dir, adapter_dir, d / "lora-F32.gguf", "F32", progress=False)
        runs = [_llama_greedy(_llama(merged), PROMPT), _llama_greedy(_llama(base, lora_path=str(lora_file)), PROMPT)]
        diffs = [max(float(np.abs(a - b).max()) for a, b in zip(logits, want_logits)) for _, logits in runs]
        seen.append((margin, diffs))
        if max(diffs) < margin / 2:  # every step's argmax is then decided by the numbers
            break
    else:
        pytest.fail(f"in 8 models no step's logits were within half the top-2 margin of lean's (margin, "
                    f"differences): {seen}: llama.cpp computes another model from lean's files")
    for got, _ in runs:
        assert got == want, (got, want, seen)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
def test_f32_logits_equal_llama_cpp(tmp_path, arch):
    """llama.cpp's logits at every prompt position on lean's merged F32 export (MoE: top-2 of 4 experts)
    equal lean's adapted model's within RTOL of their largest."""
    hf = _moe_hf(arch) if arch in ("qwen3_moe", "gpt_oss") else None
    model_dir, adapter_dir, model, lora = tiny_setup(tmp_path, arch, hf=hf)
    want = lean.forward(model, lora, lean.pack([PROMPT], max_tokens=16, device="cpu")).numpy()
    llm = _llama(export_model(model_dir, tmp_path / "m.gguf", "F32", adapter_dir, progress=False))
    llm.eval(PROMPT)
    got = np.array(llm.scores[:len(PROMPT)], dtype=np.float32)
    assert np.abs(got - want).max() <= RTOL * np.abs(want).max(), (np.abs(got - want).max(), np.abs(want).max())


def test_chat_template_and_tokens_in_llama_cpp(tmp_path):
    from jinja2 import Template
    from tokenizers import Tokenizer

    model_dir, adapter_dir, *_ = tiny_setup(tmp_path, "qwen3")
    path = export_model(model_dir, tmp_path / "m.gguf", "Q8_0", adapter_dir, progress=False)
    llm = _llama(path)
    assert llm.metadata["tokenizer.chat_template"] == CHATML
    chat = Template(CHATML).render(messages=[{"role": "user", "content": "the 12 theme?"}], add_generation_prompt=True)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(chat).ids
    assert llm.tokenize(chat.encode(), add_bos=False, special=True) == ours


def _q4_model(tmp_path, arch):
    """Rows of 256 columns (Q4_K / Q6_K proper) and 4 layers (llama-quantize's more-bits layers 0, 2, 3)."""
    from transformers import LlamaConfig

    if arch == "qwen3_moe":
        from tests.test_moe import moe_config
        hf = build_hf(arch, 0, config=moe_config(4, 2, True, [], layers=4, vocab_size=V, hidden_size=256,
                                                 moe_intermediate_size=256, head_dim=64))
    else:
        hf = build_hf(arch, 0, config=LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                                  max_position_embeddings=256, tie_word_embeddings=False))
    return tiny_setup(tmp_path, arch, hf=hf)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_q4_k_m_equals_llama_quantize(tmp_path, arch):
    model_dir, adapter_dir, *_ = _q4_model(tmp_path, arch)
    ours = export_model(model_dir, tmp_path / "m-Q4_K_M.gguf", "Q4_K_M", adapter_dir, progress=False)
    for source in ("F32", "F16"):
        src = export_model(model_dir, tmp_path / f"m-{source}.gguf", source, adapter_dir, progress=False)
        llama_quantize(src, tmp_path / f"llama-{source}.gguf", threads=2)
        report = compare_gguf_files(ours, tmp_path / f"llama-{source}.gguf")
        assert all(r["same_type"] for r in report), [r for r in report if not r["same_type"]]
        if source == "F32":
            assert all(r["same_bytes"] for r in report), [r for r in report if not r["same_bytes"]]
    types = {t[0].name for t in read_gguf(ours)[0].values()}
    assert {"Q4_K", "Q6_K"} <= types, types
