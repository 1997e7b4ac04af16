"""The training loop behind `lean-train`: data -> packed micro-batches -> LoRA steps -> adapter.

    cfg = TrainConfig(model="model/or/x.gguf", data="data/", out_dir="out", steps=100)
    metrics = train(cfg)          # {"step", "loss", "eval_loss", "tokens", "seconds", "adapter"}

Per optimizer step: `grad_accum` micro-batches of at most `max_tokens` tokens each; the gradient is
that of (sum of token losses over the step) / (target tokens over the step), the target count known
on the host from the batch descriptors (no sync). The loss is read back once per step, at the log
point. LR: linear warm-up to `lr` over `warmup_steps`, then cosine down to `lr * min_lr_ratio`.

Data order: epoch e packs the training documents with `pack_batches(seed=seed + e)`; micro-batches
are taken in that order, and the next epoch starts when one runs out. The held-out split
(`heldout_fraction`, seeded, at most `heldout_tokens` tokens: the drawn documents past the cap
train) is evaluated before training, every `eval_every` steps and at the end, with a progress bar;
on a GPU in batches of max_tokens, on the CPU in one batch (the interpreter's cost is per launch).

Outputs in out_dir:
  metrics.jsonl   one JSON line per step {"kind": "train", "step", "loss", "lr", "grad_norm",
                  "tokens", "tokens_per_s", "seconds"; MoE models: "expert_load_max", "_mean",
                  "_max_over_mean", and "aux_loss" when on} and per evaluation {"kind": "eval", "step",
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
model and data have loaded). Every setting is checked first (settings.check_config: ranges,
paths, device), then out_dir's lock is taken (checkpoint.RunLock: a second run on the folder is
refused naming this one's PID), then the checkpoint's settings; data and checkpoint are checked
before the weights load. A resumed run that has already trained its steps and written its adapter
returns at once with "finished" set (lean-train --resume --merge merges it).

Errors are TrainError naming the cause and the fix: a NaN/inf loss or grad norm (names the step;
raised before anything of it is saved, so the last checkpoint stays good), out of
memory (lower --max-tokens; in the loop the completed steps are checkpointed first), a checkpoint
that does not match the config or cannot be read, an OSError on a file (its path, the fix, and
what is kept). KeyboardInterrupt saves a checkpoint at the last completed step and is re-raised
with a message that says what is saved and what to run next: while loading (nothing written),
before step 1 (nothing trained), after a step, again during that checkpoint's write (not saved:
the previous one is named), after the last step (the adapter is written by --resume), in the
final evaluation or sample (the adapter is complete).
Caution: an interrupt that lands inside the optimizer update cannot be checkpointed safely; the
previous checkpoint is kept and the message says so.
Before and after training it prints the held-out loss and a greedy sample answer to a fixed
prompt (lean/runtime/observe.py: KV-cache generation through lean's kernels); metrics also go to
TensorBoard (out_dir/tb) when tensorboard is installed.
Several processes (torchrun; runtime/dist.py): each rank trains its share of every step's
world x grad_accum micro-batches of the one global stream (the union is one process's step with
grad_accum x world), normalised by the targets of all of them, the LoRA gradient all-reduced in
buckets under the backward; evaluation is spread over the ranks. Rank 0 alone takes the lock and
writes checkpoints, metrics, TensorBoard, the adapter and samples; an error, NaN/inf or OOM on any
rank stops every rank at the step boundary with the same TrainError (RunStopped: rank 0 checkpoints
the last completed step), and a rank that dies stops the others at their next collective
(RankLost). shard_weights: each rank holds 1/N of every layer's frozen weights (runtime/shard.py).
On a CUDA device with grad_accum 1 and dropout 0 (and graph=True, the default), each step is
replayed from one captured CUDA graph (lean.StepGraph: zero-grad, forward, loss, backward and
AdamW in one launch, under the vram_budget plan when there is one; batches padded to max_tokens
tokens in GRAPH_DOCS document slots); a batch of more documents than that runs eagerly (under a
VRAM budget the graph is dropped first: its memory and an eager step's would not both fit, and
the run goes on eagerly). The graph's GEMMs may differ from the eager step's in the last bit
(graph.py's Cautions); `--no-graph` runs every step eagerly.
Tested: tests/test_dist.py (2 and 3 CPU processes against one, resume, faults on one rank),
tests/test_train.py (loss goes down, resume == uninterrupted after an interrupt inside
or between steps, atomic and flushed checkpoints, NaN/inf errors, OOM, the out_dir guard, CLI;
on the GPU the graph run against the eager one), tests/test_cli_guard.py (the folder's lock,
settings, exit messages, finished runs, the held-out cap).
"""
import dataclasses
import math
import os
import random
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .batch import pack
from .checkpoint import (CHECKPOINT, RunLock, TrainError, data_fingerprint, earlier_run, finished_step, kept,
                         prepare_out_dir, read_checkpoint, restore_checkpoint, run_state, save_checkpoint)
from .data import load_records, pack_batches, split_heldout, tokenize_records
from .dist import DIST_TIMEOUT, Dist, GradReducer, Interrupted, RankLost, RunStopped, start, take_step
from .loader import load_model, resolve_model_dir
from .lora import LoRA
from .observe import Metrics, NoMetrics, Progress, sample
from .offload import gather_of
from .graph import StepGraph
from . import parallel
from .optim import AdamW
from ..kernels.arch import describe
from .plan import SLACK
from .planner import early_plan, format_plan, plan_for
from .report import ReportJob, report_in_process
from .settings import HELDOUT_TOKENS, check_config
from .step import loss_eval
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
    heldout_tokens: int = HELDOUT_TOKENS  # cap of the held-out set (documents past it train)
    dtype: str = None             # float32 / bfloat16 / float16; None: bf16 on cuda, fp32 on cpu
    device: str = None            # None: cuda if available, else cpu
    resume: bool = False
    overwrite: bool = False       # start over in an out_dir that holds an earlier run (its files go)
    progress: bool = True         # the progress bar and the before/after report
    sample_prompt: str = "What is your name?"  # greedy sample before and after training
    sample_tokens: int = 32       # new tokens per sample (0: no samples)
    tensorboard: bool = True      # also log to out_dir/tb when tensorboard is installed
    vram_budget: float = None     # GiB: plan recompute/offload so a step fits (None: the GPU's free memory)
    graph: bool = True            # CUDA: replay each step from one captured graph where it can
    quant: str = None             # "nf4": the base model's projections in 4-bit NF4 (QLoRA, --load-in-4bit)
    report_process: bool = False  # the before/after report in a second process (report.py); None: where it
                                  # pays (lean-train's choice; a spawned process imports the caller's __main__)
    dist_timeout: int = DIST_TIMEOUT  # data parallel (torchrun): seconds a collective may wait for the other ranks
    shard_weights: bool = False   # data parallel: each rank holds 1/N of every layer's frozen weights (shard.py)
    tables_on_host: bool = False  # CUDA: the embedding and lm_head in pinned host memory (head_host.tables_to_host)
    lora_state: str = "auto"      # LoRA master weights, gradients, AdamW moments: "device", "host" (pinned host
                                  # memory, host_state.py), "auto": host where --vram-budget fits no other way


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
        from .gguf import default_cache_dir, ensure_hf_folder
        try:
            return ensure_hf_folder(p, dtype_name)
        except OSError as e:
            raise TrainError(f"cannot write the converted model to {default_cache_dir(p, dtype_name)} "
                             f"({os_error_text(e)}): set XDG_CACHE_HOME to a folder you can write") from e
    return resolve_model_dir(model)


def build_data(cfg, tok):
    """(train docs, held-out docs, stats) from cfg.data."""
    stats = {}
    docs = tokenize_records(load_records(cfg.data), tok, max_len=cfg.max_tokens, stats=stats)
    train_docs, heldout = split_heldout(docs, cfg.heldout_fraction, seed=cfg.seed, max_tokens=cfg.heldout_tokens)
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


def evaluate(model, lora, batches, show=False, dist=None) -> tuple:
    """(mean held-out loss, targets) over pre-packed batches; one host read. show: a progress bar.
    dist (data parallel): rank r evaluates batches r, r + world, ..., the sums are exchanged
    (parallel.evaluate_shared)."""
    if dist is not None and dist.world > 1:
        return parallel.evaluate_shared(model, lora, batches, show, dist)
    sums, count = [], 0
    bar = Progress(0, len(batches), show, desc="held-out", leave=False)
    for i, b in enumerate(batches):
        loss_sum, n = loss_eval(model, lora, b)
        sums.append(loss_sum)
        count += n
        bar.update(f"held-out batch {i + 1}/{len(batches)}")
    bar.close()
    return sum(t.item() for t in sums) / max(count, 1), count  # sync: eval point


def eval_budget(cfg, device) -> int:
    """Tokens per held-out batch: max_tokens on a GPU (a forward fits where the step does); on the
    CPU the whole capped held-out set in one batch (the interpreter's cost is per launch, not per
    token: one forward instead of several)."""
    return cfg.max_tokens if device.startswith("cuda") else max(cfg.max_tokens, cfg.heldout_tokens)


# ---------------------------------------------------------------- the loop

def train(cfg: TrainConfig) -> dict:
    """Run the configured LoRA training; returns the final metrics (see the module docstring)."""
    check_config(cfg)  # every setting, before anything loads or is written
    dist = start(cfg)  # data parallel under torchrun (runtime/dist.py); else a single process
    try:
        with ExitStack() as stack, parallel.deferred_signals(dist):  # several: Ctrl-C stops every rank together
            with dist.agreed("taking the run folder"):  # one owner per run folder (rank 0): a second run is refused
                if dist.main:
                    stack.enter_context(RunLock(cfg.out_dir))
            out = Path(cfg.out_dir)
            try:
                return _train(cfg, out, dist)
            except OSError as e:  # the run's files (or a cache): name the path and the fix
                raise TrainError(f"{os_error_text(e, out)}; {kept(out)}") from e
    finally:
        dist.close()


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


def _train(cfg, out, dist) -> dict:
    device, dtype_name, dtype = resolve_device_dtype(cfg)
    device = dist.device or device  # data parallel on GPUs: cuda:LOCAL_RANK
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    say = print if cfg.progress and dist.main else (lambda *a, **k: None)  # other ranks print errors only
    with dist.agreed("checking the run folder and the device"):
        earlier = earlier_run(cfg, dist.world)  # every check before the weights load: a mistake fails fast
        say(f"lean-train: {describe(torch.device(device))}", flush=True)  # a GPU below sm_80 is refused here
        free = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else None
        done = finished_step(out, cfg) if cfg.resume else None
    free = parallel.least_free(free, dist)  # several GPUs: every rank plans for the smallest
    if done is not None and (out / "adapter").is_dir():  # nothing left to do (--resume --merge merges it)
        say(f"lean-train: the run in {out} finished at step {done}; its adapter is {out / 'adapter'}", flush=True)
        return {"step": done, "loss": None, "eval_loss": None, "eval_loss_before": None, "tokens": 0,
                "seconds": 0.0, "finished": True, "adapter": str(out / "adapter")}
    try:
        loaded = parallel.load_agreed(cfg, device, dtype_name, dtype, dist, _load, _setup)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"interrupted while loading, before anything was written to {out}: run the "
                                "same command again") from None
    model_dir, tok, train_docs, heldout, fingerprint, resume, model, lora, opt, eval_batches = loaded
    vocab = model.config.vocab
    sharded = gather_of(model) is not None
    if cfg.tables_on_host and model.device.type != "cuda":
        say("lean-train: --tables-on-host on the CPU: the tables are in host memory already")
    elif cfg.tables_on_host and sharded:
        say("lean-train: --tables-on-host under --shard-weights: the tables are off the GPU already (the "
            "embedding in host memory, the lm_head sharded over the GPUs)")
    if cfg.shard_weights and not sharded:
        say("lean-train: --shard-weights with one process: the weights stay whole (start several with torchrun)")
    if sharded and cfg.sample_tokens:  # a sample is one rank's generation; every rank holds a part of the layers
        say("lean-train: no greedy samples under --shard-weights (the held-out loss is reported)", flush=True)
        cfg = dataclasses.replace(cfg, sample_tokens=0)
    with dist.agreed("planning the step"):
        plan = default_plan(cfg, model, lora, free, say)
        if cfg.vram_budget is not None:
            plan = plan_for(model, lora, cfg.max_tokens, budget_bytes=int(cfg.vram_budget * 2**30))
        elif sharded and plan is None:  # every activation kept: the plan prices and prints the gathers
            plan = plan_for(model, lora, cfg.max_tokens)
    parallel.same_plan(plan, dist)  # hence the same graph or eager step on every rank
    if plan is not None and cfg.progress and dist.main:
        print(format_plan(plan), flush=True)
    step, epoch, index = 0, 0, 0
    with dist.agreed("preparing the run folder"):
        if dist.main:
            out = prepare_out_dir(cfg.out_dir, earlier)  # an earlier run goes only now (--overwrite)
        if resume is not None:
            st = restore_checkpoint(*resume, lora, opt)
            step, epoch, index = st["step"], st["epoch"], st["batch_index"]
    stream = DataStream(train_docs, cfg.max_tokens, cfg.seed, epoch, index)
    held = sum(len(d[0]) for d in heldout)
    ranks = f"; {dist.world} processes x {cfg.grad_accum} micro-batches a step" if dist.world > 1 else ""
    say(f"lean-train: {model.config.arch} from {model_dir} on {device} ({dtype_name}); "
        f"{len(train_docs)} training documents, {len(heldout)} held out ({held:,} tokens, at most "
        f"--heldout-tokens {cfg.heldout_tokens:,}); LoRA r={cfg.r} on {', '.join(lora.targets)} "
        f"({lora.params.numel():,} parameters){ranks}", flush=True)
    beside = dist.world == 1 and report_in_process(cfg, device, model)  # the report on a second core (report.py)
    jobs, after, finished = [], [], False
    resume_step = step if resume is not None else None
    with dist.agreed("opening the metrics"):
        metrics = Metrics(out, tensorboard=cfg.tensorboard, resume_step=resume_step) if dist.main else NoMetrics()
    with metrics:
        try:
            before = None
            # the untrained model's report, once: a run resumed at step 0 may not have logged it
            want = {"eval": bool(eval_batches), "sample": cfg.sample_tokens > 0} if step == 0 else {}
            want = dist.broadcast({k: v and (k, 0) not in metrics.kept for k, v in want.items()})  # rank 0's log
            if any(want.values()):
                job = None
                if beside:
                    job = ReportJob.start(_report_spec(cfg, model_dir, dtype_name, device,
                                                       heldout=heldout if want["eval"] else None,
                                                       tokens=cfg.sample_tokens if want["sample"] else 0))
                    jobs.append(job)
                before = Before(cfg, model, lora, tok, eval_batches if want["eval"] else [], metrics, job,
                                sample=want["sample"] and dist.main, dist=dist)
            def last_step():  # the adapter's sample beside the final evaluation: its process starts now
                if beside and cfg.sample_tokens > 0 and not (before is not None and before.job is not None):
                    after.append(ReportJob.start(_report_spec(cfg, model_dir, dtype_name, device,
                                                              adapter=out / "adapter"), wait=True))
                    jobs.append(after[0])
            result = _loop(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan,
                           fingerprint, before, last_step, dist)
            finished = True
        except torch.cuda.OutOfMemoryError as e:
            raise _oom_error(cfg, e) from e
        except KeyboardInterrupt as e:
            if e.args:  # the loop's own message
                raise
            raise KeyboardInterrupt(f"interrupted before step {step + 1} was trained: {kept(out)}") from None
        finally:  # the report before training is done; the final sample's process lives on if training did
            for job in jobs:
                if job not in after or not finished:
                    job.close()
        jobs = list(after)
        step = result["step"]
        try:
            job = after[0] if after else None
            if job is not None:
                job.go()  # the adapter is saved
            elif beside and cfg.sample_tokens > 0:  # the adapter's sample beside the final evaluation
                job = ReportJob.start(_report_spec(cfg, model_dir, dtype_name, device, adapter=out / "adapter"))
                jobs.append(job)
            if eval_batches:
                result["eval_loss"], n = evaluate(model, lora, eval_batches, show=cfg.progress, dist=dist)
            with dist.agreed("the final log and sample"):  # rank 0's: an error stops every rank with its text
                if eval_batches:
                    metrics.log({"kind": "eval", "step": step, "loss": result["eval_loss"], "targets": n})
                if result["eval_loss_before"] is not None:
                    say(f"held-out loss: {result['eval_loss_before']:.4f} before, {result['eval_loss']:.4f} after")
                result["sample_before"] = before.text if before is not None else None
                text = job.result()["sample"] if job is not None else None
                result["sample_after"] = (_sample(cfg, model, lora, tok, metrics, step, "after", say, text)
                                          if dist.main else None)
        except torch.cuda.OutOfMemoryError as e:
            raise _oom_error(cfg, e) from e
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"interrupted after training, in the final evaluation or sample: the adapter "
                                    f"of step {step} is saved in {out / 'adapter'} (the run is complete)") from None
        finally:
            for job in jobs:
                job.close()
    result["adapter"] = str(out / "adapter")
    return result


def _report_spec(cfg, model_dir, dtype_name, device, heldout=None, adapter=None, tokens=None) -> dict:
    """What the report process needs (report.py): the untrained model's report, or the adapter's sample."""
    return {"model_dir": str(model_dir), "dtype": dtype_name, "quant": cfg.quant, "adapter": str(adapter) if adapter else None,
            "lora": dict(r=cfg.r, alpha=cfg.alpha, targets=_targets(cfg.targets), dropout=cfg.dropout, seed=cfg.seed),
            "heldout": heldout, "budget": eval_budget(cfg, device), "prompt": cfg.sample_prompt,
            "tokens": cfg.sample_tokens if tokens is None else tokens}


class Before:
    """The untrained model's held-out loss and sample, logged and printed once: computed here
    before the first step, or (job: a ReportJob beside the training) taken after the first step's
    compute, before its log line, so the records keep their order."""

    def __init__(self, cfg, model, lora, tok, eval_batches, metrics, job=None, sample=True, dist=None):
        self.cfg, self.model, self.lora, self.tok, self.eval_batches = cfg, model, lora, tok, eval_batches
        self.metrics, self.job, self.text, self.sample, self.dist = metrics, job, None, sample, dist or Dist()

    def report(self, say):
        """Log and print the report; returns the held-out loss (None without a held-out set)."""
        cfg, got = self.cfg, self.job.result() if self.job is not None else None
        with self.dist.agreed("the sample before training"):  # rank 0's: every rank hears of an error
            if self.sample:
                text = got["sample"] if got else None
                self.text = _sample(cfg, self.model, self.lora, self.tok, self.metrics, 0, "before", say, text)
        if got:
            ev = got["eval"]
        else:
            ev = (evaluate(self.model, self.lora, self.eval_batches, show=cfg.progress, dist=self.dist)
                  if self.eval_batches else None)
        if ev is None:
            return None
        with self.dist.deferred():  # rank 0's file: an error stops every rank at the next exchange
            self.metrics.log({"kind": "eval", "step": 0, "loss": ev[0], "targets": ev[1]})
        say(f"held-out loss before training: {ev[0]:.4f} ({ev[1]} target tokens)", flush=True)
        return ev[0]


def expert_load(moe, cfg):
    """An MoE model's expert load in the step's (last) batch, for the metrics: the tokens each
    expert got, averaged over the MoE layers; their max and mean over the experts, and the ratio (1.0 = perfectly balanced; a
    captured step's padding tokens count too). With the load-balancing loss on, its value. {} for a
    dense model."""
    if moe is None:
        return {}
    counts = moe.counts.tolist()  # sync: log point
    L = max(len(cfg.moe_layers), 1)
    mean = sum(counts) / len(counts) / L
    out = {"expert_load_max": max(counts) / L, "expert_load_mean": mean,
           "expert_load_max_over_mean": max(counts) / L / mean if mean else 0.0}
    if moe.aux is not None:
        out["aux_loss"] = moe.aux.item()  # sync: log point
    return out


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


def _load(cfg, device, dtype_name, dtype, read=True, world=1, dist=None):
    """Model folder, tokenizer, documents, checkpoint (checked; read: here), weights (sharded over
    the ranks with --shard-weights). Several processes: parallel.load_agreed calls it on each."""
    model_dir = resolve_model(cfg.model, dtype_name)
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


def _setup(cfg, device, dtype_name, loaded):
    """(LoRA, AdamW, held-out batches) of what _load loaded; under --vram-budget on a GPU the early
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
            host_state = early_plan(model, cfg.r, _targets(cfg.targets), cfg.dropout, cfg.max_tokens,
                                    cfg.vram_budget, lora_state=cfg.lora_state if one else "device")
            if host_state and cfg.lora_state == "auto":
                print(f"lean-train: the step fits --vram-budget {cfg.vram_budget} GiB only with the LoRA's "
                      "master weights, gradients and AdamW moments in pinned host memory: moved there "
                      "(--lora-state host; each update crosses the bus)", flush=True)
        eval_batches = [pack(b, eval_budget(cfg, device), device=device, vocab=model.config.vocab)
                        for b in pack_batches(heldout, eval_budget(cfg, device), shuffle=False)] if heldout else []
        lora = LoRA.init(model, r=cfg.r, alpha=cfg.alpha, targets=_targets(cfg.targets), dropout=cfg.dropout,
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


def _sample(cfg, model, lora, tok, metrics, step, when, say, text=None):
    """The greedy answer to cfg.sample_prompt (text: computed by the report process), printed and
    logged; None when samples are off."""
    if cfg.sample_tokens <= 0:
        return None
    if text is None:
        text = sample(model, lora, tok, cfg.sample_prompt, max_new_tokens=cfg.sample_tokens)
    metrics.log({"kind": "sample", "step": step, "when": when, "prompt": cfg.sample_prompt, "text": text})
    say(f"sample {when} training: {cfg.sample_prompt!r} -> {text!r}", flush=True)
    return text


def _targets(targets):
    return targets[0] if isinstance(targets, (list, tuple)) and len(targets) == 1 else targets


def _oom_error(cfg, e, saved=None):
    so_far = (f"; the run so far is saved in {saved}: continue with the same command plus --resume once "
              "it fits (--max-tokens must stay; use --vram-budget)" if saved else "")
    return TrainError(f"out of GPU memory at max_tokens={cfg.max_tokens} ({e}): lower --max-tokens (raise "
                      "--grad-accum to keep the tokens per step), or set --vram-budget GiB to recompute/offload "
                      f"activations{so_far}")


GRAPH_DOCS = 256  # document slots of the captured step (a batch of more runs eagerly)


def _step_graph(cfg, model, lora, opt, device, plan, reducer=None, dist=None):
    """The captured step where it applies (see the module docstring), else None. Data parallel
    (reducer): the gradient's all-reduce is captured inside it; if the capture fails on any rank,
    every rank runs eagerly and the first says why (parallel.capture)."""
    if not (cfg.graph and device.startswith("cuda") and cfg.grad_accum == 1 and cfg.dropout == 0.0):
        return None
    if model.config.aux_loss_coef > 0:  # the load-balancing loss would count a captured step's padding
        return None
    if reducer is None:
        return StepGraph(model, lora, opt, budget=cfg.max_tokens, max_docs=GRAPH_DOCS, plan=plan)
    return parallel.capture(cfg, model, lora, opt, plan, reducer, dist, GRAPH_DOCS)


def _check_finite(out, step, lr, **values):
    """TrainError naming the first NaN/inf among values (loss, grad norm), raised before anything
    of this step is saved: the last checkpoint stays the last good one."""
    for name, x in values.items():
        if not math.isfinite(x):
            raise TrainError(f"{name.replace('_', ' ')} is {x} at step {step} (lr {lr:.3g}): start over with a "
                             "lower --lr (or a longer --warmup) and --overwrite, and check the data for broken "
                             f"records; the last checkpoint in {out / CHECKPOINT} is untouched")


def _loop(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan=None, fingerprint=None,
          before=None, last_step=None, dist=None):
    """The training steps from `step` to cfg.steps, the adapter saved at the end. last_step: called
    once as the last step starts (train() starts the final sample's process there). dist: data
    parallel (runtime/dist.py): each rank trains its share of a step, rank 0 writes."""
    out = Path(cfg.out_dir)
    dist = dist or Dist()
    reducer = GradReducer(lora, dist) if dist.world > 1 else None
    graph = _step_graph(cfg, model, lora, opt, device, plan, reducer, dist)
    eval_loss = eval_before = None
    say = print if cfg.progress and dist.main else (lambda *a, **k: None)
    if before is not None and before.job is None:  # computed here, before the first step
        eval_loss = eval_before = before.report(say)
    progress = Progress(step, cfg.steps, cfg.progress and dist.main)
    t_start, done_at_start, loss = time.time(), step, None
    tokens_total = 0
    # the last completed step's data position and dropout counter: what an interrupt saves
    pos, in_update = (stream.epoch, stream.index, lora.steps), False

    def state():  # the checkpoint of the last completed step
        return run_state(cfg, step, *pos, fingerprint, world=dist.world)

    try:
        while step < cfg.steps:
            t0 = time.time()
            if step == cfg.steps - 1 and last_step is not None:
                last_step()
            share = take_step(stream, dist, cfg.grad_accum)  # this rank's micro-batches (several: the step's counts)
            fits = graph is not None and parallel.graph_fits(graph, share)
            if not fits and graph is not None and plan is not None:
                # A budget has no room for the graph's memory and an eager step's: drop the graph.
                progress.write(f"step {step + 1}: {max(len(d) for d in share.every)} documents, more than the "
                               f"captured step's {graph.max_docs - 1}: under --vram-budget the graph is dropped and "
                               "the run goes on eagerly (a lower --max-tokens packs fewer documents a step)")
                graph = None
                torch.cuda.empty_cache()
            lr = lr_at(step + 1, cfg)
            if fits:  # the captured step: one replay
                with dist.agreed("the step"):  # several processes: every rank's batch packed, or all stop
                    fixed = graph.pack(share.docs[0], vocab=vocab)
                n_targets, n_tokens = ((share.n_targets, share.n_tokens) if dist.world > 1 else  # every rank's
                                       (fixed.n_targets, sum(fixed.doc_lens[:len(share.docs[0])])))  # not the padding
                in_update, base = True, lora.steps
                sums = [graph.step(fixed, lr=lr, n_targets=n_targets)[0]]
                lora.steps = base + share.count  # global micro-batches (the graph counted its own)
            else:
                sums, n_targets, n_tokens = parallel.eager_step(cfg, model, lora, share, device, vocab, plan, reducer,
                                                                dist)
                in_update = True
                opt.step(lr=lr)
            loss = dist.gather_loss(sums) / max(n_targets, 1)  # sync: log point (every rank's losses)
            grad_norm = opt.grad_norm.item()  # sync: log point (already complete; the same on every rank)
            _check_finite(out, step + 1, lr, loss=loss, grad_norm=grad_norm)
            # checked: the step counts as done (an interrupt from here on saves it)
            step, pos, in_update = step + 1, (stream.epoch, stream.index, lora.steps), False
            if before is not None and before.job is not None:  # computed beside step 1
                eval_before = before.report(lambda line, **k: progress.write(line))
                before.job = None
            dt = time.time() - t0
            tokens_total += n_tokens
            elapsed = time.time() - t_start
            eta = elapsed / (step - done_at_start) * (cfg.steps - step)
            load = expert_load(graph.moe if fits else model.cache.get("moe"), model.config)
            with dist.deferred():  # rank 0's files: an error stops every rank at the next exchange
                metrics.log({"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                             "tokens": n_tokens, "targets": n_targets, "tokens_per_s": n_tokens / dt, "seconds": dt,
                             **load})
            mem = f" mem {torch.cuda.max_memory_allocated() / 2**30:.2f}GiB" if device.startswith("cuda") else ""
            moe = f" experts max/mean {load['expert_load_max_over_mean']:.2f}" if load else ""
            progress.update(f"loss {loss:.4f} lr {lr:.2e} {n_tokens / dt:,.0f} tok/s{mem}{moe} eta {eta:.0f}s")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and eval_batches:
                eval_loss, n = evaluate(model, lora, eval_batches, show=cfg.progress, dist=dist)
                with dist.deferred():
                    metrics.log({"kind": "eval", "step": step, "loss": eval_loss, "targets": n})
                progress.write(f"step {step}: held-out loss {eval_loss:.4f}")
            if cfg.save_every and step % cfg.save_every == 0 and dist.main:
                with dist.deferred():
                    save_checkpoint(out, lora, opt, state())
    except torch.cuda.OutOfMemoryError as e:
        progress.close()
        if in_update or step == done_at_start:  # an update half done, or nothing new to keep
            raise
        try:  # the parameters are whole: an OOM leaves them as the last completed step left them
            saved = parallel.save_main(dist, out, lora, opt, state())
        except Exception:
            raise e from None
        raise _oom_error(cfg, e, saved) from e
    except RunStopped as e:  # a step failed on some rank; every rank is here with the same text
        progress.close()
        saved = None if step == done_at_start else parallel.save_agreed(dist, out, lora, opt, state())
        raise (_oom_error(cfg, e, saved) if e.oom else parallel.stopped(e, out, step, saved)) from e
    except RankLost as e:  # a rank died: no more collectives; rank 0 keeps what it safely can
        progress.close()
        saved = None
        if dist.main and not in_update and step > done_at_start:
            try:
                saved = save_checkpoint(out, lora, opt, state())
            except Exception:  # noqa: BLE001 - the message says what is kept
                saved = None
        raise parallel.stopped(e, out, step, saved) from e
    except KeyboardInterrupt as e:  # several processes: Interrupted, every rank at the same exchange
        progress.close()
        if in_update:
            raise KeyboardInterrupt(f"interrupted during the update of step {step + 1}, which cannot be saved: "
                                    f"{kept(out)}") from None
        raise _save_interrupted(out, lora, opt, state(), f"interrupted after step {step}", dist, e) from None
    progress.close()
    try:
        with dist.agreed("the final save"):  # rank 0 writes; every rank hears of an error
            if cfg.save_every and dist.main:
                save_checkpoint(out, lora, opt, state())
            if dist.main:
                lora.save(out / "adapter")  # before the final eval and sample: what trained is kept if they fail
    except KeyboardInterrupt as e:  # Interrupted: at the exchange, after rank 0's writes
        written = (f"its adapter written in {out / 'adapter'}" if isinstance(e, Interrupted) else
                   "before the adapter was written")
        raise _save_interrupted(out, lora, opt, state(), f"interrupted after the last step ({step}), {written}",
                                dist, e) from None
    return {"step": step, "loss": loss, "eval_loss": eval_loss, "eval_loss_before": eval_before, "tokens": tokens_total,
            "seconds": time.time() - t_start}


def _save_interrupted(out, lora, opt, state, what, dist=None, e=None) -> KeyboardInterrupt:
    """The checkpoint of a Ctrl-C saved; the KeyboardInterrupt to raise says what is saved and what
    to run next (a second Ctrl-C during the save leaves the previous checkpoint, and says so).
    Several processes: after a stop every rank agreed on (e: dist.Interrupted) rank 0 saves and
    every rank raises its words; after a second signal (no agreement) rank 0 saves, the others say so."""
    several = dist is not None and dist.world > 1
    if several and isinstance(e, Interrupted):
        what += parallel.who_stopped(e)
        return parallel.save_interrupted(dist, lambda: _save_interrupted(out, lora, opt, state, what), what, out)
    if several and not dist.main:
        return KeyboardInterrupt(f"{what}: rank 0 saves the checkpoint of step {state['step']} in "
                                 f"{out / CHECKPOINT}; continue with the same command plus --resume")
    try:
        save_checkpoint(out, lora, opt, state)
    except KeyboardInterrupt:
        return KeyboardInterrupt(f"{what}, and again while its checkpoint was written: the checkpoint of step "
                                 f"{state['step']} was not saved; {kept(out)}")
    return KeyboardInterrupt(f"{what}: checkpoint of step {state['step']} saved in {out / CHECKPOINT}; continue "
                             "with the same command plus --resume")
