"""One training step, hand-scheduled: embed, layers forward, fused lm_head + loss, layers backward.

Read it top to bottom. The tape is the whole autograd engine: forward records, per layer, the
backward function and what the activation plan (lean/runtime/plan.py) says to save; backward
pops the records in reverse. Nothing here reads back from the device: the loss stays a device
tensor, and the target count is a host int from the batch descriptor.

With a plan (plan=, from planner.plan_step / plan_for), each layer runs in its mode, and the two
loops show where it happens:
    keep       the tape holds the layer's Saved tuple (the default, plan=None)
    recompute  the tape holds Kept(x, xa): the layer input and the LoRA xa rows; backward reruns
               layer_forward(rebuild=...) from them, up to the gate/up projections
    offload    forward copies x to pinned host memory (sched.offload, on a copy stream; retired a
               layer later), the tape holds Kept(None, xa); backward reloads x one layer ahead
               (sched.prefetch before the layer above runs its backward, sched.wait before use),
               then rebuilds as above
    offload_up as offload, and the up projection goes to the host and back with x: the rebuild
               skips its GEMM
The rebuilt Saved is bit-identical to the forward's (same kernels, inputs and dropout seeds),
so the gradients are the same bits with or without a plan (tests/test_offload.py).
Sharded weights (runtime/shard.py): every pass asks the scheduler for a layer's weights
(sched.weights: gathered from the ranks' shards, the next layer's gather issued under this one),
before its forward and again before its backward.
"""
import math
from typing import NamedTuple, Optional

import torch

from ..kernels.arch import interpreting
from ..kernels.embedding import embedding_fwd
from ..kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from ..kernels.rope import rope_inv_freq, rope_table
from ..kernels.moe_route import moe_aux
from ..models.dense import Ctx, layer_backward, layer_forward
from ..models.moe import MoeStep
from .head_host import lm_head_logits, lm_head_loss
from .offload import scheduler
from .plan import KEEP, KEPT_ROWS, OFFLOADED, decide_loss_rows


class Kept(NamedTuple):
    """What the tape holds of a layer that is rebuilt in backward."""
    x: Optional[torch.Tensor]  # (N, C) the layer input; None when offloaded
    xa: dict  # target -> (N, R) LoRA rows, kept (the rebuild writes them again in place)


class Tape:
    """The minimal autograd engine: a list of (backward, saved, args), popped in reverse by
    _backward_layers. saved: the layer's Saved (keep) or Kept (rebuilt in backward)."""

    def __init__(self):
        self.records = []

    def record(self, backward, saved, *args):
        self.records.append((backward, saved, args))


def rope_tables(model, batch):
    """cos, sin (N, D/2) fp32 for this batch's positions: built once per batch, cached on it."""
    cfg = model.config
    key = ("rope", cfg.head_dim, cfg.rope_theta, tuple(sorted((k, str(v)) for k, v in cfg.rope_scaling.items())))
    if key not in batch.cache:
        inv_freq, attn_scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or None)
        inv = model.cache.get(key)
        if inv is None:
            inv = torch.from_numpy(inv_freq).to(batch.device)  # once per model
            model.cache[key] = inv
        N, half = batch.n_tokens, cfg.head_dim // 2
        cos = torch.empty(N, half, dtype=torch.float32, device=batch.device)  # (N, D/2)
        sin = torch.empty(N, half, dtype=torch.float32, device=batch.device)  # (N, D/2)
        rope_table(cos, sin, batch.positions, inv, attn_scaling)
        batch.cache[key] = (cos, sin)
    return batch.cache[key]


def moe_step(model):
    """The per-step MoE buffers (None for a dense model): expert counts, and with the load-balancing
    loss on (output_router_logits), the router probability sums, its value and its gradient. Kept
    as model.cache["moe"], where lean-train reads the expert load at its log points."""
    cfg = model.config
    if not cfg.moe_layers:
        return None
    zeros = lambda n: torch.zeros(n, dtype=torch.float32, device=model.device)  # noqa: E731
    aux = cfg.aux_loss_coef > 0
    st = MoeStep(zeros(cfg.n_experts), zeros(cfg.n_experts) if aux else None, zeros(cfg.n_experts) if aux else None,
                 zeros(1) if aux else None)
    model.cache["moe"] = st
    return st


def check_compute_dtype(model):
    """A bfloat16 model on the CPU is refused: Triton's interpreter multiplies bf16 bit patterns in
    tl.dot (triton issue 11584), so every result would be wrong without an error. (lean-train's
    settings refuse --dtype bfloat16 there too; a bf16 model may still be loaded on the CPU and moved.)"""
    if model.dtype == torch.bfloat16 and model.device.type == "cpu" and interpreting():
        raise ValueError("a bfloat16 model on the CPU: Triton's interpreter does not compute bfloat16 right; "
                         "load it with dtype=torch.float32 (or float16) on the CPU, or run on a CUDA GPU")


def check_devices(model, batch=None):
    """A batch on another device than the model, or a model on the CPU without Triton's interpreter
    (a GPU machine: lean turns the interpreter on only where there is no CUDA GPU), is refused by
    name: Triton's own error there ("cannot be accessed from Triton (cpu tensor?)") names neither."""
    m = torch.device(model.device)
    b = batch.device if batch is not None else m
    if m.type != b.type or (m.index is not None and b.index is not None and m.index != b.index):
        raise ValueError(f"the batch is on {b}, the model on {m}: pack it there (lean.pack(..., device=model.device))")
    if m.type == "cpu" and not interpreting():
        raise ValueError("the model is on the CPU, where lean's kernels run only through Triton's interpreter: set "
                         "TRITON_INTERPRET=1 in the environment before lean is imported, or load the model on the GPU")


def make_ctx(model, lora, batch, seed=0):
    check_compute_dtype(model)
    check_devices(model, batch)
    cfg = model.config
    cos, sin = rope_tables(model, batch)
    return Ctx(
        cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen, cos=cos, sin=sin, eps=cfg.rms_eps,
        attn_scale=1.0 / math.sqrt(cfg.head_dim),
        lora_scale=lora.scale if lora is not None else 0.0,
        dropout=lora.dropout if lora is not None else 0.0,
        seed=seed,
        moe=moe_step(model),
    )


def _forward_layers(model, lora, batch, ctx, tape, plan=None, sched=None):
    cfg = model.config
    N, L = batch.n_tokens, cfg.n_layers
    modes = plan.modes if plan is not None else (KEEP,) * L
    if sched is None and getattr(model, "shard", None) is not None:
        sched = scheduler(model, None, N)  # a pass without a plan over sharded weights: the gathers
    s = torch.empty(N, cfg.hidden, dtype=model.dtype, device=model.device)  # (N, C)
    embedding_fwd(s, batch.ids, model.embed)
    d = None
    for li, w in enumerate(model.layers):
        if sched is not None and sched.gather is not None:
            w = sched.weights(li, li + 1)  # the gathered layer; layer li+1's gather runs under this one
        ads = lora.layers[li] if lora is not None else {}
        if lora is not None and lora.ring is not None:
            lora.ring.ready(li)  # host state: the last step's update of this layer, run under this forward
        keep = () if tape is None else KEPT_ROWS[modes[li]]  # what the tape or the scheduler will hold
        (s, d), saved = layer_forward(s, d, w, ads, ctx, li, cfg, keep=keep)
        if tape is None:
            continue
        if modes[li] in OFFLOADED:
            sched.offload(li, saved.x, saved.up)  # D2H on the copy stream, under layer li+1's forward
            saved = Kept(None, saved.xa)  # the rest is rebuilt in backward
        elif modes[li] != KEEP:
            saved = Kept(saved.x, saved.xa)  # keep the input (and xa) only
        if sched is not None:
            sched.retire(li - 1)  # compute waits for layer li-1's copy (done by now); its x is freed
        tape.record(layer_backward, saved, w, ads, ctx, li, cfg)
    # final norm, fused with the last residual add
    x_final = torch.empty_like(s)  # (N, C)
    nf = torch.empty_like(s)  # (N, C)
    rstd = torch.empty(N, dtype=torch.float32, device=s.device)
    rmsnorm_fwd(nf, rstd, s, model.norm, cfg.rms_eps, residual=d, h=x_final)
    if sched is not None:
        sched.retire(L - 1)
        if modes[L - 1] in OFFLOADED:
            sched.prefetch(L - 1)  # the last layer's reload runs under the lm_head + loss
    return nf, x_final, rstd


def _backward_layers(g, tape, plan=None, sched=None, reducer=None, ring=None):
    """Every layer's backward, last to first; g = dL/d(stream) is updated in place. reducer: a
    grad_reduce.GradReducer told as each layer's LoRA gradient is complete (data parallel). ring:
    the LoRA state on the host (host_state.GradRing): each layer's gradient slot zeroed before its
    backward, summed into the norm's partials and copied to the host after it."""
    modes = plan.modes if plan is not None else None
    while tape.records:
        backward, saved, args = tape.records.pop()  # popping frees each layer's activations
        w, ads, ctx, li, cfg = args
        if sched is not None and sched.gather is not None:
            w = sched.weights(li, li - 1)  # gathered again (held for the top two); li-1's under this one
            args = (w, ads, ctx, li, cfg)
        if modes is not None and li > 0 and modes[li - 1] in OFFLOADED:
            sched.prefetch(li - 1)  # H2D of the next layer's rows, under this layer's backward
        if isinstance(saved, Kept):
            x, up = (saved.x, None) if saved.x is not None else sched.wait(li)  # offloaded: reloaded
            saved = layer_forward(x, None, w, ads, ctx, li, cfg, rebuild=(saved.xa, up))[1]  # rebuild
        if ring is not None:
            ring.begin(li)  # its gradient slot, free once layer li+2's copy to the host is done
        g = backward(g, saved, *args)
        if ring is not None:
            ring.end(li)  # its norm partials, and its copy to the host
        if modes is not None and modes[li] in OFFLOADED:
            sched.release(li)  # its reload buffers may be refilled
        if reducer is not None:
            reducer.layer_done(li)  # its bucket's all-reduce may start under the layers below
    if ring is not None:
        ring.finish()
    return g


def forward_backward(model, lora, batch, *, grad_scale=None, seed=None, plan=None, reducer=None):
    """Loss and LoRA gradients for one packed batch.

    Gradients of grad_scale * (sum of token losses) are ADDED to lora.grads (call lora.zero_grad()
    at the start of an optimizer step). grad_scale defaults to 1 / batch.n_targets (the mean loss,
    as HF computes it); for gradient accumulation pass 1 / (targets over the whole step). It may
    be a (1,) fp32 device tensor, read on the device (a captured graph's per-step value).
    Returns (loss_sum, n_targets): loss_sum a (1,) fp32 device tensor, n_targets a host int.
    plan: the activation plan (planner.plan_for); None keeps every layer's activations.
    reducer: data parallel (runtime/dist.py), the step's last micro-batch: the LoRA gradient's
    buckets are all-reduced across the ranks as the backward finishes their layers.
    """
    if grad_scale is None:
        grad_scale = 1.0 / max(batch.n_targets, 1)
    if seed is None:
        seed = lora.next_seed() if lora is not None else 0
    ctx = make_ctx(model, lora, batch, seed)
    tape = Tape()
    sched = scheduler(model, plan, batch.n_tokens)  # None unless the plan offloads
    nf, x_final, rstd = _forward_layers(model, lora, batch, ctx, tape, plan, sched)
    loss = torch.empty(2, dtype=torch.float32, device=nf.device)  # [sum, count]
    dnf = torch.empty_like(nf)
    lm_head_loss(loss, dnf, nf, model, batch.targets, grad_scale=grad_scale,  # streamed when on the host
                 chunk_rows=loss_rows(model, lora, batch.n_tokens, plan))
    _aux_loss(loss, ctx, model.config, batch, grad_scale)
    g = torch.empty_like(nf)  # dL/d(stream): the residual-stream gradient, updated in place
    rmsnorm_bwd(g, None, dnf, x_final, model.norm, rstd)
    del nf, dnf, x_final, rstd  # dead: their memory serves the layers' backward (plan.py counts on it)
    _backward_layers(g, tape, plan, sched, reducer, lora.ring if lora is not None else None)  # every layer in reverse
    return loss[0:1], batch.n_targets


def loss_rows(model, lora, n_tokens, plan=None):
    """The lm_head + loss's chunk rows for this model (an int, or None: linear_ce's default), one
    value for all its steps, so that a step's bits never depend on its plan or its batch's size:
    the plan's (plan.loss_rows) when a plan is given, else the first plan_for's
    (model.cache["loss_rows"]), else runtime/plan.decide_loss_rows at this step's token count, kept
    in model.cache for the steps after (host arithmetic, once)."""
    if plan is not None:
        return plan.loss_rows
    if "loss_rows" not in model.cache:
        r, targets, dropout = (lora.r, lora.targets, lora.dropout) if lora is not None else (0, (), 0.0)
        model.cache["loss_rows"] = decide_loss_rows(model.config, n_tokens, model.dtype.itemsize, r,
                                                    tuple(targets) if r else (), dropout, "head" in model.cache)
    return model.cache["loss_rows"]


def _aux_loss(loss, ctx, cfg, batch, grad_scale):
    """The load-balancing loss (MoE models with output_router_logits): HF adds coef * aux to the
    mean token loss, so loss[0] (a sum over the batch's targets) gets n_targets * coef * aux, and
    the routers' backward gets its gradient at the same grad_scale as the token losses."""
    st = ctx.moe
    if st is None or st.aux_grad is None:
        return
    rows = len(cfg.moe_layers) * batch.n_tokens
    moe_aux(st.aux, st.aux_grad, st.counts, st.prob_sum, rows, grad_scale,
            alpha=cfg.aux_loss_coef * batch.n_targets, loss=loss)


def forward(model, lora, batch):
    """Logits (N, V) in the model dtype, for evaluation of small batches (no tape)."""
    ctx = make_ctx(model, lora, batch, seed=0)
    # evaluation: no dropout
    ctx = ctx._replace(dropout=0.0)
    nf, _, _ = _forward_layers(model, lora, batch, ctx, None)
    logits = torch.empty(batch.n_tokens, model.config.vocab, dtype=model.dtype, device=nf.device)  # (N, V)
    lm_head_logits(logits, nf, model)
    return logits


def loss_eval(model, lora, batch):
    """(loss_sum device tensor, n_targets) without gradients."""
    ctx = make_ctx(model, lora, batch, seed=0)._replace(dropout=0.0)
    nf, _, _ = _forward_layers(model, lora, batch, ctx, None)
    loss = torch.empty(2, dtype=torch.float32, device=nf.device)
    lm_head_loss(loss, None, nf, model, batch.targets)
    _aux_loss(loss, ctx, model.config, batch, 1.0)
    return loss[0:1], batch.n_targets
