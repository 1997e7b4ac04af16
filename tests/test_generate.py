"""Greedy generation with the KV cache (lean/runtime/generate.py) against transformers + PEFT."""
import numpy as np
import pytest
import torch

import lean
from lean.runtime.generate import generate
from tests.test_step import _lean_setup, _rel_max
from tests.util import DEVICE, fresh_generator


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_match_hf_generate(tmp_path, arch):
    seed = int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))
    rng = np.random.default_rng(seed)
    hf, model, lora = _lean_setup(tmp_path, arch, seed)
    prompt = rng.integers(0, model.config.vocab, int(rng.integers(1, 12))).tolist()
    steps = []
    out = generate(model, lora, prompt, max_new_tokens=9, on_logits=lambda i, lg: steps.append(lg.clone()))
    from lean.reference.hf_peft import peft_wrap

    pm = peft_wrap(hf, lora)
    with torch.no_grad():
        # attention_mask given: else generate masks every prompt token equal to pad_token_id
        ref = pm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref
    # every step's logits equal a cache-free forward over the whole sequence so far
    seq = prompt + out
    full = lean.forward(model, lora, lean.pack([seq], max_tokens=len(seq), device=DEVICE))
    for i, lg in enumerate(steps):
        assert _rel_max(lg[0], full[len(prompt) - 1 + i]) <= 1e-5, f"step {i}"


def test_generate_stops_at_a_stop_token_and_base_model_works(tmp_path):
    seed = int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))
    _, model, _ = _lean_setup(tmp_path, "llama", seed)
    prompt = [3, 5, 7]
    first = generate(model, None, prompt, max_new_tokens=4)
    assert len(first) == 4
    stopped = generate(model, None, prompt, max_new_tokens=4, stop_ids={first[1]})
    assert stopped == first[:first.index(first[1]) + 1]
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, None, [], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt ids \[100000\] are outside the vocabulary.*not this model's"):
        generate(model, None, [3, 100000], max_new_tokens=2)
    from lean.runtime.observe import _generation_eos
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text('{"eos_token_id": [128001, 128009]}')
    assert _generation_eos(tmp_path / "gen") == {128001, 128009} and _generation_eos(tmp_path / "none") == set()
