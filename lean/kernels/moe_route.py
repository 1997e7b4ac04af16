"""MoE router: top-K expert choice on the device, its backward, and the load-balancing aux loss.

Shape legend: N tokens in the packed batch, E experts (<= 256), K experts per token (1 <= K <= E),
L MoE layers (for the aux loss).

    logits   : (N, E) fp32 / fp16 / bf16, unit last stride (the router GEMM's output)
    weights  : (N, K) routing weights in the model dtype, contiguous     experts: (N, K) int32, contiguous
    dweights : (N, K) fp32, contiguous (dL/dweights)                      dlogits: (N, E) any float dtype
    prob_sum, aux_grad, counts : (E,) fp32, contiguous                    aux: (1,) fp32

Forward, softmax_first=True (Qwen3-MoE, HF transformers 5 Qwen3MoeTopKRouter):
    probs   = softmax(fp32(logits))                 over E, max-subtracted, exp / sum
    top     = the K largest probs, in descending order; ties -> the lower expert id (torch.topk's
              order on distinct values; the stable order on equal ones)
    weights = round(top / sum(top)) if norm_topk else round(top)
Forward, softmax_first=False (GPT-OSS): top-K of the fp32 logits (same order), then
    weights = round(softmax over the K chosen logits); norm_topk is ignored.
Either way prob_sum += sum over tokens of probs (the full softmax): per-program partials into a
(programs, E) fp32 scratch, then one pass over E columns sums them in a fixed order, so the
result is the same bits run to run (on one GPU kind and config).

Backward (probs recomputed from logits; the cast to the weights' dtype is identity):
    softmax_first: dsel = dweights scattered to the chosen columns; with norm_topk (w = p / S,
      S = sum of the chosen p): dp_j = (dsel_j - sum_i dsel_i w_i) / S on chosen columns, else
      dp = dsel; dp[e] += aux_grad[e] for every token (the aux loss); dlogits = p * (dp - <dp, p>)
    not softmax_first: q = softmax of the chosen logits; dlogits = q * (dsel - <dsel, q>) on the
      chosen columns, 0 elsewhere; plus p * (aux_grad - <aux_grad, p>) when aux_grad is given.
Saved for backward: logits and experts (the caller keeps them); nothing else.

Aux loss (HF load_balancing_loss_func over L layers, rows = L * N, counts the slot counts
group_slots accumulates, prob_sum as above, both summed over the L layers):
    aux      = E * sum_e (counts_e / rows) * (prob_sum_e / rows)
    aux_grad = scale * E * counts_e / rows / rows     (d(scale * aux) / d probs[n, e], any layer)

Supported: 1 <= E <= 256, 1 <= K <= E, N >= 0 (N < 2^31 / E). A row of E logits is one block;
shared memory holds only the reductions' scratch (a few KiB), so one config serves every tier.
Tested: tests/test_moe_route.py: fp32 and fp16 through the interpreter (N 1, 7, 33; E 4, 8, 12,
128; K 1, 2, 4, E), both softmax orders, norm_topk on/off, ties, prob_sum bitwise determinism,
parity with transformers' Qwen3MoeTopKRouter and load_balancing_loss_func (value and gradient);
bf16 and N = 65536, E = 256 on GPU.

Caution:
  - probs come from Triton's exp, not torch's: they agree to an ulp or so, so the chosen experts
    equal HF's except where two probabilities are within an ulp of each other.
  - HF's load_balancing_loss_func takes softmax in the logits' dtype (bf16 in a bf16 model) and
    chooses top-K again on those rounded probs; prob_sum here sums fp32 probs and the counts
    follow the routing's own choice (closer to the fp32 math; differs from HF in bf16 by rounding).
  - NaN logits give undefined expert ids (possibly >= E): group_slots must not see them.
  - route_topk_fwd with prob_sum allocates a (programs, E) fp32 scratch (<= 16 * SMs rows) per call.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_E = 256


@triton.jit
def _softmax_rows(logits_ptr, stride_l, rows, cols, N, E):
    """(x, probs, mask): the (BLOCK_N, BLOCK_E) fp32 logits (-inf outside), their softmax (0 outside)."""
    mask = (rows < N)[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(rows < N, m, 0.0)                # padding rows: no -inf - -inf
    ex = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
    s = tl.sum(ex, axis=1)
    s = tl.where(rows < N, s, 1.0)
    return x, ex / s[:, None], mask


@triton.jit
def _route_fwd_kernel(
    w_ptr, e_ptr, part_ptr,                       # outputs: (N, K), (N, K) int32; (programs, E) fp32 if PROB_SUM
    logits_ptr, stride_l,                         # input: (N, E), row stride
    N, E, K,
    NORM_TOPK: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, PROB_SUM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_E)
    psum = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for blk in range(pid, tl.cdiv(N, BLOCK_N), nprog):  # programs loop over row blocks
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        x, probs, mask = _softmax_rows(logits_ptr, stride_l, rows, cols, N, E)
        if PROB_SUM:
            psum += tl.sum(probs, axis=0)
        score = probs if SOFTMAX_FIRST else x
        # K rounds of (row max, its lowest column): each chosen column notes its round i in rank,
        # and the weights are made and stored from the (BLOCK_N, BLOCK_E) tile itself (no (N, K)
        # tile: K may be E).
        taken = ~mask                             # padding columns (and rows) are never chosen
        rank = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.int32)
        for i in range(K):
            cand = tl.where(taken, float("-inf"), score)
            v = tl.max(cand, axis=1)
            hit = (cand == v[:, None]) & ~taken
            idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
            now = cols[None, :] == idx[:, None]
            taken = taken | now
            rank = tl.where(now, i, rank)
        sel = taken & mask
        if SOFTMAX_FIRST:
            w = probs
            if NORM_TOPK:
                w = probs / tl.where(rows < N, tl.sum(tl.where(sel, probs, 0.0), axis=1), 1.0)[:, None]
        else:                                     # softmax over the K chosen logits
            xs = tl.where(sel, x, float("-inf"))
            ex = tl.where(sel, tl.exp(xs - tl.where(rows < N, tl.max(xs, axis=1), 0.0)[:, None]), 0.0)
            w = ex / tl.where(rows < N, tl.sum(ex, axis=1), 1.0)[:, None]
        offs = rows.to(tl.int64)[:, None] * K + rank  # slot (n, i) of each chosen column
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=sel)
        tl.store(e_ptr + offs, cols[None, :] + tl.zeros_like(rank), mask=sel)
    if PROB_SUM:
        tl.store(part_ptr + pid * E + cols, psum, mask=cols < E)


@triton.jit
def _colsum_kernel(
    out_ptr,                                      # output: (E,) fp32, += column sums
    part_ptr,                                     # input: (B, E) fp32 partials
    B, E,
    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_B, BLOCK_E), dtype=tl.float32)
    for b0 in range(0, B, BLOCK_B):               # a fixed order: the same bits every run
        rb = b0 + tl.arange(0, BLOCK_B)
        acc += tl.load(part_ptr + rb[:, None] * E + cols[None, :], mask=(rb < B)[:, None] & (cols < E)[None, :],
                       other=0.0)
    total = tl.sum(acc, axis=0)
    old = tl.load(out_ptr + cols, mask=cols < E, other=0.0)
    tl.store(out_ptr + cols, old + total, mask=cols < E)


@triton.jit
def _route_bwd_kernel(
    dl_ptr,                                       # output: (N, E) dlogits
    dw_ptr,                                       # incoming gradient: (N, K) fp32
    logits_ptr, e_ptr, aux_ptr,                   # inputs: (N, E), (N, K) int32, (E,) fp32 if AUX
    stride_dl, stride_l,
    N, E, K,
    NORM_TOPK: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, AUX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    x, probs, mask = _softmax_rows(logits_ptr, stride_l, rows, cols, N, E)
    dsel = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
    sel = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.int1)
    r64 = rows.to(tl.int64)
    for i in range(K):                            # scatter dweights to the chosen columns
        ei = tl.load(e_ptr + r64 * K + i, mask=rows < N, other=-1)
        dwi = tl.load(dw_ptr + r64 * K + i, mask=rows < N, other=0.0)
        hit = cols[None, :] == ei[:, None]
        dsel = tl.where(hit, dwi[:, None], dsel)
        sel = sel | hit
    if AUX:
        aux = tl.load(aux_ptr + cols, mask=cols < E, other=0.0)
    if SOFTMAX_FIRST:
        dp = dsel
        if NORM_TOPK:                             # w = p / S: dp_j = (dw_j - sum_i dw_i w_i) / S
            S = tl.sum(tl.where(sel, probs, 0.0), axis=1)
            S = tl.where(rows < N, S, 1.0)
            T = tl.sum(dsel * probs, axis=1) / S
            dp = tl.where(sel, (dsel - T[:, None]) / S[:, None], 0.0)
        if AUX:
            dp += aux[None, :]
        dl = probs * (dp - tl.sum(dp * probs, axis=1)[:, None])
    else:                                         # softmax over the chosen logits only
        xs = tl.where(sel, x, float("-inf"))
        mq = tl.where(rows < N, tl.max(xs, axis=1), 0.0)
        eq = tl.where(sel, tl.exp(xs - mq[:, None]), 0.0)
        q = eq / tl.where(rows < N, tl.sum(eq, axis=1), 1.0)[:, None]
        dl = q * (dsel - tl.sum(dsel * q, axis=1)[:, None])
        if AUX:
            dl += probs * (aux[None, :] - tl.sum(aux[None, :] * probs, axis=1)[:, None])
    tl.store(dl_ptr + r64[:, None] * stride_dl + cols[None, :], dl.to(dl_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_aux_kernel(
    aux_ptr, aux_grad_ptr, loss_ptr,              # outputs: (1,) fp32, (E,) fp32, (2,) fp32 if LOSS (+=)
    counts_ptr, prob_sum_ptr, scale_ptr,          # inputs: (E,) fp32, (E,) fp32, (1,) fp32 if SCALE_PTR
    rows, scale, alpha, E,
    SCALE_PTR: tl.constexpr, LOSS: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    f = tl.load(counts_ptr + cols, mask=cols < E, other=0.0) / rows        # HF's tokens_per_expert
    p = tl.load(prob_sum_ptr + cols, mask=cols < E, other=0.0) / rows      # router_prob_per_expert
    aux = tl.sum(f * p, axis=0) * E
    tl.store(aux_ptr, aux)
    if LOSS:
        tl.store(loss_ptr, tl.load(loss_ptr) + alpha * aux)
    if SCALE_PTR:
        scale = tl.load(scale_ptr)
    tl.store(aux_grad_ptr + cols, alpha * scale * E * f / rows, mask=cols < E)


def _rows_config(N, E):
    """(BLOCK_N, BLOCK_E, num_warps): a row of E in one block, about one row per warp, so the
    K rounds of row max / min reduce within a warp. H100, bf16, route_topk_fwd without prob_sum:
    N = 65536, E = 128, K = 8: 2 rows / 2 warps 66-68 us, 4/4 66-69, 8/8 68-70, 16/4 85, 32/8 88;
    E = 256, K = 8: 2/2 128-131 us, 16/4 179; N = 4099, E = K = 256: 2/2 200 us, 16/4 337.
    Small E (8 rows / 2 warps and more) untuned; the backward takes the same tiles (untimed).
    The interpreter takes two row blocks up to N = 256 (it pays per program and per op)."""
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_N = max(2, 256 // BLOCK_E)
    if os.environ.get("TRITON_INTERPRET") == "1":
        BLOCK_N = max(1, min(128, triton.next_power_of_2(triton.cdiv(max(N, 1), 2))))
    return BLOCK_N, BLOCK_E, 2


def _check_ek(E, K):
    if not 1 <= E <= MAX_E:
        raise ValueError(f"logits: E = {E} experts, supported 1 <= E <= {MAX_E}")
    if not 1 <= K <= E:
        raise ValueError(f"weights: K = {K} experts per token, supported 1 <= K <= E = {E}")


def route_topk_fwd(weights, experts, logits, *, norm_topk, softmax_first=True, prob_sum=None):
    """weights (N, K) model dtype, experts (N, K) int32: each token's top-K experts (module
    docstring); prob_sum (E,) fp32, optional: += the column sums of the full softmax. Returns nothing."""
    check(logits, "logits", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, E = logits.shape
    dev = logits.device
    check(weights, "weights", shape=(N, None), dtype=_DTYPES, device=dev, contiguous=True)
    K = weights.shape[1]
    check(experts, "experts", shape=(N, K), dtype=torch.int32, device=dev, contiguous=True)
    if prob_sum is not None:
        check(prob_sum, "prob_sum", shape=(E,), dtype=torch.float32, device=dev, contiguous=True)
    _check_ek(E, K)
    if N == 0:
        return
    BLOCK_N, BLOCK_E, num_warps = _rows_config(N, E)
    blocks = triton.cdiv(N, BLOCK_N)
    # With prob_sum, programs loop over row blocks so the scratch stays <= 16 * SMs rows (at 4 per
    # SM and 16-row blocks the loop cost 115 us against 81 without prob_sum, H100, N = 65536,
    # E = 128; 16 per SM is untimed). The interpreter takes 2 programs: loop and partials both run.
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    progs = min(blocks, 2 if interp else 16 * arch(dev).sms) if prob_sum is not None else blocks
    part = torch.empty((progs, E), dtype=torch.float32, device=dev) if prob_sum is not None else weights  # (progs, E)
    _route_fwd_kernel[(progs,)](
        weights, experts, part,
        logits, logits.stride(0),
        N, E, K,
        NORM_TOPK=bool(norm_topk), SOFTMAX_FIRST=bool(softmax_first), PROB_SUM=prob_sum is not None,
        BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E, num_warps=num_warps,
    )
    if prob_sum is not None:
        BLOCK_EC = min(BLOCK_E, 64)
        _colsum_kernel[(triton.cdiv(E, BLOCK_EC),)](prob_sum, part, progs, E, BLOCK_B=32, BLOCK_E=BLOCK_EC,
                                                     num_warps=4)


def route_topk_bwd(dlogits, dweights, logits, experts, *, norm_topk, softmax_first=True, aux_grad=None):
    """dlogits (N, E) = the routing backward of dweights (N, K) fp32 [+ the aux loss through
    aux_grad (E,) fp32], probs recomputed from logits. Written (=), never accumulated. Returns nothing."""
    check(logits, "logits", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, E = logits.shape
    dev = logits.device
    check(dlogits, "dlogits", shape=(N, E), dtype=_DTYPES, device=dev, last_contiguous=True)
    check(dweights, "dweights", shape=(N, None), dtype=torch.float32, device=dev, contiguous=True)
    K = dweights.shape[1]
    check(experts, "experts", shape=(N, K), dtype=torch.int32, device=dev, contiguous=True)
    if aux_grad is not None:
        check(aux_grad, "aux_grad", shape=(E,), dtype=torch.float32, device=dev, contiguous=True)
    _check_ek(E, K)
    if N == 0:
        return
    BLOCK_N, BLOCK_E, num_warps = _rows_config(N, E)
    _route_bwd_kernel[(triton.cdiv(N, BLOCK_N),)](
        dlogits, dweights, logits, experts, aux_grad if aux_grad is not None else dweights,
        dlogits.stride(0), logits.stride(0),
        N, E, K,
        NORM_TOPK=bool(norm_topk), SOFTMAX_FIRST=bool(softmax_first), AUX=aux_grad is not None,
        BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E, num_warps=num_warps,
    )


def moe_aux(aux, aux_grad, counts, prob_sum, rows, scale, *, alpha=1.0, loss=None):
    """aux (1,) fp32 = HF's load-balancing loss from counts and prob_sum (E,) fp32 summed over the
    layers; aux_grad (E,) fp32 = d(alpha * scale * aux) / d probs. rows = L * N, a Python int; scale a
    Python float or a (1,) fp32 tensor (read on the device); alpha a Python float. loss (2,) fp32
    or None: loss[0] += alpha * aux (the step's loss sum, lean/runtime/step.py). Returns nothing."""
    check(counts, "counts", shape=(None,), dtype=torch.float32, contiguous=True)
    E, dev = counts.shape[0], counts.device
    check(aux, "aux", shape=(1,), dtype=torch.float32, device=dev)
    check(aux_grad, "aux_grad", shape=(E,), dtype=torch.float32, device=dev, contiguous=True)
    check(prob_sum, "prob_sum", shape=(E,), dtype=torch.float32, device=dev, contiguous=True)
    if isinstance(scale, torch.Tensor):
        check(scale, "scale", shape=(1,), dtype=torch.float32, device=dev)
    if not 1 <= E <= MAX_E:
        raise ValueError(f"counts: E = {E} experts, supported 1 <= E <= {MAX_E}")
    if int(rows) < 1:
        raise ValueError(f"rows = {rows}: expected the number of routed rows (L * N >= 1)")
    if loss is not None:
        check(loss, "loss", shape=(2,), dtype=torch.float32, device=dev)
    tensor_scale = isinstance(scale, torch.Tensor)
    _moe_aux_kernel[(1,)](
        aux, aux_grad, loss if loss is not None else aux, counts, prob_sum, scale if tensor_scale else aux,
        float(rows), 0.0 if tensor_scale else float(scale), float(alpha), E,
        SCALE_PTR=tensor_scale, LOSS=loss is not None, BLOCK_E=triton.next_power_of_2(E), num_warps=4,
    )
