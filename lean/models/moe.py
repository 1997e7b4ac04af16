"""The Mixture-of-Experts MLP block (Qwen3-MoE): forward and backward side by side.

Shape legend: N tokens in the packed batch, C hidden, E experts, K experts per token (top-k),
F one expert's MLP width (moe_intermediate), P = N*K slots, R LoRA rank (gate_up's adapter has 2R).
Slot j = n*K + i is token n's i-th choice; the slots are grouped by expert with a stable counting
sort (kernels/moe_group.group_slots): order[p] = j for sorted position p, slot_pos[j] = p, and
offsets[e] the first sorted position of expert e. All of it stays on the device; every shape
depends on N only, so the block captures in a CUDA graph (runtime/graph.py).

Forward, from n2 = rmsnorm(mid) * w_post (the post-attention norm dense.py runs):

    logits = n2 Wr^T                                  (N, E) model dtype, the frozen router
    w, e   = top-K of softmax(fp32 logits) over E; w / sum(w) when norm_topk_prob; w cast to dtype
    h_s    = n2[tok(p)] Wgu_e^T + s (n2[tok(p)] A_e^T) B_e^T      (P, 2F) gate | up, sorted
    act_s  = silu(h_s[:, :F]) * h_s[:, F:]                         (P, F)
    y_s    = act_s Wd_e^T + s (act_s Ad_e^T) Bd_e^T                (P, C)
    m[n]   = sum_i w[n, i] y_s[slot_pos[n*K + i]]                  (N, C) fp32 sum, one rounding

GPT-OSS's experts may be MXFP4 pairs (models/weights.Mxfp4): every expert-weight GEMM, forward and
backward, then reads them through _wgmm (MXFP4_FUSED: dequantised in gmm_mxfp4's tile loads, or
into one GEMM's transient bf16 weight; the model holds no bf16 copy).

exactly transformers' Qwen3MoeSparseMoeBlock (router, top-k and cast order), with PEFT's expert
adapters (runtime/lora.py). The gathers of n2 rows happen in the grouped GEMM's prologue
(kernels/grouped_gemm.py); y_s is written sorted and summed per token by one combine kernel rather
than scatter-added with atomics, so the sum has a fixed order and the step is bit-reproducible.

Backward, g = dL/dm (N, C):

    G_s    = g[tok(p)] Wd_e + s (g[tok(p)] Bd_e) Ad_e              (P, F)  dL/d(act_s) before w
    dw[j]  = <G_s[p], act_s[p]>  (= <g[n], y_s[p]>)                 (N, K) fp32: the routing-weight grad
    dh_s   = swiglu_bwd(w_j G_s)                                    (P, 2F) written over h_s
    dBd_e += s sum_p w_p g[tok(p)]^T xad_s[p];  dAd_e += s sum_p w_p (g[tok(p)] Bd_e)^T act_s[p]
    dX_s   = dh_s Wgu_e + s (dh_s B_e) A_e                          (P, C)
    dn2[n] = sum_i dX_s[slot_pos[n*K + i]] + (route_bwd(dw) Wr)[n]
    dB_e  += s sum_p dh_s[p]^T xa_s[p];  dA_e += s sum_p (dh_s[p] B_e)^T n2[tok(p)]   (waits for n2)

route_bwd takes dw back through the cast (identity), the renormalisation, the top-k selection and
the softmax to the router logits, plus the load-balancing loss's gradient when the config enables it
(ctx.moe.aux_grad). Without dw every layer below would get wrong gradients (tests/test_moe.py
checks that dropping it fails).

The GLU (SwiGLU, or GPT-OSS's clamped one on interleaved columns: kernels/moe_glu.py) is its own
elementwise kernel on each side, not fused into the grouped GEMMs, because neither fusion pays here:
  - backward: dh_s is needed whole by gate_up's LoRA weight gradients (dB_e, dA_e above) as well as
    by dX_s, so it is written either way; a dX GEMM that made dh in its prologue would read G_s and
    h_s (3F a row, not 2F) once per output-column tile (C / BLOCK_N times) and still write dh_s.
  - forward: h_s is saved for the backward, so an epilogue that wrote act_s as well would save only
    the GLU kernel's read of h_s: the GLU forward is 1.3% of gpt-oss-20b's 24-layer step (its
    backward 6.3%, a bandwidth problem of that kernel, 37% of the copy rate: BENCHMARKS.md, GPT-OSS).

Saved (MoeSaved): logits, w, e, order, slot_pos, offsets, h_s and the expert LoRA rows xa_s and
xad_s. act_s and y_s are not: act_s is written again by the backward's fused kernel, y_s is not
needed (dw comes from G_s and act_s). n2 is not saved either (dense.py writes it again over dn2,
as for the dense MLP's dA).
"""
import os
from typing import NamedTuple, Optional

import torch

from ..kernels.gmm_wgrad import gmm_wgrad
from ..kernels.grouped_gemm import gmm
from ..kernels.lora_linear import linear_bwd, linear_fwd
from ..kernels.moe_bias_dot import expert_bias_dot
from ..kernels.moe_glu import moe_glu_bwd, moe_glu_fwd
from ..kernels.moe_group import group_slots, moe_act_bwd, moe_combine
from ..kernels.moe_route import route_topk_bwd, route_topk_fwd
from ..kernels.mxfp4 import gmm_mxfp4, mxfp4_dequant
from ..kernels.swiglu import swiglu_fwd
from .weights import Mxfp4


class MoeStep(NamedTuple):
    """Per-step MoE buffers every MoE layer reads or adds to (in Ctx.moe)."""
    counts: torch.Tensor  # (E,) fp32: slots routed to each expert, summed over the MoE layers (+=)
    prob_sum: Optional[torch.Tensor]  # (E,) fp32: router probabilities summed over tokens and layers (aux loss)
    aux_grad: Optional[torch.Tensor]  # (E,) fp32: d(scaled aux loss)/d(probs[n, e]), set before backward
    aux: Optional[torch.Tensor]  # (1,) fp32: the load-balancing loss (before its coefficient)


class MoeSaved(NamedTuple):
    logits: torch.Tensor  # (N, E) model dtype
    weights: torch.Tensor  # (N, K) model dtype
    experts: torch.Tensor  # (N, K) int32
    order: torch.Tensor  # (P,) int32
    slot_pos: torch.Tensor  # (P,) int32
    offsets: torch.Tensor  # (E+1,) int32
    h: torch.Tensor  # (P, 2F) gate | up, sorted by expert
    xa_gu: Optional[torch.Tensor]  # (P, 2R) gate_up LoRA rows, or None
    xa_d: Optional[torch.Tensor]  # (P, R) down LoRA rows, or None


def _lora(ad, xa, b):
    return None if ad is None else (xa, b, ad.scale)


def _experts(w, cfg):
    """(Wgu (E, 2F, C), Wd (E, C, F)): the expert weights as (E, out, in). Qwen3-MoE stores them so;
    GPT-OSS's bf16 layout is (E, in, out) (gate_up (E, C, 2F) with gate/up interleaved, down
    (E, F, C)), seen here transposed, without a copy; its MXFP4 pairs dequantise to (E, out, in)."""
    if cfg.expert_bias and not isinstance(w.gate_up, Mxfp4):
        return w.gate_up.transpose(1, 2), w.down_e.transpose(1, 2)
    return w.gate_up, w.down_e


# MXFP4 experts: True runs gmm_mxfp4 (the weight dequantised in the GEMM's tile loads, no copy);
# False dequantises the GEMM's weight into a transient (E, out, in) buffer in x's dtype first
# (mxfp4_dequant, ~0.4 ms at gpt-oss-20b's gate_up) and runs gmm on it. Measured on the H100
# (gpt-oss-20b, 8192 tokens, BENCHMARKS.md): gmm_mxfp4 runs at 0.25-0.31x of gmm on a bf16 weight,
# dequantise + gmm at 0.79-0.84x, so the transient buffer (one GEMM's weight: 1.0 GB at gate_up, priced by
# the planner as "wq_gu" / "wq_d") is the default until its tile decode is reworked; both paths are tested.
MXFP4_FUSED = False
# The transient holds MXFP4_GROUPS-th of the experts at a time: the experts are dequantised and
# multiplied group by group (gmm over the group's offsets and weights: on a GPU the same tiles, so the
# same bits; the interpreter's tile follows rows per expert and may differ),
# so gpt-oss-20b's gate_up transient is 0.27 GB instead of 1.06 (its MXFP4 step under 12.8 GiB).
MXFP4_GROUPS = int(os.environ.get("LEAN_MXFP4_GROUPS", "4"))  # the variable: for experiments (1: all at once)


def mxfp4_group(E):
    """Experts dequantised at a time (plan.py prices a transient of this many)."""
    return -(-E // max(1, min(MXFP4_GROUPS, E)))


def _wgmm(y, x, w, offsets, transpose=False, **kw):
    """y = x @ W_e^T (transpose: x @ W_e) per expert, W (E, out, in) a tensor or an Mxfp4 pair
    (MXFP4_FUSED says how it is read)."""
    if isinstance(w, Mxfp4) and MXFP4_FUSED:
        gmm_mxfp4(y, x, w.blocks, w.scales, offsets, transpose=transpose, **kw)
        return
    if not isinstance(w, Mxfp4):
        gmm(y, x, w.transpose(1, 2) if transpose else w, offsets, **kw)
        return
    E, step = w.shape[0], mxfp4_group(w.shape[0])
    wq = torch.empty((step,) + tuple(w.shape[1:]), dtype=x.dtype, device=x.device)  # (Eg, out, in), freed on return
    lora, bias = kw.pop("lora", None), kw.pop("bias", None)
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        wg = wq[:e1 - e0]
        mxfp4_dequant(wg, w.blocks[e0:e1], w.scales[e0:e1])
        gmm(y, x, wg.transpose(1, 2) if transpose else wg, offsets[e0:e1 + 1],  # the group's rows only
            lora=None if lora is None else (lora[0], lora[1][e0:e1], lora[2]),
            bias=None if bias is None else bias[e0:e1], **kw)


def _act_fwd(act, h, cfg):
    """act (P, F) from the gate/up rows h (P, 2F): SwiGLU on the halves, or GPT-OSS's clamped GLU
    on the interleaved columns."""
    F = act.shape[1]
    if cfg.glu_limit:
        moe_glu_fwd(act, h, limit=cfg.glu_limit, alpha=cfg.glu_alpha)
    else:
        swiglu_fwd(act, h[:, :F], h[:, F:])


def _act_bwd(dh, dw, G, h, weights, order, act, cfg):
    if cfg.glu_limit:
        moe_glu_bwd(dh, dw, G, h, weights, order, limit=cfg.glu_limit, alpha=cfg.glu_alpha, act=act)
    else:
        moe_act_bwd(dh, dw, G, h, weights, order, act=act)


def moe_forward(m, n2, w, ads, ctx, cfg, rebuild=False):
    """m (N, C) = the MoE block of n2 (N, C); returns MoeSaved. rebuild (backward's recompute):
    m is None and nothing is summed into it, nor into the per-step counts."""
    N, C, E, K, F = n2.shape[0], cfg.hidden, cfg.n_experts, cfg.top_k, cfg.moe_intermediate
    P = N * K
    new = lambda *shape, dt=n2.dtype: torch.empty(*shape, dtype=dt, device=n2.device)  # noqa: E731
    gu, dn = ads.get("gate_up"), ads.get("down_e")
    st = None if rebuild else ctx.moe
    # routing: router logits, top-K, slots grouped by expert
    logits = new(N, E)
    linear_fwd(logits, n2, w.router, bias=w.router_bias)
    weights, experts = new(N, K), new(N, K, dt=torch.int32)
    route_topk_fwd(weights, experts, logits, norm_topk=cfg.norm_topk, softmax_first=cfg.softmax_first,
                   prob_sum=st.prob_sum if st is not None else None)
    order, slot_pos, offsets = new(P, dt=torch.int32), new(P, dt=torch.int32), new(E + 1, dt=torch.int32)
    group_slots(order, slot_pos, offsets, experts, counts=st.counts if st is not None else None)
    # experts: gate/up (gathering n2 rows), SwiGLU, down
    xa_gu = None
    if gu is not None:
        xa_gu = new(P, gu.a_lowp.shape[1])  # (P, 2R)
        gmm(xa_gu, n2, gu.a_lowp, offsets, gather=order, gather_div=K)
    wgu, wd = _experts(w, cfg)
    h = new(P, 2 * F)
    _wgmm(h, n2, wgu, offsets, gather=order, gather_div=K, lora=_lora(gu, xa_gu, gu.b_lowp if gu else None),
        bias=w.gate_up_bias)
    act = new(P, F)
    _act_fwd(act, h, cfg)
    xa_d = None
    if dn is not None:
        xa_d = new(P, dn.a_lowp.shape[1])  # (P, R)
        gmm(xa_d, act, dn.a_lowp, offsets)
    saved = MoeSaved(logits, weights, experts, order, slot_pos, offsets, h, xa_gu, xa_d)
    if rebuild:  # the backward needs neither y_s nor m
        return saved
    y = new(P, C)
    _wgmm(y, act, wd, offsets, lora=_lora(dn, xa_d, dn.b_lowp if dn else None), bias=w.down_bias)
    del act
    moe_combine(m, y, slot_pos, weights)
    return saved


def moe_backward(dn2, g, sv, w, ads, ctx, cfg):
    """dn2 (N, C) = dL/dn2 (written) from g = dL/dm (N, C); expert LoRA grads +=. Returns what the
    gate_up adapter's dA waits for (None without one): pass it to moe_backward_da with n2."""
    N, K, F = g.shape[0], cfg.top_k, cfg.moe_intermediate
    P = N * K
    new = lambda *shape, dt=g.dtype: torch.empty(*shape, dtype=dt, device=g.device)  # noqa: E731
    gu, dn = ads.get("gate_up"), ads.get("down_e")
    order, offsets, slot = sv.order, sv.offsets, (sv.weights.view(-1), sv.order)  # slot: w of sorted row p
    # down projection, bottom-up: G_s (gathering g rows), then dw and SwiGLU's backward in one kernel
    gb = None
    if dn is not None:
        gb = new(P, dn.a_lowp.shape[1])  # (P, R) = g[tok] Bd_e
        gmm(gb, g, dn.b_lowp.transpose(1, 2), offsets, gather=order, gather_div=K)
    wgu, wd = _experts(w, cfg)
    G = new(P, F)
    _wgmm(G, g, wd, offsets, transpose=True, gather=order, gather_div=K,
        lora=_lora(dn, gb, dn.a_lowp.transpose(1, 2) if dn else None))
    dw = new(N, K, dt=torch.float32)
    act = new(P, F) if dn is not None else None
    dh = sv.h  # in place: h is dead once read
    _act_bwd(dh, dw, G, sv.h, sv.weights, order, act, cfg)
    if w.down_bias is not None:  # y = act Wd^T + bd: dw also gets <g, bd>
        expert_bias_dot(dw, g, w.down_bias, sv.experts)
    del G
    if dn is not None:
        gmm_wgrad(dn.db, g, sv.xa_d, offsets, gather_a=order, gather_div=K, scale=slot, alpha=dn.scale)
        gmm_wgrad(dn.da, gb, act, offsets, scale=slot, alpha=dn.scale)
        del gb, act
    # gate/up projection: dX_s, summed per token into dn2
    dhb = None
    if gu is not None:
        dhb = new(P, gu.a_lowp.shape[1])  # (P, 2R) = dh_s B_e
        gmm(dhb, dh, gu.b_lowp.transpose(1, 2), offsets)
        gmm_wgrad(gu.db, dh, sv.xa_gu, offsets, alpha=gu.scale)
    dX = new(P, dn2.shape[1])
    _wgmm(dX, dh, wgu, offsets, transpose=True, lora=_lora(gu, dhb, gu.a_lowp.transpose(1, 2) if gu else None))
    moe_combine(dn2, dX, sv.slot_pos)
    del dX
    # the router: dw back through renormalise / top-K / softmax, then into dn2 through Wr
    dlogits = new(N, cfg.n_experts)
    route_topk_bwd(dlogits, dw, sv.logits, sv.experts, norm_topk=cfg.norm_topk, softmax_first=cfg.softmax_first,
                   aux_grad=ctx.moe.aux_grad if ctx.moe is not None else None)
    linear_bwd(dn2, dlogits, w.router, accumulate=True)
    return None if gu is None else (dhb, order, offsets)


def moe_backward_da(waiting, n2, ads, cfg):
    """The gate_up adapter's dA_e += s sum_p (dh_s B_e)^T n2[tok(p)], once n2 is back."""
    if waiting is None:
        return
    dhb, order, offsets = waiting
    gu = ads["gate_up"]
    gmm_wgrad(gu.da, dhb, n2, offsets, gather_b=order, gather_div=cfg.top_k, alpha=gu.scale)
