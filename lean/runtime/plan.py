"""The activation plan: every tensor a layer saves, its policy per layer, and the step's predicted peak.

Shape legend: N tokens, C hidden, H/KVH heads, D head dim, F MLP hidden, R LoRA rank, V vocab.
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
| gate   | (N, F)       | act   | gate projection (overwritten by its gradient)  |
| up     | (N, F)       | act   | up projection (overwritten by its gradient)    |
| moe    | -            | -     | an MoE layer's moe.MoeSaved (routing, expert rows); not priced yet: |
|        |              |       | planner.plan_for refuses MoE models, whose layers keep every row    |

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

The planner (lean/runtime/planner.py) picks the modes, and for an untied model whether the frozen
embedding table lives in pinned host memory (Plan.embed_host: its weights leave the GPU's count,
its per-step gather is priced by embed_gather_cost); this module prices and sizes a given plan.

The predicted peak walks the step as lean/runtime/step.py runs it and counts what is really
allocated: the persistent state (frozen weights, the LoRA flat buffers and AdamW moments, the
batch descriptor and RoPE tables, the scheduler's reload buffers), and on top of it, moment by
moment, the rows the finished layers hold, the working layer's forward or rebuild allocation by
allocation (forward_events: a layer rebuilt later lets each row go once its forward is done with
it, and writes act over gate), its gradient buffers (BACKWARD_MOMENTS, dense.py frees each when
dead), the kernels' own scratch (lora_linear_bwd's
dy B and partial sums, linear_ce's logits chunk) and the lm_head/loss buffers. Budgets compare
with torch.cuda.max_memory_allocated (tensor bytes; the caching allocator's reserved-but-free
memory and its 512-byte rounding are not counted).

Errors: PlanError for modes that do not match the model (and, from the planner, when no plan fits).
Tested: tests/test_offload.py (CPU: the walk equals the bytes allocated during a step, allocation
by allocation; the plan's kept bytes equal what the tape holds) and
tests/test_step.py (the table names exactly what a layer saves). GPU (H100): measured peak <=
budget and within 10% of the prediction (measured: within 1.2%, BENCHMARKS.md).
Caution: the kernel scratch rules below mirror kernels/lora_linear.py and kernels/linear_ce.py;
the CPU test fails when they drift apart.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..kernels.arch import arch
from ..kernels.gemm import interpreting
from ..kernels.linear_ce import _default_chunk_rows, _gemm_workspace_bytes
from ..kernels.lora_grad import _GRAD, _block_r
from .lora import TARGETS

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


class Rates(NamedTuple):
    """What this machine moves and computes per second (offload.measure_rates measures them)."""
    d2h: float  # pinned device -> host bytes/s (the forward's offloads)
    h2d: float  # pinned host -> device bytes/s (the backward's reloads)
    flops: float  # a layer-sized GEMM's FLOP/s


# An H100 SXM's measured rates (BENCHMARKS.md): the planner's prices when none are measured (CPU).
DEFAULT_RATES = Rates(d2h=50e9, h2d=50e9, flops=600e12)


class PlanError(ValueError):
    pass


class Row(NamedTuple):
    name: str
    shape: str  # in the legend's symbols; "R*" = one (N, R) per LoRA projection
    dtype: str  # "act" or "fp32"
    when: str = "always"  # "always" | "qk_norm" | "lora" | "moe"


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
    Row("gate", "N,F", "act"),
    Row("up", "N,F", "act"),
    Row("moe", "N", "act", "moe"),  # 0 bytes in a dense model; MoE layers are not priced (see above)
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
BACKWARD_MOMENTS = (
    ("down", ("dact",), (), "dx", ("down",)),
    ("down dA", ("dact",), ("down",), "dA", ("down",)),
    ("gate", ("dn2",), (), "dx", ("gate",)),
    ("up", ("dn2",), ("gate",), "dx", ("up",)),
    ("gate/up dA", ("dn2",), ("gate", "up"), "dA", ("gate", "up")),
    ("o", ("do",), (), "all", ("o",)),
    ("attention", ("do", "dq", "dk", "dv", "delta"), (), "", ()),
    ("qk-norm", ("dq", "dk", "dv", "dq_pre", "dk_pre"), (), "", ()),
    ("q", ("dq", "dk", "dv", "dn1"), (), "dx", ("q",)),  # dq, dk: dq_pre, dk_pre with QK-norm
    ("k", ("dq", "dk", "dv", "dn1"), ("q",), "dx", ("k",)),
    ("v", ("dq", "dk", "dv", "dn1"), ("q", "k"), "dx", ("v",)),
    ("q/k/v dA", ("dn1",), ("q", "k", "v"), "dA", ("q", "k", "v")),
)


def _sym(cfg, n_tokens, lora_rank, n_lora_targets):
    return {"N": n_tokens, "C": cfg.hidden, "H": cfg.n_heads, "KVH": cfg.n_kv_heads, "D": cfg.head_dim,
            "F": cfg.intermediate, "R*": lora_rank * n_lora_targets}


def row_bytes(row, cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0):
    """Bytes one layer spends on one row of a table."""
    if row.when == "qk_norm" and not cfg.qk_norm:
        return 0
    if row.when == "lora" and not n_lora_targets:
        return 0
    if row.when == "moe":
        return 0
    sym = _sym(cfg, n_tokens, lora_rank, n_lora_targets)
    numel = 1
    for dim in row.shape.split(","):
        size = 1
        for factor in dim.split("*") if dim != "R*" else ["R*"]:
            size *= sym[factor]
        numel *= size
    return numel * (4 if row.dtype == "fp32" else act_bytes)


def layer_bytes(cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0):
    """What one layer's saved activations take on the GPU when it keeps every row."""
    return sum(row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, n_lora_targets) for r in PLAN)


def mode_bytes(cfg, n_tokens, act_bytes, policy, lora_rank=0, n_lora_targets=0):
    """mode -> bytes of one layer's rows whose policy in that mode is `policy` (keep: what a finished
    layer holds on the GPU; offload: what it sends to the host)."""
    rows = [(r.name, row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, n_lora_targets)) for r in PLAN]
    return {m: sum(b for name, b in rows if mode_policy(m, name) == policy) for m in MODES}


def _proj_dims(cfg, t):
    """(in, out) of LoRA target projection t."""
    C, F, Oq, Okv = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim
    return {"q": (C, Oq), "k": (C, Okv), "v": (C, Okv), "o": (Oq, C), "gate": (C, F), "up": (C, F),
            "down": (F, C)}[t]


def lora_state_bytes(cfg, lora_rank, lora_targets, act_bytes, optimizer=True):
    """The LoRA flat buffers (runtime/lora.py: params fp32, grads fp32, the compute copy unless
    fp32) and AdamW's moments m, v fp32 (runtime/optim.py)."""
    P = cfg.n_layers * sum(lora_rank * sum(_proj_dims(cfg, t)) for t in lora_targets)
    per = 4 + 4 + (act_bytes if act_bytes != 4 else 0) + (8 if optimizer else 0)
    return P * per


def _cdiv(a, b):
    return -(-a // b)


def _lora_partials(N, P, R):
    """lora_grad._lora_grad's (S, P*R) fp32 partial sums."""
    BP, BT = (32, 32) if interpreting() else _GRAD[:2]
    chunk = BT * _cdiv(_cdiv(N, _cdiv(2 * arch().sms, _cdiv(P, BP))), BT)  # the current GPU's SMs, as the kernel
    return _cdiv(N, chunk) * P * R * 4


def lora_bwd_scratch(N, K, O, R, act_bytes, part="all"):
    """What the LoRA backward of one (K -> O) projection allocates: part "all", lora_linear_bwd
    whole (zero-padded A, B copies when R is not its padded rank RP, dy B (N, RP), then the da
    and db partials one after the other); "dx", with da deferred (the caller's dy B, the padded
    copies, the db partials); "dA", lora_linear_bwd_da's da partials; "dyb", the dy B alone."""
    if N == 0:
        return 0
    RP = _block_r(R)
    pad = (RP * K + O * RP) * act_bytes if RP != R else 0
    dyb = N * RP * act_bytes
    return {"all": pad + dyb + max(_lora_partials(N, K, RP), _lora_partials(N, O, R)),
            "dx": dyb + pad + _lora_partials(N, O, R), "dA": _lora_partials(N, K, RP), "dyb": dyb}[part]


def linear_ce_scratch(N, V, C, act_bytes):
    """linear_ce_fwd_bwd's logits chunk (rows, V), per-row losses (N,) fp32 and the largest split-K
    workspace of its GEMMs (gemm.py: 16-bit on Hopper; assumed on any GPU, 0 under the interpreter)."""
    rows = max(1, min(_default_chunk_rows(N, V, C, act_bytes, interpreting()), N))
    return rows * V * act_bytes + N * 4 + _gemm_workspace_bytes(N, V, C, act_bytes, rows)


def constant_bytes(cfg, n_tokens):
    """The batch descriptor (at most 4N + 1 int32: ids, positions, targets, cu_seqlens) and the
    RoPE tables (cos, sin (N, D/2) fp32; the model's inverse frequencies (D/2,) fp32)."""
    N, half = n_tokens, cfg.head_dim // 2
    return (4 * N + 1) * 4 + 2 * N * half * 4 + half * 4


class Memory(NamedTuple):
    """Predicted device bytes, by part; peak = their sum."""
    weights: int  # frozen model tensors
    lora: int  # LoRA params, grads, compute copy, AdamW moments
    constants: int  # batch descriptor, RoPE tables
    reload: int  # the offload scheduler's two (N, C) reload buffers (and two (N, F) with offload_up)
    activations: int  # the step's own high-water mark above all of the above

    @property
    def peak(self):
        return sum(self)


def forward_events(cfg, lora_targets, keep=None, first=False, rebuild=False, up_given=False):
    """dense.layer_forward's allocations ("+", row) and releases ("-", row), in its order. keep:
    its keep argument (None: every Saved row); first: layer 0 (x is the input, not allocated);
    rebuild: the backward's rebuild (x given, xa written in place, no act or m); up_given: up is
    the reloaded one. Rows: PLAN's names (q_pre/k_pre are the first q/k with QK-norm), "xa:t" per
    LoRA projection t, and n1, a, n2, act, m."""
    drop = (lambda *names: [("-", n) for n in names if n not in keep]) if keep is not None else (lambda *n: [])
    xa = (lambda *ts: [("+", "xa:" + t) for t in ts if t in lora_targets and not rebuild])
    q, k = ("q_pre", "k_pre") if cfg.qk_norm else ("q", "k")
    ev = [("+", "n1"), ("+", "rstd1")] + ([] if first or rebuild else [("+", "x")])
    ev += [("+", q), ("+", k), ("+", "v")] + xa("q", "k", "v") + [("-", "n1")]
    if cfg.qk_norm:
        ev += [("+", "q"), ("+", "k"), ("+", "rstd_q"), ("+", "rstd_k")] + drop("q_pre", "k_pre", "rstd_q", "rstd_k")
    ev += [("+", "o"), ("+", "lse")] + drop("q", "k", "v") + [("+", "a")] + xa("o") + drop("o", "lse")
    ev += [("+", "mid"), ("+", "n2"), ("+", "rstd2"), ("-", "a"), ("+", "gate")] + xa("gate")
    ev += ([] if up_given else [("+", "up")] + xa("up")) + [("-", "n2")]
    if not rebuild:
        ev += ([("+", "act")] if keep is None else drop("up")) + [("+", "m")] + xa("down")  # else act = gate
    return ev


def walk(cfg, modes, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout=0.0):
    """The step's activation bytes moment by moment, as step.py and dense.py allocate and free
    them; returns (high-water bytes, the moment it happens). Without LoRA dropout the waiting dA of
    projections sharing an input run as one kernel (dense.proj_bwd_da): their partials coexist."""
    N, C, V = n_tokens, cfg.hidden, cfg.vocab
    nt = len(lora_targets)
    rb = lambda r: row_bytes(r, cfg, N, act_bytes, lora_rank, nt)  # noqa: E731
    grads = {r.name: rb(r) for r in GRADS}
    rows = {r.name: rb(r) for r in PLAN + FORWARD_EXTRA}
    xb, xab = rows["x"], rows["xa"]  # xb: one (N, C) activation
    rows.update({"n1": xb, "n2": xb, "a": xb}, **{"xa:" + t: xab // max(nt, 1) for t in lora_targets})
    full = layer_bytes(cfg, N, act_bytes, lora_rank, nt)
    holds = mode_bytes(cfg, N, act_bytes, KEEP, lora_rank, nt)  # a finished layer, on the GPU
    sent = mode_bytes(cfg, N, act_bytes, OFFLOAD, lora_rank, nt)  # its rows on the host (and in flight)
    scratch = {t: {part: lora_bwd_scratch(N, *_proj_dims(cfg, t), lora_rank, act_bytes, part)
                   for part in ("all", "dx", "dA", "dyb")} for t in lora_targets}
    best = [0, "nothing allocated"]

    def at(moment, live):
        if live > best[0]:
            best[:] = [live, moment]

    def run(moment, live, events):
        for sign, name in events:
            live += rows[name] if sign == "+" else -rows[name]
            at(moment, live)

    held = 0  # bytes the finished layers hold
    for li, mode in enumerate(modes):
        prev = modes[li - 1] if li else None
        inputs = xb if li == 0 else xb + (0 if prev == KEEP else xb)  # s (layer 0: x), d, and s = mid unless kept
        pending = sent[prev] if li else 0  # the previous layer's offloaded rows, until their copy is retired
        run(f"forward of layer {li}", held + pending + inputs,
            forward_events(cfg, lora_targets, KEPT_ROWS[mode], first=li == 0))
        held += holds[mode]
    last = modes[-1]
    final = 2 * xb + N * 4  # x_final, nf, rstd
    s_d = xb + (0 if last == KEEP else xb)
    at("final norm", held + sent[last] + s_d + final)
    loss = 2 * 4
    ce = linear_ce_scratch(N, V, C, act_bytes) + 4  # + the (1,) fp32 grad_scale it makes from a number
    at("lm_head + loss", held + final + loss + xb + ce)  # + dnf
    at("final norm backward", held + final + loss + 2 * xb)  # + dnf, g
    base = loss + xb  # g, through the layers' backward (nf, dnf, x_final, rstd are freed)
    for li in reversed(range(len(modes))):
        mode = modes[li]
        held -= holds[mode]
        cur = full - sent[mode]  # offloaded rows live in the reload buffers
        if mode != KEEP:  # the rebuild, from x and xa (kept, or x in a reload buffer)
            run(f"recompute of layer {li}", held + base + xab + (xb if mode == RECOMPUTE else 0),
                forward_events(cfg, lora_targets, rebuild=True, up_given=mode == OFFLOAD_UP))
        for name, live, waiting, runs, projs in BACKWARD_MOMENTS:
            extra = sum(scratch[t]["dyb"] for t in waiting if t in scratch)
            sizes = [scratch[t][runs] for t in projs if t in scratch]
            extra += sum(sizes) if runs == "dA" and lora_dropout == 0.0 else max(sizes, default=0)
            at(f"backward of layer {li} ({name})", held + base + cur + sum(grads[g] for g in live) + extra)
    return best[0], best[1]


def layer_flops(cfg, n_tokens):
    """GEMM FLOPs of one layer's forward: (q, k, v and o together, gate, up, down)."""
    N, C, F = n_tokens, cfg.hidden, cfg.intermediate
    return 2 * N * C * 2 * (cfg.q_dim + cfg.kv_dim), 2 * N * C * F, 2 * N * C * F, 2 * N * F * C


# A layer's forward over its GEMMs' time alone (attention, norms, RoPE, the LoRA pre-passes): the
# compute a copy hides under. Measured on the H100 (bench_offload, keep rows, 8192 tokens packed):
# Qwen3-8B 6.7 ms a layer against 4.1 ms of GEMMs (1.63), Llama-3.2-3B 4.0 against 2.25 (1.78).
LAYER_OVER_GEMM = 1.6


def plan_cost(cfg, modes, n_tokens, act_bytes, rates):
    """Predicted seconds a plan adds to an all-keep step: the rebuilds' GEMMs, and every copy's
    excess over the compute it hides under (an offload under the next layer's forward, a reload
    under the backward of the layer above), a layer's compute being LAYER_OVER_GEMM times its
    GEMMs'. A rebuild is priced by its GEMMs alone (what differs between the modes)."""
    attn, gate, up, down = layer_flops(cfg, n_tokens)
    fwd = LAYER_OVER_GEMM * (attn + gate + up + down) / rates.flops  # a layer's forward; its backward's dx alike
    rebuild = {KEEP: 0.0, RECOMPUTE: (attn + gate + up) / rates.flops, OFFLOAD: (attn + gate + up) / rates.flops,
               OFFLOAD_UP: (attn + gate) / rates.flops}
    sent = mode_bytes(cfg, n_tokens, act_bytes, OFFLOAD)  # x and up: the LoRA rank plays no part
    cost = 0.0
    for li, mode in enumerate(modes):
        cost += rebuild[mode]
        if sent[mode]:
            above = modes[li + 1] if li + 1 < len(modes) else KEEP
            cost += max(0.0, sent[mode] / rates.d2h - fwd)
            cost += max(0.0, sent[mode] / rates.h2d - (fwd + rebuild[above]))
    return cost


@dataclass(frozen=True, eq=False)
class Plan:
    """Per-layer modes for steps of up to n_tokens tokens, and the predicted memory."""
    cfg: object  # ModelConfig
    n_tokens: int  # the most tokens a batch may hold (the buffers are sized for it)
    act_bytes: int
    lora_rank: int
    lora_targets: tuple
    modes: tuple  # per layer: KEEP | RECOMPUTE | OFFLOAD
    memory: Memory
    peak_at: str  # the moment of the predicted peak
    budget_bytes: Optional[int] = None
    cost: float = 0.0  # predicted seconds over an all-keep step (plan_cost)
    rates: Rates = DEFAULT_RATES  # what the cost was priced with
    embed_host: bool = False  # the (untied) embedding table lives in pinned host memory

    def policy(self, li, name):
        """keep / offload / recompute of saved row `name` in layer li."""
        return mode_policy(self.modes[li], name)

    @property
    def offloaded(self):
        """Layers whose input goes to the host."""
        return tuple(li for li, m in enumerate(self.modes) if m in OFFLOADED)

    def _bytes(self, policy):
        per = mode_bytes(self.cfg, self.n_tokens, self.act_bytes, policy, self.lora_rank, len(self.lora_targets))
        return sum(per[m] for m in self.modes)

    @property
    def kept_bytes(self):
        """Device bytes the layers hold at the end of the forward: rows whose policy is keep."""
        return self._bytes(KEEP)

    @property
    def host_bytes(self):
        """Pinned host bytes: a slot per offloaded row of every layer."""
        return self._bytes(OFFLOAD)


def embed_gather_cost(cfg, n_tokens, act_bytes, rates):
    """Seconds a step's embedding gather takes from a table in pinned host memory: its N rows over
    the link (it runs before layer 0, under no compute)."""
    return n_tokens * cfg.hidden * act_bytes / rates.h2d


def make_plan(cfg, n_tokens, modes, *, lora_rank, lora_targets=TARGETS, act_bytes=2, weights_bytes=0,
              optimizer=True, budget_bytes=None, rates=DEFAULT_RATES, embed_host=False, lora_dropout=0.0):
    """The plan with these per-layer modes, its predicted memory and cost. weights_bytes: the frozen
    tensors on the GPU (without the embedding table when embed_host)."""
    modes = tuple(modes)
    if len(modes) != cfg.n_layers or not set(modes) <= set(MODES):
        raise PlanError(f"modes: expected {cfg.n_layers} of {', '.join(MODES)}, got {modes!r}")
    if n_tokens < 1:
        raise PlanError(f"n_tokens={n_tokens}: a step needs at least one token")
    lora_targets = tuple(lora_targets) if lora_rank else ()
    act, where = walk(cfg, modes, n_tokens, act_bytes, lora_rank, lora_targets, lora_dropout)
    reload = (2 * n_tokens * cfg.hidden * act_bytes if any(m in OFFLOADED for m in modes) else 0) + (
        2 * n_tokens * cfg.intermediate * act_bytes if OFFLOAD_UP in modes else 0)
    mem = Memory(weights_bytes, lora_state_bytes(cfg, lora_rank, lora_targets, act_bytes, optimizer),
                 constant_bytes(cfg, n_tokens), reload, act)
    cost = plan_cost(cfg, modes, n_tokens, act_bytes, rates)
    if embed_host:
        cost += embed_gather_cost(cfg, n_tokens, act_bytes, rates)
    return Plan(cfg, n_tokens, act_bytes, lora_rank, lora_targets, modes, mem, where, budget_bytes, cost, rates,
                bool(embed_host))
