"""Data parallel's gradient: lora.grads all-reduced in per-layer buckets under the backward.

    reducer = GradReducer(lora, dist)    # runtime/dist.py's Dist: the ranks and their collectives

Each rank's forward_backward adds grad_scale * its token losses'
gradient into lora.grads with grad_scale = 1 / (global targets), so the SUM over ranks is the
step's gradient. lora.grads is laid out layer-major (lora.py), so a run of consecutive layers is a
contiguous slice: the buckets are layer 0 alone (the last layer the backward finishes: what cannot
hide is small), then runs of consecutive layers going up, each closed as it reaches BUCKET_BYTES
(the top run may be smaller). In the last micro-batch of a step, step._backward_layers calls layer_done(li) after layer li's backward; when li is the lowest
layer of a bucket, its all-reduce is launched asynchronously (dist.all_reduce(async_op=True)), so
it runs under the backward of the layers below. On a GPU, ProcessGroupNCCL runs it on its own
communication stream, which first waits on an event of the issuing (compute) stream: exactly "wait
for the bucket's last layer, then reduce", with no host sync; finish() makes the compute stream wait
for every bucket before AdamW (its clipping reads the whole gradient). On the CPU gloo runs the
same calls on its own threads. After the reduction every rank holds the same gradient bits, so the
grad norm, the clipping, the update and the NaN check agree without more communication.
Tested: tests/test_dist.py (the buckets' slices and order; 2 and 3 CPU processes against one),
tests/test_dist_gpu.py (NCCL, the captured step).
"""
import torch.distributed as torch_dist

from .lora import _numel

BUCKET_BYTES = 25 << 20  # DDP's default bucket. Qwen3-8B, r=16 on every target: 174.6 MB of fp32
# gradient in 7 buckets by GradReducer's rule (layer 0 alone, 4.8 MB; five of 6 layers, 29.1 MB; the top 5)


class GradReducer:
    """lora.grads all-reduced (SUM) in per-layer buckets under the backward (see the module docstring).

        reducer.begin()                                   # a step starts
        forward_backward(..., reducer=reducer)            # its last micro-batch: buckets launch as layers finish
        reducer.finish()                                  # the rest launched, every bucket waited on
    """

    def __init__(self, lora, dist, bucket_bytes=BUCKET_BYTES):
        if lora.host_state:
            raise ValueError("data parallel all-reduces the LoRA gradient on the GPU: the LoRA state on the host "
                             "(host_state, --lora-state host) is for one GPU; drop one or the other")
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
            with self.dist.collective("the gradient all-reduce"):
                self.works.append(torch_dist.all_reduce(view, async_op=True))

    def finish(self):
        """Launch every bucket not launched yet (a micro-batch that raised: every rank issues the same
        all-reduces in the same order), then wait for all (the compute stream waits on a GPU)."""
        for b in range(len(self.buckets)):
            if b not in self.launched:
                self._launch(b)
        works, self.works = self.works, []
        with self.dist.collective("the gradient all-reduce"):
            for w in works:
                w.wait()
