"""lean-train's settings checked before anything loads: each field's allowed range, in one table.

    check_config(cfg)          # ConfigError naming the flag, the value and what is allowed
    RANGES["lr"].text          # "a number in (0, 1]": the same words in --help and in the error
    check_export_gguf("Q4_K_M")  # --export-gguf's type, or ConfigError naming the types written

Checked: every number against RANGES (NaN and inf are outside every range), --warmup against
--steps, --shard-weights with --load-in-4bit (refused), the LoRA targets, --dtype and --device against this machine, --resume with --overwrite,
empty --out/--model/--data/--sample-prompt, that --model and --data paths that look local exist
(a hub id is fetched later), and an --out that is or lies in the --data folder, or is the
--model folder. Nothing is read or written here beyond a stat of the paths.
Tested: tests/test_cli_guard.py (each bad value refused before anything loads, --help lists them).
"""
import math
import os
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A setting outside what lean-train allows: names the flag and the allowed values."""


@dataclass(frozen=True)
class Range:
    lo: float = None
    hi: float = None
    lo_open: bool = False     # lo itself is outside
    hi_open: bool = False
    integer: bool = False
    note: str = ""            # what a special value means, e.g. "0: no clipping"

    def __contains__(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if self.integer and v != int(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    @property
    def text(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.lo is not None and self.hi is not None:
            span = f"{kind} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            span = f"{kind} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            span = kind
        return f"{span} ({self.note})" if self.note else span


def _num(x) -> str:
    return f"{x:,}" if isinstance(x, int) and x >= 10**6 else f"{x:g}"


HELDOUT_TOKENS = 16384  # the default cap of the held-out set, in tokens
# TrainConfig field -> (flag, allowed values)
RANGES = {
    "max_tokens": ("--max-tokens", Range(2, integer=True, note="a document needs 2 tokens to carry a target")),
    "grad_accum": ("--grad-accum", Range(1, integer=True)),
    "steps": ("--steps", Range(1, integer=True)),
    "lr": ("--lr", Range(0, 1, lo_open=True)),
    "warmup_steps": ("--warmup", Range(0, integer=True, note="at most --steps")),
    "min_lr_ratio": ("--min-lr-ratio", Range(0, 1)),
    "weight_decay": ("--weight-decay", Range(0, 1)),
    "max_grad_norm": ("--max-grad-norm", Range(0, note="0: no clipping")),
    "r": ("--r", Range(1, 128, integer=True)),
    "alpha": ("--alpha", Range(0, lo_open=True)),
    "dropout": ("--dropout", Range(0, 1, hi_open=True)),
    "seed": ("--seed", Range(0, 2**32 - 1, integer=True)),
    "eval_every": ("--eval-every", Range(0, integer=True, note="0: before and after training only")),
    "save_every": ("--save-every", Range(0, integer=True, note="0: on Ctrl-C and errors only")),
    "heldout_fraction": ("--heldout", Range(0, 1, hi_open=True, note="0: no held-out set")),
    "heldout_tokens": ("--heldout-tokens", Range(1, integer=True)),
    "sample_tokens": ("--sample-tokens", Range(0, 4096, integer=True, note="0: no samples")),
    "vram_budget": ("--vram-budget", Range(0, lo_open=True, note="GiB")),
    "dist_timeout": ("--dist-timeout", Range(1, integer=True, note="seconds; several processes under torchrun")),
}


def check_config(cfg):
    """ConfigError for the first setting of cfg (a TrainConfig) outside what is allowed."""
    for field, (flag, allowed) in RANGES.items():
        v = getattr(cfg, field)
        if v is None and field == "vram_budget":
            continue
        if v not in allowed:
            raise ConfigError(f"{flag} {v!r}: must be {allowed.text}")
    if cfg.warmup_steps > cfg.steps:
        raise ConfigError(f"--warmup {cfg.warmup_steps} is longer than --steps {cfg.steps}: the learning rate "
                          f"would never reach --lr; pass --warmup {cfg.steps} or less")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume and --overwrite: pass one (continue the run in --out, or delete it and "
                          "start over)")
    if getattr(cfg, "shard_weights", False) and cfg.quant == "nf4":
        raise ConfigError("--shard-weights with --load-in-4bit: the NF4 quantisation runs on the GPU as the model "
                          "loads, and a sharded load reads the model on the host; pass a checkpoint already in "
                          "bitsandbytes' 4-bit layout (a *-bnb-4bit upload) without --load-in-4bit, or drop a flag")
    for flag, v in (("--out", cfg.out_dir), ("--model", cfg.model), ("--data", cfg.data)):
        if not str(v or "").strip():
            raise ConfigError(f"{flag} is empty: pass a path")
    if cfg.sample_tokens and not str(cfg.sample_prompt or "").strip():
        raise ConfigError("--sample-prompt is empty: pass a prompt, or --sample-tokens 0 for no samples")
    _check_targets(cfg.targets)
    kind = _check_device_dtype(cfg.device, cfg.dtype)
    if getattr(cfg, "lora_state", "auto") == "host" and kind == "cpu":
        raise ConfigError("--lora-state host keeps the LoRA state in pinned host memory beside a GPU: on the CPU "
                          "it is there already; drop --lora-state host")
    _check_paths(cfg.model, cfg.data)
    _check_out(cfg.out_dir, cfg.model, cfg.data)


def _check_targets(targets):
    from .lora import LoRAError, _normalise_targets

    names = targets[0] if isinstance(targets, (list, tuple)) and len(targets) == 1 else targets
    try:
        _normalise_targets(names)
    except LoRAError as e:
        raise ConfigError(f"--targets: {e}") from None


DTYPES = ("float32", "bfloat16", "float16")


def _check_device_dtype(device, dtype):
    """ConfigError for a device or dtype lean cannot run; else the device kind, "cuda" or "cpu"."""
    import torch

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ConfigError(f"--device {device!r}: must be cpu, cuda or cuda:N")
    if kind == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"--device {device}: no CUDA GPU is visible to torch on this machine: leave "
                              "--device out (or pass --device cpu) to run on the CPU")
        if index and int(index) >= n:
            raise ConfigError(f"--device {device}: this machine has {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}")
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--device cpu: the kernels run on the CPU through Triton's interpreter, which must "
                          "be on before lean is imported: run with TRITON_INTERPRET=1 in the environment")
    if dtype == "bfloat16":
        raise ConfigError("--dtype bfloat16 on the CPU: Triton's interpreter does not compute bfloat16 "
                          "right; use float32 (the CPU default) or float16, or a CUDA GPU")
    return "cpu"


def _check_out(out, model, data):
    """An --out that is the --data folder or lies inside it (the run's metrics.jsonl, checkpoint/
    and adapter/ would be read as data: the next run, --resume too, fails on them or trains on
    them), or that is the --model folder (the run's files would mix with the model's)."""
    def resolved(p):
        return Path(os.path.expanduser(str(p))).resolve()

    o, d, m = resolved(out), resolved(data), resolved(model)
    if d.is_dir() and (o == d or d in o.parents):
        where = "the --data folder" if o == d else f"inside the --data folder {data}"
        raise ConfigError(f"--out {out} is {where}: the run's files (metrics.jsonl, checkpoint/, adapter/) "
                          "would be read as data by the next run; pass an --out outside it")
    if m.is_dir() and o == m:
        raise ConfigError(f"--out {out} is the --model folder: the run's files would mix with the model's; "
                          "pass another --out")


def check_export_gguf(gguf_type):
    """--export-gguf TYPE: ConfigError for a type the GGUF export does not write (None: no export)."""
    if gguf_type is None:
        return None
    from .gguf import GGUFError
    from .gguf_export import check_type

    try:
        return check_type(gguf_type)
    except GGUFError as e:
        raise ConfigError(f"--export-gguf {gguf_type}: {str(e).split(': ', 1)[1]}") from None


def _check_paths(model, data):
    from .records import data_files

    data_files(data)
    p = Path(os.path.expanduser(str(model)))
    if p.suffix.lower() == ".gguf":
        from .gguf import _source_path
        _source_path(p)
    else:
        from .loader import local_model_dir
        local_model_dir(model)
