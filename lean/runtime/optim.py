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
"""
import torch

from ..kernels.adamw import adamw_norm, adamw_step, adamw_update
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

    def update(self):
        """Device half of a step: AdamW from lora.grads and `hyper`; safe to capture in a graph."""
        lora = self.lora
        lowp = None if lora.lowp is lora.params else lora.lowp
        hp = dict(beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay,
                  max_grad_norm=self.max_grad_norm)
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

    def state_dict(self):
        self.lora.sync()
        return {"m": self.m, "v": self.v, "step": self.step_count}

    def load_state_dict(self, sd):
        self.lora.sync()
        self.m.copy_(sd["m"])
        self.v.copy_(sd["v"])
        self.step_count = int(sd["step"])
