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

On a CPU device there are no streams: the same calls copy synchronously (the CI variant; it runs
the same slot and buffer bookkeeping, and holds the offloaded rows until retire as the GPU does, so
the planner's walk equals the CPU step's allocations in every mode).

measure_rates() times the pinned link (each direction) and a layer-sized GEMM once, before the
plan: the planner prices copies and recomputes with them (plan.Rates).

Tested: tests/test_offload.py: CPU, NaN-poisoned buffers, gradients equal to keeping everything bit
for bit; GPU (H100): the same with these streams, under sync_debug_mode("error"), and inside a
captured CUDA graph.
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
    def __init__(self, plan, dtype, device):
        device = torch.device(device)
        self.layers = plan.offloaded
        self.slot = {li: j for j, li in enumerate(self.layers)}
        ups = [li for li in self.layers if plan.policy(li, "up") == "offload" and not plan.cfg.is_moe(li)]
        self.up_slot = {li: j for j, li in enumerate(ups)}
        self.max_tokens = plan.n_tokens
        self.on_gpu = device.type == "cuda"
        N, C, F = plan.n_tokens, plan.cfg.hidden, plan.cfg.intermediate
        pin = dict(dtype=dtype, pin_memory=self.on_gpu)
        self.host = torch.empty(len(self.layers), N, C, **pin)  # (L_off, N, C)
        self.host_up = torch.empty(len(ups), N, F, **pin)  # (L_up, N, F)
        self.reload = [torch.empty(N, C, dtype=dtype, device=device) for _ in range(2)]  # 2 x (N, C)
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


def scheduler(model, plan, n_tokens):
    """The Offloader for (model, plan), built on first use and cached on the model, begun for a step
    of n_tokens; None when the plan offloads nothing."""
    if plan is None:
        return None
    cfg = model.config
    if len(plan.modes) != cfg.n_layers or plan.cfg.hidden != cfg.hidden:
        raise OffloadError(f"the activation plan is for {len(plan.modes)} layers of hidden size {plan.cfg.hidden}, "
                           f"the model has {cfg.n_layers} of {cfg.hidden}: make it for this model (plan_for)")
    if not plan.offloaded:
        return None
    key = (plan.modes, plan.n_tokens, plan.cfg.hidden)
    cached = model.cache.get("offload")
    if cached is None or cached[0] != key:
        cached = (key, Offloader(plan, model.dtype, model.device))
        model.cache["offload"] = cached
    sched = cached[1]
    sched.begin(n_tokens)
    return sched


def rate_weight(model):
    """The weight (<= F, C) in the model dtype that measure_rates times lean's GEMM on: the model's own
    values (no zeros), a dense layer's gate (F, C), or where every layer is an MoE layer, F rows of
    layer 0's expert gate_up (E*2Fe, C), or of its q (Oq, C) when the experts are MXFP4 pairs. An Nf4
    comes dequantised (a new tensor: the GEMM its scratch path runs), then sliced."""
    C, F = model.config.hidden, model.config.intermediate
    w = next((layer.gate for layer in model.layers if layer.gate is not None), None)  # (F, C)
    if w is None:
        gu = model.layers[0].gate_up
        w = gu.reshape(-1, C) if isinstance(gu, torch.Tensor) else model.layers[0].q
    if isinstance(w, Nf4):
        w = w.dense(model.dtype)
    return w[:F]


def measure_rates(model, n_tokens, repeats=9):
    """plan.Rates on this GPU, measured once before the plan (a setup-time sync): pinned D2H and
    H2D copies of one (n_tokens, F) activation and lean's GEMM at a layer's gate shape
    (n_tokens, C) x (C, F) (on rate_weight's weight), each the fastest of `repeats` after a warm-up
    (what the link and the GEMM can do; single copies vary by up to ~20% between calls), timed with
    CUDA events. None on a CPU."""
    from ..kernels.gemm import matmul
    from .plan import Rates
    if model.device.type != "cuda":
        return None
    cfg = model.config
    N, C, F = min(n_tokens, cfg.vocab), cfg.hidden, cfg.intermediate
    dev = torch.empty(N, F, dtype=model.dtype, device=model.device)  # (N, F)
    host = torch.empty(N, F, dtype=model.dtype, pin_memory=True)  # (N, F)
    w = rate_weight(model)  # (F, C), or fewer rows
    out = dev[:, :w.shape[0]]  # (N, F), or fewer columns: the GEMM's output
    x = model.lm_head[:N].to(model.device)  # (N, C): real rows, no zeros (copied: the head may be on the host)

    def timed(fn):
        fn()  # warm-up (compiles the GEMM)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # sync: setup only, before the first step
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    nbytes = dev.numel() * dev.element_size()
    d2h = nbytes / timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = nbytes / timed(lambda: dev.copy_(host, non_blocking=True))
    flops = 2 * N * C * w.shape[0] / timed(lambda: matmul(out, x, w.t()))
    return Rates(d2h=d2h, h2d=h2d, flops=flops)
