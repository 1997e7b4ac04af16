"""The training loop behind `lean-train`: data -> packed micro-batches -> LoRA steps -> adapter.

    cfg = TrainConfig(model="model/or/x.gguf", data="data/", out_dir="out", steps=100)
    metrics = train(cfg)          # {"step", "loss", "eval_loss", "tokens", "seconds", "adapter"}

Per optimizer step: `grad_accum` micro-batches of at most `max_tokens` tokens each; the gradient is
that of (sum of token losses over the step) / (target tokens over the step), the target count known
on the host from the batch descriptors (no sync). The loss is read back once per step, at the log
point. LR: linear warm-up to `lr` over `warmup_steps`, then cosine down to `lr * min_lr_ratio`.

Data order: epoch e packs the training documents with `pack_batches(seed=seed + e)`; micro-batches
are taken in that order, and the next epoch starts when one runs out. The held-out split
(`heldout_fraction`, seeded) is evaluated before training, every `eval_every` steps and at the end.

Outputs in out_dir:
  metrics.jsonl   one JSON line per step {"kind": "train", "step", "loss", "lr", "grad_norm",
                  "tokens", "tokens_per_s", "seconds"} and per evaluation {"kind": "eval", "step",
                  "loss", "targets"}; appended to on resume, after the records of steps past
                  the checkpoint (logged by a run killed before its next save) are dropped
  checkpoint/     every save_every steps, on Ctrl-C and on OOM: the LoRA params, AdamW state and
                  the run's position, written so a crash never corrupts it (checkpoint.py)
  adapter/        the final adapter (PEFT layout: PeftModel.from_pretrained loads it), written when
                  the last step ends, before the final evaluation and sample

Resume (`resume=True`) restores the checkpoint and continues with the same batches in the same
order, the same dropout seeds and the same optimizer state: the per-step losses equal those of an
uninterrupted run (bit for bit on CPU). The config fields that shape the run and the training
documents must match; an unreadable checkpoint falls back to checkpoint.old where one is left.
A fresh run refuses an out_dir that holds an earlier run (`overwrite=True` deletes it, once the
model and data have loaded). Settings, data and checkpoint are checked before the weights load.

Errors are TrainError naming the cause and the fix: a NaN/inf loss or grad norm (names the step;
raised before anything of it is saved, so the last checkpoint stays good), out of
memory (lower --max-tokens; in the loop the completed steps are checkpointed first), a checkpoint
that does not match the config or cannot be read. KeyboardInterrupt saves a checkpoint at the
last completed step and is re-raised with a message on how to resume.
Caution: an interrupt that lands inside the optimizer update cannot be checkpointed safely; the
previous checkpoint is kept and the message says so.
Before and after training it prints the held-out loss and a greedy sample answer to a fixed
prompt (lean/runtime/observe.py: KV-cache generation through lean's kernels); metrics also go to
TensorBoard (out_dir/tb) when tensorboard is installed.
On a CUDA device with grad_accum 1 and dropout 0 (and graph=True, the default), each step is
replayed from one captured CUDA graph (lean.StepGraph: zero-grad, forward, loss, backward and
AdamW in one launch, under the vram_budget plan when there is one; batches padded to max_tokens
tokens in GRAPH_DOCS document slots); a batch of more documents than that runs eagerly (under a
VRAM budget the graph is dropped first: its memory and an eager step's would not both fit, and
the run goes on eagerly). The graph's GEMMs may differ from the eager step's in the last bit
(graph.py's Cautions); `--no-graph` runs every step eagerly.
Tested: tests/test_train.py (loss goes down, resume == uninterrupted after an interrupt inside
or between steps, atomic and flushed checkpoints, NaN/inf errors, OOM, the out_dir guard, CLI;
on the GPU the graph run against the eager one).
"""
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .batch import pack
from .checkpoint import (CHECKPOINT, TrainError, data_fingerprint, earlier_run, prepare_out_dir, read_checkpoint,
                         restore_checkpoint, run_state, save_checkpoint)
from .data import load_records, pack_batches, split_heldout, tokenize_records
from .loader import load_model, resolve_model_dir
from .lora import LoRA
from .observe import Metrics, Progress, sample
from .graph import StepGraph
from .optim import AdamW
from .planner import format_plan, plan_for
from .step import forward_backward, loss_eval
from .tokenizer import Tokenizer

@dataclass
class TrainConfig:
    model: str                    # HF folder, hub id, or a .gguf file (converted once, cached)
    data: str                     # a data file or folder (see lean/runtime/data.py)
    out_dir: str = "lean-out"
    max_tokens: int = 4096        # tokens per micro-batch (also the longest document)
    grad_accum: int = 1           # micro-batches per optimizer step
    steps: int = 100              # optimizer steps
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1     # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: ["all"])
    seed: int = 0
    eval_every: int = 50          # 0: evaluate only before and after training
    save_every: int = 50          # 0: checkpoint only on interrupt
    heldout_fraction: float = 0.05
    dtype: str = None             # float32 / bfloat16 / float16; None: bf16 on cuda, fp32 on cpu
    device: str = None            # None: cuda if available, else cpu
    resume: bool = False
    overwrite: bool = False       # start over in an out_dir that holds an earlier run (its files go)
    progress: bool = True         # the progress bar and the before/after report
    sample_prompt: str = "What is your name?"  # greedy sample before and after training
    sample_tokens: int = 32       # new tokens per sample (0: no samples)
    tensorboard: bool = True      # also log to out_dir/tb when tensorboard is installed
    vram_budget: float = None     # GiB: plan recompute/offload so a step fits (None: keep all)
    graph: bool = True            # CUDA: replay each step from one captured graph where it can


# ---------------------------------------------------------------- setup

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
        from .gguf import ensure_hf_folder
        return ensure_hf_folder(p, dtype_name)
    return resolve_model_dir(model)


def build_data(cfg, tok):
    """(train docs, held-out docs, stats) from cfg.data."""
    stats = {}
    docs = tokenize_records(load_records(cfg.data), tok, max_len=cfg.max_tokens, stats=stats)
    train_docs, heldout = split_heldout(docs, cfg.heldout_fraction, seed=cfg.seed)
    if not train_docs:
        raise TrainError(f"{cfg.data}: no training document left after holding out "
                         f"{cfg.heldout_fraction:.0%}: add data or lower the held-out fraction")
    return train_docs, heldout, stats


def lr_at(step, cfg) -> float:
    """LR of optimizer step `step` (1-based): linear warm-up, then cosine to lr * min_lr_ratio."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * t))


class DataStream:
    """Micro-batches of documents in a fixed order; the position (epoch, index) is the state."""

    def __init__(self, docs, max_tokens, seed, epoch=0, index=0):
        self.docs, self.max_tokens, self.seed = docs, max_tokens, seed
        self.epoch, self.index = epoch, index
        self._batches = pack_batches(docs, max_tokens, seed=seed + epoch)

    def next(self):
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = pack_batches(self.docs, self.max_tokens, seed=self.seed + self.epoch)
        b = self._batches[self.index]
        self.index += 1
        return b


def evaluate(model, lora, batches) -> tuple:
    """(mean held-out loss, targets) over pre-packed batches; one host read."""
    sums, count = [], 0
    for b in batches:
        loss_sum, n = loss_eval(model, lora, b)
        sums.append(loss_sum)
        count += n
    return sum(t.item() for t in sums) / max(count, 1), count  # sync: eval point


# ---------------------------------------------------------------- the loop

def train(cfg: TrainConfig) -> dict:
    """Run the configured LoRA training; returns the final metrics (see the module docstring)."""
    device, dtype_name, dtype = resolve_device_dtype(cfg)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    earlier = earlier_run(cfg)  # every check before the weights load: a mistake fails fast
    model_dir = resolve_model(cfg.model, dtype_name)
    tok = Tokenizer.from_dir(model_dir)
    train_docs, heldout, _ = build_data(cfg, tok)
    fingerprint = data_fingerprint(train_docs)
    resume = read_checkpoint(cfg.out_dir, cfg, fingerprint) if cfg.resume else None
    try:
        model = load_model(model_dir, dtype=dtype, device=device)
        vocab = model.config.vocab
        eval_batches = [pack(b, cfg.max_tokens, device=device, vocab=vocab)
                        for b in pack_batches(heldout, cfg.max_tokens, shuffle=False)] if heldout else []
        lora = LoRA.init(model, r=cfg.r, alpha=cfg.alpha, targets=_targets(cfg.targets), dropout=cfg.dropout,
                         seed=cfg.seed)
        if Path(str(cfg.model)).suffix.lower() != ".gguf":  # the adapter names the model as given: a hub id
            lora.base_model_name = str(cfg.model)        # stays an id, not this machine's cache folder
        opt = AdamW(lora, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
    except (torch.cuda.OutOfMemoryError, MemoryError) as e:
        where = "GPU" if isinstance(e, torch.cuda.OutOfMemoryError) else "host"
        raise TrainError(f"out of {where} memory loading {model_dir} in {dtype_name} on {device} ({e}): "
                         "the model does not fit; use a smaller model, bfloat16 (--dtype), or a GPU with "
                         "more memory") from e
    plan = None
    if cfg.vram_budget is not None:
        plan = plan_for(model, lora, cfg.max_tokens, budget_bytes=int(cfg.vram_budget * 2**30))
        if cfg.progress:
            print(format_plan(plan), flush=True)
    out = prepare_out_dir(cfg.out_dir, earlier)  # an earlier run goes only now (--overwrite)
    step, epoch, index = 0, 0, 0
    if resume is not None:
        st = restore_checkpoint(*resume, lora, opt)
        step, epoch, index = st["step"], st["epoch"], st["batch_index"]
    stream = DataStream(train_docs, cfg.max_tokens, cfg.seed, epoch, index)
    say = print if cfg.progress else (lambda *a, **k: None)
    say(f"lean-train: {model.config.arch} from {model_dir} on {device} ({dtype_name}); "
        f"{len(train_docs)} training documents, {len(heldout)} held out; LoRA r={cfg.r} on "
        f"{', '.join(lora.targets)} ({lora.params.numel():,} parameters)", flush=True)
    with Metrics(out, tensorboard=cfg.tensorboard, resume_step=step if resume is not None else None) as metrics:
        try:
            fresh = resume is None  # a resumed run logged its "before" records already
            before = _sample(cfg, model, lora, tok, metrics, step, "before", say) if fresh else None
            result = _loop(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan,
                           fingerprint, resumed=not fresh)
            if result["eval_loss_before"] is not None:
                say(f"held-out loss: {result['eval_loss_before']:.4f} before, {result['eval_loss']:.4f} after")
            result["sample_before"] = before
            result["sample_after"] = _sample(cfg, model, lora, tok, metrics, result["step"], "after", say)
        except torch.cuda.OutOfMemoryError as e:
            raise _oom_error(cfg, e) from e
    result["adapter"] = str(out / "adapter")
    return result


def _sample(cfg, model, lora, tok, metrics, step, when, say):
    """The greedy answer to cfg.sample_prompt, printed and logged; None when samples are off."""
    if cfg.sample_tokens <= 0:
        return None
    text = sample(model, lora, tok, cfg.sample_prompt, max_new_tokens=cfg.sample_tokens)
    metrics.log({"kind": "sample", "step": step, "when": when, "prompt": cfg.sample_prompt, "text": text})
    say(f"sample {when} training: {cfg.sample_prompt!r} -> {text!r}", flush=True)
    return text


def _targets(targets):
    return targets[0] if isinstance(targets, (list, tuple)) and len(targets) == 1 else targets


def _oom_error(cfg, e, saved=None):
    kept = (f"; the run so far is saved in {saved}: continue with the same command plus --resume once "
            "it fits (--max-tokens must stay; use --vram-budget)" if saved else "")
    return TrainError(f"out of GPU memory at max_tokens={cfg.max_tokens} ({e}): lower --max-tokens (raise "
                      "--grad-accum to keep the tokens per step), or set --vram-budget GiB to recompute/offload "
                      f"activations{kept}")


GRAPH_DOCS = 256  # document slots of the captured step (a batch of more runs eagerly)


def _step_graph(cfg, model, lora, opt, device, plan):
    """The captured step where it applies (see the module docstring), else None."""
    if not (cfg.graph and device.startswith("cuda") and cfg.grad_accum == 1 and cfg.dropout == 0.0):
        return None
    return StepGraph(model, lora, opt, budget=cfg.max_tokens, max_docs=GRAPH_DOCS, plan=plan)


def _graph_batch(graph, docs, vocab):
    """docs packed to the graph's fixed shapes, or None when they need more document slots than it
    has (the padding document takes one)."""
    return graph.pack(docs, vocab=vocab) if len(docs) < graph.max_docs else None


def _check_finite(out, step, lr, **values):
    """TrainError naming the first NaN/inf among values (loss, grad norm), raised before anything
    of this step is saved: the last checkpoint stays the last good one."""
    for name, x in values.items():
        if not math.isfinite(x):
            raise TrainError(f"{name.replace('_', ' ')} is {x} at step {step} (lr {lr:.3g}): start over with a "
                             "lower --lr (or a longer --warmup) and --overwrite, and check the data for broken "
                             f"records; the last checkpoint in {out / CHECKPOINT} is untouched")


def _loop(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan=None, fingerprint=None,
          resumed=False):
    out = Path(cfg.out_dir)
    graph = _step_graph(cfg, model, lora, opt, device, plan)
    eval_loss = eval_before = None
    if eval_batches and step == 0 and not resumed:  # resumed at step 0: logged before the interrupt
        eval_loss, n = evaluate(model, lora, eval_batches)
        eval_before = eval_loss
        metrics.log({"kind": "eval", "step": 0, "loss": eval_loss, "targets": n})
        if cfg.progress:
            print(f"held-out loss before training: {eval_loss:.4f} ({n} target tokens)", flush=True)
    progress = Progress(step, cfg.steps, cfg.progress)
    t_start, done_at_start, loss = time.time(), step, None
    tokens_total = 0
    # the last completed step's data position and dropout counter: what an interrupt saves
    pos, in_update = (stream.epoch, stream.index, lora.steps), False
    try:
        while step < cfg.steps:
            t0 = time.time()
            docs = [stream.next() for _ in range(cfg.grad_accum)]
            fixed = _graph_batch(graph, docs[0], vocab) if graph is not None else None
            if fixed is None and graph is not None and plan is not None:
                # A budget has no room for the graph's memory and an eager step's: drop the graph.
                progress.write(f"step {step + 1}: {len(docs[0])} documents, more than the captured step's "
                               f"{graph.max_docs - 1}: under --vram-budget the graph is dropped and the run "
                               "goes on eagerly (a lower --max-tokens packs fewer documents a step)")
                graph = None
                torch.cuda.empty_cache()
            lr = lr_at(step + 1, cfg)
            if fixed is not None:  # the captured step: one replay
                batches = [fixed]
                n_targets = fixed.n_targets
                in_update = True
                sums = [graph.step(fixed, lr=lr)[0]]
            else:
                batches = [pack(d, cfg.max_tokens, device=device, vocab=vocab) for d in docs]
                n_targets = sum(b.n_targets for b in batches)  # host ints: no sync
                lora.zero_grad()
                sums = []  # device tensors, read once at the log point
                for b in batches:
                    loss_sum, _ = forward_backward(model, lora, b, grad_scale=1.0 / max(n_targets, 1), plan=plan)
                    sums.append(loss_sum)
                in_update = True
                opt.step(lr=lr)
            loss = sum(t.item() for t in sums) / max(n_targets, 1)  # sync: log point
            grad_norm = opt.grad_norm.item()  # sync: log point (already complete)
            _check_finite(out, step + 1, lr, loss=loss, grad_norm=grad_norm)
            # checked: the step counts as done (an interrupt from here on saves it)
            step, pos, in_update = step + 1, (stream.epoch, stream.index, lora.steps), False
            dt = time.time() - t0
            n_tokens = (sum(fixed.doc_lens[:len(docs[0])]) if fixed is not None  # real tokens, not the padding
                        else sum(b.n_tokens for b in batches))
            tokens_total += n_tokens
            elapsed = time.time() - t_start
            eta = elapsed / (step - done_at_start) * (cfg.steps - step)
            metrics.log({"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens": n_tokens, "targets": n_targets, "tokens_per_s": n_tokens / dt, "seconds": dt})
            mem = f" mem {torch.cuda.max_memory_allocated() / 2**30:.2f}GiB" if device.startswith("cuda") else ""
            progress.update(f"loss {loss:.4f} lr {lr:.2e} {n_tokens / dt:,.0f} tok/s{mem} eta {eta:.0f}s")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and eval_batches:
                eval_loss, n = evaluate(model, lora, eval_batches)
                metrics.log({"kind": "eval", "step": step, "loss": eval_loss, "targets": n})
                progress.write(f"step {step}: held-out loss {eval_loss:.4f}")
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(out, lora, opt, run_state(cfg, step, *pos, fingerprint))
    except torch.cuda.OutOfMemoryError as e:
        progress.close()
        if in_update or step == done_at_start:  # an update half done, or nothing new to keep
            raise
        try:  # the parameters are whole: an OOM leaves them as the last completed step left them
            saved = save_checkpoint(out, lora, opt, run_state(cfg, step, *pos, fingerprint))
        except Exception:
            raise e from None
        raise _oom_error(cfg, e, saved) from e
    except KeyboardInterrupt:
        progress.close()
        if in_update:
            raise KeyboardInterrupt(f"interrupted during the update of step {step + 1}: the previous "
                                    f"checkpoint in {out / CHECKPOINT} is kept; resume with --resume") from None
        save_checkpoint(out, lora, opt, run_state(cfg, step, *pos, fingerprint))
        raise KeyboardInterrupt(f"interrupted after step {step}: checkpoint saved in {out / CHECKPOINT}; "
                                "continue with the same command plus --resume") from None
    progress.close()
    if cfg.save_every:
        save_checkpoint(out, lora, opt, run_state(cfg, step, *pos, fingerprint))
    lora.save(out / "adapter")  # before the final eval and sample: what trained is kept if they fail
    if eval_batches:
        eval_loss, n = evaluate(model, lora, eval_batches)
        metrics.log({"kind": "eval", "step": step, "loss": eval_loss, "targets": n})
    return {"step": step, "loss": loss, "eval_loss": eval_loss, "eval_loss_before": eval_before, "tokens": tokens_total,
            "seconds": time.time() - t_start}
