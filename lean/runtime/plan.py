"""The activation plan: every tensor a layer saves, its policy per layer, and the step's predicted peak.

Shape legend: N tokens, C hidden, H/KVH heads, D head dim, F MLP hidden, R LoRA rank, V vocab;
MoE layers (Qwen3-MoE, GPT-OSS): E experts, K experts per token, P = N*K slots, Fe one expert's MLP
width, Rgu the experts' gate_up LoRA rank (2R for Qwen3-MoE, R for GPT-OSS).
act = the model's compute dtype (2 bytes for bf16).

What one layer's forward saves for its backward (dense.Saved, field for field):

| name   | shape        | dtype | what it is                                     |
|--------|--------------|-------|------------------------------------------------|
| x      | (N, C)       | act   | layer input (residual stream)                  |
| rstd1  | (N,)         | fp32  | 1/rms of x                                     |
| xa     | (N, R) each  | act   | drop(input) A^T of every LoRA projection       |
| q_pre  | (N, H*D)     | act   | q before QK-norm (Qwen3 only)                  |
| k_pre  | (N, KVH*D)   | act   | k before QK-norm (Qwen3 only)                  |
| rstd_q | (N*H,)       | fp32  | QK-norm statistics (Qwen3 only)                |
| rstd_k | (N*KVH,)     | fp32  | QK-norm statistics (Qwen3 only)                |
| q      | (N, H*D)     | act   | q after norm and RoPE                          |
| k      | (N, KVH*D)   | act   | k after norm and RoPE                          |
| v      | (N, KVH*D)   | act   | v                                              |
| o      | (N, H*D)     | act   | attention output: input of o_proj              |
| lse    | (H, N)       | fp32  | attention log-sum-exp                          |
| mid    | (N, C)       | act   | x + attention block output                     |
| rstd2  | (N,)         | fp32  | 1/rms of mid                                   |
| gate   | (N, F)       | act   | gate projection (overwritten by its gradient); dense-MLP layers only |
| up     | (N, F)       | act   | up projection (overwritten by its gradient); dense-MLP layers only   |
| moe    | MOE_PLAN     | -     | an MoE layer's moe.MoeSaved (below); 0 bytes on a dense-MLP layer    |

An MoE layer's block saves (moe.MoeSaved, field for field; MOE_PLAN):

| name     | shape    | dtype | what it is                                                  |
|----------|----------|-------|-------------------------------------------------------------|
| logits   | (N, E)   | act   | router logits                                               |
| weights  | (N, K)   | act   | routing weights (top-K, renormalised with norm_topk_prob)   |
| experts  | (N, K)   | int32 | each token's K experts                                      |
| order    | (P,)     | int32 | slot of each sorted position (grouped by expert)            |
| slot_pos | (P,)     | int32 | sorted position of each slot                                |
| offsets  | (E+1,)   | int32 | first sorted position of each expert                        |
| h        | (P, 2Fe) | act   | gate | up of every slot, sorted (overwritten by its gradient) |
| xa_gu    | (P, Rgu) | act   | the experts' gate_up LoRA rows (with that adapter)          |
| xa_d     | (P, R)   | act   | the experts' down LoRA rows (with that adapter)             |

Each layer is priced as its kind (cfg.is_moe) with its own LoRA targets (lora.layer_targets: an
MoE model adapts its experts for gate/up/down, and its dense-MLP layers' MLP not at all), so
row_bytes, layer_bytes and mode_bytes take the layer index and the user's targets.

Not in the table, never saved: n1 = rmsnorm(x) w_in (q/k/v's input), n2 = rmsnorm(mid) w_post
(gate/up's) and act = silu(gate) up (down's). Their one use in backward is the LoRA dA; the
backward kernels that read their inputs anyway write them again (dense.py), so no mode pays for
them: they were a third of a kept layer.

Policies, chosen per layer by its mode (MODES): a row is `keep` (stays on the GPU until its
layer's backward), `offload` (copied to pinned host memory in forward, reloaded in backward) or
`recompute` (dropped in forward, rebuilt in backward by rerunning layer_forward from the input).
xa, a few MiB per layer, is kept in every mode: with it the rebuild skips swiglu and the down
projection (dense.layer_forward(rebuild=...)), whose outputs backward never reads:

| mode       | x       | up        | xa   | every other row | GPU bytes the layer holds | extra work in backward          |
|------------|---------|-----------|------|-----------------|---------------------------|---------------------------------|
| keep       | keep    | keep      | keep | keep            | all rows                  | none                            |
| recompute  | keep    | recompute | keep | recompute       | x, xa                     | the forward up to gate/up       |
| offload    | offload | recompute | keep | recompute       | xa (one reload buffer)    | the same; copies overlap        |
| offload_up | offload | offload   | keep | recompute       | xa (one reload buffer)    | as offload, without up's GEMM   |

On an MoE layer the moe row (every MoeSaved field, the expert LoRA rows xa_gu / xa_d too) follows
"every other row": kept in keep, rebuilt otherwise (the rebuild reruns the routing, the grouping
and gate_up, and counts no slot twice). An MoE layer has no up row, so offload_up there is
offload: make_plan writes it so (layer_modes), the planner's candidates that differ only there are
one plan, and the scheduler gives MoE layers no up slot.

The planner (lean/runtime/planner.py) picks the modes, and for an untied model whether the frozen
embedding table lives in pinned host memory (Plan.embed_host: its weights leave the GPU's count,
its per-step gather is priced by embed_gather_cost), and whether the lm_head does (Plan.head_host,
a tied table with it: the loss streams it in chunks, head_host_bytes / head_host_scratch /
head_host_cost); this module prices and sizes a given plan.

The predicted peak walks the step as lean/runtime/step.py runs it and counts what is really
allocated: the persistent state (frozen weights, the LoRA flat buffers and AdamW moments, the
batch descriptor and RoPE tables, the scheduler's reload buffers), and on top of it, moment by
moment, the rows the finished layers hold, the working layer's forward or rebuild allocation by
allocation (forward_events: a layer rebuilt later lets each row go once its forward is done with
it, and writes act over gate), its gradient buffers (MLP_MOMENTS, or MLP_MOMENTS_FUSED without
dropout, then ATTENTION_MOMENTS; dense.py frees each when dead), the kernels' own scratch
(lora_linear_bwd's dy B and partial sums, swiglu_bwd_lora's partials, attention_bwd's dk/dv
partials, linear_ce's logits chunk) and the lm_head/loss buffers. The sizes of everything but the
saved rows (state, constants, scratch, streamed-head and gather buffers) are in
lean/runtime/plan_bytes.py; this module walks the moments they live in. Budgets compare
with torch.cuda.max_memory_allocated (tensor bytes; the caching allocator's reserved-but-free
memory and its 512-byte rounding are not counted).

Errors: PlanError for modes that do not match the model (and, from the planner, when no plan fits).
Tested: tests/test_offload.py (CPU: the walk's peak equals the bytes allocated during a step, dense
and Qwen3-MoE models in every mode, the MoE ones with a dense layer mixed in and the aux loss on;
the plan's kept bytes equal what the tape holds) and tests/test_step.py (the tables name exactly
what a dense and an MoE layer save). GPU (H100): measured peak <=
budget and within 10% of the prediction (measured: within 1.2%, BENCHMARKS.md; dense models: MoE
plans are not measured on a GPU yet).
Caution: the kernel scratch rules (plan_bytes.py) mirror kernels/lora_linear.py, kernels/linear_ce.py,
kernels/moe_group.py and kernels/moe_route.py, and the MoE events models/moe.py's order; the CPU
test fails when they drift apart (where they make the peak).
"""
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..kernels.attention_config import attention_bwd_scratch
from ..kernels.gemm import interpret_big, interpreting
from ..kernels.linear_ce import _default_chunk_rows
from ..kernels.lora_grad import _block_r
from ..kernels.swiglu import lora_chunking as swiglu_lora_chunking
from ..models.moe import mxfp4_group
from .lora import EXPERT_TARGETS, TARGETS, layer_targets
from .plan_bytes import (_proj_dims, constant_bytes, gather_buffer_bytes, head_host_bytes, head_host_scratch,
                         layer_weight_bytes, linear_ce_scratch, lora_bwd_scratch, lora_state_bytes, moe_scratch,
                         nf4_scratch_bytes)

GiB = 1 << 30
# Headroom the planner leaves under a budget: torch's caching allocator rounds every tensor up to
# 512 bytes (a few hundred live tensors: under 1 MiB), and a few scalars live outside the step.
# On the H100 a planned Qwen3-8B step measured 6.6 MiB (eager) and 10.7 MiB (StepGraph) above
# the walk (bench.py step --budget 17.5, commit ce965d8), so 8 MiB was too little.
SLACK = 16 << 20
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


class Rates(NamedTuple):
    """What this machine moves and computes per second (offload.measure_rates measures them; link: measure_link)."""
    d2h: float  # pinned device -> host bytes/s (the forward's offloads)
    h2d: float  # pinned host -> device bytes/s (the backward's reloads)
    flops: float  # a layer-sized GEMM's FLOP/s
    link: float = 100e9  # sharded weights: bytes/s a rank receives in an all-gather of a layer (N-1 parts of N)


# An H100 SXM's measured rates (BENCHMARKS.md): the planner's prices when none are measured (CPU).
# link: assumed (NCCL's all-gather over NVLink), not measured yet; measure_link measures it on the GPUs.
DEFAULT_RATES = Rates(d2h=50e9, h2d=50e9, flops=600e12, link=100e9)


class PlanError(ValueError):
    pass


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


# The lm_head + loss in chunks of CE_FAST_ROWS rows where that costs no peak memory (Plan.loss_rows).
# linear_ce's default chunk is the fewest rows that keep its two GEMMs compute-bound (640 for a
# C 2048, V 151936 head), the least scratch; more rows run faster. H100, bf16, N 8192, 2026-11-27
# (`tools/splitk_bench.py --ce-chunks ...`, the whole op, ms at the default | 1024 | 2048 rows):
# Qwen3-0.6B 10.55 (768) | 10.16 | 9.99, Llama-3.2-1B 15.60 (640) | 14.10 | 13.63, Qwen3-8B 31.91
# (512) | 30.40 | 30.58, Qwen3-30B-A3B 19.16 (640) | 16.82 | 17.12, gpt-oss-20b 33.33 (512) |
# 32.09 | 32.73 (1536 rows: 10-20% slower than 1024 on four of five heads: the dh GEMM's split-K
# under-fills a wave). The step (`bench.py step --graph`, LEAN_CE_CHUNK_ROWS=default | 1024):
# Qwen3-30B-A3B (8 layers) packed 109,216 -> 110,720 tok/s, padded 107,616 -> 109,913, peak 17.46
# GiB both (its peak is inside a layer's experts); Qwen3-0.6B 113,653 -> 114,398 at +0.06 GiB
# and Llama-3.2-1B 85,184 -> 85,459 at +0.09 GiB, where the loss's moment is the peak: those keep
# the default.
CE_FAST_ROWS = 1024
AUTO = "auto"  # make_plan's loss_rows: decide them (decide_loss_rows) rather than take the model's (step.loss_rows)


def decide_loss_rows(cfg, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout=0.0, head_host=False):
    """The lm_head + loss's chunk rows (Plan.loss_rows): fast_loss_rows' where the all-keep step's
    walk peaks no higher with them than with linear_ce's default (its peak is elsewhere: inside an MoE
    layer's experts), else None (the default). Decided on the all-keep step, not per plan, so that
    every plan of a model runs the same chunks: plans differ in memory and time, never in bits (the
    chunk rows tile the dh GEMM, and so its summation order)."""
    rows = fast_loss_rows(cfg, n_tokens, act_bytes, head_host)
    if rows is None:
        return None
    keep = (KEEP,) * cfg.n_layers
    peak = lambda r: walk(cfg, keep, n_tokens, act_bytes, lora_rank, lora_targets,  # noqa: E731
                          lora_dropout, head_host, r)[0]
    return rows if peak(rows) <= peak(None) else None


def fast_loss_rows(cfg, n_tokens, act_bytes, head_host=False):
    """CE_FAST_ROWS where a step could run its lm_head + loss in them (decide_loss_rows keeps them
    where the peak does not rise), else None: under the interpreter, with the head on the host
    (linear_ce_vchunk's own chunks), where linear_ce's default already takes as many rows, and
    while LEAN_CE_CHUNK_ROWS is set (the experiment decides)."""
    N, V, C = n_tokens, cfg.vocab, cfg.hidden
    if interpreting() or head_host or os.environ.get("LEAN_CE_CHUNK_ROWS"):
        return None
    return CE_FAST_ROWS if min(_default_chunk_rows(N, V, C, act_bytes, False), N) < min(CE_FAST_ROWS, N) else None


def head_host_cost(cfg, n_tokens, act_bytes, rates, world=1):
    """Seconds the streamed head adds to a step: its 2n - 2 chunk copies over the link, less the three
    lm_head GEMMs they hide under (two when the head is on the GPU: the third is added). world > 1:
    the head sharded over the ranks (shard.ShardHead), each fill the N-1 parts of a chunk a rank
    receives in an all-gather, at rates.link."""
    from .head_host import chunk_rows
    V, C = cfg.vocab, cfg.hidden
    Vc = chunk_rows(V, C, act_bytes, world)
    n = -(-V // Vc)
    gemm = 2 * n_tokens * V * C / rates.flops
    moved = (2 * n - 2 if n > 1 else 1) * Vc * C * act_bytes
    link = moved / rates.h2d if world <= 1 else moved * (world - 1) / world / rates.link
    return gemm + max(0.0, link - 3 * gemm)


class Memory(NamedTuple):
    """Predicted device bytes, by part; peak = their sum."""
    weights: int  # frozen model tensors (sharded weights: this rank's parts of the layers)
    lora: int  # LoRA params, grads, compute copy, AdamW moments
    constants: int  # batch descriptor, RoPE tables
    reload: int  # the offload scheduler's two (N, C) reload buffers (and two (N, F) with offload_up)
    activations: int  # the step's own high-water mark above all of the above
    gather: int = 0  # sharded weights: the two rotating full layers of each kind (offload.Gather)

    @property
    def peak(self):
        return sum(self)


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


def layer_flops(cfg, n_tokens, layer=None):
    """GEMM FLOPs of one layer's forward: (q, k, v and o together, gate, up, down). An MoE layer
    (layer given, cfg.is_moe): the router with its gate, over the N*K slots of the experts."""
    N, C, F = n_tokens, cfg.hidden, cfg.intermediate
    if layer is not None and cfg.is_moe(layer):
        P, Fe = N * cfg.top_k, cfg.moe_intermediate
        return 2 * N * C * 2 * (cfg.q_dim + cfg.kv_dim), 2 * N * C * cfg.n_experts + 2 * P * C * Fe, 2 * P * C * Fe, \
            2 * P * Fe * C
    return 2 * N * C * 2 * (cfg.q_dim + cfg.kv_dim), 2 * N * C * F, 2 * N * C * F, 2 * N * F * C


# A layer's forward over its GEMMs' time alone (attention, norms, RoPE, the LoRA pre-passes): the
# compute a copy hides under. Measured on the H100 (bench_offload, keep rows, 8192 tokens packed):
# Qwen3-8B 6.7 ms a layer against 4.1 ms of GEMMs (1.63), Llama-3.2-3B 4.0 against 2.25 (1.78).
LAYER_OVER_GEMM = 1.6


def plan_cost(cfg, modes, n_tokens, act_bytes, rates):
    """Predicted seconds a plan adds to an all-keep step: the rebuilds' GEMMs, and every copy's
    excess over the compute it hides under (an offload under the next layer's forward, a reload
    under the backward of the layer above), a layer's compute being LAYER_OVER_GEMM times its
    GEMMs'. A rebuild is priced by its GEMMs alone (what differs between the modes); each layer
    by its kind (layer_flops)."""
    kinds = {}

    def price(li):  # (a layer's forward, mode -> its rebuild, mode -> bytes it sends), per kind
        moe = cfg.is_moe(li)
        if moe not in kinds:
            attn, gate, up, down = layer_flops(cfg, n_tokens, li)
            fwd = LAYER_OVER_GEMM * (attn + gate + up + down) / rates.flops  # its backward's dx alike
            rebuild = {KEEP: 0.0, RECOMPUTE: (attn + gate + up) / rates.flops,
                       OFFLOAD: (attn + gate + up) / rates.flops, OFFLOAD_UP: (attn + gate) / rates.flops}
            sent = mode_bytes(cfg, n_tokens, act_bytes, OFFLOAD, layer=li)  # x and up: the LoRA rank plays no part
            kinds[moe] = fwd, rebuild, sent
        return kinds[moe]

    cost = 0.0
    for li, mode in enumerate(modes):
        fwd, rebuild, sent = price(li)
        cost += rebuild[mode]
        if sent[mode]:
            nxt = li + 1 if li + 1 < len(modes) else li  # the layer whose compute hides the copies
            above = modes[li + 1] if li + 1 < len(modes) else KEEP
            fwd_up, rebuild_up, _ = price(nxt)
            cost += max(0.0, sent[mode] / rates.d2h - fwd_up)
            cost += max(0.0, sent[mode] / rates.h2d - (fwd_up + rebuild_up[above]))
    return cost


@dataclass(frozen=True, eq=False)
class Plan:
    """Per-layer modes for steps of up to n_tokens tokens, and the predicted memory."""
    cfg: object  # ModelConfig
    n_tokens: int  # the most tokens a batch may hold (the buffers are sized for it)
    act_bytes: int
    lora_rank: int
    lora_targets: tuple
    modes: tuple  # per layer: KEEP | RECOMPUTE | OFFLOAD | OFFLOAD_UP (never on an MoE layer: layer_modes)
    memory: Memory
    peak_at: str  # the moment of the predicted peak
    budget_bytes: Optional[int] = None
    cost: float = 0.0  # predicted seconds over an all-keep step (plan_cost)
    rates: Rates = DEFAULT_RATES  # what the cost was priced with
    embed_host: bool = False  # the embedding table lives in pinned host memory
    head_host: bool = False  # so does the lm_head, streamed through the loss in chunks (head_host.py)
    world: int = 1  # sharded weights over this many ranks (runtime/shard.py); 1: whole
    loss_rows: Optional[int] = None  # the lm_head + loss's chunk rows (make_plan's); None: linear_ce's default

    def policy(self, li, name):
        """keep / offload / recompute of saved row `name` in layer li."""
        return mode_policy(self.modes[li], name)

    @property
    def offloaded(self):
        """Layers whose input goes to the host."""
        return tuple(li for li, m in enumerate(self.modes) if m in OFFLOADED)

    def _bytes(self, policy):
        per = {}  # per kind of layer (dense, MoE)
        for li in range(len(self.modes)):
            per.setdefault(self.cfg.is_moe(li), mode_bytes(self.cfg, self.n_tokens, self.act_bytes, policy,
                                                           self.lora_rank, self.lora_targets, li))
        return sum(per[self.cfg.is_moe(li)][m] for li, m in enumerate(self.modes))

    @property
    def kept_bytes(self):
        """Device bytes the layers hold at the end of the forward: rows whose policy is keep."""
        return self._bytes(KEEP)

    @property
    def host_bytes(self):
        """Pinned host bytes: a slot per offloaded row of every layer."""
        return self._bytes(OFFLOAD)


def gather_cost(cfg, modes, n_tokens, act_bytes, rates, world):
    """Predicted seconds sharded weights add to a step: each layer's all-gather (the N-1 parts it
    receives over rates.link) beyond the compute it hides under: the forward's gather of layer
    li+1 under layer li's forward (layer 0's under nothing), the backward's of layer li-1 under
    layer li's backward and rebuild (the top two layers are still held). Compute as plan_cost's.
    Assumes the gathers have the link to themselves: they run on their own process group (NCCL
    communicator and stream: dist.Dist.gathers), so none waits behind a gradient bucket's
    all-reduce; the all-reduces' share of the link is not priced."""
    if world <= 1:
        return 0.0
    L = cfg.n_layers
    fwd = [LAYER_OVER_GEMM * sum(layer_flops(cfg, n_tokens, li)) / rates.flops for li in range(L)]
    attn_up = {KEEP: 0, RECOMPUTE: 3, OFFLOAD: 3, OFFLOAD_UP: 2}  # the rebuild's GEMMs: attention, gate, up
    rebuild = [sum(layer_flops(cfg, n_tokens, li)[:attn_up[modes[li]]]) / rates.flops for li in range(L)]
    g = [layer_weight_bytes(cfg, li, act_bytes, world) * (world - 1) / world / rates.link for li in range(L)]
    cost = g[0] + sum(max(0.0, g[li + 1] - fwd[li]) for li in range(L - 1))
    return cost + sum(max(0.0, g[li] - fwd[li + 1] - rebuild[li + 1]) for li in range(L - 2))


def embed_gather_cost(cfg, n_tokens, act_bytes, rates):
    """Seconds a step's embedding gather takes from a table in pinned host memory: its N rows over
    the link (it runs before layer 0, under no compute)."""
    return n_tokens * cfg.hidden * act_bytes / rates.h2d


def make_plan(cfg, n_tokens, modes, *, lora_rank, lora_targets=TARGETS, act_bytes=2, weights_bytes=0,
              optimizer=True, budget_bytes=None, rates=DEFAULT_RATES, embed_host=False, lora_dropout=0.0,
              head_host=False, world=1, loss_rows=AUTO, host_state=False):
    """The plan with these per-layer modes, its predicted memory and cost. weights_bytes: the frozen
    tensors on the GPU (without the embedding table when embed_host, without the lm_head when
    head_host: its two chunk buffers are added here; a tied table moves with the head; this rank's
    parts of the layers when sharded). world > 1: sharded weights, their gather buffers and gathers
    priced. loss_rows: the lm_head + loss's chunk rows (an int, or None: linear_ce's default), as a
    model already runs them (step.loss_rows); AUTO decides them (decide_loss_rows). host_state: the
    LoRA's master weights, gradients and moments in pinned host memory (runtime/host_state.py)."""
    modes = tuple(modes)
    if len(modes) != cfg.n_layers or not set(modes) <= set(MODES):
        raise PlanError(f"modes: expected {cfg.n_layers} of {', '.join(MODES)}, got {modes!r}")
    modes = layer_modes(cfg, modes)  # offload_up on an MoE layer: offload
    if n_tokens < 1:
        raise PlanError(f"n_tokens={n_tokens}: a step needs at least one token")
    lora_targets = tuple(lora_targets) if lora_rank else ()
    rows = decide_loss_rows(cfg, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout, head_host) \
        if loss_rows is AUTO else (None if head_host else loss_rows)
    act, where = walk(cfg, modes, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout, head_host, rows)
    act += nf4_scratch_bytes(cfg, n_tokens, act_bytes)
    reload = (2 * n_tokens * cfg.hidden * act_bytes if any(m in OFFLOADED for m in modes) else 0) + (
        2 * n_tokens * cfg.intermediate * act_bytes if OFFLOAD_UP in modes else 0)
    if head_host:
        weights_bytes += head_host_bytes(cfg, act_bytes, world)
    mem = Memory(weights_bytes, lora_state_bytes(cfg, lora_rank, lora_targets, act_bytes, optimizer, host_state),
                 constant_bytes(cfg, n_tokens), reload, act, gather_buffer_bytes(cfg, act_bytes, world))
    cost = plan_cost(cfg, modes, n_tokens, act_bytes, rates) + gather_cost(cfg, modes, n_tokens, act_bytes, rates, world)
    embed_host = bool(embed_host or (head_host and cfg.tie_embeddings))  # a tied table goes with the head
    if embed_host:
        cost += embed_gather_cost(cfg, n_tokens, act_bytes, rates)
    if head_host:
        cost += head_host_cost(cfg, n_tokens, act_bytes, rates, world)
    return Plan(cfg, n_tokens, act_bytes, lora_rank, lora_targets, modes, mem, where, budget_bytes, cost, rates,
                embed_host, bool(head_host), world, rows)
