"""lean-train's steps across several processes (torchrun): what every rank runs together, so that
all of them stay on one path. runtime/dist.py is the transport (ranks, exchanges, the gradient's
buckets); this file is the training loop's use of it (runtime/train.py and train_loop.py call in here).

    with deferred_signals(dist):                     # a first Ctrl-C / SIGTERM waits for the next exchange
        loaded = load_agreed(cfg, ..., dist, load, setup)   # every rank loads; rank 0 reads the checkpoint first
        sums, n_targets, n_tokens = eager_step(cfg, model, lora, share, ..., reducer, dist)
        loss, count = evaluate_shared(model, lora, batches, show, dist)

One process (dist.world 1) runs the same functions (eager_step, load_agreed) with every agreement
a no-op: the steps and their bits are those of the single-process loop.

What the ranks agree on, and where (each an exchange on the host, dist.agreed; an error on any rank
raises RunStopped with the same text on every rank, or Interrupted where a rank holds a signal):
  before loading       the run folder's checks (earlier_run, a finished run); then each GPU's free
                       memory, the smallest counting on every rank (least_free)
  loading              the model, data and rank 0's checkpoint read (then the others read it);
                       sharded weights: turn by turn, each turn an exchange inside "loading"
                       (shard.load_sharded; exchanges nest, dist.Dist.agreed)
  the plan's inputs    rank 0's measured rates (sharded weights: the gather buffers allocated, then
                       the all-gather's rate measured by every rank together, outside any
                       agreement) and the smallest host share, so that every rank's planner picks
                       the same plan (same_plan checks it: the modes and where the embedding and
                       lm_head live), hence the same graph or eager step
  setting up           LoRA, AdamW, the held-out batches (and early_plan under --vram-budget)
  the run folder       rank 0 prepares it and opens the metrics; every rank restores the checkpoint
  the captured step    its set-up, before the warm-up's all-reduces; then whether the capture
                       worked on every rank (capture; else every rank runs eagerly)
  each step            after its micro-batches (eager_step) or the captured step's pack; the loss is
                       exchanged after the update (dist.gather_loss)
  evaluation, samples  evaluate_shared's rounds; rank 0's samples
Stop signals (deferred_signals): torchrun (torch 2.13) forwards a Ctrl-C or SIGTERM to each
rank's process group one after the other, so each rank gets it at its own point of its step; a
rank that stopped there would leave the others waiting in a collective. A first signal is only
held (dist.signal) and carried by the next exchange; there every rank raises Interrupted, the
parameters are those of the last completed step, rank 0 saves that checkpoint and every rank
raises rank 0's message (save_interrupted). A second signal acts at once, as in one process
(without agreement: rank 0 saves, the others say so). torchrun sends SIGKILL
--shutdown_timeout seconds (30 by default) after its signal: the step in flight and rank 0's save
must end by then.
Tested: tests/test_dist.py (2 and 3 CPU processes: a SIGINT to one rank mid-step, errors, NaN,
OOM, a killed rank, sharded evaluation rounds). On GPUs (NCCL): the steps and their equalities
(tests/test_dist_gpu.py, 4 x H100); the agreement on errors is tested on gloo only.
"""
import signal
from contextlib import contextmanager

import torch

from .batch import pack
from .checkpoint import CHECKPOINT, TrainError, kept, read_checkpoint, save_checkpoint
from .dist import Interrupted, RankLost, RunStopped, step_ends
from .graph import StepGraph
from .offload import gather_of, measure_link, measure_rates
from .planner import host_share
from .step import forward_backward, loss_eval


# ---------------------------------------------------------------- stop signals

@contextmanager
def deferred_signals(dist):
    """Several processes: a first SIGINT or SIGTERM is held for the next exchange (dist.signal),
    where every rank stops together (dist.Interrupted); a second one acts at once. A signal is held
    only where its handler raises KeyboardInterrupt (SIGINT's default, lean-train's SIGTERM
    handler): that handler runs (lean-train notes SIGTERM for its exit status) and its
    KeyboardInterrupt is kept. One process, or off the main thread: nothing changes."""
    previous = {}

    def held(signum, frame):
        if dist.signal is not None:  # the second: as it would act without this
            return previous[signum](signum, frame)
        try:
            previous[signum](signum, frame)
        except KeyboardInterrupt:
            dist.signal = signum

    if dist.world > 1:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                prev = signal.getsignal(sig)
                if callable(prev):
                    previous[sig] = prev
                    signal.signal(sig, held)
        except ValueError:  # not the main thread: no handler can be set
            pass
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)


def who_stopped(e) -> str:
    """' (SIGINT to rank 1)' for an agreed stop; '' otherwise."""
    if not isinstance(e, Interrupted):
        return ""
    return " (" + ", ".join(f"{signal.Signals(sig).name} to rank {r}" for r, sig in e.signals) + ")"


def save_interrupted(dist, save, what, out) -> KeyboardInterrupt:
    """The stop every rank agreed on (Interrupted): rank 0 runs save() (the KeyboardInterrupt a
    single process would raise: what is saved, what to run next) and every rank raises its text.
    An error in rank 0's save is raised there; the other ranks say that the save failed."""
    text, error = None, None
    if dist.main:
        try:
            text = str(save())
        except Exception as e:  # noqa: BLE001 - raised below, once the others know
            error = e
    text = dist.broadcast(text)
    if error is not None:
        raise error
    return KeyboardInterrupt(text or f"{what}: rank 0 could not save the checkpoint (its error says why); {kept(out)}")


# ---------------------------------------------------------------- loading and planning

def load_agreed(cfg, device, dtype_name, dtype, dist, load, setup):
    """load() and setup() (runtime/train_setup.py's load_run, setup_run) on every rank, each agreed: rank 0
    reads the checkpoint first (it may set checkpoint.old in place of a broken one), the others
    after; between them the plan's inputs are shared (share_plan_inputs). A sharded load's turns
    are exchanges inside "loading": a rank that failed before them meets the others at the first
    turn with its error, and every rank stops there with the same text."""
    if dist.world == 1:
        loaded = load(cfg, device, dtype_name, dtype)
        return loaded + setup(cfg, device, dtype_name, loaded)
    with dist.agreed("loading"):
        loaded = load(cfg, device, dtype_name, dtype, read=dist.main, world=dist.world, dist=dist)
    if cfg.resume:  # rank 0 has read it (and set checkpoint.old in place of a broken one): the others now
        with dist.agreed("reading the checkpoint"):
            if not dist.main:
                loaded = loaded[:5] + (read_checkpoint(cfg.out_dir, cfg, loaded[4], dist.world),) + loaded[6:]
    share_plan_inputs(loaded[6], cfg.max_tokens, dist)
    with dist.agreed("setting up the LoRA"):
        rest = setup(cfg, device, dtype_name, loaded)
    return loaded + rest


def least_free(free, dist):
    """The smallest of every rank's free GPU memory (None on the CPU): the one budget all plan for."""
    return free if dist.world == 1 or free is None else min(dist.all(free, "the GPUs' free memory"))


def share_plan_inputs(model, n_tokens, dist):
    """What the planner reads that differs between ranks, made the same on every rank (model.cache):
    rank 0's measured rates (offload.measure_rates) and the smallest host share (planner.host_share).
    Sharded weights: the gather buffers are allocated under an agreement first, then every rank
    measures the all-gather's link rate together, outside any agreement (offload.measure_link: a
    collective that allocates nothing, so no rank waits in it for one that failed before it), and
    rank 0 measures the rest with layer 0 still gathered."""
    if dist.world == 1:
        return
    link = None
    if getattr(model, "shard", None) is not None:
        with dist.agreed("allocating the weights' gather buffers"):
            gather_of(model)
        if model.device.type == "cuda":
            link = measure_link(model)
    if model.device.type == "cuda":
        with dist.agreed("measuring the GPU's copy and GEMM rates"):
            rates = measure_rates(model, n_tokens, link=link) if dist.main else None
        model.cache["rates", n_tokens] = dist.broadcast(rates)
    model.cache["host"] = min(dist.all(host_share(), "the hosts' memory"))


def same_plan(plan, dist):
    """TrainError on every rank unless every rank's plan has the same layer modes and keeps the
    embedding and lm_head in the same place (their inputs are shared: this is the check)."""
    if dist.world == 1:
        return
    mine = None if plan is None else (plan.modes, plan.embed_host, plan.head_host)
    every = dist.all(mine, "comparing the plans")
    if any(p != every[0] for p in every):
        raise TrainError("the ranks planned different steps (" + "; ".join(f"rank {r}: {p}" for r, p in enumerate(every))
                         + ") although they share the planner's inputs: a bug in lean; please report it with these plans")


# ---------------------------------------------------------------- the step

def eager_step(cfg, model, lora, share, device, vocab, plan, reducer, dist):
    """This rank's micro-batches of the step, eagerly: zero-grad, forward_backward on each with the
    step's 1 / targets (several processes: the global count; dropout seeds of the global
    micro-batch index), the gradient's all-reduce under the last backward, then the step's
    agreement (an error here is raised on every rank, after the same collectives as every other
    rank's: dist.step_ends). Returns (device loss sums, n_targets, n_tokens) of the step (every
    rank's). One process: the single-process step (its counts from the packed batches)."""
    lora.zero_grad()
    base, sums, gather = lora.steps, [], gather_of(model)
    n_targets, n_tokens = share.n_targets, share.n_tokens
    if reducer is not None:
        reducer.begin()
    if gather is not None:
        gather.begin_step()
    try:
        with dist.agreed("the step"), step_ends(reducer, gather, len(share.docs)):
            if dist.pending is not None:  # a deferred error of rank 0's files: the step is lost anyway
                raise dist.pending
            batches = [pack(d, cfg.max_tokens, device=device, vocab=vocab) for d in share.docs]
            if n_targets is None:  # one process: host ints of the packed batches, no sync
                n_targets, n_tokens = sum(b.n_targets for b in batches), sum(b.n_tokens for b in batches)
            for j, b in enumerate(batches):
                lora.steps = base + share.first + j  # forward_backward draws seed number base + first + j + 1
                last = reducer if j == len(batches) - 1 else None
                loss_sum, _ = forward_backward(model, lora, b, grad_scale=1.0 / max(n_targets, 1), plan=plan,
                                               reducer=last)
                sums.append(loss_sum)
    finally:
        lora.steps = base + share.count
    return sums, n_targets, n_tokens


def evaluate_shared(model, lora, batches, show, dist):
    """runtime/train_loop.py's evaluate on several ranks: rank r evaluates batches r, r + world, ...;
    an error on any rank stops every rank at the exchange. Sharded weights: every rank runs as many
    forward passes (a rank out of batches runs the first again, not counted), since each pass
    gathers the layers together. Returns (mean loss, targets)."""
    mine, gather = batches[dist.rank::dist.world], gather_of(model)
    rounds = -(-len(batches) // dist.world) if gather is not None else len(mine)
    if gather is not None:
        gather.begin_step()
    with dist.agreed("the held-out evaluation") as box, step_ends(None, gather, rounds, backward=False):
        sums, count = [], 0
        for k in range(rounds):
            loss_sum, n = loss_eval(model, lora, mine[k] if k < len(mine) else batches[0])
            if k < len(mine):
                sums.append(loss_sum)
                count += n
        box.values = [sum(t.item() for t in sums), count]  # sync: eval point
    total, count = box.sums
    return total / max(count, 1), count


def capture(cfg, model, lora, opt, plan, reducer, dist, max_docs):
    """The captured step with the gradient's all-reduce inside, or None where the capture failed on
    any rank (every rank then runs eagerly; the first says why)."""
    graph, why, agreed = None, None, False
    try:
        graph = StepGraph(model, lora, opt, budget=cfg.max_tokens, max_docs=max_docs, plan=plan, reducer=reducer)
    except RankLost:
        raise
    except RunStopped as e:  # its set-up failed on some rank: every rank is here with the same text
        why, agreed = str(e), True
    except Exception as e:  # noqa: BLE001 - every rank falls back together
        why = f"rank {dist.rank}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    failed = agreed or dist.exchange([why is not None], what="capturing the step")[0]
    if not failed:
        return graph
    if why is not None and (dist.main or not agreed):
        print(f"lean-train: the captured step with its all-reduce inside failed ({why}); every rank "
              "runs the step eagerly (--no-graph skips the attempt)", flush=True)
    graph = None
    torch.cuda.empty_cache()
    return None


def graph_fits(graph, share):
    """Every rank's batch of the step fits the graph's document slots (the padding document takes
    one): decided from the host's view of every rank's micro-batch, so all ranks agree."""
    return all(len(d) < graph.max_docs for d in share.every)


# ---------------------------------------------------------------- stopping

def save_agreed(dist, out, lora, opt, state):
    """The last completed step's checkpoint, saved by rank 0 after a step failed on some rank (the
    parameters are whole: the update had not begun); every rank learns its path, or None."""
    saved = None
    if dist.main:
        try:
            saved = str(save_checkpoint(out, lora, opt, state))
        except Exception:  # noqa: BLE001 - the message then names the checkpoint kept
            saved = None
    return dist.broadcast(saved)


def save_main(dist, out, lora, opt, state):
    """save_checkpoint on rank 0, the only rank that writes; the checkpoint's path on every rank."""
    return save_checkpoint(out, lora, opt, state) if dist.main else out / CHECKPOINT


def stopped(e, out, step, saved) -> TrainError:
    """The TrainError of a run stopped by another rank: the cause, then what is saved."""
    if saved:
        return TrainError(f"{e}: the checkpoint of step {step} is saved in {saved}: continue with the same "
                          "command plus --resume")
    return TrainError(f"{e}: {kept(out)}")
