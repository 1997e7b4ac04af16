"""`lean-train` with no --model/--data (SmolLM2-135M-Instruct GGUF + chatterbot), end to end on CPU.

Shortened by flags (one step, two held-out documents, two sample tokens) so CI can afford it: the
held-out loss on real text goes down, the samples are printed, and the saved adapter loads in
PEFT on the transformers model and gives lean's logits.
"""
import json

import torch

import lean
from lean.cli import main



def test_default_run_lowers_heldout_loss_and_its_adapter_loads_in_peft(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--out", str(out), "--steps", "1", "--heldout", "0.001", "--sample-tokens", "2", "--device", "cpu"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-3000:]
    assert "sample before training" in printed.out and "sample after training" in printed.out
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 1] and evals[0]["targets"] > 0
    assert evals[1]["loss"] < evals[0]["loss"], evals  # real text, real model: one step helps

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lean.cli import default_model
    from lean.runtime.gguf import ensure_hf_folder
    from lean.runtime.tokenizer import Tokenizer

    folder = ensure_hf_folder(default_model(), "float32")  # the cached conversion the run used
    tok = Tokenizer.from_dir(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "Do you like music?"},
                                    {"role": "assistant", "content": "Yes, I do."}])
    ids = tok.encode(text)
    model = lean.load_model(folder, dtype=torch.float32, device="cpu")
    lora = lean.LoRA.load(model, out / "adapter")
    assert float(lora.params.abs().max()) > 0
    logits = lean.forward(model, lora, lean.pack([ids], max_tokens=len(ids), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, str(out / "adapter")).eval()
    with torch.no_grad():
        ref = pm(input_ids=torch.tensor([ids])).logits[0]
        with pm.disable_adapter():
            base = pm(input_ids=torch.tensor([ids])).logits[0]
    err = ((logits.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err <= 1e-4, f"lean vs PEFT logits: relative error {err:.2e}"
    assert (ref - base).abs().max() > 100 * err * ref.abs().max(), "the adapter changes nothing: vacuous"
