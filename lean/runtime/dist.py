"""Data parallel over torch.distributed: the ranks, each step's share of the micro-batches, and the
agreement that keeps every rank on the same path (the bucketed gradient all-reduce: grad_reduce.py).

    torchrun --nproc-per-node 4 -m lean.cli --model ... --data ... --out run1     # or lean-train
    dist = start(cfg)          # world 1 (no WORLD_SIZE in the environment): a Dist that does nothing
    share = take_step(stream, dist, grad_accum)    # this rank's micro-batches, the step's global counts
    reducer = GradReducer(lora, dist)              # grad_reduce.py: the flat LoRA gradient in per-layer buckets

Ranks: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A GPU run
uses NCCL on cuda:LOCAL_RANK, a CPU run gloo; both with the process-group timeout `dist_timeout`
(a collective that waits longer raises). Host-side agreement (exchange) runs on a gloo group of
its own beside NCCL, so it never touches the device. NVLink multicast stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set where the environment does not
set them, and nothing here calls multimem or symmetric-memory APIs.

The data (take_step): every rank packs all the training documents as a single process would
(pack_batches(seed=seed + epoch), deterministic), walks the same global micro-batch stream and
takes a step's world x grad_accum micro-batches from it; rank r trains micro-batches
[r*G, (r+1)*G) of them (G = grad_accum). So the union over ranks of a step is exactly the step of
one process run with grad_accum = world x G, and the data position (epoch, index) means the same
for any world size: a checkpoint resumes under another world size when world x grad_accum stays
the same (checkpoint.py refuses anything else, naming both). Every rank knows every micro-batch of
the step on the host, so the global target count (the loss normalisation 1 / targets of the whole
step) and the step's token count need no communication (batch.count_tokens). Dropout seeds are
those of the global micro-batch index (lora.steps counts global micro-batches).

The gradient: GradReducer (runtime/grad_reduce.py), the flat LoRA gradient all-reduced in per-layer
buckets under the backward.

Agreement (exchange, agreed): at each step boundary, before the update, the ranks exchange on the
host (gloo, a few hundred bytes) whether their step raised; an error on any rank (an OOM, a bad
batch, a deferred failure of rank 0's checkpoint or metrics write) raises RunStopped with the same
text on every rank, after every rank has issued the same collectives (a rank that failed mid-step
issues the rest of its step's gathers and buckets first: step_ends). `with dist.agreed(what):`
wraps any such block: a rank's error is held to the block's end and then raised on every rank.
The exchange also carries a stop signal: under several processes a first Ctrl-C or SIGTERM only
sets a flag (runtime/parallel.py, deferred_signals); torchrun signals each rank at its own point of
its step, so the ranks stop together at the next exchange (Interrupted, a KeyboardInterrupt, on
every rank), where the parameters are whole, and rank 0 saves. An error outranks a signal.
The per-step loss: each rank reads its own micro-batches' loss sums (the log point's sync) and the
ranks exchange them over gloo, summed on the host in global micro-batch order (the single-process
order), so the NaN/inf check sees one value on every rank and a dead peer is found by gloo, not by
a device wait. A rank that dies outright is found by the next collective (gloo: the connection
closes at once; NCCL: its timeout, or the next gloo exchange): RankLost names the rank(s) whose
process is gone (this host's PIDs) and the surviving ranks stop with an error instead of waiting.
Only a collective's own failure counts as a lost rank (collective(): an OOM, a CUDA error or a
TrainError raised inside one is raised as it is).

The captured step (graph.StepGraph(..., reducer=)) holds the same bucket all-reduces: torch records
NCCL collectives issued during a capture into the graph; lean-train builds it on every rank at
once (the warm-up creates the communicator outside the capture) and, if the capture fails on any
rank, every rank runs eagerly and says so. Sharded frozen weights: runtime/shard.py; their
gathers run on a process group of their own (Dist.gathers: its own NCCL communicator and stream),
so a gather issued ahead never queues behind a bucket's all-reduce. The ranks issue both kinds in
the same program order, as NCCL asks of two communicators used at once.

Equal to one process: after k steps the LoRA parameters equal those of a single-process run with
grad_accum = world x G over the same micro-batches to fp32 rounding (the gradient sums in another
order; with 2 ranks and G = 1 the sum of two partials is one commutative add: the same bits);
tests/test_dist.py (CPU, gloo, 2 and 3 processes through the interpreter); tests/test_dist_gpu.py
holds the same in bf16 on 2 GPUs with NCCL and the captured step (passed on 4 x H100, 2026-11-26).
Caution: a rank's out_dir must be readable by every rank (checkpoints are read by all, written by
rank 0): one machine, or a shared file system.
"""
import datetime
import os
import socket
from contextlib import contextmanager
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as torch_dist

from .batch import count_tokens
from .checkpoint import TrainError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DIST_TIMEOUT = 900  # seconds a collective may wait (--dist-timeout)


class RunStopped(TrainError):
    """A step failed on some rank: every rank raises this with the same text (see exchange)."""

    def __init__(self, text, failures=()):
        super().__init__(text)
        self.failures = list(failures)  # [(rank, kind, text)], kind "oom" or "error"

    @property
    def oom(self):
        return any(kind == "oom" for _, kind, _ in self.failures)


class RankLost(TrainError):
    """A collective failed: a rank died or stopped answering within the timeout."""


class Interrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM) reached some rank: every rank raises this at the same exchange."""

    def __init__(self, signals=()):
        super().__init__()
        self.signals = list(signals)  # [(rank, signal number)] of the ranks that had one


# Raised inside a collective call but not a failure of the collective: raised as they are.
NOT_LOST = (torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.cuda.OutOfMemoryError), TrainError)


def env_ranks():
    """(rank, world, local_rank) from torchrun's environment; (0, 1, 0) outside it."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    return rank, world, int(os.environ.get("LOCAL_RANK", str(rank)) or 0)


def _describe(e) -> tuple:
    """(kind, one-line text) of a rank's exception, for the others."""
    kind = "oom" if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) else "error"
    if isinstance(e, OSError) and e.filename:
        text = f"{e.filename}: {e.strerror or e}"
    elif isinstance(e, (TrainError, ValueError, torch.cuda.OutOfMemoryError)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}"
    return kind, " ".join(text.split())


class Dist:
    """This process's place in the run. world 1: every method is the single-process no-op."""

    def __init__(self, rank=0, world=1, local_rank=0, device=None, ctrl=None, peers=(), gathers=None):
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device
        self.ctrl = ctrl  # the gloo group of the host-side exchanges
        self.gathers = gathers  # sharded weights: the process group of the weights' all-gathers (None: the default)
        self.peers = list(peers)  # (hostname, pid) of every rank
        self.pending = None  # an error of this rank deferred to the next exchange (deferred())
        self.signal = None  # a stop signal this rank received, held for the next exchange (parallel.deferred_signals)
        self.graphs = []  # CUDA graphs holding this run's collectives (StepGraph): released before close

    @property
    def main(self):
        return self.rank == 0

    @contextmanager
    def collective(self, what):
        """Around a collective call: its failure (a dead or silent peer; gloo says "Connection closed
        by peer", NCCL raises DistBackendError) becomes RankLost; an OOM, a CUDA error or a
        TrainError raised in it is raised as it is."""
        try:
            yield
        except NOT_LOST:
            raise
        except RuntimeError as e:
            raise self.lost(e, what) from e

    def all(self, obj, what):
        """Every rank's obj (host, pickled), in rank order, over the gloo group."""
        got = [None] * self.world
        with self.collective(what):
            torch_dist.all_gather_object(got, obj, group=self.ctrl)
        return got

    def exchange(self, values=(), error=None, what="the step"):
        """Every rank's `values` (host numbers) summed, once every rank has reported; RunStopped
        with the same text on every rank when any rank reports an error (`error`, or one kept by
        deferred()); else Interrupted on every rank when any rank holds a stop signal. World 1:
        the values as given, the error raised as it is."""
        error = error if error is not None else self.pending
        self.pending = None
        if self.world == 1:
            if error is not None:
                raise error
            return list(values)
        got = self.all((list(values), None if error is None else (*_describe(error), what), self.signal), what)
        failures = [(r, err[0], err[1]) for r, (_, err, _) in enumerate(got) if err is not None]
        if failures:  # named by the first failing rank's block: the same text on every rank (agreed() nests)
            where = got[failures[0][0]][1][2]
            raise RunStopped(_agreed(failures, where, self.world), failures) from error
        signals = [(r, sig) for r, (_, _, sig) in enumerate(got) if sig is not None]
        if signals:
            raise Interrupted(signals)
        return [sum(v[i] for v, _, _ in got) for i in range(len(values))]

    @contextmanager
    def agreed(self, what):
        """A block every rank runs, ended by an exchange: an error in it on any rank raises
        RunStopped with the same text on every rank (a stop signal: Interrupted). The block may
        set box.values (host numbers), summed over the ranks into box.sums. World 1: the block as
        it is (an error raises at once), box.sums = box.values.

            with dist.agreed("the held-out evaluation") as box:
                box.values = [loss_sum, targets]
            total, count = box.sums

        What a block may hold: work of its own rank (rank 0's writes, allocations, a plan) and
        further exchanges or agreed blocks: every exchange is the same call on the same gloo
        group, so a rank that failed before an inner one meets the others there with its error,
        and every rank stops (RunStopped and RankLost pass through). No other collective: a rank
        that failed before it would wait at the block's exchange while the others wait in the
        collective, until the timeout. The step's gathers and buckets are the one exception,
        because a failed rank issues the rest of them first (step_ends)."""
        box = SimpleNamespace(values=(), sums=None)
        if self.world == 1:
            yield box
            box.sums = list(box.values)
            return
        error = None
        try:
            yield box
        except (RankLost, RunStopped):  # no exchange is possible any more, or it was agreed already
            raise
        except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange
            error = e
        box.sums = self.exchange(box.values if error is None else [0] * len(box.values), error, what)

    def broadcast(self, obj):
        """Rank 0's obj on every rank (host, pickled)."""
        if self.world == 1:
            return obj
        box = [obj]
        with self.collective("a broadcast from rank 0"):
            torch_dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    @contextmanager
    def deferred(self):
        """Run this rank's own work (rank 0's metrics and checkpoint writes): with world 1 an error
        raises as it is; otherwise it is kept and reported at the next exchange, where every rank
        stops together (raising here would leave the others waiting in a collective)."""
        if self.world == 1:
            yield
            return
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every error goes to the others, none is dropped
            self.pending = self.pending or e

    def gather_loss(self, sums):
        """The step's loss sum over every rank's micro-batches: each rank reads its own (1,) device
        loss sums (the log point), the ranks exchange them on the host (gloo) and add them in
        global micro-batch order (the single-process order)."""
        mine = [t.item() for t in sums]  # sync: log point
        if self.world == 1:
            return sum(mine)
        return sum(x for part in self.all(mine, "the step's losses") for x in part)

    def lost(self, e, what) -> RankLost:
        """RankLost for a failed collective: the ranks whose process is gone (on this host), or the
        backend's own words when none is known to be."""
        here = socket.gethostname()
        dead = [r for r, (host, pid) in enumerate(self.peers) if host == here and r != self.rank and not _alive(pid)]
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        who = (", ".join(f"rank {r} (PID {self.peers[r][1]})" for r in dead) + " exited" if dead else
               f"another rank stopped answering ({first})")
        return RankLost(f"rank {self.rank}: {who} during {what}; the run stops here")

    def hold_graph(self, graph):
        """A captured CUDA graph with this run's NCCL work in it: NCCL's communicator cannot be destroyed
        while such a graph lives (ncclCommDestroy waits for it), so close() releases it first."""
        self.graphs.append(graph)

    def close(self):
        for g in self.graphs:  # first: with one alive, destroy_process_group can hang in ncclCommDestroy
            g.reset()
        self.graphs.clear()
        if self.world > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def _alive(pid) -> bool:
    """The process exists and is no zombie (a killed child its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _agreed(failures, what, world) -> str:
    """The one text every rank raises for these failures."""
    texts = {text for _, _, text in failures}
    if len(failures) == world and len(texts) == 1:  # every rank, the same cause (bad data, a setting)
        return texts.pop()
    return "; ".join(f"rank {r}: {text}" for r, _, text in failures) + f" (in {what})"


def device_of(cfg_device, local_rank, world):
    """This rank's device: cuda:LOCAL_RANK for a CUDA run of several processes."""
    device = cfg_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if world == 1 or not device.startswith("cuda"):
        return device
    if ":" in device:
        raise TrainError(f"--device {device} with {world} processes: each process takes the GPU of its "
                         "LOCAL_RANK; pass --device cuda or leave --device out")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise TrainError(f"LOCAL_RANK {local_rank}: this machine has {n} CUDA GPU(s): start at most {n} "
                         "processes a machine (torchrun --nproc-per-node)")
    return f"cuda:{local_rank}"


def start(cfg) -> Dist:
    """This process's Dist: torchrun's environment joined into a process group (NCCL on a GPU, gloo
    on the CPU) with cfg.dist_timeout, a gloo group for the host exchanges (the default group on
    the CPU) and, with cfg.shard_weights, a group of the weights' all-gathers; world 1: Dist()."""
    rank, world, local = env_ranks()
    if world == 1:
        return Dist()
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    device = device_of(cfg.device, local, world)
    timeout = datetime.timedelta(seconds=getattr(cfg, "dist_timeout", DIST_TIMEOUT))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    try:
        torch_dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                      device_id=torch.device(device) if cuda else None)
        ctrl = torch_dist.new_group(backend="gloo", timeout=timeout) if cuda else torch_dist.group.WORLD
        gathers = (torch_dist.new_group(backend="nccl" if cuda else "gloo", timeout=timeout)
                   if getattr(cfg, "shard_weights", False) else None)
        peers = [None] * world
        torch_dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=ctrl)
    except (RuntimeError, ValueError) as e:
        raise TrainError(f"rank {rank}: could not join the {world} processes' group ({' '.join(str(e).split())[:300]}): "
                         "start every process with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and "
                         "MASTER_PORT), and check that none is left from an earlier run") from e
    return Dist(rank, world, local, device, ctrl, peers, gathers)


class StepShare(NamedTuple):
    """One optimizer step as this rank sees it."""
    docs: list  # this rank's micro-batches (lists of documents), grad_accum of them
    first: int  # global index of its first micro-batch within the step
    count: int  # micro-batches of the step over every rank (world x grad_accum)
    n_targets: int  # target tokens over every rank's micro-batches (the loss normalisation); None with one
    n_tokens: int  # tokens over every rank's micro-batches; None with one process (the packed batches say)
    every: list  # every rank's micro-batches, in global order


def take_step(stream, dist, grad_accum) -> StepShare:
    """The next step's world x grad_accum micro-batches from the global stream (runtime/train_loop.py's
    DataStream), this rank's share of them and, with several processes, the step's global counts
    (host only; one process reads them from its packed batches)."""
    every = [stream.next() for _ in range(dist.world * grad_accum)]
    first = dist.rank * grad_accum
    n_tokens, n_targets = count_tokens([d for batch in every for d in batch]) if dist.world > 1 else (None, None)
    return StepShare(every[first:first + grad_accum], first, len(every), n_targets, n_tokens, every)


@contextmanager
def step_ends(reducer, gather, passes, backward=True):
    """Around this rank's passes of a step (or of an evaluation round): whatever happens in them,
    the step's collectives end as every other rank's do. An Exception in the block: first the
    rest of the passes' gathers and the buckets after their layers (gather.complete, sharded
    weights), then the re-raise; then, or after the block, every bucket launched and waited on
    (reducer.finish). A KeyboardInterrupt (a second Ctrl-C), RankLost (a collective failed: no
    more can be issued) and RunStopped go through as they are. reducer,
    gather: None where there is none (one process: nothing to do).

        with step_ends(reducer, gather_of(model), len(micro_batches)):
            for b in micro_batches: forward_backward(...)
    """
    try:
        yield
    except (RankLost, RunStopped):  # a collective failed, or every rank stops already: nothing more to issue
        raise
    except Exception:
        if gather is not None:
            gather.complete(passes, reducer, backward)
        if reducer is not None:
            reducer.finish()
        raise
    if reducer is not None:
        reducer.finish()
