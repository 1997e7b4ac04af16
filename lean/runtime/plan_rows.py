"""The activation plan's rows: what a layer saves (PLAN, MOE_PLAN), what its forward and backward
allocate besides (MOE_EXTRA, FORWARD_EXTRA, GRADS, the backward's moments), the modes that set
each row's policy, and what a row costs in bytes for a layer of each kind. The tables' meaning,
the policies and the modes: lean/runtime/plan.py's docstring. Host-side arithmetic only.
"""
from typing import NamedTuple

from ..models.moe import mxfp4_group
from .lora import EXPERT_TARGETS, layer_targets


class PlanError(ValueError):
    pass


KEEP, RECOMPUTE, OFFLOAD, OFFLOAD_UP = "keep", "recompute", "offload", "offload_up"
# mode -> policy of (x, up, every other row but xa); xa is kept in every mode
MODES = {KEEP: (KEEP, KEEP, KEEP), RECOMPUTE: (KEEP, RECOMPUTE, RECOMPUTE),
         OFFLOAD: (OFFLOAD, RECOMPUTE, RECOMPUTE), OFFLOAD_UP: (OFFLOAD, OFFLOAD, RECOMPUTE)}
OFFLOADED = (OFFLOAD, OFFLOAD_UP)  # modes whose input x goes to the host
# mode -> the Saved fields its layer_forward hands back (None: all); the rest die in the forward
KEPT_ROWS = {KEEP: None, RECOMPUTE: ("x", "xa"), OFFLOAD: ("x", "xa"), OFFLOAD_UP: ("x", "xa", "up")}


def mode_policy(mode, name):
    """keep / offload / recompute of saved row `name` in a layer run in `mode`."""
    x, up, rest = MODES[mode]
    return {"x": x, "up": up, "xa": KEEP}.get(name, rest)


def layer_modes(cfg, modes):
    """modes as the layers run them: offload_up on an MoE layer (no up row to send) is offload."""
    return tuple(OFFLOAD if m == OFFLOAD_UP and cfg.is_moe(li) else m for li, m in enumerate(modes))


class Row(NamedTuple):
    name: str
    shape: str  # in the legend's symbols; "R*" = one (N, R) per LoRA projection
    dtype: str  # "act", "fp32" or "int32"
    # "always" | "qk_norm" | "lora" (an (N, R) xa row) | "moe" (MoE layers only) | "mlp" (dense-MLP
    # layers only) | "gate_up" / "down_e" (an MoE layer whose experts carry that adapter) | "mxfp4"
    # (an MoE layer whose experts are held in MXFP4)
    when: str = "always"


PLAN = (  # what a layer saves: dense.Saved, in its field order
    Row("x", "N,C", "act"),
    Row("rstd1", "N", "fp32"),
    Row("xa", "N,R*", "act", "lora"),
    Row("q_pre", "N,H*D", "act", "qk_norm"),
    Row("k_pre", "N,KVH*D", "act", "qk_norm"),
    Row("rstd_q", "N*H", "fp32", "qk_norm"),
    Row("rstd_k", "N*KVH", "fp32", "qk_norm"),
    Row("q", "N,H*D", "act"),
    Row("k", "N,KVH*D", "act"),
    Row("v", "N,KVH*D", "act"),
    Row("o", "N,H*D", "act"),
    Row("lse", "H,N", "fp32"),
    Row("mid", "N,C", "act"),
    Row("rstd2", "N", "fp32"),
    Row("gate", "N,F", "act", "mlp"),
    Row("up", "N,F", "act", "mlp"),
    Row("moe", "MOE_PLAN", "-", "moe"),  # an MoE layer's moe.MoeSaved: the sum of MOE_PLAN's rows
)

MOE_PLAN = (  # what an MoE layer's block saves: moe.MoeSaved, in its field order
    Row("logits", "N,E", "act"),
    Row("weights", "N,K", "act"),
    Row("experts", "N,K", "int32"),
    Row("order", "P", "int32"),
    Row("slot_pos", "P", "int32"),
    Row("offsets", "E+1", "int32"),
    Row("h", "P,2*Fe", "act"),
    Row("xa_gu", "P,Rgu", "act", "gate_up"),
    Row("xa_d", "P,R", "act", "down_e"),
)
# What moe_forward and moe_backward allocate besides MoeSaved, and the kernels' scratch (moe.py, in
# its order: forward_events / moe_backward_events): m the block's output, e_act = SwiGLU of h, y the
# sorted expert outputs; dn2, then gb = g B_d, G = dL/d(e_act) before w, dw, e_act again (the down
# dA's input), dhb = dh B_gu, dX the sorted dL/dn2 rows, dlogits; route_part, route_topk_fwd's
# prob_sum partials (the aux loss on, not in a rebuild); hist, group_slots' (blocks, E) int32;
# ws_fwd / ws_bwd, the router GEMMs' split-K workspaces (gemm_splitk.py; 0 under the interpreter);
# wq_gu / wq_d, an MXFP4 expert weight (gate_up's, down's) dequantised for one grouped GEMM, Eq of its
# experts at a time (moe._wgmm, moe.mxfp4_group).
MOE_EXTRA = (
    Row("e_act", "P,Fe", "act"), Row("y", "P,C", "act"),
    Row("gb", "P,R", "act", "down_e"), Row("G", "P,Fe", "act"), Row("dw", "N,K", "fp32"),
    Row("dhb", "P,Rgu", "act", "gate_up"), Row("dX", "P,C", "act"), Row("dlogits", "N,E", "act"),
    Row("wq_gu", "Eq,2*Fe,C", "act", "mxfp4"), Row("wq_d", "Eq,C,Fe", "act", "mxfp4"),  # MXFP4 experts, dequantised
)

# What layer_forward holds at its peak (the down projection) besides Saved: its input act (dropped
# at return) and its output m.
FORWARD_EXTRA = (Row("act", "N,F", "act"), Row("m", "N,C", "act"))

# layer_backward's gradient buffers (dense.py) ...
GRADS = (
    Row("dact", "N,F", "act"), Row("dn2", "N,C", "act"), Row("do", "N,H*D", "act"),
    Row("dq", "N,H*D", "act"), Row("dk", "N,KVH*D", "act"), Row("dv", "N,KVH*D", "act"),
    Row("delta", "H,N", "fp32"), Row("dq_pre", "N,H*D", "act", "qk_norm"),
    Row("dk_pre", "N,KVH*D", "act", "qk_norm"), Row("dn1", "N,C", "act"),
)
# ... and the moments of layer_backward, in order: (moment, live GRADS rows, projections whose
# dy B waits for its dA, what runs and on which projections). What runs: "dx" = lora_linear_bwd
# with its dA deferred (input not kept), "dA" = the deferred lora_linear_bwd_da, "all" = the whole
# lora_linear_bwd (o: its input is saved anyway), "" = no LoRA scratch.
MLP_MOMENTS = (  # with LoRA dropout
    ("down", ("dact",), (), "dx", ("down",)),
    ("down dA", ("dact",), ("down",), "dA", ("down",)),
    ("gate", ("dn2",), (), "dx", ("gate",)),
    ("up", ("dn2",), ("gate",), "dx", ("up",)),
    ("gate/up dA", ("dn2",), ("gate", "up"), "dA", ("gate", "up")),
)
# Without dropout (dense.layer_backward's `fused`): swiglu_bwd_lora's partials, the down dA's and
# gate's and up's dB at once ("swiglu", sized by swiglu.lora_chunking), down's dy B waiting until it
# ends; then gate and up without their dB partials ("dx_nodb").
MLP_MOMENTS_FUSED = (
    ("down", ("dact",), (), "dx", ("down",)),
    ("swiglu", ("dact",), ("down",), "swiglu", ("down", "gate", "up")),
    ("gate", ("dn2",), (), "dx_nodb", ("gate",)),
    ("up", ("dn2",), ("gate",), "dx_nodb", ("up",)),
    ("gate/up dA", ("dn2",), ("gate", "up"), "dA", ("gate", "up")),
)
ATTENTION_MOMENTS = (  # an MoE layer's backward ends with these too (moe_backward_events before them)
    ("o", ("do",), (), "all", ("o",)),
    ("attention", ("do", "dq", "dk", "dv", "delta"), (), "attention", ()),  # + the dk/dv partials
    ("qk-norm", ("dq", "dk", "dv", "dq_pre", "dk_pre"), (), "", ()),
    ("q", ("dq", "dk", "dv", "dn1"), (), "dx", ("q",)),  # dq, dk: dq_pre, dk_pre with QK-norm
    ("k", ("dq", "dk", "dv", "dn1"), ("q",), "dx", ("k",)),
    ("v", ("dq", "dk", "dv", "dn1"), ("q", "k"), "dx", ("v",)),
    ("q/k/v dA", ("dn1",), ("q", "k", "v"), "dA", ("q", "k", "v")),
)


def _sym(cfg, n_tokens, lora_rank, n_xa):
    return {"N": n_tokens, "C": cfg.hidden, "H": cfg.n_heads, "KVH": cfg.n_kv_heads, "D": cfg.head_dim,
            "F": cfg.intermediate, "R*": lora_rank * n_xa, "R": lora_rank, "E": cfg.n_experts, "K": cfg.top_k,
            "P": n_tokens * cfg.top_k, "Fe": cfg.moe_intermediate, "Eq": mxfp4_group(cfg.n_experts),
            "Rgu": lora_rank * (1 if cfg.expert_bias else 2)}  # gate_up's expert rank: 2r (Qwen3-MoE), r (GPT-OSS)


def layer_lora(cfg, layer, lora_targets):
    """(MoE layer?, its (N, R) xa rows, its LoRA targets) of layer `layer` (None: a dense layer).
    lora_targets: the user's targets (a tuple, lora.targets: each layer adapts what
    lora.layer_targets gives it; an MoE model's experts take gate/up/down), or for a dense layer a
    count of adapted projections."""
    moe = layer is not None and cfg.is_moe(layer)
    if isinstance(lora_targets, int):
        if moe and lora_targets:
            raise PlanError("an MoE layer's LoRA rows depend on which projections are adapted: pass the "
                            "targets (lora.targets), not a count")
        return moe, lora_targets, ()
    ts = layer_targets(cfg, layer if layer is not None else -1, tuple(lora_targets))  # -1: a dense layer
    return moe, sum(t not in EXPERT_TARGETS for t in ts), ts


def _numel(shape, sym):
    """Elements of a shape in the legend's symbols: dims split by ",", sums by "+", products by "*"."""
    numel = 1
    for dim in shape.split(","):
        if dim == "R*":
            numel *= sym["R*"]
            continue
        size = 0
        for term in dim.split("+"):
            prod = 1
            for factor in term.split("*"):
                prod *= int(factor) if factor.isdigit() else sym[factor]
            size += prod
        numel *= size
    return numel


def _row_bytes(row, cfg, n_tokens, act_bytes, lora_rank, kind):
    moe, n_xa, ts = kind
    if row.when == "qk_norm" and not cfg.qk_norm:
        return 0
    if row.when == "lora" and not n_xa:
        return 0
    if row.when in ("gate_up", "down_e") and row.when not in ts:
        return 0
    if (row.when == "moe" and not moe) or (row.when == "mlp" and moe):
        return 0
    if row.when == "mxfp4" and not (moe and cfg.expert_quant == "mxfp4"):
        return 0
    if row.name == "moe":
        return sum(_row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, kind) for r in MOE_PLAN)
    numel = _numel(row.shape, _sym(cfg, n_tokens, lora_rank, n_xa))
    return numel * (4 if row.dtype in ("fp32", "int32") else act_bytes)


def row_bytes(row, cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0, layer=None):
    """Bytes one layer spends on one row of a table. n_lora_targets: the adapted projections of a
    dense layer (a count) or the user's LoRA targets (a tuple; needed for an MoE model's layers);
    layer: the layer index (None: a dense layer), whose kind (cfg.is_moe) prices the row."""
    return _row_bytes(row, cfg, n_tokens, act_bytes, lora_rank, layer_lora(cfg, layer, n_lora_targets))


def layer_bytes(cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0, layer=None):
    """What one layer's saved activations take on the GPU when it keeps every row."""
    return sum(row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, n_lora_targets, layer) for r in PLAN)


def mode_bytes(cfg, n_tokens, act_bytes, policy, lora_rank=0, n_lora_targets=0, layer=None):
    """mode -> bytes of one layer's rows whose policy in that mode is `policy` (keep: what a finished
    layer holds on the GPU; offload: what it sends to the host)."""
    rows = [(r.name, row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, n_lora_targets, layer)) for r in PLAN]
    return {m: sum(b for name, b in rows if mode_policy(m, name) == policy) for m in MODES}
