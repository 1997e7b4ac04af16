"""Sharded frozen weights (`--shard-weights`): each rank holds 1/N of every decoder layer's flat
buffers; a layer's full weights are all-gathered just before they are read.

Shape legend: N ranks (the world size), r this rank; per layer P its flat buffer's elements
(weights.Layer.buf, model dtype) and Q its quantised buffer's bytes (Layer.qbuf, uint8: NF4
projections, MXFP4 experts; 0 for a bf16 model), S = ceil(P / N), Sq = ceil(Q / N).

    model = load_sharded(model_dir, dtype, device, dist)    # the ranks' shards, the rest whole
    sched.weights(li, ahead)                                 # offload.py: layer li's full weights

What a rank holds after load_sharded (or shard_model on a loaded model):
    model.layers[li]   LayerShard: buf (S,) act and qbuf (Sq,) uint8, its part [r*S, (r+1)*S) of
                       the layer's buffers zero-padded to N*S (and N*Sq)
    model.embed        the whole table in pinned host memory on every rank (the gather reads the
                       batch's rows; on a CPU device where it is); a tied lm_head is the same table
    model.lm_head      untied: its shape only (a meta tensor): the table lives in the shards
    model.cache["head"] ShardHead: rank r's 1/N of every chunk of the lm_head's rows on the device,
                       all-gathered a chunk at a time in the loss (one process: the tables whole on
                       the device, no ShardHead)
    model.norm         whole, on the device
    model.shard        Sharding(rank, world, dist): what the scheduler and the planner read
The gathers run on the step's scheduler (offload.Gather, one per model on model.cache, which the
offload scheduler and every pass over the model share): two rotating full-size layers per kind of
layer (dense, MoE), the gather of the next layer issued as a layer starts (forward: li+1, backward:
li-1), so it runs under that layer's compute, on a process group of the gathers' own
(dist.Dist.gathers). plan.py counts the two buffers in the peak and prices the gathers against the
all-gather rate offload.measure_link measures. A rank whose pass raises issues the rest of its
step's gathers before it reports the error (Gather.complete), so no rank waits in one.

Loading: every rank reads the checkpoint on the host (load_model on the CPU), keeps its part of
each layer on the device and frees the rest; on a GPU the ranks take turns (one whole copy of the
model in host memory at a time, N load times), on the CPU they load at once. NF4 quantisation at
load (--load-in-4bit) runs device kernels and is refused here; a checkpoint already in
bitsandbytes' 4-bit layout loads as stored.

Equal to the unsharded run: the gathered buffers are the same bits, so the layers are: bit for bit
in one process under a plan that offloads and recomputes (tests/test_dist.py, the gathers' rotation),
and 3 CPU processes (gloo) equal one process to fp32 rounding (the ranks' gradients sum in another
order, and the sharded head's loss adds its chunks in another order than the whole head's kernel).
On GPUs (tests/test_dist_gpu.py, bf16 by the project's rule) the sharded layers passed on 4 x H100
(2026-11-26), and with the sharded lm_head (2026-11-27).
Caution: every pass over a sharded model is collective (each rank must run the same layers in the
same order): evaluation is spread over the ranks in equal rounds, and lean-train's greedy samples
(one rank's generation) are off under --shard-weights.
"""
from typing import NamedTuple

import torch

from .checkpoint import TrainError
from .head_host import HostHead


class Sharding(NamedTuple):
    rank: int
    world: int
    dist: object  # the run's dist.Dist (a failed gather names the rank that is gone)


class LayerShard:
    """Rank r's part of decoder layer li's flat buffers (see the module docstring)."""

    def __init__(self, layer, li, rank, world, device):
        self.li, self.moe = li, layer.moe
        self.numel, self.qnumel = layer.buf.numel(), layer.qbuf.numel()
        self.buf = _part(layer.buf, rank, world, device)  # (S,) act
        self.qbuf = _part(layer.qbuf, rank, world, device)  # (Sq,) uint8


def _part(flat, rank, world, device):
    """[r*S, (r+1)*S) of flat zero-padded to world*S, as a new tensor on device."""
    S = -(-flat.numel() // world)
    out = torch.zeros(S, dtype=flat.dtype, device=device)
    lo, hi = min(rank * S, flat.numel()), min((rank + 1) * S, flat.numel())
    out[:hi - lo].copy_(flat[lo:hi])
    return out


def padded(n, world):
    """Elements of a flat buffer of n padded to world equal parts."""
    return -(-n // world) * world


class ShardHead(HostHead):
    """The loss's lm_head chunks (head_host.py's HostHead protocol) all-gathered from the ranks' GPUs:
    rank r holds rows [c*Vc + r*Vc/N, c*Vc + (r+1)*Vc/N) of every chunk c, shard (n, Vc/N, C) on its
    device (rows past V zero), and a fill is one all_gather_into_tensor of chunk c's N parts into a
    (Vc, C) buffer, on the copy stream, one visit ahead as HostHead's copies run. Vc: HostHead's rows
    rounded up to a multiple of N. The whole table w is not kept here (a tied one stays the
    embedding's, in pinned host memory). Every rank fills the same chunks in
    the same order (collective = True: linear_ce_vchunks goes back over the chunks at N = 0 too);
    offload.Gather counts the fills with the layers' gathers, so that a rank whose pass raised issues
    the rest of them (Gather.complete). The gathers run on the layers' process group (dist.gathers),
    in the order every rank's passes issue them."""

    collective = True

    def __init__(self, w, dist, device, chunk_v=None):
        super().__init__(w, device, chunk_v, multiple=dist.world)
        self.dist = dist
        part = self.chunk_v // dist.world
        rows = torch.zeros(self.n * self.chunk_v, self.C, dtype=w.dtype)  # (n*Vc, C) host, padded
        rows[: self.V].copy_(w)
        mine = rows.view(self.n, dist.world, part, self.C)[:, dist.rank]  # (n, Vc/N, C)
        self.shard = mine.contiguous().to(self.device)
        self.w = None  # the whole table: not held here (on a GPU it would stay on the GPU)

    def _fill(self, c, b):
        import torch.distributed as torch_dist

        with self.dist.collective("the lm_head's all-gather"):
            work = torch_dist.all_gather_into_tensor(self.buf[b], self.shard[c], group=self.dist.gathers, async_op=True)
            self.fills += 1  # issued: counted (an error before this point leaves it to Gather.complete)
            work.wait()  # a GPU: the copy stream waits for the all-gather's stream (no host sync)

    def fill_again(self):
        """One more fill as the step's sequence has it, its chunk unread (Gather.complete: after an error)."""
        self._fill(0, 0)


def shard_model(model, dist, device):
    """model (loaded whole, anywhere) with every layer replaced by this rank's LayerShard on device,
    the norm moved there, and with several ranks the tables off the device: the embedding (and a
    tied lm_head) in pinned host memory (on a CPU where it is), the lm_head's chunks sharded over the
    ranks' devices (ShardHead on model.cache["head"]; model.lm_head the whole table, on the host)."""
    rank, world = dist.rank, dist.world
    for li, layer in enumerate(model.layers):
        model.layers[li] = LayerShard(layer, li, rank, world, device)
    tied = model.embed is model.lm_head
    model.norm = model.norm.to(device)
    model.device = torch.device(device)
    model.shard = Sharding(rank, world, dist)
    if world == 1:
        model.embed = model.embed.to(device)
        model.lm_head = model.embed if tied else model.lm_head.to(device)
        return model
    model.embed = _host(model.embed, model.device)
    head = model.embed if tied else model.lm_head
    model.cache.pop("head", None)
    model.cache["head"] = ShardHead(head, dist, device)
    # untied: the table lives in the ranks' shards alone; model.lm_head keeps its shape and dtype (meta),
    # which the planner reads (merge and export load the checkpoint anew)
    model.lm_head = model.embed if tied else torch.empty(head.shape, dtype=head.dtype, device="meta")
    return model


def _host(t, device):
    """t in pinned host memory for a GPU device (the embedding gather reads its rows there); as it is
    on a CPU device."""
    if device.type != "cuda":
        return t.to(device)
    if t.device.type == "cpu" and t.is_pinned():
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # sync: set-up, once, before the first step
    return host


def load_sharded(model_dir, dtype, device, dist, quant=None):
    """This rank's sharded model (see the module docstring): loaded on the host, then sharded; on a
    GPU one rank after another, each turn closed by an exchange (an error stops every rank)."""
    from .loader import load_model

    if quant == "nf4":  # lean-train refuses the pair first (settings.check_config)
        raise TrainError("load_sharded: quant='nf4' quantises on the GPU at load; the sharded load reads on the host")
    turns = range(dist.world) if str(device).startswith("cuda") else (None,)
    model = None
    for turn in turns:
        error = None
        if turn in (None, dist.rank):
            try:
                model = shard_model(load_model(model_dir, dtype=dtype, device="cpu", quant=quant), dist, device)
            except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange
                error = e
        dist.exchange(error=error, what="loading the sharded weights" + (f" (rank {turn}'s turn)" if turn is not None else ""))
    return model
