"""The training loop behind `lean-train`: data -> packed micro-batches -> LoRA steps -> adapter.

    cfg = TrainConfig(model="model/or/x.gguf", data="data/", out_dir="out", steps=100)
    metrics = train(cfg)          # {"step", "loss", "eval_loss", "tokens", "seconds", "adapter"}

Three files, in the order a run goes: train_setup.py (device, model, data, checkpoint, weights,
LoRA state, the default plan), this file (train(): the run folder, the report before and after
training, the errors' last words) and train_loop.py (the steps, their logs, saves and interrupts).

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
paths, device), then out_dir's lock is taken (run_lock.RunLock: a second run on the folder is
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
import random
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .checkpoint import TrainError, earlier_run, finished_step, kept, prepare_out_dir, restore_checkpoint
from .dist import DIST_TIMEOUT, Dist, start
from .observe import Metrics, NoMetrics, sample
from .offload import gather_of
from . import parallel
from ..kernels.arch import describe
from .planner import format_plan, plan_for
from .report import ReportJob, report_in_process
from .run_lock import RunLock
from .settings import HELDOUT_TOKENS, check_config
# the run's two halves, re-exported: what comes before the first step, and the steps
from .train_setup import (build_data, default_plan, eval_budget, load_run, lora_targets, os_error_text,  # noqa: F401
                          resolve_device_dtype, resolve_model, setup_run)
from .train_loop import GRAPH_DOCS, DataStream, evaluate, expert_load, lr_at, oom_error, run_steps  # noqa: F401


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
        loaded = parallel.load_agreed(cfg, device, dtype_name, dtype, dist, load_run, setup_run)
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
            result = run_steps(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan,
                           fingerprint, before, last_step, dist)
            finished = True
        except torch.cuda.OutOfMemoryError as e:
            raise oom_error(cfg, e) from e
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
            raise oom_error(cfg, e) from e
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
            "lora": dict(r=cfg.r, alpha=cfg.alpha, targets=lora_targets(cfg.targets), dropout=cfg.dropout, seed=cfg.seed),
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
