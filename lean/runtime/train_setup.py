"""What lean-train does before its first step (runtime/train.py runs it): the device and dtype,
the model folder (a .gguf converted once, a hub id fetched), the documents and their held-out split,
the checkpoint to resume from, the weights, the LoRA state and AdamW, and the plan a step runs under
when the card's free memory is too small for every activation (default_plan).

Several processes (torchrun): parallel.load_agreed calls load_run and setup_run on every rank.
Errors: TrainError naming the cause and the fix (an unknown dtype, no training document left, an
out-of-memory load, a cache folder that cannot be written, --lora-state host where it cannot be).
Tested: tests/test_train.py, tests/test_cli_guard.py (through lean-train and train()).
"""
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from .batch import pack
from .checkpoint import TrainError, data_fingerprint, read_checkpoint
from .data import load_records, pack_batches, split_heldout, tokenize_records
from .loader import load_model, read_config, resolve_model_dir
from .lora import LoRA
from .optim import AdamW
from .plan import SLACK
from .planner import early_plan, plan_for
from .tokenizer import Tokenizer


def resolve_device_dtype(cfg):
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = cfg.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise TrainError(f"dtype {name!r} is not supported: use one of {', '.join(dtypes)}")
    return device, name, dtypes[name]


def resolve_model(model, dtype_name="float32") -> Path:
    """A model folder: a local folder as is, a .gguf converted once (cached), else a hub id."""
    p = Path(os.path.expanduser(str(model)))
    if p.suffix.lower() == ".gguf":
        from .gguf import default_cache_dir, ensure_hf_folder
        try:
            return ensure_hf_folder(p, dtype_name)
        except OSError as e:
            raise TrainError(f"cannot write the converted model to {default_cache_dir(p, dtype_name)} "
                             f"({os_error_text(e)}): set XDG_CACHE_HOME to a folder you can write") from e
    return resolve_model_dir(model)


def os_error_text(e: OSError, folder=None) -> str:
    """'path: what went wrong: the fix' for an OSError on a file the run reads or writes (one
    without a path, a write's ENOSPC say, names the folder it was in where that is known)."""
    import errno

    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f) or (
        f"writing in {folder}" if folder is not None else "a file of the run")
    fix = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free disk space (quota)",
           errno.EACCES: "fix its permissions or use another path", errno.EPERM: "fix its permissions or use another path",
           errno.EROFS: "the disk is read-only: use another path", errno.ENOTDIR: "a file is in the way of a folder: move it",
           errno.EISDIR: "a folder is in the way of a file: move it", errno.EEXIST: "something is in the way: move it"}
    return f"{where}: {e.strerror or e}: {fix.get(e.errno, 'check the path')}"


def build_data(cfg, tok):
    """(train docs, held-out docs, stats) from cfg.data."""
    stats = {}
    docs = tokenize_records(load_records(cfg.data), tok, max_len=cfg.max_tokens, stats=stats)
    train_docs, heldout = split_heldout(docs, cfg.heldout_fraction, seed=cfg.seed, max_tokens=cfg.heldout_tokens)
    if not train_docs:
        raise TrainError(f"{cfg.data}: no training document left after holding out "
                         f"{cfg.heldout_fraction:.0%}: add data or lower the held-out fraction")
    return train_docs, heldout, stats


def eval_budget(cfg, device) -> int:
    """Tokens per held-out batch: max_tokens on a GPU (a forward fits where the step does); on the
    CPU the whole capped held-out set in one batch (the interpreter's cost is per launch, not per
    token: one forward instead of several)."""
    return cfg.max_tokens if device.startswith("cuda") else max(cfg.max_tokens, cfg.heldout_tokens)


def lora_targets(targets):
    return targets[0] if isinstance(targets, (list, tuple)) and len(targets) == 1 else targets


def default_plan(cfg, model, lora, free, say=print):
    """Without --vram-budget on a GPU the budget is the memory the card had free when the run started
    (`free` bytes, before the weights loaded): None (keep every activation, no planning) when a step
    fits it, else the planner's plan for it, so that a step too big for the card recomputes and
    offloads instead of running out of memory."""
    if cfg.vram_budget is not None or free is None:
        return None
    keep = plan_for(model, lora, cfg.max_tokens)  # no budget: the all-keep plan, priced, no measurement
    if keep.memory.peak + SLACK <= free:
        return None
    say(f"lean-train: a step of --max-tokens {cfg.max_tokens} needs {keep.memory.peak / 2**30:.2f} GiB, more "
        f"than the {free / 2**30:.2f} GiB this GPU had free: planning for that budget (--vram-budget sets "
        "another)", flush=True)
    return plan_for(model, lora, cfg.max_tokens, budget_bytes=free)


def load_run(cfg, device, dtype_name, dtype, read=True, world=1, dist=None):
    """Model folder, tokenizer, documents, checkpoint (checked; read: here), weights (sharded over
    the ranks with --shard-weights). Several processes: parallel.load_agreed calls it on each."""
    model_dir = resolve_model(cfg.model, dtype_name)
    read_config(model_dir)  # an architecture lean does not train is named before the tokenizer or the data
    tok = Tokenizer.from_dir(model_dir)
    train_docs, heldout, _ = build_data(cfg, tok)
    fingerprint = data_fingerprint(train_docs)
    resume = read_checkpoint(cfg.out_dir, cfg, fingerprint, world) if cfg.resume and read else None
    with _out_of_memory(model_dir, dtype_name, device):
        if cfg.shard_weights and world > 1:
            from .shard import load_sharded
            model = load_sharded(model_dir, dtype, device, dist, quant=cfg.quant)
        else:
            model = load_model(model_dir, dtype=dtype, device=device, quant=cfg.quant,  # tables placed by the plan
                               stage_tables=cfg.vram_budget is not None and device.startswith("cuda")
                               and not cfg.tables_on_host)
        if cfg.tables_on_host:
            from .head_host import tables_to_host
            tables_to_host(model)  # before any plan: the planner counts them on the host
    return model_dir, tok, train_docs, heldout, fingerprint, resume, model


def setup_run(cfg, device, dtype_name, loaded):
    """(LoRA, AdamW, held-out batches) of what load_run loaded; under --vram-budget on a GPU the early
    plan first: it places the tables the load staged on the host (the embedding table may stay
    there) before the LoRA state is allocated."""
    model_dir, heldout, model = loaded[0], loaded[3], loaded[6]
    gpu, one = device.startswith("cuda"), int(os.environ.get("WORLD_SIZE", "1") or 1) == 1
    if cfg.lora_state == "host" and not (gpu and one):
        raise TrainError("--lora-state host keeps the LoRA state in pinned host memory beside one GPU: "
                         f"{'this run is on the CPU' if not gpu else 'data parallel all-reduces it on the GPUs'}; "
                         "drop --lora-state host")
    host_state = cfg.lora_state == "host"
    with _out_of_memory(model_dir, dtype_name, device):
        if cfg.vram_budget is not None and gpu:
            host_state = early_plan(model, cfg.r, lora_targets(cfg.targets), cfg.dropout, cfg.max_tokens,
                                    cfg.vram_budget, lora_state=cfg.lora_state if one else "device")
            if host_state and cfg.lora_state == "auto":
                print(f"lean-train: the step fits --vram-budget {cfg.vram_budget} GiB only with the LoRA's "
                      "master weights, gradients and AdamW moments in pinned host memory: moved there "
                      "(--lora-state host; each update crosses the bus)", flush=True)
        eval_batches = [pack(b, eval_budget(cfg, device), device=device, vocab=model.config.vocab)
                        for b in pack_batches(heldout, eval_budget(cfg, device), shuffle=False)] if heldout else []
        lora = LoRA.init(model, r=cfg.r, alpha=cfg.alpha, targets=lora_targets(cfg.targets), dropout=cfg.dropout,
                         seed=cfg.seed, host_state=host_state)
        if Path(str(cfg.model)).suffix.lower() != ".gguf":  # the adapter names the model as given: a hub id
            lora.base_model_name = str(cfg.model)        # stays an id, not this machine's cache folder
        opt = AdamW(lora, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm or None)
    return lora, opt, eval_batches


@contextmanager
def _out_of_memory(model_dir, dtype_name, device):
    """An OOM while the model and its LoRA state load: a TrainError naming the fixes."""
    try:
        yield
    except (torch.cuda.OutOfMemoryError, MemoryError) as e:
        where = "GPU" if isinstance(e, torch.cuda.OutOfMemoryError) else "host"
        raise TrainError(f"out of {where} memory loading {model_dir} in {dtype_name} on {device} ({e}): "
                         "the model does not fit; use a smaller model, bfloat16 (--dtype), 4-bit base "
                         "weights (--load-in-4bit), or a GPU with more memory") from e
