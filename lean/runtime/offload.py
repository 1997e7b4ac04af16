"""The offload scheduler: layer inputs (and up projections) to pinned host memory in forward, back in backward.

Shape legend: N tokens of the step (<= the plan's n_tokens), C hidden, F MLP hidden, L_off layers
whose input is offloaded (modes offload and offload_up), L_up layers whose up is too (offload_up).

Buffers, allocated once from the plan (never grown during a step):
    host     (L_off, N, C) act, pinned   one x slot per offloaded layer
    host_up  (L_up, N, F) act, pinned    one up slot per offload_up layer
    reload   2 x (N, C) act, device      two reload buffers; offloaded layer j (in layer order)
    reload_up 2 x (N, F) act, device     reloads into buffer j % 2 (its x, and its up when it has
                                         one), so consecutive ones alternate
The step (lean/runtime/step.py) calls, in this order:
    forward   offload(li, x, up)  after layer li's forward: x (and up) -> host slots, on the copy
                              stream, which first waits for the compute stream (x is written);
                              the scheduler holds them so their memory is not reused during the copy
              retire(li)      after layer li+1's forward: the compute stream waits for li's copy
                              (done by then when it fits under layer li+1; the planner counts the
                              wait when it does not), and x, up are let go
    backward  prefetch(li)    before layer li+1's backward: host slots -> li's reload buffers, on
                              the copy stream, after the compute stream has released them (the
                              offloaded layer two slots up read them); so a layer costs
                              max(copy, compute). The last layer's prefetch is issued at the end
                              of the forward, under the lm_head + loss
              wait(li)        before layer li's recompute: the compute stream waits for its reload;
                              returns (x, up or None)
              release(li)     after layer li's backward: its reload buffers may be overwritten
Every cross-stream dependency is an event: no host sync, and the calls capture in a CUDA graph
(every copy-stream op is waited on by the compute stream before the step ends; events are only
waited on within the step that recorded them).

Sharded weights (runtime/shard.py, --shard-weights): one more kind of copy, the all-gather of a
layer's frozen buffers from the ranks' shards (Gather, one per model, shared by every pass over it):
    weights(li, ahead)  before layer li's forward, and again before its backward (its rebuild too):
                        returns li's full weights, gathered (waiting for its all-gather), and
                        issues the all-gather of layer `ahead` (forward li+1, backward li-1), so it
                        runs under layer li's compute
The gathers run on a process group of their own (dist.Dist.gathers: on GPUs its own NCCL
communicator, hence its own stream), so one issued ahead never waits behind a gradient bucket's
all-reduce; plan.gather_cost prices them so. The full layers rotate through two buffers per kind
of layer: consecutive layers of a kind alternate. A gather into a buffer is issued after every
launch of the layer that read it last (the host's order), and ProcessGroupNCCL's stream waits on
the issuing stream at that point: the event between them is the collective's own. A layer still
held needs no gather (the backward starts with the last two layers the forward gathered). On the
CPU gloo runs the gather on its own thread. A pass without a plan (evaluation) gets a scheduler of
the gathers alone.

On a CPU device there are no streams: the same calls copy synchronously (the CI variant; it runs
the same slot and buffer bookkeeping, and holds the offloaded rows until retire as the GPU does, so
the planner's walk equals the CPU step's allocations in every mode).

measure_rates() times the pinned link (each direction) and a layer-sized GEMM once, before the
plan: the planner prices copies and recomputes with them (plan.Rates); measure_link times the
sharded weights' all-gather on every rank at once.

Tested: tests/test_offload.py: CPU, NaN-poisoned buffers, gradients equal to keeping everything bit
for bit; GPU (H100): the same with these streams, under sync_debug_mode("error"), and inside a
captured CUDA graph. The gathers: tests/test_dist.py (CPU, gloo, sharded == unsharded) and
tests/test_dist_gpu.py (2 GPUs; passed on 4 x H100, 2026-11-26).
Errors: OffloadError when a batch holds more tokens than the plan was made for, or the plan was
made for another model shape.
Caution: the scheduler belongs to one model and plan (scheduler() caches it on model.cache);
two steps must not run interleaved on one scheduler.
"""
import torch

from ..kernels.nf4 import Nf4


class OffloadError(ValueError):
    pass


class Offloader:
    def __init__(self, plan, dtype, device, gather=None):
        device = torch.device(device)
        self.gather = gather  # the model's Gather (sharded weights), or None
        self.layers = plan.offloaded if plan is not None else ()
        self.slot = {li: j for j, li in enumerate(self.layers)}
        ups = [li for li in self.layers if plan.policy(li, "up") == "offload" and not plan.cfg.is_moe(li)]
        self.up_slot = {li: j for j, li in enumerate(ups)}
        self.max_tokens = plan.n_tokens if plan is not None else float("inf")
        self.on_gpu = device.type == "cuda"
        N, C, F = (plan.n_tokens, plan.cfg.hidden, plan.cfg.intermediate) if self.layers else (0, 0, 0)
        pin = dict(dtype=dtype, pin_memory=self.on_gpu)
        self.host = torch.empty(len(self.layers), N, C, **pin)  # (L_off, N, C)
        self.host_up = torch.empty(len(ups), N, F, **pin)  # (L_up, N, F)
        self.reload = [torch.empty(N, C, dtype=dtype, device=device) for _ in range(2 if self.layers else 0)]  # 2 x (N, C)
        self.reload_up = [torch.empty(N, F, dtype=dtype, device=device) for _ in range(2 if ups else 0)]
        self.n = N
        self._held = {}  # li -> (x, up), their D2H copy in flight
        if self.on_gpu:
            self.copy_stream = torch.cuda.Stream(device)
            self.copied = {li: torch.cuda.Event() for li in self.layers}  # D2H of li done
            self.loaded = [torch.cuda.Event(), torch.cuda.Event()]  # H2D into buffer b done
            self.freed = [torch.cuda.Event(), torch.cuda.Event()]  # compute done reading buffer b
        self._freed_this_step = [False, False]

    def begin(self, n_tokens):
        """Start a step of n_tokens tokens."""
        if n_tokens > self.max_tokens:
            raise OffloadError(f"the batch holds {n_tokens} tokens but the activation plan was made for at most "
                               f"{self.max_tokens}: plan for the largest batch (plan_for(model, lora, n_tokens=...))")
        self._held.clear()  # only non-empty after a step that raised mid-forward
        self.n = n_tokens
        self._freed_this_step = [False, False]

    def _buf(self, li):
        return self.slot[li] % 2

    def _pairs(self, li):
        """(host slot, reload buffer) views of every row li offloads."""
        b, n = self._buf(li), self.n
        pairs = [(self.host[self.slot[li], :n], self.reload[b][:n])]
        if li in self.up_slot:
            pairs.append((self.host_up[self.up_slot[li], :n], self.reload_up[b][:n]))
        return pairs

    def offload(self, li, x, up=None):
        """Forward, after layer li: its input x (N, C), and up (N, F) in offload_up, -> pinned host slots."""
        rows = [x] + ([up] if li in self.up_slot else [])
        if not self.on_gpu:  # synchronous; the rows are still held until retire, as on the GPU
            for (dst, _), src in zip(self._pairs(li), rows):
                dst.copy_(src)
            self._held[li] = rows
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # x, up are written
        with torch.cuda.stream(self.copy_stream):
            for (dst, _), src in zip(self._pairs(li), rows):
                dst.copy_(src, non_blocking=True)
            self.copied[li].record()
        self._held[li] = rows

    def retire(self, li):
        """Forward, a layer later: the compute stream waits for li's copy; its rows' memory is let go."""
        rows = self._held.pop(li, None)
        if rows is not None and self.on_gpu:
            torch.cuda.current_stream().wait_event(self.copied[li])

    def prefetch(self, li):
        """Backward, before layer li+1's backward: li's host slots -> its reload buffers."""
        b = self._buf(li)
        if not self.on_gpu:
            for src, dst in self._pairs(li):
                dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._freed_this_step[b]:  # the layer that read these buffers last has finished
                self.copy_stream.wait_event(self.freed[b])
            for src, dst in self._pairs(li):
                dst.copy_(src, non_blocking=True)
            self.loaded[b].record()

    def wait(self, li):
        """Backward: the compute stream waits for li's reload; returns (x (N, C), up (N, F) or None)."""
        if self.on_gpu:
            torch.cuda.current_stream().wait_event(self.loaded[self._buf(li)])
        rows = [dst for _, dst in self._pairs(li)]
        return rows[0], (rows[1] if len(rows) > 1 else None)

    def release(self, li):
        """Backward, after layer li's backward: its reload buffers may be refilled."""
        b = self._buf(li)
        if self.on_gpu:
            self.freed[b].record(torch.cuda.current_stream())
        self._freed_this_step[b] = True

    def weights(self, li, ahead=None):
        """Sharded weights: layer li's full weights; the all-gather of layer `ahead` is issued."""
        return self.gather.weights(li, ahead)


class Gather:
    """The all-gather of a sharded model's layers (see the module docstring; runtime/shard.py)."""

    def __init__(self, model):
        from ..models.weights import Layer, layer_fields, nf4_projections
        from .shard import padded

        cfg, world = model.config, model.shard.world
        self.model, self.L, self.dist = model, cfg.n_layers, model.shard.dist
        self.full, self.slot, self.held, self.works = {}, {}, {}, {}
        self.calls = 0  # weights() calls since begin_step(): how far a step's passes got
        count = {}
        for li in range(cfg.n_layers):
            kind = (cfg.is_moe(li), tuple(f for f, _, _ in layer_fields(cfg, li)),
                    tuple(t for t, _, _ in nf4_projections(cfg, li)))
            j = count.get(kind, 0)
            count[kind] = j + 1
            self.slot[li] = (kind, j % 2)  # consecutive layers of a kind alternate
            if self.slot[li] not in self.full:
                sh = model.layers[li]
                buf = torch.empty(padded(sh.numel, world), dtype=model.dtype, device=model.device)  # (N*S,)
                qbuf = torch.empty(padded(sh.qnumel, world), dtype=torch.uint8, device=model.device)  # (N*Sq,)
                self.full[self.slot[li]] = (Layer(cfg, model.dtype, model.device, li, buf=buf, qbuf=qbuf), buf, qbuf)

    def begin_step(self):
        self.calls = 0
        head = self._head()
        if head is not None:
            head.fills = 0

    def _head(self):
        """The sharded lm_head (shard.ShardHead) whose fills are collectives of this step too, or None."""
        head = self.model.cache.get("head")
        return head if getattr(head, "collective", False) else None

    def complete(self, passes, reducer=None, backward=True):
        """After an error on this rank mid-step: the rest of the step's collectives, issued as its
        passes would have issued them (every pass's gathers in order; in the last pass's backward,
        the reducer's buckets after their layers), so that no other rank waits in a collective.
        passes: the step's micro-batches (forward and backward each) or forward-only passes."""
        head = self._head()
        fills = head.fills_per_call(backward) if head is not None else 0  # the loss's, between the passes' halves
        seq = []
        for p in range(passes):
            seq += [(li, li + 1, False) for li in range(self.L)] + [None] * fills
            if backward:
                seq += [(li, li - 1, reducer is not None and p == passes - 1) for li in reversed(range(self.L))]
        layers = [x for x in seq if x is not None]
        done, done_fills = self.calls, head.fills if head is not None else 0
        if done and layers[done - 1][2]:  # the layer whose backward raised may have launched its bucket or not
            reducer.layer_done(layers[done - 1][0])
        for x in seq:  # the layers' gathers and the head's fills not issued yet, in the order of the passes
            if x is None:
                if done_fills:
                    done_fills -= 1
                else:
                    head.fill_again()
                continue
            if done:
                done -= 1
                continue
            li, ahead, tell = x
            self.weights(li, ahead)
            if tell:
                reducer.layer_done(li)

    def weights(self, li, ahead=None):
        self.calls += 1
        self._start(li)
        with self.dist.collective("the weights' all-gather"):
            for w in self.works.pop(li, ()):
                w.wait()  # a GPU: the compute stream waits for the all-gather's stream (no host sync)
        if ahead is not None and 0 <= ahead < self.L:
            self._start(ahead)
        return self.full[self.slot[li]][0]

    def _start(self, li):
        import torch.distributed as dist

        key = self.slot[li]
        if self.held.get(key) == li:  # gathered, or its gather is in flight
            return
        self.held[key] = li
        _, buf, qbuf = self.full[key]
        sh, group = self.model.layers[li], self.dist.gathers  # their own group: never behind a bucket's all-reduce
        with self.dist.collective("the weights' all-gather"):
            works = [dist.all_gather_into_tensor(buf, sh.buf, group=group, async_op=True)]
            if sh.qbuf.numel():
                works.append(dist.all_gather_into_tensor(qbuf, sh.qbuf, group=group, async_op=True))
        self.works[li] = works


def gather_of(model):
    """A sharded model's Gather (built once, kept on model.cache); None for whole weights."""
    if getattr(model, "shard", None) is None:
        return None
    gather = model.cache.get("gather")
    if gather is None:
        gather = model.cache["gather"] = Gather(model)
    return gather


def scheduler(model, plan, n_tokens):
    """The Offloader for (model, plan), built on first use and cached on the model, begun for a step
    of n_tokens; None when the plan offloads nothing and the weights are whole. A sharded model's
    scheduler always exists (plan None: the gathers alone, for a pass without a plan)."""
    sharded = getattr(model, "shard", None) is not None
    if plan is None and not sharded:
        return None
    cfg = model.config
    if plan is not None and (len(plan.modes) != cfg.n_layers or plan.cfg.hidden != cfg.hidden):
        raise OffloadError(f"the activation plan is for {len(plan.modes)} layers of hidden size {plan.cfg.hidden}, "
                           f"the model has {cfg.n_layers} of {cfg.hidden}: make it for this model (plan_for)")
    if not sharded and not plan.offloaded:
        return None
    gather = gather_of(model)
    key = (plan.modes, plan.n_tokens, plan.cfg.hidden) if plan is not None and plan.offloaded else None
    slot = "offload" if key is not None else "offload:gather"  # a pass without offloads keeps the step's
    cached = model.cache.get(slot)
    if cached is None or cached[0] != key:
        cached = (key, Offloader(plan if key is not None else None, model.dtype, model.device, gather))
        model.cache[slot] = cached
    sched = cached[1]
    sched.begin(n_tokens)
    return sched


def rate_weight(model, layers=None):
    """The weight (<= F, C) in the model dtype that measure_rates times lean's GEMM on: the model's own
    values (no zeros), a dense layer's gate (F, C), or where every layer is an MoE layer, F rows of
    layer 0's expert gate_up (E*2Fe, C), or of its q (Oq, C) when the experts are MXFP4 pairs. An Nf4
    comes dequantised (a new tensor: the GEMM its scratch path runs), then sliced."""
    C, F = model.config.hidden, model.config.intermediate
    layers = layers or model.layers  # sharded weights: layer 0 gathered (measure_rates)
    w = next((layer.gate for layer in layers if layer.gate is not None), None)  # (F, C)
    if w is None:
        gu = layers[0].gate_up
        w = gu.reshape(-1, C) if isinstance(gu, torch.Tensor) else layers[0].q
    if isinstance(w, Nf4):
        w = w.dense(model.dtype)
    return w[:F]


def measure_rates(model, n_tokens, repeats=9, link=None):
    """plan.Rates on this GPU, measured once before the plan (a setup-time sync): pinned D2H and
    H2D copies of one (n_tokens, F) activation and lean's GEMM at a layer's gate shape
    (n_tokens, C) x (C, F) (on rate_weight's weight), each the fastest of `repeats` after a warm-up
    (what the link and the GEMM can do; single copies vary by up to ~20% between calls), timed with
    CUDA events. Sharded weights: the GEMM on layer 0 gathered, and `link` as measure_link gives it
    (link None: measured here, so every rank calls this at once; runtime/parallel.py measures the
    link on every rank first and the rest on rank 0, layer 0 then still held). None on a CPU."""
    from ..kernels.gemm import matmul
    from .plan import DEFAULT_RATES, Rates
    if model.device.type != "cuda":
        return None
    gather = gather_of(model)
    if gather is not None and link is None:
        link = measure_link(model, repeats)
    cfg = model.config
    N, C, F = min(n_tokens, cfg.vocab), cfg.hidden, cfg.intermediate
    dev = torch.empty(N, F, dtype=model.dtype, device=model.device)  # (N, F)
    host = torch.empty(N, F, dtype=model.dtype, pin_memory=True)  # (N, F)
    w = rate_weight(model, [gather.weights(0)] if gather is not None else None)  # (F, C), or fewer rows
    out = dev[:, :w.shape[0]]  # (N, F), or fewer columns: the GEMM's output
    x = model.embed[:N].to(model.device)  # (N, C): real rows, no zeros (copied: the table may be on the host)
    nbytes = dev.numel() * dev.element_size()
    d2h = nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), repeats)
    h2d = nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), repeats)
    flops = 2 * N * C * w.shape[0] / _timed(lambda: matmul(out, x, w.t()), repeats)
    return Rates(d2h=d2h, h2d=h2d, flops=flops, link=DEFAULT_RATES.link if link is None else link)


def measure_link(model, repeats=9):
    """Sharded weights, every rank at once (collective): the bytes a rank receives per second in
    the all-gather of layer 0 (its N-1 other parts), into the Gather's own buffer of layer 0. It
    allocates nothing, so only a failed collective can raise in it (RankLost on every rank): no
    rank is left waiting in an all-gather that another never issues. Layer 0 stays held."""
    import torch.distributed as dist

    gather = gather_of(model)
    gather.weights(0)  # layer 0 held in its buffer (an all-gather, waited on)
    _, buf, _ = gather.full[gather.slot[0]]
    part, world = model.layers[0].buf, model.shard.world
    with model.shard.dist.collective("measuring the weights' all-gather"):
        return part.numel() * part.element_size() * (world - 1) / _timed(
            lambda: dist.all_gather_into_tensor(buf, part, group=model.shard.dist.gathers, async_op=True).wait(), repeats)


def _timed(fn, repeats):
    """The fastest of `repeats` timed runs of fn (CUDA events) after one warm-up (it compiles a GEMM)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # sync: setup only, before the first step
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)
