"""The decoder layer (Llama 3.x, SmolLM, Qwen2, Qwen3, Qwen3-MoE): forward and backward side by side.

Shape legend: N tokens in the packed batch, C hidden, H/KVH heads, D head dim, F MLP hidden,
R LoRA rank, Oq = H*D, Okv = KVH*D.

One layer, with s the residual stream entering it and d the previous layer's MLP output:

    x    = s + d                       (fused into norm1; layer 0 has no d)
    n1   = rmsnorm(x) * w_in
    q, k, v = n1 Wq^T (+bq), n1 Wk^T (+bk), n1 Wv^T (+bv)      each with its LoRA term
    q, k = rmsnorm_head(q), rmsnorm_head(k)                      (Qwen3 only; one kernel with rope)
    q, k = rope(q), rope(k)
    o    = attention(q, k, v)          (causal within each packed document; GPT-OSS: a sink logit
                                        per head in the softmax denominator, a sliding window on
                                        the layers cfg.windows names)
    a    = o Wo^T (+bo)
    mid  = x + a                       (fused into norm2)
    n2   = rmsnorm(mid) * w_post
    act  = silu(n2 Wg^T) * (n2 Wu^T)
    m    = act Wd^T
    return (mid, m)                    the next layer's s and d

A Mixture-of-Experts layer (w.moe: Qwen3-MoE) runs lean/models/moe.py's block from n2 in place of
the gate/up/swiglu/down lines; everything else, attention included, is this file's.

The backward reads the forward bottom-up. Accumulation rule: LoRA gradients and the residual
stream gradient accumulate (+=); everything else is written (=). `g` enters as dL/d(mid + m) and
leaves as dL/d(s + d) = dL/ds = dL/dd.

n1, n2 and act are not saved (a third of a layer's activations): their only use in backward is the
LoRA dA of the projections they feed (dA += s (dy B)^T x). Those wait: the projection's dx runs
first and leaves dy B in a small (N, R) buffer; then the backward kernel that reads the tensor's
inputs anyway (swiglu_bwd for act, rmsnorm_bwd for n2 and n1) writes it again, the same bits, into
the gradient buffer it has just consumed, and dA follows. Without dropout act is never written:
swiglu_bwd_lora sums the down dA from the tiles it computes, and gate's and up's dB from the dgate,
dup tiles it writes (the separate passes' products, in one pass over the (N, F) tensors).

Projections that share an input (q/k/v read n1, gate/up read n2) share its reads where the LoRA
kernels would each make one: their xa pre-passes (the Hopper path, dropout 0: proj_xa_shared) and
their waiting dA sums (dropout 0: proj_bwd_da) each run as one kernel over the input.
"""
import warnings
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch

from ..kernels.attention import attention_bwd, attention_fwd
from ..kernels.lora_linear import (
    dyb_width, fwd_prepass, linear_bwd, linear_fwd, lora_linear_bwd, lora_linear_bwd_da, lora_linear_fwd,
)
from ..kernels.lora_linear_pre import lora_xa_shared
from ..kernels.qk_norm_rope import qk_norm_rope_bwd, qk_norm_rope_fwd
from ..kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from ..kernels.rope import rope_bwd, rope_fwd
from ..kernels.swiglu import swiglu_bwd, swiglu_bwd_lora, swiglu_fwd
from .moe import moe_backward, moe_backward_da, moe_forward


@contextmanager
def masked_exp2_quiet():
    """The attention backward recomputes p = exp2(s - lse) over whole blocks; the causally masked
    lanes (future keys, whose s may exceed lse by far) overflow to inf before tl.where drops them.
    On a GPU that is silent; Triton's CPU interpreter runs exp2 in numpy, which warns
    'overflow encountered in exp2' for them. That one warning is silenced here, where it is known
    to be noise (a real overflow shows up as a non-finite gradient, which lean-train names);
    numpy's other warnings, and exp2's anywhere else, still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="overflow encountered in exp2", category=RuntimeWarning)
        yield


class Ctx(NamedTuple):
    """What every layer reads: the batch descriptor and per-step constants."""
    cu_seqlens: torch.Tensor  # (B+1,) int32
    max_seqlen: int
    cos: torch.Tensor  # (N, D/2) fp32
    sin: torch.Tensor  # (N, D/2) fp32
    eps: float
    attn_scale: float
    lora_scale: float
    dropout: float
    seed: int  # dropout seed of this step; each projection derives its own
    moe: object = None  # moe.MoeStep: the per-step expert counts and aux-loss buffers (MoE models)


class Saved(NamedTuple):
    """What one layer's forward keeps for its backward (see lean/runtime/plan.py for the table)."""
    x: torch.Tensor  # (N, C) layer input stream
    rstd1: torch.Tensor  # (N,) fp32
    xa: dict  # target -> (N, R) LoRA down-projection of that projection's input
    q_pre: Optional[torch.Tensor]  # (N, Oq) before QK-norm (Qwen3), else None
    k_pre: Optional[torch.Tensor]  # (N, Okv)
    rstd_q: Optional[torch.Tensor]  # (N*H,) fp32
    rstd_k: Optional[torch.Tensor]  # (N*KVH,) fp32
    q: torch.Tensor  # (N, Oq) after norm and RoPE
    k: torch.Tensor  # (N, Okv)
    v: torch.Tensor  # (N, Okv)
    o: torch.Tensor  # (N, Oq) attention output
    lse: torch.Tensor  # (H, N) fp32
    mid: torch.Tensor  # (N, C)
    rstd2: torch.Tensor  # (N,) fp32
    gate: torch.Tensor  # (N, F)
    up: torch.Tensor  # (N, F)
    moe: object = None  # moe.MoeSaved of an MoE layer (whose gate and up are None)


def _attn_options(w, cfg, li):
    """GPT-OSS's attention options (a sink logit per head, a sliding window on some layers); none else."""
    return dict(sinks=w.sinks, window=cfg.window(li)) if cfg.sinks or cfg.windows else {}


_TARGET_ID = {"q": 0, "k": 1, "v": 2, "o": 3, "gate": 4, "up": 5, "down": 6}


def _seed(ctx, layer_idx, t):
    # One dropout stream per (step, layer, projection): the mask is regenerated in backward.
    return (ctx.seed * 1_000_003 + layer_idx * 7 + _TARGET_ID[t]) % (2**31 - 1)


def proj_fwd(y, xa_out, x, w, bias, ad, t, ctx, li):
    """y = x W^T (+ bias) (+ LoRA term when projection t carries an adapter). xa_out[t] receives
    drop(x) A^T; a rebuild passes the kept one (its pre-pass skipped, or written again, the same bits)."""
    if ad is None:
        linear_fwd(y, x, w, bias=bias)
        return
    xa = xa_out.get(t)
    ready = xa is not None  # kept: the kernels that compute it in a pre-pass skip it
    if xa is None:
        xa = torch.empty(x.shape[0], ad.a_lowp.shape[0], dtype=x.dtype, device=x.device)  # (N, R)
    lora_linear_fwd(y, xa, x, w, ad.a_lowp, ad.b_lowp, ctx.lora_scale, bias=bias,
                    dropout=ctx.dropout, seed=_seed(ctx, li, t), xa_ready=ready)
    xa_out[t] = xa


def proj_xa_shared(xa_out, x, weights, ads, ctx):
    """xa_out[t] for the projections t (-> weight) that share input x and would each compute their
    xa in a pre-pass (kernels/lora_linear.fwd_prepass): one read of x for all; proj_fwd then finds
    them ready. Nothing to do for one projection, or in a rebuild (xa kept)."""
    todo = [t for t, w in weights.items()
            if ads.get(t) is not None and t not in xa_out and fwd_prepass(x, w, ads[t].a_lowp, ctx.dropout)]
    if len(todo) > 1:
        xas = [torch.empty(x.shape[0], ads[t].a_lowp.shape[0], dtype=x.dtype, device=x.device) for t in todo]  # (N, R)
        lora_xa_shared(xas, x, [ads[t].a_lowp for t in todo])
        xa_out.update(zip(todo, xas))


def proj_bwd(dx, dy, x, w, ad, xa, t, ctx, li, accumulate, waiting=None, db=True):
    """dx (=, or += when accumulate) dy W (+ LoRA term); LoRA grads += into the flat buffer.
    x None: the input was not kept; dA waits in `waiting` (t -> dy B) for proj_bwd_da.
    db False: dB was summed already (swiglu_bwd_lora, for gate and up)."""
    if ad is None:
        linear_bwd(dx, dy, w, accumulate=accumulate)
        return
    dyb = None
    if x is None:
        dyb = torch.empty(dy.shape[0], dyb_width(ad.a_lowp.shape[0]), dtype=dy.dtype, device=dy.device)  # (N, RP)
        waiting[t] = dyb
    lora_linear_bwd(dx, ad.da, ad.db if db else None, dy, x, xa, w, ad.a_lowp, ad.b_lowp, ctx.lora_scale,
                    dropout=ctx.dropout, seed=_seed(ctx, li, t), accumulate_dx=accumulate, dyb=dyb)


def proj_bwd_da(waiting, x, ads, ctx, li):
    """The waiting dA of each projection in `waiting` now that their input x is back; empties it.
    Without dropout they share one read of x."""
    if ctx.dropout == 0.0 and len(waiting) > 1:
        (t, dyb), *more = waiting.items()
        lora_linear_bwd_da(ads[t].da, dyb, x, ctx.lora_scale, more=[(ads[u].da, d) for u, d in more])
    else:
        for t, dyb in waiting.items():
            lora_linear_bwd_da(ads[t].da, dyb, x, ctx.lora_scale, dropout=ctx.dropout, seed=_seed(ctx, li, t))
    waiting.clear()


def layer_forward(s, d, w, ads, ctx, li, cfg, rebuild=None, keep=None):
    """(s, d) -> (mid, m), saved. w: the layer's frozen weights; ads: target -> Adapter.

    keep: the Saved fields the caller holds on to (None: all). The others are let go as soon as
    the forward is done with them (q/k/v after attention, o after its projection, gate after
    swiglu...) and are None in saved: a layer rebuilt in backward peaks lower in forward.

    rebuild = (xa, up): backward's recompute from the layer input s (d None) of what the forward
    did not keep. It runs only what the backward reads: xa (kept) is written again in place, up
    (offloaded, or None) is not recomputed, and swiglu and the down projection do not run (their
    outputs are the next layer's input and the down dA's input, which swiglu_bwd writes again).
    Returns (None, saved), saved equal to the forward's bit for bit."""
    N, C, H, KVH, D = s.shape[0], cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    new = lambda *shape, dt=s.dtype: torch.empty(*shape, dtype=dt, device=s.device)  # noqa: E731
    xa, up = rebuild if rebuild is not None else ({}, None)
    # attention block
    n1, rstd1 = new(N, C), new(N, dt=torch.float32)
    if d is None:
        x = s
        rmsnorm_fwd(n1, rstd1, x, w.in_norm, ctx.eps)
    else:
        x = new(N, C)
        rmsnorm_fwd(n1, rstd1, s, w.in_norm, ctx.eps, residual=d, h=x)
    q, k, v = new(N, H * D), new(N, KVH * D), new(N, KVH * D)
    proj_xa_shared(xa, n1, {"q": w.q, "k": w.k, "v": w.v}, ads, ctx)
    proj_fwd(q, xa, n1, w.q, w.q_bias, ads.get("q"), "q", ctx, li)
    proj_fwd(k, xa, n1, w.k, w.k_bias, ads.get("k"), "k", ctx, li)
    proj_fwd(v, xa, n1, w.v, w.v_bias, ads.get("v"), "v", ctx, li)
    del n1  # not saved: rmsnorm_bwd writes it again for the q/k/v dA
    q_pre = k_pre = rstd_q = rstd_k = None
    if cfg.qk_norm:  # the per-head norms and rope in one kernel
        q_pre, k_pre = q, k
        q, k = new(N, H * D), new(N, KVH * D)
        rstd_q, rstd_k = new(N * H, dt=torch.float32), new(N * KVH, dt=torch.float32)
        qk_norm_rope_fwd(q.view(N, H, D), k.view(N, KVH, D), rstd_q, rstd_k, q_pre.view(N, H, D),
                         k_pre.view(N, KVH, D), w.q_norm, w.k_norm, ctx.cos, ctx.sin, ctx.eps)
        if keep is not None:
            q_pre = k_pre = rstd_q = rstd_k = None
    else:
        rope_fwd(q.view(N, H, D), k.view(N, KVH, D), ctx.cos, ctx.sin)
    o, lse = new(N, H * D), new(H, N, dt=torch.float32)
    attention_fwd(o.view(N, H, D), lse, q.view(N, H, D), k.view(N, KVH, D), v.view(N, KVH, D),
                  ctx.cu_seqlens, ctx.max_seqlen, ctx.attn_scale, **_attn_options(w, cfg, li))
    if keep is not None:
        q = k = v = None
    a = new(N, C)
    proj_fwd(a, xa, o, w.o, w.o_bias, ads.get("o"), "o", ctx, li)
    if keep is not None:
        o = lse = None
    # MLP block
    mid, n2, rstd2 = new(N, C), new(N, C), new(N, dt=torch.float32)
    rmsnorm_fwd(n2, rstd2, x, w.post_norm, ctx.eps, residual=a, h=mid)
    del a  # dead: its memory serves the MLP (the activation plan counts on it)
    if w.moe:  # the Mixture-of-Experts block (moe.py) in place of the dense MLP
        m = None if rebuild is not None else new(N, C)
        ms = moe_forward(m, n2, w, ads, ctx, cfg, rebuild=rebuild is not None)
        del n2  # not saved: rmsnorm_bwd writes it again for the experts' gate_up dA
        saved = Saved(x, rstd1, xa, q_pre, k_pre, rstd_q, rstd_k, q, k, v, o, lse, mid, rstd2, None, None, ms)
        if rebuild is not None:
            return None, saved
        if keep is not None:
            saved = Saved(*(t if f in keep else None for f, t in zip(Saved._fields, saved)))
        return (mid, m), saved
    F = cfg.intermediate
    gate = new(N, F)
    proj_xa_shared(xa, n2, {"gate": w.gate, "up": w.up}, ads, ctx)
    proj_fwd(gate, xa, n2, w.gate, None, ads.get("gate"), "gate", ctx, li)
    if up is None:
        up = new(N, F)
        proj_fwd(up, xa, n2, w.up, None, ads.get("up"), "up", ctx, li)
    del n2  # not saved, like n1
    if rebuild is not None:  # the backward needs neither act nor m
        return None, Saved(x, rstd1, xa, q_pre, k_pre, rstd_q, rstd_k, q, k, v, o, lse, mid, rstd2, gate, up)
    act = new(N, F) if keep is None else gate  # gate not kept: act is written over it
    swiglu_fwd(act, gate, up)
    if keep is not None:
        gate, up = None, (up if "up" in keep else None)
    m = new(N, C)
    proj_fwd(m, xa, act, w.down, None, ads.get("down"), "down", ctx, li)
    saved = Saved(x, rstd1, xa, q_pre, k_pre, rstd_q, rstd_k, q, k, v, o, lse, mid, rstd2, gate, up)
    if keep is not None:
        saved = Saved(*(t if f in keep else None for f, t in zip(Saved._fields, saved)))
    return (mid, m), saved  # act dies here: swiglu_bwd writes it again for the down dA


def layer_backward(g, sv, w, ads, ctx, li, cfg):
    """g = dL/d(mid + m) in; returns dL/ds (the same buffer, updated in place)."""
    N, C, H, KVH, D, F = g.shape[0], cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
    new = lambda *shape, dt=g.dtype: torch.empty(*shape, dtype=dt, device=g.device)  # noqa: E731
    waiting = {}  # projection -> dy B, its dA waiting for an input the forward did not keep
    if w.moe:  # the Mixture-of-Experts block (moe.py), bottom-up
        dn2 = new(N, C)
        moe_waiting = moe_backward(dn2, g, sv.moe, w, ads, ctx, cfg)
        n2 = dn2  # as below: the experts' gate_up dA input
        rmsnorm_bwd(g, None, dn2, sv.mid, w.post_norm, sv.rstd2, dresidual=g, y=n2 if moe_waiting else None)
        moe_backward_da(moe_waiting, n2, ads, cfg)
        del dn2, n2, moe_waiting
        return _attention_backward(g, sv, w, ads, ctx, li, cfg, waiting)
    # MLP block, bottom-up
    dact = new(N, F)
    proj_bwd(dact, g, None, w.down, ads.get("down"), sv.xa.get("down"), "down", ctx, li, False, waiting)
    dgate, dup = sv.gate, sv.up  # in place: gate/up are dead after this
    fused = ctx.dropout == 0.0  # gate/up dB and down dA from swiglu's own pass (no act, no re-reads)
    if fused:
        lora = {t: (ads[t].db, sv.xa[t]) for t in ("gate", "up") if ads.get(t) is not None}
        swiglu_bwd_lora(dgate, dup, dact, sv.gate, sv.up, scale=ctx.lora_scale, **lora,
                        down=(ads["down"].da, waiting.pop("down")) if "down" in waiting else None)
        del dact  # each gradient buffer is freed once dead: plan.py's BACKWARD moments count on it
    else:
        act = dact  # act replaces dact: the down dA's input, written again
        swiglu_bwd(dgate, dup, dact, sv.gate, sv.up, h=act if waiting else None)
        proj_bwd_da(waiting, act, ads, ctx, li)
        del dact, act
    dn2 = new(N, C)
    proj_bwd(dn2, dgate, None, w.gate, ads.get("gate"), sv.xa.get("gate"), "gate", ctx, li, False, waiting,
             db=not fused)
    proj_bwd(dn2, dup, None, w.up, ads.get("up"), sv.xa.get("up"), "up", ctx, li, True, waiting, db=not fused)
    n2 = dn2  # rmsnorm_bwd writes n2 over dn2 once read: the gate/up dA input
    rmsnorm_bwd(g, None, dn2, sv.mid, w.post_norm, sv.rstd2, dresidual=g, y=n2 if waiting else None)  # g = dL/dmid
    proj_bwd_da(waiting, n2, ads, ctx, li)
    del dn2, n2
    return _attention_backward(g, sv, w, ads, ctx, li, cfg, waiting)


def _attention_backward(g, sv, w, ads, ctx, li, cfg, waiting):
    """The attention block of layer_backward, bottom-up: g = dL/dmid in, dL/ds out (in place)."""
    N, C, H, KVH, D = g.shape[0], cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    new = lambda *shape, dt=g.dtype: torch.empty(*shape, dtype=dt, device=g.device)  # noqa: E731
    do = new(N, H * D)
    proj_bwd(do, g, sv.o, w.o, ads.get("o"), sv.xa.get("o"), "o", ctx, li, False)
    dq, dk, dv = new(N, H * D), new(N, KVH * D), new(N, KVH * D)
    delta = new(H, N, dt=torch.float32)
    with masked_exp2_quiet():
        attention_bwd(dq.view(N, H, D), dk.view(N, KVH, D), dv.view(N, KVH, D), delta, do.view(N, H, D),
                      sv.q.view(N, H, D), sv.k.view(N, KVH, D), sv.v.view(N, KVH, D), sv.o.view(N, H, D),
                      sv.lse, ctx.cu_seqlens, ctx.max_seqlen, ctx.attn_scale, **_attn_options(w, cfg, li))
    del do, delta
    if cfg.qk_norm:  # through rope and the per-head norms to the projections' outputs (dq, dk only read)
        dq_pre, dk_pre = new(N, H * D), new(N, KVH * D)
        qk_norm_rope_bwd(dq_pre.view(N, H, D), dk_pre.view(N, KVH, D), dq.view(N, H, D), dk.view(N, KVH, D),
                         sv.q_pre.view(N, H, D), sv.k_pre.view(N, KVH, D), w.q_norm, w.k_norm, sv.rstd_q, sv.rstd_k,
                         ctx.cos, ctx.sin)
        dq, dk = dq_pre, dk_pre
        del dq_pre, dk_pre
    else:
        rope_bwd(dq.view(N, H, D), dk.view(N, KVH, D), ctx.cos, ctx.sin)
    dn1 = new(N, C)
    proj_bwd(dn1, dq, None, w.q, ads.get("q"), sv.xa.get("q"), "q", ctx, li, False, waiting)
    proj_bwd(dn1, dk, None, w.k, ads.get("k"), sv.xa.get("k"), "k", ctx, li, True, waiting)
    proj_bwd(dn1, dv, None, w.v, ads.get("v"), sv.xa.get("v"), "v", ctx, li, True, waiting)
    del dq, dk, dv
    n1 = dn1  # as n2 above
    rmsnorm_bwd(g, None, dn1, sv.x, w.in_norm, sv.rstd1, dresidual=g, y=n1 if waiting else None)  # g = dL/dx = dL/ds
    proj_bwd_da(waiting, n1, ads, ctx, li)
    return g
