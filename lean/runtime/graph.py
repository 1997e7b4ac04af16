"""The whole LoRA training step captured once in a CUDA graph, replayed with new batch contents.

    graph = lean.StepGraph(model, lora, opt, budget=8192, max_docs=64)   # warm-up + capture
    graph = lean.StepGraph(..., plan=plan_for(model, lora, 8192, budget))  # under a VRAM budget
    for docs in batches:
        batch = graph.pack(docs)             # = lean.pack(docs, 8192, pad_to=8192, max_docs=64, device="cpu")
        loss_sum, n_targets = graph.step(batch, lr=lr_now)

What is captured, once: lora.zero_grad(); forward_backward (embedding, the RoPE tables built from
the static positions, every layer, fused lm_head + loss, the whole backward, with the activation
plan's offloads, reloads and rebuilds when one is given: runtime/offload.py); opt.update() (AdamW
with gradient clipping). A replay is one launch of all of it. Shapes are fixed by the token budget
T and the document slots D (lean.pack(..., pad_to=T, max_docs=D), see batch.py), so every kernel
grid is the same on every step. What changes between replays is only the contents of persistent
device tensors, written from the host before each replay by non-blocking copies from pinned
buffers (batch.PinnedUpload; no host sync):
    batch  (3T + D + 1,) int32  [ids | positions | targets | cu_seqlens]  the static descriptor
    scale  (1,) fp32            1 / max(n_targets, 1): the loss normalisation (mean over targets)
    hyper  (2,) fp32            [lr, step] of the optimizer (AdamW.begin_step)
The loss is read from the graph's output after each replay (a device tensor, cloned: no sync).

Equal to the eager step (lora.zero_grad(); forward_backward; opt.step()) on the same fixed-shape
batches bit for bit: loss, LoRA gradients, parameters and moments (tests/test_graph.py, GPU).

Data parallel (reducer=, a grad_reduce.GradReducer): the capture holds the gradient's bucketed all-reduce
too (each bucket's NCCL all-reduce launched as its lowest layer's backward finishes, every bucket
waited on before AdamW), so a replay is the whole data-parallel step; `step(batch, n_targets=)`
normalises by the targets of every rank's batch. torch captures NCCL collectives issued on the
capture stream (ProcessGroupNCCL records them into the graph; the warm-up, run first on every rank,
creates the communicator outside the capture). A rank whose set-up fails stops every rank at an
exchange before the warm-up; one whose warm-up raises still issues the step's remaining buckets
and gathers (dist.step_ends), so no rank waits in an all-reduce. On several GPUs:
tests/test_dist_gpu.py holds the check (passed on 4 x H100), and lean-train falls back to the eager step, saying why,
if a capture fails.

Errors (StepGraphError): LoRA dropout > 0 (the dropout seed is a host int baked into the captured
launches, so every replay would draw the same masks: use dropout=0 or the eager step), a model or
LoRA not on a CUDA device, an optimizer over another LoRA, a batch packed with other shapes.
Cautions:
  - The graph reads fixed addresses: the model weights, lora.params/lowp/grads and opt.m/v/hyper
    must stay the same tensors (copy_ into them is fine; LoRA.load returns a new LoRA: build a new
    StepGraph for it). The captured activations live in the graph's private memory pool for as
    long as the StepGraph does (about the peak of one eager step).
  - Padding costs compute: the padding document is attended causally like a real one, and the
    attention grids span D documents x T / BLOCK_M query blocks (empty ones exit at once).
  - Gradient accumulation is not captured (zero_grad is inside): one batch per optimizer step.
  - On Hopper the captured step runs the TMA GEMM kernels at every projection size (eager steps
    keep them for large GEMMs only: their launch costs ~45 us of host time), so its bits may
    differ from an eager step's in the last place; tests/test_graph.py compares the two inside
    the same tma_at_every_size() setting.
  - The host waits on an event only if it runs two steps ahead of the GPU (PinnedUpload).
"""
from contextlib import nullcontext

import torch

from ..kernels.gemm import tma_at_every_size
from .batch import Batch, PinnedUpload, pack
from .dist import step_ends
from .offload import gather_of
from .step import forward_backward


class StepGraphError(ValueError):
    pass


def _check_setup(model, lora, opt, budget, max_docs, plan):
    if lora.dropout > 0:
        raise StepGraphError(f"StepGraph needs LoRA dropout 0, got {lora.dropout}: the dropout seed is a host "
                             "value baked into the captured launches (every replay would draw the same masks); "
                             "use LoRA.init(..., dropout=0.0) or the eager step (forward_backward + opt.step)")
    if model.config.aux_loss_coef > 0:
        raise StepGraphError("StepGraph: this MoE model's config turns on the load-balancing loss "
                             "(output_router_logits), which would count the padding tokens a captured step adds; "
                             "use the eager step (forward_backward + opt.step)")
    if opt.lora is not lora:
        raise StepGraphError("StepGraph: opt updates another LoRA than the one given: build it as AdamW(lora)")
    if not (isinstance(budget, int) and budget >= 1 and isinstance(max_docs, int) and max_docs >= 1):
        raise StepGraphError(f"StepGraph: budget and max_docs must be positive ints, got {budget!r}, {max_docs!r}")
    if plan is not None and plan.n_tokens < budget:
        raise StepGraphError(f"StepGraph: the activation plan was made for {plan.n_tokens} tokens, the graph's "
                             f"budget is {budget}: plan for the budget (plan_for(model, lora, {budget}, ...))")
    if not (torch.cuda.is_available() and lora.lowp.is_cuda and model.device.type == "cuda"):
        raise StepGraphError(f"StepGraph captures a CUDA graph: the model and LoRA must be on a CUDA device, "
                             f"got {model.device} and {lora.lowp.device} (use the eager step on the CPU)")


def _static_batch(flat, T, D):
    """The descriptor the graph reads: views of one persistent int32 buffer, laid out like pack's."""
    return Batch(
        ids=flat[:T], positions=flat[T:2 * T], targets=flat[2 * T:3 * T], cu_seqlens=flat[3 * T:],
        max_seqlen=T, n_tokens=T, n_targets=0,  # n_targets unused: the scale tensor carries 1/n
        doc_lens=[], host=None,
    )


class StepGraph:
    """One captured LoRA step (see the module docstring). step(batch, lr) replays it."""

    def __init__(self, model, lora, opt, budget, max_docs, plan=None, reducer=None):
        # Data parallel: the set-up agreed on every rank before the warm-up's all-reduces, so that an
        # error here on one rank stops every rank at the exchange, none in a collective (dist.agreed).
        with reducer.dist.agreed("setting up the captured step") if reducer is not None else nullcontext():
            _check_setup(model, lora, opt, budget, max_docs, plan)
            self.model, self.lora, self.opt, self.plan, self.reducer = model, lora, opt, plan, reducer
            self.budget, self.max_docs = budget, max_docs
            dev = lora.lowp.device
            self._ints = PinnedUpload(3 * budget + max_docs + 1, torch.int32, dev)
            self._scale = PinnedUpload(1, torch.float32, dev)
            self.batch = _static_batch(self._ints.dev, budget, max_docs)
            # Warm-up and capture content: one document with no target (valid descriptor, zero loss).
            self._ints.write(self.pack([([0] * budget, [False] * budget)]).host)
            self._scale.write(1.0)
        with tma_at_every_size():  # Hopper: TMA GEMMs for every projection (host cost paid once)
            self._warm_up()
            self._graph, self._loss = self._capture()
        run = reducer.dist if reducer is not None else getattr(getattr(model, "shard", None), "dist", None)
        if run is not None and run.world > 1:
            run.hold_graph(self._graph)  # it holds NCCL work: released before the process group is destroyed
        self.moe = model.cache.get("moe")  # an MoE model's per-step buffers the replays write (expert load)

    def pack(self, docs, vocab=None):
        """lean.pack with this graph's fixed shapes, on the host (step() does the one copy)."""
        return pack(docs, self.budget, pad_to=self.budget, max_docs=self.max_docs, device="cpu", vocab=vocab)

    def _run(self):
        """The step as captured. Nothing here reads a host value that changes from step to step.
        Sharded weights: every layer's gather is captured (none is taken as still held). Data
        parallel: a warm-up that raises on this rank still issues the rest of the step's gathers
        and buckets, as the other ranks do (dist.step_ends)."""
        gather = gather_of(self.model)
        if gather is not None:
            gather.held.clear()
            gather.begin_step()
        self.lora.zero_grad()
        if self.reducer is not None:
            self.reducer.begin()
        with step_ends(self.reducer, gather, passes=1):  # the buckets' all-reduces go into the graph too
            loss, _ = forward_backward(self.model, self.lora, self.batch, grad_scale=self._scale.dev, seed=0,
                                       plan=self.plan, reducer=self.reducer)
        self.opt.update()
        return loss

    def _warm_up(self):
        """One eager run on a side stream, as torch asks before a capture (it compiles every Triton
        kernel and builds the per-model tables); the optimizer state it changes is put back."""
        state = (self.lora.params, self.opt.m, self.opt.v, self.opt.grad_norm)
        # sync: set-up, once. On the host, so the warm-up peaks like a step (device clones of the
        # LoRA params and AdamW moments would add 12 bytes a parameter: 0.5 GiB at 8B, r=16).
        self.lora.sync()  # host state (runtime/host_state.py): the last update has reached the host
        saved = [t.to("cpu", copy=True) for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.lora.sync()  # host state: the warm-up's update is done before the host puts it back
        for t, s in zip(state, saved):
            t.copy_(s)
        self.lora.sync_lowp()

    def _capture(self):
        # The warm-up cached RoPE tables of the warm-up positions on the static batch: drop them,
        # so the capture records the table kernel and every replay rebuilds cos/sin from positions.
        self.batch.cache.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self._run()
        self.batch.cache.clear()  # the captured tables are graph-pool memory rewritten on replay
        return graph, loss

    def _check_batch(self, batch):
        T, D = self.budget, self.max_docs
        shapes = (batch.n_tokens, batch.cu_seqlens.shape[0], batch.max_seqlen, batch.host.shape[0])
        if shapes != (T, D + 1, T, 3 * T + D + 1):
            raise StepGraphError(
                f"batch has {batch.n_tokens} tokens, {batch.cu_seqlens.shape[0] - 1} document slots and "
                f"max_seqlen {batch.max_seqlen}; this StepGraph was captured for {T} tokens and {D} slots: "
                f"pack it with graph.pack(docs) or lean.pack(docs, {T}, pad_to={T}, max_docs={D})")

    def step(self, batch, lr=None, n_targets=None):
        """One optimizer step on `batch` (from self.pack). Returns (loss_sum, n_targets) like
        forward_backward: loss_sum a (1,) fp32 device tensor, n_targets a host int. No host sync.
        n_targets: the loss normalisation's target count (data parallel: every rank's; default the
        batch's own)."""
        self._check_batch(batch)
        self._ints.write(batch.host)  # one H2D copy of the descriptor, into the static buffer
        self._scale.write(1.0 / max(batch.n_targets if n_targets is None else n_targets, 1))
        self.opt.begin_step(lr)
        self.lora.next_seed()  # count the step as the eager forward_backward does (checkpoints)
        self._graph.replay()
        gather = gather_of(self.model)
        if gather is not None:  # which layer a gather buffer holds is the replay's business now
            gather.held.clear()
        return self._loss.clone(), batch.n_targets  # clone: the next replay rewrites _loss
