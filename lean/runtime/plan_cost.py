"""What a plan costs in time: the rebuilds' GEMMs and the copies beyond the compute they hide under
(plan_cost), the sharded weights' gathers (gather_cost), an embedding table on the host
(embed_gather_cost), a streamed lm_head (head_host_cost), priced at a machine's Rates.
lean/runtime/plan.py adds them up for a plan; the planner (planner.py) compares them.
"""
from typing import NamedTuple

from .plan_bytes import layer_weight_bytes
from .plan_rows import KEEP, OFFLOAD, OFFLOAD_UP, RECOMPUTE, mode_bytes


class Rates(NamedTuple):
    """What this machine moves and computes per second (offload.measure_rates measures them; link: measure_link)."""
    d2h: float  # pinned device -> host bytes/s (the forward's offloads)
    h2d: float  # pinned host -> device bytes/s (the backward's reloads)
    flops: float  # a layer-sized GEMM's FLOP/s
    link: float = 100e9  # sharded weights: bytes/s a rank receives in an all-gather of a layer (N-1 parts of N)


# An H100 SXM's measured rates (BENCHMARKS.md): the planner's prices when none are measured (CPU).
# link: assumed (NCCL's all-gather over NVLink), not measured yet; measure_link measures it on the GPUs.
DEFAULT_RATES = Rates(d2h=50e9, h2d=50e9, flops=600e12, link=100e9)


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
