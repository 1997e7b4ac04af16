"""The lm_head in pinned host memory, streamed to the GPU one vocabulary chunk at a time.

Shape legend: N tokens of the step, C hidden, V vocab, Vc rows of a chunk, n = ceil(V / Vc) chunks.

What --vram-budget does when even every layer offloaded does not fit (runtime/planner.py prices it):
the (V, C) lm_head leaves the GPU for pinned host memory (Qwen3-14B: 1.45 GiB), and the loss
(kernels/linear_ce_vchunk.py) reads it through two (Vc, C) device buffers, filled on a copy stream
while the compute stream works on the other one. A tied table moves with it: the embedding gather
then reads the batch's rows from the host (kernels/embedding.py), as an untied table does under
plan.embed_host.

    model.cache["head"]   the HostHead below, the loss's chunk source; model.lm_head the host table

Per step the training loss visits the chunks 0 .. n-1 (logits, log-sum-exp) and n-1 .. 0 (gradient,
dh): 2n - 2 copies of Vc rows, two fewer than 2n because the two chunks the first pass ends with are
still in the buffers when the second begins. fetch_plan works out which buffer each visit reads and
after which visit each copy may start (the buffer's previous reader done), for any visit order; the
copies then run one visit ahead of the compute. Evaluation and generation visit 0 .. n-1 once.

Streams: begin() makes the copy stream wait for the compute stream (the buffers' readers of the last
call are done); a copy waits on the `freed` event its buffer's last reader recorded; get() makes the
compute stream wait on the copy's `loaded` event. Every copy is waited on by the compute stream before
the call returns, so the calls capture in a CUDA graph (graph.py) and the step makes no host sync.
On a CPU device the copies run synchronously through the same plan (the tests' path).

Cost: 2 (V - Vc) C bytes over the host-to-device link a training step (Qwen3-14B at 32 MiB chunks:
2.8 GB, ~56 ms at 50 GB/s), hidden under the three lm_head GEMMs only where they are slower.
Memory on the GPU: the two chunk buffers (2 Vc C) and the loss's scratch (linear_ce_vchunk: N Vc, dh's
fp32 (N, C), four (N,) fp32), priced by plan.head_host_bytes.
Tested: tests/test_head_host.py (the fetch plan for every order the loss and logits use, buffer reuse
never ahead of its reader; a step with the head on the host equals the step with it on the device; the
planner takes it only when nothing else fits).
"""
import torch
import triton

CHUNK_BYTES = 32 << 20  # one chunk buffer; the copies stay link-bound above a few MB (untuned)


def chunk_rows(V, C, elsize, multiple=1):
    """Rows of one chunk: as many as CHUNK_BYTES holds, a multiple of 128 when V allows, at most V;
    then rounded up to a multiple of `multiple` (a sharded head: the ranks' world size, every rank an
    equal part of each chunk)."""
    rows = max(1, CHUNK_BYTES // (C * elsize))
    if rows >= 128:
        rows = rows // 128 * 128
    return -(-min(rows, V) // multiple) * multiple


def fetch_plan(order, slots=2):
    """For visits `order` (chunk ids) with `slots` buffers: (buf, copies), buf[k] the buffer visit k
    reads, copies a list of (k, chunk, buffer, after): visit k's chunk is copied into the buffer once
    visit `after` (-1: none) is done with it. A chunk still held is not copied again; a copy evicts the
    buffer whose chunk is needed again latest (or never)."""
    order = list(order)
    holder, last = [None] * slots, [-1] * slots
    buf, copies = [], []

    def next_use(c, k):
        return next((j for j in range(k + 1, len(order)) if order[j] == c), len(order))

    for k, c in enumerate(order):
        if c in holder:
            b = holder.index(c)
        else:
            b = max(range(slots), key=lambda s: len(order) + 1 if holder[s] is None else next_use(holder[s], k))
            copies.append((k, c, b, last[b]))
            holder[b] = c
        last[b] = k
        buf.append(b)
    return buf, copies


class HostHead:
    """linear_ce_vchunk's chunk source for an lm_head w (V, C) in (pinned) host memory."""

    collective = False  # its fills are the same on every rank whatever the rank's tokens (ShardHead)

    def __init__(self, w, device, chunk_v=None, multiple=1):
        self.w = w  # (V, C) host
        self.V, self.C = w.shape
        self.dtype, self.device = w.dtype, torch.device(device)
        rows = min(chunk_v, self.V) if chunk_v else chunk_rows(self.V, self.C, w.element_size())
        self.chunk_v = -(-rows // multiple) * multiple  # ShardHead: a chunk splits evenly over the ranks
        self.n = triton.cdiv(self.V, self.chunk_v)
        self.fills = 0  # ShardHead: its collectives issued since the step began (offload.Gather counts them)
        self.buf = [torch.empty(self.chunk_v, self.C, dtype=w.dtype, device=self.device) for _ in range(2)]  # 2 x (Vc, C)
        self.device = self.buf[0].device  # "cuda" -> "cuda:0": compared with h.device by the kernel
        self.on_gpu = self.device.type == "cuda"
        self._plans = {}
        if self.on_gpu:
            self.stream = torch.cuda.Stream(self.device)
            self.loaded = [torch.cuda.Event() for _ in range(2 * self.n)]  # copy j done
            self.freed = [torch.cuda.Event(), torch.cuda.Event()]  # buffer b's last reader done

    def bounds(self, c):
        return c * self.chunk_v, min(self.V, (c + 1) * self.chunk_v)

    def begin(self, order):
        order = tuple(order)
        if order not in self._plans:
            self._plans[order] = fetch_plan(order)
        self.order, (self.bufs, copies) = order, self._plans[order]
        self.copy_of = {k: j for j, (k, _, _, _) in enumerate(copies)}  # visit -> its copy's index
        self.after = {}
        for j, (k, c, b, after) in enumerate(copies):
            self.after.setdefault(after, []).append((j, c, b))
        self.pos = 0
        if self.on_gpu:
            self.stream.wait_stream(torch.cuda.current_stream())  # the last call's readers are done
        self._copy(self.after.get(-1, ()), wait=False)

    def _copy(self, copies, wait=True):
        for j, c, b in copies:
            if not self.on_gpu:
                self._fill(c, b)
                continue
            with torch.cuda.stream(self.stream):
                if wait:
                    self.stream.wait_event(self.freed[b])
                self._fill(c, b)
                self.loaded[j].record()

    def _fill(self, c, b):
        """Chunk c into buffer b, on the current stream (the copy stream on a GPU)."""
        v0, v1 = self.bounds(c)
        self.buf[b][: v1 - v0].copy_(self.w[v0:v1], non_blocking=self.on_gpu)

    def fills_per_call(self, backward):
        """Fills one loss call issues (backward: with dh, the chunks there and back; else once over):
        2n - 2 and n (n > 1), 1 and 1 (n = 1)."""
        order = list(range(self.n)) + (list(reversed(range(self.n))) if backward else [])
        return len(fetch_plan(order)[1])

    def get(self, c):
        k = self.pos
        if self.order[k] != c:
            raise RuntimeError(f"HostHead: visit {k} asked for chunk {c}, begin() was told {self.order[k]}")
        if self.on_gpu and k in self.copy_of:
            torch.cuda.current_stream().wait_event(self.loaded[self.copy_of[k]])
        v0, v1 = self.bounds(c)
        return self.buf[self.bufs[k]][: v1 - v0]

    def done(self, c):
        k = self.pos
        if self.on_gpu:
            self.freed[self.bufs[k]].record(torch.cuda.current_stream())
        self.pos += 1
        self._copy(self.after.get(k, ()))


def head_to_host(model, chunk_v=None):
    """Move the lm_head (and a tied embedding, the same table) to pinned host memory and stream the
    loss's chunks from there (model.cache["head"]). Returns the GPU bytes freed (0 if it is there)."""
    if "head" in model.cache:
        return 0
    w = model.lm_head
    on_gpu = w.device.type == "cuda"
    host = w
    if on_gpu:
        host = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)  # (V, C)
        host.copy_(w)  # sync: set-up, once, before the first step
    freed = w.numel() * w.element_size() if on_gpu else 0
    if model.embed is model.lm_head:
        model.embed = host
    model.lm_head = host
    model.cache["head"] = HostHead(host, model.device, chunk_v)
    return freed


def tables_to_host(model, chunk_v=None):
    """--tables-on-host: the embedding table and the lm_head (one table when tied) to pinned host
    memory for good, whatever the plan: the embedding gather reads the batch's rows over PCIe and the
    loss streams the lm_head's chunks (HostHead): Qwen3-8B, 2.32 GiB fewer on the GPU. A sharded
    model (--shard-weights) has its tables off the GPU already (shard.shard_model: the lm_head's
    chunks are gathered from the GPUs, not streamed from the host): nothing moves. Returns the GPU
    bytes freed (0 on a CPU device: nothing moves)."""
    from ..models.weights import embed_to_host

    if model.device.type != "cuda":
        return 0
    freed = embed_to_host(model) if model.embed is not model.lm_head else 0
    return freed + head_to_host(model, chunk_v)


def lm_head_loss(loss, dh, h, model, targets, grad_scale=1.0, chunk_rows=None):
    """The fused lm_head + cross-entropy (linear_ce.py, in chunks of chunk_rows rows: None, its
    default), or its chunked form when the head is on the host."""
    from ..kernels.linear_ce import linear_ce_fwd_bwd
    from ..kernels.linear_ce_vchunk import linear_ce_vchunks

    src = model.cache.get("head")
    if src is None:
        linear_ce_fwd_bwd(loss, dh, h, model.lm_head, targets, grad_scale=grad_scale, chunk_rows=chunk_rows)
    else:
        linear_ce_vchunks(loss, dh, h, src, targets, grad_scale=grad_scale)


def lm_head_logits(logits, h, model):
    """logits (N, V) = h @ lm_head^T, wherever the lm_head lives."""
    from ..kernels.gemm import matmul
    from ..kernels.linear_ce_vchunk import logits_vchunks

    src = model.cache.get("head")
    if src is None:
        matmul(logits, h, model.lm_head.t())
    else:
        logits_vchunks(logits, h, src)
