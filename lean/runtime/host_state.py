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

Bits: each layer's gradient is the same as with the state on the GPU (the slot is zeroed as
zero_grad zeroes lora.grads, and the kernels are the same). The norm is summed layer by layer (its
blocks start at each layer's offset), so it may differ from the GPU state's in the last place: the
updates are the same bits when clipping is off or does not bind (the factor is exactly 1 either
way), and within fp32 rounding of the factor when it binds (tests/test_host_state.py).

No host sync in a step: every wait is an event between the two streams, so a captured step
(graph.py) holds the copies too. The host may read params, grads, m, v only after sync() (a
checkpoint, merge, the tests do). Not with data parallel or sharded weights (their reducer
all-reduces lora.grads on the GPU). Cautions: zero_grad does not clear lora.grads on the host (each
backward overwrites it layer by layer), so an optimizer step with no backward after zero_grad reuses
the last gradient; torch's pinned allocator rounds each buffer up to a power of two (plan_for counts
the rounded bytes against the host's share).
"""
import torch

from ..kernels.adamw import adamw_partials, adamw_sumsq


class GradRing:
    """The two gradient slots, the norm's partials and the copies to the host (module docstring)."""

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


def pinned(n, dtype=torch.float32):
    """(n,) zeros in pinned host memory (plain host memory where there is no GPU: the CPU tests)."""
    return torch.zeros(n, dtype=dtype, pin_memory=torch.cuda.is_available())


def sync(device):
    """Wait for the GPU before the host reads the state (a save point)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: a save point (checkpoint, merge, state_dict), never in a step
