"""The offload scheduler: layer inputs to pinned host memory in forward, back in backward.

Shape legend: N tokens of the step (<= the plan's n_tokens), C hidden, L_off offloaded layers.

Buffers, allocated once from the plan (never grown during a step):
    host     (L_off, N, C) act, pinned   one slot per offloaded layer
    reload   2 x (N, C) act, device      two reload buffers; offloaded layer j (in layer order)
                                         reloads into buffer j % 2, so consecutive ones alternate
The step (lean/runtime/step.py) calls, in this order:
    forward   offload(li, x)  after layer li's forward: x -> its host slot, on the copy stream,
                              which first waits for the compute stream (x is written); the
                              scheduler holds x so its memory is not reused during the copy
              retire(li)      after layer li+1's forward: the compute stream waits for li's copy
                              (done by then: it ran under layer li+1), and x is let go
    backward  prefetch(li)    before layer li+1's backward: host slot -> li's reload buffer, on the
                              copy stream, after the compute stream has released that buffer
                              (the offloaded layer two slots up read it); so a layer costs
                              max(copy, compute). The last layer's prefetch is issued at the end
                              of the forward, under the lm_head + loss
              wait(li)        before layer li's recompute: the compute stream waits for its reload;
                              returns the (N, C) input
              release(li)     after layer li's backward: its reload buffer may be overwritten
Every cross-stream dependency is an event: no host sync, and the calls capture in a CUDA graph
(every copy-stream op is waited on by the compute stream before the step ends; events are only
waited on within the step that recorded them).

On a CPU device there are no streams: the same calls copy synchronously (the CI variant; it runs
the same slot and buffer bookkeeping).

Tested: tests/test_offload.py: CPU, NaN-poisoned buffers, gradients equal to keeping everything bit
for bit; GPU (written, to be run on the device): the same with these streams, under
sync_debug_mode("error"), and inside a captured CUDA graph.
Errors: OffloadError when a batch holds more tokens than the plan was made for, or the plan was
made for another model shape.
Caution: the scheduler belongs to one model and plan (scheduler() caches it on model.cache);
two steps must not run interleaved on one scheduler.
"""
import torch


class OffloadError(ValueError):
    pass


class Offloader:
    def __init__(self, plan, dtype, device):
        device = torch.device(device)
        self.layers = plan.offloaded
        self.slot = {li: j for j, li in enumerate(self.layers)}
        self.max_tokens = plan.n_tokens
        self.on_gpu = device.type == "cuda"
        N, C = plan.n_tokens, plan.cfg.hidden
        self.host = torch.empty(len(self.layers), N, C, dtype=dtype, pin_memory=self.on_gpu)  # (L_off, N, C)
        self.reload = [torch.empty(N, C, dtype=dtype, device=device) for _ in range(2)]  # 2 x (N, C)
        self.n = N
        self._held = {}  # li -> x, its D2H copy in flight
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

    def offload(self, li, x):
        """Forward, after layer li: its input x (N, C) -> pinned host slot."""
        dst = self.host[self.slot[li], :self.n]
        if not self.on_gpu:
            dst.copy_(x)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # x is written
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(x, non_blocking=True)
            self.copied[li].record()
        self._held[li] = x

    def retire(self, li):
        """Forward, a layer later: the compute stream waits for li's copy; x's memory is let go."""
        x = self._held.pop(li, None)
        if x is not None:
            torch.cuda.current_stream().wait_event(self.copied[li])

    def prefetch(self, li):
        """Backward, before layer li+1's backward: li's host slot -> its reload buffer."""
        b = self._buf(li)
        dst, src = self.reload[b][:self.n], self.host[self.slot[li], :self.n]
        if not self.on_gpu:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._freed_this_step[b]:  # the layer that read this buffer last has finished
                self.copy_stream.wait_event(self.freed[b])
            dst.copy_(src, non_blocking=True)
            self.loaded[b].record()

    def wait(self, li):
        """Backward: the compute stream waits for li's reload; returns its input (N, C)."""
        b = self._buf(li)
        if self.on_gpu:
            torch.cuda.current_stream().wait_event(self.loaded[b])
        return self.reload[b][:self.n]

    def release(self, li):
        """Backward, after layer li's backward: its reload buffer may be refilled."""
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
    key = (plan.offloaded, plan.n_tokens, plan.cfg.hidden)
    cached = model.cache.get("offload")
    if cached is None or cached[0] != key:
        cached = (key, Offloader(plan, model.dtype, model.device))
        model.cache["offload"] = cached
    sched = cached[1]
    sched.begin(n_tokens)
    return sched
