"""The LoRA state in pinned host memory: master weights, gradients and AdamW moments off the GPU.

Shape legend: P trainable parameters (lora.py's flat layout, layer-major), Pl the largest layer's
share of them, K the norm's partial sums (adamw_partials per layer, summed over the layers).

A LoRA step of a bf16 model keeps 18 bytes a parameter on the GPU: the fp32 master weight (4), its
gradient (4), AdamW's two moments (8) and the compute copy the kernels read (2). A Mixture-of-Experts
model adapts every expert, and at full depth that state outgrows the card (Qwen3-30B-A3B, r=16 on
attention and experts: 995M parameters, 16.7 GiB). With LoRA(..., host_state=True) the GPU keeps the
compute copy and a ring of two layers' gradients:

    params, grads, m, v  (P,) fp32, pinned host memory (m, v: runtime/optim.py)
    lowp                 (P,) model dtype, GPU: what the kernels read, written by the update
    slots                (2, Pl) fp32, GPU: layer li's gradient views (Adapter.da / db) are fixed
                         views of slot li % 2, at the layer's own offsets (a captured graph sees
                         the same addresses on every replay)
    partials             (K,) fp32, GPU: each layer's sums of squared gradients

The backward (step._backward_layers) brackets each layer's backward with begin(li) and end(li):
    begin   the compute stream waits for slot li % 2's copy to the host (layer li+2's) if one was
            issued this pass, then zeroes the slot; on a later micro-batch of an accumulated step it
            reloads the layer's host gradient into the slot instead (the step adds to it)
    end     adamw_sumsq of the slot into the layer's partials (the norm's share, on the GPU), then
            the copy stream copies the slot into grads[layer's range] on the host
and finish() joins the copy stream into the compute stream. AdamW.update then sums the partials into
the norm and runs the update kernel on the host buffers, which it reads and writes over the bus
(Triton takes pinned pointers; no staging buffers): 28 bytes a parameter cross the link in an update
(p, m, v, g in; p, m, v out), and lowp is written on the GPU.

The update under the next forward (update(), ready()): at 995M parameters the update takes ~0.4 s,
bound by the bus, while the GPU's SMs idle. So AdamW.update hands it to update(launch): on the copy
stream, after the backward's copies and the norm, layer by layer in forward order, each layer in
chunks of PROGRAMS x adamw.UPDATE_BLOCK elements (one launch each: a bounded chunk leaves SMs to
the compute stream, where one launch over a whole layer would hold them all until it drains), each
layer's last chunk followed by an event. The next pass's forward waits, before layer li, for layer
li's event only (ready(li)), so the forward runs under the rest of the update. The same bits: every element's update is the same arithmetic, whatever the chunks. Not under graph
capture (a captured step's update stays in the step: the next replay could not wait on this one's
events) and not with PROGRAMS = 0 (LEAN_HOST_UPDATE_PROGRAMS=0): then one launch, on the compute
stream, before the next step's work.

Bits: each layer's gradient is the same as with the state on the GPU (the slot is zeroed as
zero_grad zeroes lora.grads, and the kernels are the same). The norm is summed layer by layer (its
blocks start at each layer's offset), so it may differ from the GPU state's in the last place: the
updates are the same bits when clipping is off or does not bind (the factor is exactly 1 either
way), and within fp32 rounding of the factor when it binds (tests/test_host_state.py).

No host sync in a step: every wait is an event between the two streams, so a captured step
(graph.py) holds the copies too. The host may read params, grads, m, v only after sync() (a
checkpoint, merge, the tests do). Not with data parallel or sharded weights (their reducer
all-reduces lora.grads on the GPU). Cautions: sync() before dropping a LoRA or its AdamW while an
update may run (the copy stream still reads and writes their buffers); zero_grad does not clear
lora.grads on the host (each backward overwrites it layer by layer), so an optimizer step with no
backward after zero_grad reuses the last gradient; torch's pinned allocator rounds each buffer up to a power of two (plan_for counts
the rounded bytes against the host's share).
"""
import contextlib
import os

import torch

from ..kernels.adamw import UPDATE_BLOCK, adamw_partials, adamw_sumsq

# Programs a launch of the update in chunks (module docstring); 0: the whole update in one launch on
# the compute stream; None: PROGRAMS_PER_SM x the device's SMs. Measured on the H100 (132 SMs;
# Qwen3-30B-A3B, 48 layers, --budget 60, padded 4 x 2048, tok/s, one call): one launch after the
# backward 9,921; chunks of 33 / 132 / 528 / 1,056 programs 7,272 / 11,679 / 12,531 / 13,548 (too
# few programs leave the bus idle; a chunk of 8 an SM is ~5 launches a layer there).
PROGRAMS_PER_SM = 8


def _programs_env():
    v = os.environ.get("LEAN_HOST_UPDATE_PROGRAMS", "")
    if not v:
        return None
    if not v.isdigit():
        raise ValueError(f"LEAN_HOST_UPDATE_PROGRAMS={v!r}: expected a whole number of programs (0: one launch)")
    return int(v)


PROGRAMS = _programs_env()


class GradRing:
    """The two gradient slots, the norm's partials, the copies to the host, and AdamW's update under
    the next forward (update, ready, join) (module docstring)."""

    def __init__(self, grads, spans, device, dtype=torch.float32):
        # spans: per layer (start, stop) in the flat layout
        self.grads = grads  # (P,) fp32 host
        self.spans = spans
        self.P = grads.shape[0]
        width = max((b - a for a, b in spans), default=0)
        self.slots = torch.zeros(2, max(width, 1), dtype=dtype, device=device)  # (2, Pl)
        self.bases, k = [], 0
        for a, b in spans:  # each layer's partials, blocks chosen for the whole P (adamw_sumsq's P=)
            self.bases.append(k)
            k += adamw_partials(b - a, self.P)
        self.partials = torch.zeros(max(k, 1), dtype=torch.float32, device=device)  # (K,)
        self.cuda = device.type == "cuda"
        self.copy = torch.cuda.Stream(device) if self.cuda else None
        self.done = [torch.cuda.Event() if self.cuda else None for _ in range(2)]  # a slot's copy to the host
        self.issued = [False, False]  # done[s] recorded in this backward pass
        self.fresh = True  # the next pass starts a step (zero_grad): slots are zeroed, not reloaded
        self.updated = [torch.cuda.Event() if self.cuda else None for _ in spans]  # a layer's update done
        self.pending = False  # an update() is running under the next forward
        if PROGRAMS is not None:
            self.programs = PROGRAMS
        elif self.cuda:
            self.programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        else:  # the CPU: one launch (the interpreter's big blocks; chunks would run its small ones)
            self.programs = 0

    def start(self):
        """zero_grad: the next pass starts a step (its slots zeroed). A pass that stopped before
        finish() (an exception) may have copies in flight: the compute stream waits for them here,
        and the next pass waits on none of its events."""
        if self.cuda and any(self.issued):
            torch.cuda.current_stream().wait_stream(self.copy)
        self.fresh = True
        self.issued = [False, False]

    def slot(self, li):
        """Layer li's gradient buffer: a view of its slot, as long as the layer's share."""
        a, b = self.spans[li]
        return self.slots[li % 2, :b - a]

    def begin(self, li):
        s = li % 2
        if self.issued[s]:
            torch.cuda.current_stream().wait_event(self.done[s])  # layer li+2's copy has read the slot
        a, b = self.spans[li]
        if self.fresh:
            self.slot(li).zero_()
        else:  # accumulating: the layer's gradient so far (the compute stream follows the last finish())
            self.slot(li).copy_(self.grads[a:b], non_blocking=True)

    def end(self, li):
        a, b = self.spans[li]
        if b == a:
            return
        part = self.partials[self.bases[li]:]
        adamw_sumsq(part, self.slot(li), P=self.P)  # overwritten each pass: the last micro-batch's sums count
        if not self.cuda:
            self.grads[a:b].copy_(self.slot(li))
            return
        s = li % 2
        self.copy.wait_stream(torch.cuda.current_stream())  # the layer's backward wrote the slot
        with torch.cuda.stream(self.copy):
            self.grads[a:b].copy_(self.slot(li), non_blocking=True)
            self.done[s].record(self.copy)
        self.issued[s] = True

    def finish(self):
        """After the backward: the compute stream waits for every copy to the host."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.copy)
        self.issued = [False, False]
        self.fresh = False
        self.pending = False  # this pass's forward waited for every layer's update

    def deferred(self):
        """Whether AdamW.update goes through update(): chunks configured, and not capturing a graph."""
        return self.programs > 0 and not (self.cuda and torch.cuda.is_current_stream_capturing())

    def update(self, launch):
        """The update layer by layer, in chunks: launch(a, b) updates the flat range [a, b). On the
        GPU on the copy stream, after the compute stream's work so far (the norm, the last copies),
        layer li's end recorded in updated[li] (module docstring)."""
        chunk = self.programs * UPDATE_BLOCK
        if self.cuda:
            self.copy.wait_stream(torch.cuda.current_stream())
            self.pending = True  # before the launches: one that raises leaves the earlier ones running
        with torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext():
            for li, (a, b) in enumerate(self.spans):
                for c in range(a, b, chunk):
                    launch(c, min(c + chunk, b))
                if self.cuda:
                    self.updated[li].record(self.copy)

    def ready(self, li):
        """Before layer li's forward: the compute stream waits for the layer's update, if one runs."""
        if not self.pending:
            return
        if torch.cuda.is_current_stream_capturing():  # a capture cannot wait on an eager step's event
            raise RuntimeError("capturing a step while an eager step's LoRA update is still running: call "
                               "lora.sync() before the capture (StepGraph does)")
        torch.cuda.current_stream().wait_event(self.updated[li])

    def join(self):
        """The compute stream waits for the whole update, if one runs: before anything that rewrites
        what it reads (AdamW.begin_step's hyper, the norm; a captured step's replay) or reads lowp
        without the per-layer waits (generation)."""
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.copy)
            self.pending = False


def pinned(n, dtype=torch.float32):
    """(n,) zeros in pinned host memory (plain host memory where there is no GPU: the CPU tests)."""
    return torch.zeros(n, dtype=dtype, pin_memory=torch.cuda.is_available())


def sync(device):
    """Wait for the GPU before the host reads the state (a save point)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: a save point (checkpoint, merge, state_dict), never in a step
