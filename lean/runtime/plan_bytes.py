"""What a step allocates besides the tensors its layers save: the bytes plan.py adds to its walk.

    the LoRA flat buffers and AdamW's moments (lora_state_bytes; on the host: runtime/host_state.py)
    the batch descriptor, RoPE tables and an MoE model's per-step buffers (constant_bytes)
    the kernels' scratch, each sized as its launcher sizes it (the LoRA backward's partials, the
        fused linear + CE's logits chunk and split-K workspace, the MoE kernels', an NF4 weight
        dequantised for one GEMM)
    the lm_head's chunk buffers when it streams from the host, sharded weights' gather buffers

Sizes only: nothing here allocates. The formulas ask the kernels' config choosers where those decide
a size and mirror the launchers otherwise; tests/test_offload.py compares the walk, these sizes
included, with the bytes a step really allocates, and fails when the two drift apart.
Shape legend as plan.py's: N tokens, C hidden, V vocab, E experts, P = N*K slots, R LoRA rank.
"""
from ..kernels.adamw import adamw_partials
from ..kernels.arch import arch
from ..kernels.gemm import interpreting
from ..kernels.gemm_splitk import splitk_workspace_bytes
from ..kernels.gmm_wgrad import wgrad_scratch
from ..kernels.linear_ce import _default_chunk_rows, _gemm_workspace_bytes
from ..kernels.lora_grad import _GRAD, _block_r
from ..kernels.moe_group import _group_config
from ..kernels.moe_route import _rows_config as _route_rows_config
from .lora import EXPERT_TARGETS, _target_shape, layer_targets


def _proj_dims(cfg, t):
    """(in, out) of LoRA target projection t."""
    C, F, Oq, Okv = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim
    return {"q": (C, Oq), "k": (C, Okv), "v": (C, Okv), "o": (Oq, C), "gate": (C, F), "up": (C, F),
            "down": (F, C)}[t]


def nf4_scratch_bytes(cfg, n_tokens, act_bytes):
    """An NF4 model's projection dequantised for one GEMM (kernels/lora_linear._nf4_scratch), on the
    shapes kernels/nf4.nf4_fused sends through a scratch copy: the largest such (O, K) of the
    projections held in NF4 (models/weights.nf4_projections: an MoE layer's q, k, v, o only),
    counted at every moment of the step (a bound: it lives for one GEMM, at the projections' moments)."""
    if cfg.weight_quant != "nf4":
        return 0
    from ..kernels.nf4 import nf4_fused
    from ..models.weights import nf4_projections

    shapes = {s for li in range(cfg.n_layers) for _, _, s in nf4_projections(cfg, li)}  # (O, K)
    return max((O * K for O, K in shapes if not nf4_fused(n_tokens, K, O)), default=0) * act_bytes


def lora_numels(cfg, lora_rank, lora_targets):
    """Per layer, its LoRA parameters (lora.py's layout): the adapters lora.layer_targets gives it."""
    def numel(t):
        if t not in EXPERT_TARGETS:
            return lora_rank * sum(_proj_dims(cfg, t))
        return cfg.n_experts * lora_rank * (2 if t == "gate_up" and not cfg.expert_bias else 1) * sum(_target_shape(cfg, t))

    return [sum(numel(t) for t in layer_targets(cfg, li, tuple(lora_targets))) for li in range(cfg.n_layers)]


def lora_state_bytes(cfg, lora_rank, lora_targets, act_bytes, optimizer=True, host_state=False):
    """The LoRA flat buffers (runtime/lora.py: params fp32, grads fp32, the compute copy unless
    fp32) and AdamW's moments m, v fp32 (runtime/optim.py). Each layer holds the adapters
    lora.layer_targets gives it (an MoE layer's experts: A (E, R, in) and B (E, out, R), R = 2r
    for Qwen3-MoE's gate_up, r for GPT-OSS's). host_state (runtime/host_state.py): the GPU holds
    the compute copy (also in fp32), the ring's two slots of the largest layer's share and the
    norm's partials; the rest is pinned host memory."""
    per_layer = lora_numels(cfg, lora_rank, lora_targets)
    P = sum(per_layer)
    if host_state:
        return P * act_bytes + 2 * max(max(per_layer), 1) * 4 + 4 * max(sum(adamw_partials(n, P) for n in per_layer), 1)
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
            "dx": dyb + pad + _lora_partials(N, O, R), "dA": _lora_partials(N, K, RP), "dyb": dyb,
            "dx_nodb": dyb + pad}[part]


def linear_ce_scratch(N, V, C, act_bytes, rows=None):
    """linear_ce_fwd_bwd's logits chunk (rows, V), per-row losses (N,) fp32 and the largest split-K
    workspace of its GEMMs (gemm.py: 16-bit on Hopper; assumed on any GPU, 0 under the interpreter).
    rows: the chunk rows the step passes (Plan.loss_rows), None: linear_ce's default."""
    rows = max(1, min(rows or _default_chunk_rows(N, V, C, act_bytes, interpreting()), N))
    return rows * V * act_bytes + N * 4 + _gemm_workspace_bytes(N, V, C, act_bytes, rows)



def head_host_bytes(cfg, act_bytes, world=1):
    """The lm_head's two chunk buffers on the GPU when it lives on the host (head_host.HostHead) or
    in the ranks' shards (world > 1: shard.ShardHead, its chunks a multiple of world rows)."""
    from .head_host import chunk_rows
    return 2 * chunk_rows(cfg.vocab, cfg.hidden, act_bytes, world) * cfg.hidden * act_bytes


def head_host_scratch(N, V, C, act_bytes):
    """linear_ce_vchunk's allocations with the head on the host: the (N, Vc) logits chunk, m, s, x_t
    and the row losses (N,) fp32, dh's fp32 accumulator (N, C) unless fp32, and the largest split-K
    workspace of its chunk GEMMs (logits (N, Vc) over C, dh (N, C) over Vc)."""
    from .head_host import chunk_rows
    Vc = chunk_rows(V, C, act_bytes)
    ws = max(splitk_workspace_bytes(N, Vc, C, act_bytes), splitk_workspace_bytes(N, C, Vc, act_bytes))
    return N * Vc * act_bytes + 4 * N * 4 + (N * C * 4 if act_bytes != 4 else 0) + ws



def moe_step_bytes(cfg):
    """An MoE model's per-step buffers (step.moe_step): counts (E,) fp32, and with the aux loss on
    prob_sum, aux_grad (E,) fp32 and aux (1,) fp32. Each step makes them anew and model.cache
    holds them until the next one replaces them: persistent state, like the constants."""
    if not cfg.moe_layers:
        return 0
    return 4 * cfg.n_experts + (4 * (2 * cfg.n_experts + 1) if cfg.aux_loss_coef > 0 else 0)


def constant_bytes(cfg, n_tokens):
    """The batch descriptor (at most 4N + 1 int32: ids, positions, targets, cu_seqlens), the
    RoPE tables (cos, sin (N, D/2) fp32; the model's inverse frequencies (D/2,) fp32) and an MoE
    model's per-step buffers (moe_step_bytes)."""
    N, half = n_tokens, cfg.head_dim // 2
    return (4 * N + 1) * 4 + 2 * N * half * 4 + half * 4 + moe_step_bytes(cfg)


def moe_scratch(cfg, n_tokens, act_bytes, lora_rank=0):
    """The scratch the MoE kernels allocate per call (moe.py's launches): group_slots' (blocks, E)
    int32, route_topk_fwd's (programs, E) fp32 prob_sum partials (aux loss on), and the router
    GEMMs' split-K workspaces, logits (N, E) over C and dn2 (N, C) over E."""
    N, E, C = n_tokens, cfg.n_experts, cfg.hidden
    P = N * cfg.top_k
    hist = max(1, _cdiv(P, _group_config(P, E)[0])) * E * 4
    blocks = _cdiv(N, _route_rows_config(N, E)[0])
    part = min(blocks, 2 if interpreting() else 16 * arch().sms) * E * 4 if N else 0
    R, Fe = lora_rank, cfg.moe_intermediate
    Rgu = lora_rank * (1 if cfg.expert_bias else 2)
    wg = {"wg_d_db": (C, R), "wg_d_da": (R, Fe), "wg_gu_db": (2 * Fe, Rgu), "wg_gu_da": (Rgu, C)}  # dw[e]'s (M, Kd)
    return {"hist": hist, "route_part": part, "ws_fwd": splitk_workspace_bytes(N, E, C, act_bytes),
            "ws_bwd": splitk_workspace_bytes(N, C, E, act_bytes),
            **{k: wgrad_scratch(E, M, Kd) for k, (M, Kd) in wg.items()}}



def layer_weight_bytes(cfg, li, act_bytes, world=1):
    """Bytes of decoder layer li's frozen buffers (weights.Layer: buf in the act dtype, qbuf), each
    padded to `world` equal parts as sharded weights gather them (runtime/shard.py)."""
    import torch

    from ..models.weights import Layer

    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[act_bytes]
    layer = Layer(cfg, dtype, "meta", li)  # sizes only: nothing is allocated
    pad = lambda n: -(-n // world) * world  # noqa: E731
    return pad(layer.buf.numel()) * act_bytes + pad(layer.qbuf.numel())


def gather_buffer_bytes(cfg, act_bytes, world):
    """offload.Gather's rotating full layers: two of each kind of layer (one where a kind has one
    layer); 0 for whole weights (world 1)."""
    if world <= 1:
        return 0
    kinds = {}
    for li in range(cfg.n_layers):
        kinds.setdefault(cfg.is_moe(li), []).append(layer_weight_bytes(cfg, li, act_bytes, world))
    return sum(min(len(sizes), 2) * max(sizes) for sizes in kinds.values())
