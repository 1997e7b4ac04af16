"""`lean-export`: a finished lean-train run as one GGUF file for llama.cpp, Ollama and LM Studio.

    lean-export RUN_DIR --gguf Q8_0                  # RUN_DIR/<run>-Q8_0.gguf: the merged model
    lean-export RUN_DIR --gguf BF16 --out m.gguf     # another file name
    lean-export RUN_DIR --gguf F16 --adapter         # RUN_DIR/<run>-lora-F16.gguf: the adapter alone
    lean-train ... --export-gguf Q8_0                # the same, right after training

RUN_DIR is a lean-train --out folder with its adapter/ (what a finished run leaves). The base model
is the run's --model: read from its checkpoint's settings (checkpoint/state.json), else from the
adapter's base_model_name_or_path; --model overrides both. A .gguf base (the default SmolLM2) is
read through lean's converted folder of it (~/.cache/lean/gguf), and an adapter's Modelfile then
names that .gguf as its FROM. Each GGUF gets a <stem>.Modelfile beside it (`ollama create NAME -f`).
On a GPU (--device, cuda where there is one) the adapter is folded in and Q8_0 / Q4_K / Q6_K are
quantised there by lean's Triton kernels; --device cpu does it all with numpy on the host.
The file is written atomically (lean/runtime/gguf_export.py): an export that fails leaves nothing
under the final name. Errors exit with status 2 and one line (the cause and the fix); Ctrl-C with
130, saying nothing was written.
The command ends its process with os._exit once the file is in place (cli: the teardown of torch and
the CUDA context is skipped, it has nothing to finish).
Tested: tests/test_gguf_export.py (lean-train --export-gguf on a 1-step run, then lean-export --adapter
on it; the errors: an unknown type before training, no adapter, a model that is not there).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path


def run_source(run_dir, model=None) -> dict:
    """What a run's export needs: model (as the run was given it), model_dir (an HF folder),
    adapter_dir, base_gguf (the .gguf the run trained on, or None), quant and dtype of the run."""
    from .runtime.gguf import GGUFError
    from .runtime.lora import ADAPTER_CONFIG

    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise GGUFError(f"{run} is not a folder: pass the --out folder of a lean-train run")
    adapter = run / "adapter"
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise GGUFError(f"{run} holds no adapter ({adapter / ADAPTER_CONFIG} is missing): let the run finish "
                        "(lean-train with the same arguments plus --resume), or pass the --out folder of a "
                        "finished run")
    settings = {}
    for name in ("checkpoint", "checkpoint.old"):
        try:
            settings = json.loads((run / name / "state.json").read_text())["config"]
            break
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if model is None:
        model = settings.get("model") or json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not model:
        raise GGUFError(f"{run}: the run does not record its base model: pass --model (the folder, hub id or "
                        ".gguf the run trained on)")
    return {"model": str(model), "adapter_dir": adapter, "quant": settings.get("quant"),
            "dtype": settings.get("dtype"), "name": run.resolve().name,
            "base_gguf": Path(model).expanduser() if str(model).lower().endswith(".gguf") else None}


def export_run(run_dir, gguf_type, out=None, *, model=None, adapter_only=False, device=None, progress=True,
               quant=None, dtype=None):
    """Export a run (see the module docstring); returns the written file's path. quant / dtype: the
    run's --load-in-4bit ("nf4") and --dtype where its folder does not record them."""
    from .runtime.gguf_export import ADAPTER_TYPES, TYPES, check_type, export_adapter, export_model
    from .runtime.train_setup import resolve_model

    type_name = check_type(gguf_type, ADAPTER_TYPES if adapter_only else TYPES)
    src = run_source(run_dir, model)
    model_dir = resolve_model(src["model"], dtype or src["dtype"] or "float32")  # a .gguf: the run's conversion
    stem = f"{src['name']}-lora-{type_name}" if adapter_only else f"{src['name']}-{type_name}"
    out = Path(out).expanduser() if out else Path(run_dir) / f"{stem}.gguf"
    if adapter_only:
        return export_adapter(model_dir, src["adapter_dir"], out, type_name, name=src["name"],
                              base=src["base_gguf"], progress=progress)
    return export_model(model_dir, out, type_name, src["adapter_dir"], name=src["name"], device=device,
                        progress=progress, quant=quant or src["quant"], quant_dtype=dtype or src["dtype"])


def build_parser():
    from .runtime.gguf_export import ADAPTER_TYPES, TYPES

    p = argparse.ArgumentParser(prog="lean-export", description="A lean-train run as a GGUF file (llama.cpp, "
                                "Ollama, LM Studio): the merged model, or the adapter alone.")
    p.add_argument("run_dir", help="the --out folder of a finished lean-train run (it holds adapter/)")
    p.add_argument("--gguf", required=True, metavar="TYPE",
                   help=f"the weights' type: {', '.join(TYPES)} (the adapter: {', '.join(ADAPTER_TYPES)})")
    p.add_argument("--out", help="the .gguf file to write (default: RUN_DIR/<run>-<TYPE>.gguf)")
    p.add_argument("--adapter", action="store_true", help="write the adapter alone as a GGUF LoRA adapter "
                   "(llama.cpp --lora, Ollama ADAPTER): a few MB instead of the whole model")
    p.add_argument("--model", help="the base model the run trained on (default: what the run recorded)")
    p.add_argument("--load-in-4bit", action="store_true", help="the run trained with --load-in-4bit (QLoRA): "
                   "fold the adapter into the NF4 base it trained on (read from the run's checkpoint when it has one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the run's --dtype, for "
                   "--load-in-4bit (default: what the run recorded, else bfloat16 on a GPU, float32 without)")
    p.add_argument("--device", help="where the adapter is folded in and the weights quantised: cuda (or cuda:N): "
                   "lean's Triton kernels on that GPU; cpu: numpy on the host (default: cuda where there is one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def export_device(device=None):
    """--device: the torch device the export merges and quantises on, or None for numpy on the host
    (cpu: lean's kernels there would run in Triton's interpreter). Default: cuda where there is one."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return None
    from .runtime.gguf import GGUFError
    if not device.startswith("cuda"):
        raise GGUFError(f"--device {device}: the export runs on cuda (or cuda:N) or cpu; pass one of those")
    if not torch.cuda.is_available():
        raise GGUFError(f"--device {device}: this machine has no CUDA GPU; pass --device cpu (numpy on the host)")
    return device


def _since_process_start(t):
    """Seconds from this process's start to perf_counter() time t (the interpreter and the imports before
    main), from /proc; None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: since boot
        with open("/proc/uptime") as f:
            now = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, now - started - (time.perf_counter() - t))


def main(argv=None) -> int:
    from .runtime.loader import ModelLoadError

    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = export_run(args.run_dir, args.gguf, args.out, model=args.model, adapter_only=args.adapter,
                          device=export_device(args.device), progress=not args.quiet,
                          quant="nf4" if args.load_in_4bit else None, dtype=args.dtype)
    except KeyboardInterrupt:
        print("lean-export: interrupted: nothing was written under the final name", file=sys.stderr)
        return 130
    except (ValueError, ModelLoadError, OSError, RuntimeError) as e:  # GGUFError, LoRAError, TrainError, ...
        print(f"lean-export: error: {e}", file=sys.stderr)
        return 2
    from .runtime.gguf_write import LAST_WRITE

    size = path.stat().st_size
    total = time.perf_counter() - t0
    where = ""
    if "done" in LAST_WRITE:  # the phases: reading the run and the tokenizer, the tensors, the closing fsync
        setup = total - LAST_WRITE["done"]
        start = _since_process_start(t0)
        where = (f": {'' if start is None else f'before main {start:.1f} s, '}"
                 f"setup {setup:.1f} s, header {LAST_WRITE['header']:.1f} s, tensors "
                 f"{LAST_WRITE['tensors'] - LAST_WRITE['header']:.1f} s, closing fsync "
                 f"{LAST_WRITE['done'] - LAST_WRITE['tensors']:.1f} s")
    print(f"lean-export: wrote {path} ({size / 2**20:,.1f} MiB) and {path.with_suffix('.Modelfile').name} "
          f"in {total:.1f} s{where}")
    return 0


def cli():
    """The lean-export command: main, then the process ends at once (os._exit) with main's status.
    By then the file is fsynced and renamed and nothing is pending; what an ordinary exit would add
    is the interpreter's teardown of torch's modules, the CUDA context and the pinned host memory:
    0.7-0.9 s for a process that only imports torch on a 2-core CPU machine. After a GPU export of
    the 8B the exit measured 0.2 s this way (tools/bench_gguf_export.py's after_main_s; 1-2 s is
    what the start and exit outside main added before, with an ordinary exit)."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (lean-export ... | head): nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    cli()
