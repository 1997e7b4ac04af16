"""AdamW over the LoRA flat buffer: fp32 master weights and moments, clipping on the device.

lr and step live in a small persistent device tensor (`hyper`) that a captured CUDA graph reads
on replay. A step is two halves: begin_step(lr) on the host (count the step, write [lr, step] into
`hyper` with one non-blocking copy from a persistent pinned buffer, see batch.PinnedUpload) and
update() on the device (the AdamW launches, no host value baked in: what a graph captures).
step(lr) is both. The global gradient norm stays on the device (`grad_norm`) until a log point
reads it.

With the LoRA's state on the host (LoRA(..., host_state=True), runtime/host_state.py) the moments
are pinned host memory too, and update() takes the norm from the partials the backward summed layer
by layer, then runs the update kernel on the host buffers over the bus, writing the GPU's copy: in
chunks on the ring's copy stream, under the next step's forward (host_state.GradRing.update), except
under graph capture.

The update under the next captured step (the LoRA state on the GPU, runtime/graph.py): the update
reads and writes 30 bytes a parameter (p, m, v, g in; p, m, v, lowp out) and needs the whole
gradient's norm first, so it cannot run under the backward that makes the gradient; on an MoE model's
expert LoRA (163M parameters on Qwen3-30B-A3B cut to 8 layers) that is ~1.3 ms of HBM traffic a step
with the SMs' math idle. A captured step then ends with arm(): the norm, and this step's [lr, t]
copied into `armed` (3,) [lr, t, on] with on = 1. The next replay starts with update_deferred(): the
armed update, layer by layer on a side stream (adamw_update gated on `on`, zeroing the gradient it
read, which is the step's zero_grad), each layer's forward waiting for its own layer only, so the
update of layer li+1 runs beside the forward of layer li. Anything else that reads the LoRA between
replays runs it first through flush() (LoRA.settle: zero_grad, sync, ready, generation), which also
disarms it. The same bits as update(): the same kernel, norm and [lr, t] on every element.
"""
import torch

from ..kernels.adamw import adamw_norm, adamw_partials, adamw_step, adamw_sumsq, adamw_update
from .batch import PinnedUpload


class AdamW:
    def __init__(self, lora, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0):
        self.lora = lora
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.max_grad_norm = max_grad_norm
        dev = lora.lowp.device
        if lora.host_state:
            from .host_state import pinned

            self.m, self.v = pinned(lora.numel), pinned(lora.numel)  # (P,) fp32 host
        else:
            self.m = torch.zeros_like(lora.params)  # (P,) fp32
            self.v = torch.zeros_like(lora.params)  # (P,) fp32
        self.grad_norm = torch.zeros(1, dtype=torch.float32, device=dev)
        self._hyper = PinnedUpload(2, torch.float32, dev)
        self.hyper = self._hyper.dev  # (2,) fp32 [lr, step], persistent: a captured graph reads it
        self.step_count = 0
        # (3,) fp32 [lr, step, on]: the update a captured step armed for the next (module docstring)
        self.armed = torch.zeros(3, dtype=torch.float32, device=dev)
        self._on_off = torch.tensor([1.0, 0.0], dtype=torch.float32, device=dev)  # copied into armed[2]

    def step(self, lr=None):
        """One update from lora.grads; lr overrides the default (a schedule's value)."""
        self.begin_step(lr)
        self.update()

    def begin_step(self, lr=None):
        """Host half of a step: count it and write [lr, step] into `hyper` (no sync)."""
        if self.lora.ring is not None:
            self.lora.ring.join()  # host state: the last update (copy stream) has read hyper and grad_norm
        self.step_count += 1
        self._hyper.write([self.lr if lr is None else lr, float(self.step_count)])

    def _hp(self):
        return dict(beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay,
                    max_grad_norm=self.max_grad_norm)

    def update(self):
        """Device half of a step: AdamW from lora.grads and `hyper`; safe to capture in a graph."""
        lora = self.lora
        lowp = None if lora.lowp is lora.params else lora.lowp
        hp = self._hp()
        if lora.ring is None:
            adamw_step(lora.params, self.m, self.v, self.grad_norm, lora.grads, self.hyper, params_lowp=lowp, **hp)
            return
        ring = lora.ring
        adamw_norm(self.grad_norm, ring.partials, lora.numel)  # the backward summed each layer's share
        p, m, v, g = lora.params, self.m, self.v, lora.grads
        if not ring.deferred():
            adamw_update(p, m, v, self.grad_norm, g, self.hyper, params_lowp=lowp, **hp)
            return

        def launch(a, b):  # [a, b) of the flat buffers, under the next forward (host_state.py)
            adamw_update(p[a:b], m[a:b], v[a:b], self.grad_norm, g[a:b], self.hyper,
                         params_lowp=None if lowp is None else lowp[a:b], **hp)

        ring.update(launch)

    # ---- the update under the next captured step (module docstring; the LoRA state on the GPU) ----
    def update_deferred(self, stream, events, programs=0):
        """The armed update, layer by layer on `stream` (after the current stream's work so far), each
        layer's end recorded in events[li]; every gradient is zeroed once read. programs > 0: launches
        of at most that many programs (adamw.UPDATE_BLOCK elements each), so that a launch leaves SMs
        to the forward beside it."""
        from ..kernels.adamw import UPDATE_BLOCK

        lora, hp = self.lora, self._hp()
        p, m, v, g = lora.params, self.m, self.v, lora.grads
        lowp = None if lora.lowp is lora.params else lora.lowp
        chunk = programs * UPDATE_BLOCK if programs > 0 else None
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for li, (a, b) in enumerate(lora.layer_spans()):
                for c in range(a, b, chunk or max(b - a, 1)):
                    e = b if chunk is None else min(c + chunk, b)
                    adamw_update(p[c:e], m[c:e], v[c:e], self.grad_norm, g[c:e], self.armed, gated=True,
                                 zero_grad=True, params_lowp=None if lowp is None else lowp[c:e], **hp)
                events[li].record(stream)

    def arm(self):
        """After a captured step's backward: the gradient's norm, and the update armed with this step's
        [lr, t] (run by the next replay's update_deferred, or by flush)."""
        g = self.lora.grads
        partials = torch.empty(adamw_partials(g.shape[0]), dtype=torch.float32, device=g.device)  # scratch
        adamw_sumsq(partials, g)
        adamw_norm(self.grad_norm, partials, g.shape[0])
        self.armed[:2].copy_(self.hyper)
        self.armed[2:].copy_(self._on_off[:1])

    def flush(self):
        """Run the armed update now on the current stream (gradients kept), then disarm it."""
        lora = self.lora
        lowp = None if lora.lowp is lora.params else lora.lowp
        adamw_update(lora.params, self.m, self.v, self.grad_norm, lora.grads, self.armed, gated=True,
                     params_lowp=lowp, **self._hp())
        self.armed[2:].copy_(self._on_off[1:])

    def state_dict(self):
        self.lora.sync()
        return {"m": self.m, "v": self.v, "step": self.step_count}

    def load_state_dict(self, sd):
        self.lora.sync()
        self.m.copy_(sd["m"])
        self.v.copy_(sd["v"])
        self.step_count = int(sd["step"])
