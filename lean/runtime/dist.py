"""Data parallel over torch.distributed: the ranks, each step's share of the micro-batches, the
bucketed gradient all-reduce, and the agreement that keeps every rank on the same path.

    torchrun --nproc-per-node 4 -m lean.cli --model ... --data ... --out run1     # or lean-train
    dist = start(cfg)          # world 1 (no WORLD_SIZE in the environment): a Dist that does nothing
    share = take_step(stream, dist, grad_accum)    # this rank's micro-batches, the step's global counts
    reducer = GradReducer(lora, dist)              # the flat LoRA gradient in per-layer buckets

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
step) and the step's token count need no communication (batch.count_targets). Dropout seeds are
those of the global micro-batch index (lora.steps counts global micro-batches).

The gradient (GradReducer): each rank's forward_backward adds grad_scale * its token losses'
gradient into lora.grads with grad_scale = 1 / (global targets), so the SUM over ranks is the
step's gradient. lora.grads is laid out layer-major (lora.py), so a run of consecutive layers is a
contiguous slice: the buckets are layer 0 alone (the last layer the backward finishes: what cannot
hide is small), then runs of layers of about BUCKET_BYTES going up. In the last micro-batch of a
step, step._backward_layers calls layer_done(li) after layer li's backward; when li is the lowest
layer of a bucket, its all-reduce is launched asynchronously (dist.all_reduce(async_op=True)), so
it runs under the backward of the layers below. On a GPU, ProcessGroupNCCL runs it on its own
communication stream, which first waits on an event of the issuing (compute) stream: exactly "wait
for the bucket's last layer, then reduce", with no host sync; finish() makes the compute stream wait
for every bucket before AdamW (its clipping reads the whole gradient). On the CPU gloo runs the
same calls on its own threads. After the reduction every rank holds the same gradient bits, so the
grad norm, the clipping, the update and the NaN check agree without more communication.

Agreement (exchange): at each step boundary, before the update, the ranks exchange on the host
(gloo, a few hundred bytes) whether their step raised; an error on any rank (an OOM, a bad batch,
a deferred failure of rank 0's checkpoint or metrics write) raises RunStopped with the same text
on every rank, after every rank has issued the same collectives (a rank that failed mid-backward
launches its remaining buckets in finish()). The per-step loss is all-gathered (each micro-batch's
loss sum, summed on the host in the single-process order), so the NaN/inf check sees one value. A
rank that dies outright is found by the next collective (gloo: the connection closes at once; any
backend: the timeout): RankLost names the rank(s) whose process is gone (this host's PIDs) and the
surviving ranks stop with an error instead of waiting.

The captured step (graph.StepGraph(..., reducer=)) holds the same bucket all-reduces: torch records
NCCL collectives issued during a capture into the graph; lean-train builds it on every rank at
once (the warm-up creates the communicator outside the capture) and, if the capture fails on any
rank, every rank runs eagerly and says so. Sharded frozen weights: runtime/shard.py.

Equal to one process: after k steps the LoRA parameters equal those of a single-process run with
grad_accum = world x G over the same micro-batches to fp32 rounding (the gradient sums in another
order; with 2 ranks and G = 1 the sum of two partials is one commutative add: the same bits);
tests/test_dist.py (CPU, gloo, 2 and 3 processes through the interpreter); tests/test_dist_gpu.py
holds the same in bf16 on 2 GPUs with NCCL and the captured step (written; not run yet).
Caution: a rank's out_dir must be readable by every rank (checkpoints are read by all, written by
rank 0): one machine, or a shared file system.
"""
import datetime
import os
import socket
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as torch_dist

from .batch import count_targets
from .checkpoint import TrainError
from .lora import _numel

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BUCKET_BYTES = 25 << 20  # DDP's default bucket; Qwen3-8B's r=16 gradient (174 MB) in 8 buckets
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

    def __init__(self, rank=0, world=1, local_rank=0, device=None, ctrl=None, peers=()):
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device
        self.ctrl = ctrl  # the gloo group of the host-side exchanges
        self.peers = list(peers)  # (hostname, pid) of every rank
        self.pending = None  # an error of this rank deferred to the next exchange (deferred())

    @property
    def main(self):
        return self.rank == 0

    def exchange(self, values=(), error=None, what="the step"):
        """Every rank's `values` (host numbers) summed, once every rank has reported; RunStopped
        with the same text on every rank when any rank reports an error (`error`, or one kept by
        deferred()). World 1: the values as given, the error raised as it is."""
        error = error if error is not None else self.pending
        self.pending = None
        if self.world == 1:
            if error is not None:
                raise error
            return list(values)
        got = [None] * self.world
        try:
            torch_dist.all_gather_object(got, (list(values), None if error is None else _describe(error)), group=self.ctrl)
        except RuntimeError as e:
            raise self.lost(e, what) from e
        failures = [(r, *err) for r, (_, err) in enumerate(got) if err is not None]
        if failures:
            raise RunStopped(_agreed(failures, what, self.world), failures) from error
        return [sum(v[i] for v, _ in got) for i in range(len(values))]

    def broadcast(self, obj):
        """Rank 0's obj on every rank (host, pickled)."""
        if self.world == 1:
            return obj
        box = [obj]
        try:
            torch_dist.broadcast_object_list(box, src=0, group=self.ctrl)
        except RuntimeError as e:
            raise self.lost(e, "a broadcast from rank 0") from e
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
        """The step's loss sum over every rank's micro-batches: each rank's (1,) device loss sums,
        all-gathered and added on the host in global micro-batch order (the single-process order)."""
        if self.world == 1:
            return sum(t.item() for t in sums)  # sync: log point
        mine = torch.empty(len(sums), dtype=torch.float32, device=sums[0].device)  # (G,)
        for j, t in enumerate(sums):
            mine[j:j + 1].copy_(t)
        every = torch.empty(self.world * len(sums), dtype=torch.float32, device=mine.device)  # (world*G,)
        try:
            torch_dist.all_gather_single(every, mine)
        except RuntimeError as e:
            raise self.lost(e, "the loss's all-gather") from e
        return sum(every.tolist())  # sync: log point

    def lost(self, e, what) -> RankLost:
        """RankLost for a failed collective: the ranks whose process is gone (on this host), or the
        backend's own words when none is known to be."""
        here = socket.gethostname()
        dead = [r for r, (host, pid) in enumerate(self.peers) if host == here and r != self.rank and not _alive(pid)]
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        who = (", ".join(f"rank {r} (PID {self.peers[r][1]})" for r in dead) + " exited" if dead else
               f"another rank stopped answering ({first})")
        return RankLost(f"rank {self.rank}: {who} during {what}; the run stops here")

    def close(self):
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
    on the CPU) with cfg.dist_timeout, plus a gloo group for the host exchanges; world 1: Dist()."""
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
    except (RuntimeError, ValueError) as e:
        raise TrainError(f"rank {rank}: could not join the {world} processes' group ({' '.join(str(e).split())[:300]}): "
                         "start every process with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and "
                         "MASTER_PORT), and check that none is left from an earlier run") from e
    ctrl = torch_dist.new_group(backend="gloo", timeout=timeout) if cuda else torch_dist.group.WORLD
    peers = [None] * world
    torch_dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=ctrl)
    return Dist(rank, world, local, device, ctrl, peers)


class StepShare(NamedTuple):
    """One optimizer step as this rank sees it."""
    docs: list  # this rank's micro-batches (lists of documents), grad_accum of them
    first: int  # global index of its first micro-batch within the step
    count: int  # micro-batches of the step over every rank (world x grad_accum)
    n_targets: int  # target tokens over every rank's micro-batches (the loss normalisation)
    n_tokens: int  # tokens over every rank's micro-batches
    every: list  # every rank's micro-batches, in global order


def take_step(stream, dist, grad_accum) -> StepShare:
    """The next step's world x grad_accum micro-batches from the global stream (runtime/train.py's
    DataStream), this rank's share of them and the step's global counts (host only)."""
    every = [stream.next() for _ in range(dist.world * grad_accum)]
    first = dist.rank * grad_accum
    docs = [d for batch in every for d in batch]
    return StepShare(every[first:first + grad_accum], first, len(every), count_targets(docs),
                     sum(len(d[0]) if isinstance(d, tuple) else len(d) for d in docs), every)


class GradReducer:
    """lora.grads all-reduced (SUM) in per-layer buckets under the backward (see the module docstring).

        reducer.begin()                                   # a step starts
        forward_backward(..., reducer=reducer)            # its last micro-batch: buckets launch as layers finish
        reducer.finish()                                  # the rest launched, every bucket waited on
    """

    def __init__(self, lora, dist, bucket_bytes=BUCKET_BYTES):
        self.dist = dist
        L = len(lora.layers)
        lo, hi = [None] * L, [None] * L  # each layer's slice of the flat buffer
        for li, _, off, sa, sb in lora.layout:
            end = off + _numel(sa) + _numel(sb)
            lo[li] = off if lo[li] is None else min(lo[li], off)
            hi[li] = end if hi[li] is None else max(hi[li], end)
        starts, at = [], 0  # a layer without an adapter starts (and ends) where the one below ended
        for li in range(L):
            starts.append(at if lo[li] is None else lo[li])
            at = at if hi[li] is None else hi[li]
        starts.append(lora.grads.numel())
        groups, cur, size = [[0]], [], 0  # layer 0 alone, then runs of about bucket_bytes going up
        for li in range(1, L):
            cur.append(li)
            size += (starts[li + 1] - starts[li]) * lora.grads.element_size()
            if size >= bucket_bytes:
                groups.append(cur)
                cur, size = [], 0
        if cur:
            groups.append(cur)
        self.buckets = [(g[0], lora.grads[starts[g[0]]:starts[g[-1] + 1]]) for g in reversed(groups) if L]
        self.order = {low: i for i, (low, _) in enumerate(self.buckets)}  # in backward order: top first
        self.begin()

    def begin(self):
        self.launched, self.works = set(), []

    def layer_done(self, li):
        """After layer li's backward (step._backward_layers): launch the bucket li completes."""
        b = self.order.get(li)
        if b is not None:
            self._launch(b)

    def _launch(self, b):
        if b in self.launched:
            return
        self.launched.add(b)
        view = self.buckets[b][1]
        if view.numel():  # the same on every rank: an empty bucket is skipped everywhere
            try:
                self.works.append(torch_dist.all_reduce(view, async_op=True))
            except RuntimeError as e:
                raise self.dist.lost(e, "the gradient all-reduce") from e

    def finish(self):
        """Launch every bucket not launched yet (a micro-batch that raised: every rank issues the same
        all-reduces in the same order), then wait for all (the compute stream waits on a GPU)."""
        for b in range(len(self.buckets)):
            if b not in self.launched:
                self._launch(b)
        works, self.works = self.works, []
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self.dist.lost(e, "the gradient all-reduce") from e
