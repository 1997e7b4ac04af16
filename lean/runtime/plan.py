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
lean/runtime/plan_bytes.py. This module makes a plan (make_plan, decide_loss_rows) from three
parts: plan_rows.py (the tables above, the modes, a row's bytes), plan_walk.py (the moments, the
peak) and plan_cost.py (the time); it re-exports their names. Budgets compare
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

from ..kernels.gemm import interpreting
from ..kernels.linear_ce import _default_chunk_rows
from .lora import TARGETS
from .plan_bytes import constant_bytes, gather_buffer_bytes, head_host_bytes, lora_state_bytes, nf4_scratch_bytes
# noqa F401: the names the planner, the step, the tools and tests take from here, re-exported
from .plan_cost import DEFAULT_RATES, Rates, embed_gather_cost, gather_cost, head_host_cost, plan_cost  # noqa: F401
from .plan_rows import (KEEP, KEPT_ROWS, MODES, MOE_PLAN, OFFLOAD, OFFLOAD_UP, OFFLOADED, PLAN, RECOMPUTE,  # noqa: F401
                        PlanError, layer_bytes, layer_modes, mode_bytes, mode_policy, row_bytes)
from .plan_walk import walk

GiB = 1 << 30
# Headroom the planner leaves under a budget: torch's caching allocator rounds every tensor up to
# 512 bytes (a few hundred live tensors: under 1 MiB), and a few scalars live outside the step.
# On the H100 a planned Qwen3-8B step measured 6.6 MiB (eager) and 10.7 MiB (StepGraph) above
# the walk (bench.py step --budget 17.5, commit ce965d8), so 8 MiB was too little.
SLACK = 16 << 20


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
