"""The training steps behind `lean-train` (runtime/train.py sets them up and reports around them):
from a step to cfg.steps, each one packed, run (replayed from the captured graph where it applies,
else eagerly), checked for NaN/inf, logged, evaluated and checkpointed on schedule; the adapter
saved after the last. An OOM, a Ctrl-C, a rank that stops or dies: the last completed step is
checkpointed where that is safe, and the error says what is kept and what to run next.

What a step computes, the data order, resume and the several-process rules: runtime/train.py's
docstring. Tested: tests/test_train.py, tests/test_dist.py, tests/test_cli_guard.py.
"""
import math
import time
from pathlib import Path

import torch

from .checkpoint import CHECKPOINT, TrainError, kept, run_state, save_checkpoint
from .data import pack_batches
from .dist import Dist, Interrupted, RankLost, RunStopped, take_step
from .grad_reduce import GradReducer
from .graph import StepGraph
from .observe import Progress
from . import parallel
from .step import loss_eval


def rate(per_s):
    """A throughput for the progress bar: whole numbers with separators, three digits below 100
    (the CPU interpreter's 1.6 tok/s is not 2)."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.3g}"


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


def oom_error(cfg, e, saved=None):
    so_far = (f"; the run so far is saved in {saved}: continue with the same command plus --resume once "
              "it fits (--max-tokens must stay; use --vram-budget)" if saved else "")
    return TrainError(f"out of GPU memory at max_tokens={cfg.max_tokens} ({e}): lower --max-tokens (raise "
                      "--grad-accum to keep the tokens per step), or set --vram-budget GiB to recompute/offload "
                      f"activations{so_far}")


GRAPH_DOCS = 256  # document slots of the captured step (a batch of more runs eagerly)


def step_graph(cfg, model, lora, opt, device, plan, reducer=None, dist=None):
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


def check_finite(out, step, lr, **values):
    """TrainError naming the first NaN/inf among values (loss, grad norm), raised before anything
    of this step is saved: the last checkpoint stays the last good one."""
    for name, x in values.items():
        if not math.isfinite(x):
            raise TrainError(f"{name.replace('_', ' ')} is {x} at step {step} (lr {lr:.3g}): start over with a "
                             "lower --lr (or a longer --warmup) and --overwrite, and check the data for broken "
                             f"records; the last checkpoint in {out / CHECKPOINT} is untouched")


def run_steps(cfg, model, lora, opt, stream, eval_batches, step, metrics, device, vocab, plan=None, fingerprint=None,
          before=None, last_step=None, dist=None):
    """The training steps from `step` to cfg.steps, the adapter saved at the end. last_step: called
    once as the last step starts (train() starts the final sample's process there). dist: data
    parallel (runtime/dist.py): each rank trains its share of a step, rank 0 writes."""
    out = Path(cfg.out_dir)
    dist = dist or Dist()
    reducer = GradReducer(lora, dist) if dist.world > 1 else None
    graph = step_graph(cfg, model, lora, opt, device, plan, reducer, dist)
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
            check_finite(out, step + 1, lr, loss=loss, grad_norm=grad_norm)
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
            progress.update(f"loss {loss:.4f} lr {lr:.2e} {rate(n_tokens / dt)} tok/s{mem}{moe} eta {eta:.0f}s")
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
        raise oom_error(cfg, e, saved) from e
    except RunStopped as e:  # a step failed on some rank; every rank is here with the same text
        progress.close()
        saved = None if step == done_at_start else parallel.save_agreed(dist, out, lora, opt, state())
        raise (oom_error(cfg, e, saved) if e.oom else parallel.stopped(e, out, step, saved)) from e
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
        raise save_interrupted(out, lora, opt, state(), f"interrupted after step {step}", dist, e) from None
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
        raise save_interrupted(out, lora, opt, state(), f"interrupted after the last step ({step}), {written}",
                                dist, e) from None
    return {"step": step, "loss": loss, "eval_loss": eval_loss, "eval_loss_before": eval_before, "tokens": tokens_total,
            "seconds": time.time() - t_start}


def save_interrupted(out, lora, opt, state, what, dist=None, e=None) -> KeyboardInterrupt:
    """The checkpoint of a Ctrl-C saved; the KeyboardInterrupt to raise says what is saved and what
    to run next (a second Ctrl-C during the save leaves the previous checkpoint, and says so).
    Several processes: after a stop every rank agreed on (e: dist.Interrupted) rank 0 saves and
    every rank raises its words; after a second signal (no agreement) rank 0 saves, the others say so."""
    several = dist is not None and dist.world > 1
    if several and isinstance(e, Interrupted):
        what += parallel.who_stopped(e)
        return parallel.save_interrupted(dist, lambda: save_interrupted(out, lora, opt, state, what), what, out)
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
