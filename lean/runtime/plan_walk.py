"""The predicted peak: the step's activation bytes moment by moment, as lean/runtime/step.py,
models/dense.py and models/moe.py allocate and free them (forward_events, moe_backward_events,
walk). What the moments are and what they hold: lean/runtime/plan.py's docstring; the rows'
sizes: plan_rows.py; everything else's: plan_bytes.py. Host-side arithmetic only.
"""
from typing import NamedTuple

from ..kernels.attention_config import attention_bwd_scratch
from ..kernels.gemm import interpret_big, interpreting
from ..kernels.lora_grad import _block_r
from ..kernels.swiglu import lora_chunking as swiglu_lora_chunking
from .lora import EXPERT_TARGETS
from .plan_bytes import _proj_dims, head_host_scratch, linear_ce_scratch, lora_bwd_scratch, moe_scratch
from .plan_rows import (ATTENTION_MOMENTS, FORWARD_EXTRA, GRADS, KEEP, KEPT_ROWS, MLP_MOMENTS, MLP_MOMENTS_FUSED,
                        MOE_EXTRA, MOE_PLAN, OFFLOAD, OFFLOAD_UP, PLAN, RECOMPUTE, _row_bytes, layer_bytes, layer_lora,
                        mode_bytes)


def forward_events(cfg, lora_targets, keep=None, first=False, rebuild=False, up_given=False, moe=False, aux=False):
    """dense.layer_forward's allocations ("+", row) and releases ("-", row), in its order. lora_targets:
    the layer's own (lora.layer_targets); keep: its keep argument (None: every Saved row); first:
    layer 0 (x is the input, not allocated); rebuild: the backward's rebuild (x given, xa written
    in place, no act or m); up_given: up is the reloaded one; moe: an MoE layer (moe.moe_forward
    from n2, aux: with the load-balancing loss on). Rows: PLAN's names (q_pre/k_pre are the first
    q/k with QK-norm), "xa:t" per LoRA projection t, n1, a, n2, act, m, and MOE_PLAN's, MOE_EXTRA's
    and moe_scratch's."""
    drop = (lambda *names: [("-", n) for n in names if n not in keep]) if keep is not None else (lambda *n: [])
    xa = (lambda *ts: [("+", "xa:" + t) for t in ts if t in lora_targets and not rebuild])
    q, k = ("q_pre", "k_pre") if cfg.qk_norm else ("q", "k")
    ev = [("+", "n1"), ("+", "rstd1")] + ([] if first or rebuild else [("+", "x")])
    ev += [("+", q), ("+", k), ("+", "v")] + xa("q", "k", "v") + [("-", "n1")]
    if cfg.qk_norm:
        ev += [("+", "q"), ("+", "k"), ("+", "rstd_q"), ("+", "rstd_k")] + drop("q_pre", "k_pre", "rstd_q", "rstd_k")
    ev += [("+", "o"), ("+", "lse")] + drop("q", "k", "v") + [("+", "a")] + xa("o") + drop("o", "lse")
    ev += [("+", "mid"), ("+", "n2"), ("+", "rstd2"), ("-", "a")]
    if moe:
        return ev + _moe_forward_events(lora_targets, keep, rebuild, aux)
    ev += [("+", "gate")] + xa("gate")
    ev += ([] if up_given else [("+", "up")] + xa("up")) + [("-", "n2")]
    if not rebuild:
        ev += ([("+", "act")] if keep is None else drop("up")) + [("+", "m")] + xa("down")  # else act = gate
    return ev


def _moe_forward_events(lora_targets, keep, rebuild, aux):
    """The MoE block's part of forward_events, from n2 (moe.moe_forward, then layer_forward's end):
    m, the routing (and the kernels' scratch), the expert rows; a rebuild stops before y."""
    ev = [] if rebuild else [("+", "m")]
    ev += [("+", "logits"), ("+", "ws_fwd"), ("-", "ws_fwd"), ("+", "weights"), ("+", "experts")]
    ev += [("+", "route_part"), ("-", "route_part")] if aux and not rebuild else []
    ev += [("+", "order"), ("+", "slot_pos"), ("+", "offsets"), ("+", "hist"), ("-", "hist")]
    ev += [("+", "xa_gu")] if "gate_up" in lora_targets else []
    ev += [("+", "h"), ("+", "wq_gu"), ("-", "wq_gu"), ("+", "e_act")] + ([("+", "xa_d")] if "down_e" in lora_targets else [])
    ev += [("-", "e_act")] if rebuild else [("+", "y"), ("+", "wq_d"), ("-", "wq_d"), ("-", "e_act"), ("-", "y")]
    ev += [("-", "n2")]
    if keep is not None and not rebuild and "moe" not in keep:  # the MoeSaved rows die with the forward
        ev += [("-", r.name) for r in MOE_PLAN]  # (an expert adapter's row is 0 bytes without it)
    return ev


def moe_backward_events(lora_targets):
    """dense.layer_backward's MoE block (moe.moe_backward, rmsnorm_bwd, moe_backward_da): its
    allocations and releases, in order, above the rows the layer holds and g."""
    gu, dn = "gate_up" in lora_targets, "down_e" in lora_targets
    wg = lambda name: [("+", name), ("-", name)]  # noqa: E731  (a gmm_wgrad call's partials, if it splits)
    ev = [("+", "dn2")] + ([("+", "gb")] if dn else []) + [("+", "G"), ("+", "wq_d"), ("-", "wq_d"), ("+", "dw")]
    ev += ([("+", "e_act")] if dn else []) + [("-", "G")]
    ev += wg("wg_d_db") + wg("wg_d_da") + [("-", "gb"), ("-", "e_act")] if dn else []
    ev += [("+", "dhb")] + wg("wg_gu_db") if gu else []
    ev += [("+", "dX"), ("+", "wq_gu"), ("-", "wq_gu"), ("-", "dX")]
    ev += [("+", "dlogits"), ("+", "ws_bwd"), ("-", "ws_bwd"), ("-", "dlogits"), ("-", "dw")]
    return ev + [("-", "dn2")] + (wg("wg_gu_da") + [("-", "dhb")] if gu else [])


class _Kind(NamedTuple):
    """What the walk needs of one kind of layer (dense or MoE)."""
    moe: bool
    targets: tuple  # its LoRA targets (lora.layer_targets)
    rows: dict  # row name -> bytes: saved, transient, gradient and scratch
    grads: dict  # GRADS name -> bytes
    full: int  # every saved row
    holds: dict  # mode -> what a finished layer holds on the GPU
    sent: dict  # mode -> its rows on the host (and in flight)
    scratch: dict  # LoRA projection -> part -> lora_bwd_scratch


def _kind(cfg, li, N, act_bytes, lora_rank, lora_targets):
    kind = layer_lora(cfg, li, lora_targets)
    moe, n_xa, ts = kind
    rb = lambda r: _row_bytes(r, cfg, N, act_bytes, lora_rank, kind)  # noqa: E731
    grads = {r.name: rb(r) for r in GRADS}
    rows = {r.name: rb(r) for r in PLAN + FORWARD_EXTRA}
    xb, xab = rows["x"], rows["xa"]  # xb: one (N, C) activation
    rows.update({"n1": xb, "n2": xb, "a": xb},
                **{"xa:" + t: xab // max(n_xa, 1) for t in ts if t not in EXPERT_TARGETS})
    if moe:
        rows.update({r.name: rb(r) for r in MOE_PLAN + MOE_EXTRA}, m=xb, dn2=grads["dn2"],
                    **moe_scratch(cfg, N, act_bytes, lora_rank))
    scratch = {t: {part: lora_bwd_scratch(N, *_proj_dims(cfg, t), lora_rank, act_bytes, part)
                   for part in ("all", "dx", "dA", "dyb", "dx_nodb")} for t in ts if t not in EXPERT_TARGETS}
    for t in set(ts) & {"down", "gate", "up"}:  # swiglu_bwd_lora's (S, F*R) partial for t (down: RP)
        F = cfg.intermediate
        S = swiglu_lora_chunking(N, F, None, interpreting() and interpret_big(N, F, F))[-1]  # as swiglu_bwd_lora
        scratch[t]["swiglu"] = S * F * (_block_r(lora_rank) if t == "down" else lora_rank) * 4
    return _Kind(moe, ts, rows, grads, layer_bytes(cfg, N, act_bytes, lora_rank, lora_targets, li),
                 mode_bytes(cfg, N, act_bytes, KEEP, lora_rank, lora_targets, li),
                 mode_bytes(cfg, N, act_bytes, OFFLOAD, lora_rank, lora_targets, li), scratch)


def walk(cfg, modes, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout=0.0, head_host=False, loss_rows=None):
    """The step's activation bytes moment by moment, as step.py, dense.py and moe.py allocate and
    free them; returns (high-water bytes, the moment it happens). head_host: the loss streams the
    lm_head from the host (linear_ce_vchunk's scratch instead of linear_ce's); loss_rows: the loss's
    chunk rows (Plan.loss_rows; None: linear_ce's default). Without LoRA dropout the waiting dA of
    projections sharing an input run as one kernel (dense.proj_bwd_da): their partials coexist.
    Each layer is priced as its kind (dense or MoE: cfg.is_moe) with its own LoRA targets."""
    N, C, V = n_tokens, cfg.hidden, cfg.vocab
    lora_targets = tuple(lora_targets)
    kinds = {}

    def kind(li):  # every dense layer of a model alike, every MoE layer alike
        if cfg.is_moe(li) not in kinds:
            kinds[cfg.is_moe(li)] = _kind(cfg, li, N, act_bytes, lora_rank, lora_targets)
        return kinds[cfg.is_moe(li)]

    xb = N * C * act_bytes  # one (N, C) activation
    aux = cfg.aux_loss_coef > 0
    best = [0, "nothing allocated"]

    def at(moment, live):
        if live > best[0]:
            best[:] = [live, moment]

    def run(moment, live, events, rows):
        for sign, name in events:
            live += rows[name] if sign == "+" else -rows[name]
            at(moment, live)

    held = 0  # bytes the finished layers hold
    for li, mode in enumerate(modes):
        prev, k = modes[li - 1] if li else None, kind(li)
        inputs = xb if li == 0 else xb + (0 if prev == KEEP else xb)  # s (layer 0: x), d, and s = mid unless kept
        pending = kind(li - 1).sent[prev] if li else 0  # the previous layer's offloaded rows, until retired
        run(f"forward of layer {li}", held + pending + inputs,
            forward_events(cfg, k.targets, KEPT_ROWS[mode], first=li == 0, moe=k.moe, aux=aux), k.rows)
        held += k.holds[mode]
    last = modes[-1]
    final = 2 * xb + N * 4  # x_final, nf, rstd
    s_d = xb + (0 if last == KEEP else xb)
    at("final norm", held + kind(len(modes) - 1).sent[last] + s_d + final)
    loss = 2 * 4
    ce = (head_host_scratch(N, V, C, act_bytes) if head_host
          else linear_ce_scratch(N, V, C, act_bytes, loss_rows)) + 4  # + the (1,) grad_scale
    at("lm_head + loss", held + final + loss + xb + ce)  # + dnf
    at("final norm backward", held + final + loss + 2 * xb)  # + dnf, g
    base = loss + xb  # g, through the layers' backward (nf, dnf, x_final, rstd are freed)
    for li in reversed(range(len(modes))):
        mode, k = modes[li], kind(li)
        held -= k.holds[mode]
        cur = k.full - k.sent[mode]  # offloaded rows live in the reload buffers
        if mode != KEEP:  # the rebuild, from x and xa (kept, or x in a reload buffer)
            run(f"recompute of layer {li}", held + base + k.rows["xa"] + (xb if mode == RECOMPUTE else 0),
                forward_events(cfg, k.targets, rebuild=True, up_given=mode == OFFLOAD_UP, moe=k.moe), k.rows)
        moments = (MLP_MOMENTS if lora_dropout else MLP_MOMENTS_FUSED) + ATTENTION_MOMENTS
        if k.moe:  # the experts and the router, then the attention as a dense layer's
            run(f"backward of layer {li} (experts)", held + base + cur, moe_backward_events(k.targets), k.rows)
            moments = ATTENTION_MOMENTS
        for name, live, waiting, runs, projs in moments:
            extra = sum(k.scratch[t]["dyb"] for t in waiting if t in k.scratch)
            sizes = [k.scratch[t][runs] for t in projs if t in k.scratch]
            extra += sum(sizes) if runs in ("dA", "swiglu") and lora_dropout == 0.0 else max(sizes, default=0)
            if runs == "attention":  # attention_bwd's own scratch
                extra += attention_bwd_scratch(N, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.window(li))
            at(f"backward of layer {li} ({name})", held + base + cur + sum(k.grads[g] for g in live) + extra)
    return best[0], best[1]
