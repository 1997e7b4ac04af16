"""MoE slot grouping around the expert GEMMs: sort the slots by expert, combine the expert outputs
back into tokens, and the SwiGLU backward fused with the routing-weight gradient.

Shape legend: N tokens, E experts (<= 256), K experts per token, P = N * K slots (slot j = n*K + i
is token n's i-th choice), C hidden size, F expert MLP hidden size; p a sorted position.

group_slots: a stable counting sort of the P slots by expert id (experts (N, K) int32):
    offsets (E+1,) int32   offsets[e] = first sorted position of expert e, offsets[E] = P
    order   (P,) int32     order[p] = j, slots of one expert in increasing j
    slot_pos (P,) int32    slot_pos[j] = p (the inverse)
    counts  (E,) fp32      optional: += slots per expert (exact below 2^24 per expert)
  Three launches, no atomics, so the same bits every run: (1) each program histograms its
  BLOCK_P slots into a (blocks, E) int32 scratch; (2) one program sums the columns (offsets by an
  exclusive scan over E) and turns the scratch into each block's first position per expert
  (exclusive scan over blocks); (3) each program scatters its slots, in-block ranks from a cumsum
  over a one-hot (CHUNK, E) tile, carried from chunk to chunk.
moe_combine: out[n] (+)= sum_{i=0..K-1} w[n, i] * ys[slot_pos[n*K + i]], in fp32 in that order,
  one rounding (out read in fp32 first when accumulate); weights None: unweighted (dX in backward).
moe_act_bwd: over sorted rows p (j = order[p], h = [gate | up] (P, 2F), G (P, F) = dL/dact unweighted):
    a          = round(gate * sigmoid(gate) * up)          the bits swiglu_fwd writes
    dweights[j] = sum_f G * a                              fp32 (the routing-weight gradient)
    dact       = w[j] * G                                  fp32, not rounded
    dgate      = round(dact * up * s * (1 + gate * (1 - s))),  dup = round(dact * gate * s)   (swiglu_bwd)
  written to dh (P, 2F), which may be h itself; act (P, F), optional: a again.
Nothing is saved by these kernels; the caller keeps order, slot_pos, offsets and the weights.

Supported: N*K < 2^31; 1 <= E <= 256; fp32 / fp16 / bf16 activations; any C, F >= 1. Shared memory
holds only reduction and scan scratch (a few KiB), so one config serves every tier.
Tested: tests/test_moe_route.py: fp32 and fp16 through the interpreter (N 1, 7, 33; E 4, 12, 128;
K 1, 2, 4, E), an expert with no slots, one expert with all, several blocks and chunks, counts
accumulated and exact; combine weighted / unweighted / accumulate against an fp64 reference;
moe_act_bwd against autograd, in place over h, F past one block; bf16 and P = 2^19 on GPU.

Caution:
  - expert ids outside [0, E) are not checked (a device value): their slots land at position 0.
  - group_slots allocates its (blocks, E) int32 scratch with torch.empty on each call.
  - moe_combine sums in fp32 where HF rounds w * y and index_adds in the model dtype, so it is
    closer to the fp32 value than HF's output.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_E = 256


@triton.jit
def _group_hist_kernel(
    hist_ptr,                                     # output: (blocks, E) int32
    e_ptr,                                        # input: (P,) int32 expert of each slot
    P, E,
    BLOCK_P: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    count = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, BLOCK_P, CHUNK):
        j = b * BLOCK_P + c + tl.arange(0, CHUNK)
        ex = tl.load(e_ptr + j, mask=j < P, other=-1)
        count += tl.sum((ex[:, None] == cols[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + b * E + cols, count, mask=cols < E)


@triton.jit
def _group_scan_kernel(
    offsets_ptr, counts_ptr, hist_ptr,            # outputs: (E+1,) int32, (E,) fp32 (+=) if COUNTS;
                                                  # hist (blocks, E) int32 in, each block's first positions out
    B, E,
    COUNTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        m = (rb < B)[:, None] & (cols < E)[None, :]
        total += tl.sum(tl.load(hist_ptr + rb[:, None] * E + cols[None, :], mask=m, other=0), axis=0)
    start = tl.cumsum(total, axis=0) - total      # exclusive scan over experts
    tl.store(offsets_ptr + cols, start, mask=cols < E)
    tl.store(offsets_ptr + E, tl.sum(total, axis=0))
    if COUNTS:
        old = tl.load(counts_ptr + cols, mask=cols < E, other=0.0)
        tl.store(counts_ptr + cols, old + total.to(tl.float32), mask=cols < E)
    run = start
    for b0 in range(0, B, BLOCK_B):               # exclusive scan over blocks, in place
        rb = b0 + tl.arange(0, BLOCK_B)
        m = (rb < B)[:, None] & (cols < E)[None, :]
        h = tl.load(hist_ptr + rb[:, None] * E + cols[None, :], mask=m, other=0)
        tl.store(hist_ptr + rb[:, None] * E + cols[None, :], run[None, :] + tl.cumsum(h, axis=0) - h, mask=m)
        run += tl.sum(h, axis=0)


@triton.jit
def _group_scatter_kernel(
    order_ptr, slot_pos_ptr,                      # outputs: (P,) int32 each
    base_ptr, e_ptr,                              # inputs: (blocks, E) int32 first positions, (P,) int32 experts
    P, E,
    BLOCK_P: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    run = tl.load(base_ptr + b * E + cols, mask=cols < E, other=0)   # next free position per expert
    for c in range(0, BLOCK_P, CHUNK):
        j = b * BLOCK_P + c + tl.arange(0, CHUNK)
        ex = tl.load(e_ptr + j, mask=j < P, other=-1)
        hot = (ex[:, None] == cols[None, :]).to(tl.int32)           # (CHUNK, BLOCK_E) one-hot
        pos = tl.sum(hot * (run[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
        tl.store(slot_pos_ptr + j, pos, mask=j < P)
        tl.store(order_ptr + pos, j, mask=j < P)
        run += tl.sum(hot, axis=0)


@triton.jit
def _moe_combine_kernel(
    out_ptr,                                      # output: (N, C), (+)=
    ys_ptr, slot_pos_ptr, w_ptr,                  # inputs: (P, C), (P,) int32, (N, K) if WEIGHTED
    stride_out, stride_ys,
    N, C, K,
    WEIGHTED: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for i in range(K):                            # in top-k order: one fixed fp32 sum
        p = tl.load(slot_pos_ptr + r64 * K + i, mask=rows < N, other=0).to(tl.int64)
        y = tl.load(ys_ptr + p[:, None] * stride_ys + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            y *= tl.load(w_ptr + r64 * K + i, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        acc += y
    ptrs = out_ptr + r64[:, None] * stride_out + cols[None, :]
    if ACCUMULATE:
        acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_act_bwd_kernel(
    dh_ptr, dw_ptr, act_ptr,                      # outputs: (P, 2F), (N*K,) fp32, (P, F) if WRITE_ACT
    g_ptr,                                        # incoming gradient G: (P, F)
    h_ptr, w_ptr, order_ptr,                      # inputs: (P, 2F), (N*K,) routing weights, (P,) int32
    stride_dh, stride_g, stride_h, stride_act,
    P, F,
    WRITE_ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < P
    r64 = rows.to(tl.int64)[:, None]
    j = tl.load(order_ptr + rows, mask=rmask, other=0)
    w = tl.load(w_ptr + j, mask=rmask, other=0.0).to(tl.float32)[:, None]
    dot = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        # All three loads come before the stores: dh may be h.
        G = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(h_ptr + r64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + r64 * stride_h + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        a = (g * s * u).to(h_ptr.dtype.element_ty)        # swiglu_fwd's expression and rounding
        dot += G * a.to(tl.float32)
        dact = w * G
        tl.store(dh_ptr + r64 * stride_dh + cols[None, :],
                 (dact * u * s * (1.0 + g * (1.0 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + r64 * stride_dh + F + cols[None, :], (dact * g * s).to(dh_ptr.dtype.element_ty), mask=mask)
        if WRITE_ACT:
            tl.store(act_ptr + r64 * stride_act + cols[None, :], a.to(act_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + j, tl.sum(dot, axis=1), mask=rmask)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def _group_config(P, E):
    """(BLOCK_P, CHUNK, BLOCK_E, num_warps). GPU: 1024 slots a program (P = 2^19: 512 programs, a
    512 x E scratch the one scan program reads twice), one-hot chunks of ~4096 elements. Untuned.
    Interpreter: about four programs of four chunks (every carry exercised, few programs)."""
    BLOCK_E = triton.next_power_of_2(E)
    if _interpreting():
        BLOCK_P = max(64, min(4096, triton.next_power_of_2(triton.cdiv(P, 4))))
        return BLOCK_P, BLOCK_P // 4, BLOCK_E, 4
    return 1024, max(16, min(256, 4096 // BLOCK_E)), BLOCK_E, 4


def group_slots(order, slot_pos, offsets, experts, *, counts=None):
    """Stable counting sort of the N*K slots by expert (module docstring): order, slot_pos (P,)
    int32 and offsets (E+1,) int32 written; counts (E,) fp32, optional, += slots per expert.
    Returns nothing."""
    check(experts, "experts", shape=(None, None), dtype=torch.int32, contiguous=True)
    N, K = experts.shape
    P, dev = N * K, experts.device
    check(offsets, "offsets", shape=(None,), dtype=torch.int32, device=dev, contiguous=True)
    E = offsets.shape[0] - 1
    check(order, "order", shape=(P,), dtype=torch.int32, device=dev, contiguous=True)
    check(slot_pos, "slot_pos", shape=(P,), dtype=torch.int32, device=dev, contiguous=True)
    if counts is not None:
        check(counts, "counts", shape=(E,), dtype=torch.float32, device=dev, contiguous=True)
    if not 1 <= E <= MAX_E:
        raise ValueError(f"offsets: E + 1 = {E + 1} entries, supported 1 <= E <= {MAX_E}")
    if P >= 2**31:
        raise ValueError(f"experts: N * K = {P} slots, supported below 2^31")
    BLOCK_P, CHUNK, BLOCK_E, num_warps = _group_config(P, E)
    B = max(1, triton.cdiv(P, BLOCK_P))
    hist = torch.empty((B, E), dtype=torch.int32, device=dev)  # (B, E) counts, then first positions
    _group_hist_kernel[(B,)](hist, experts, P, E, BLOCK_P=BLOCK_P, CHUNK=CHUNK, BLOCK_E=BLOCK_E, num_warps=num_warps)
    _group_scan_kernel[(1,)](offsets, counts if counts is not None else offsets, hist, B, E,
                             COUNTS=counts is not None, BLOCK_B=max(1, min(triton.next_power_of_2(B), 8192 // BLOCK_E)),
                             BLOCK_E=BLOCK_E, num_warps=8)
    if P:
        _group_scatter_kernel[(B,)](order, slot_pos, hist, experts, P, E,
                                    BLOCK_P=BLOCK_P, CHUNK=CHUNK, BLOCK_E=BLOCK_E, num_warps=num_warps)


def _rows_config(R, F):
    """(BLOCK_R, BLOCK_F, num_warps) for a (rows, F) elementwise pass, as swiglu's _config: column
    blocks of at most 1024, ~2048-element tiles (untuned); the interpreter takes ~4 row blocks
    and columns up to 2048 wide."""
    BLOCK_F = min(triton.next_power_of_2(F), 1024)
    BLOCK_R = max(1, min(32, 2048 // BLOCK_F))
    if _interpreting():
        BLOCK_R = max(BLOCK_R, min(64, triton.next_power_of_2(triton.cdiv(max(R, 1), 4))))
        BLOCK_F = min(triton.next_power_of_2(F), 2048)
    return BLOCK_R, BLOCK_F, max(1, min(8, BLOCK_R * BLOCK_F // 512))


def act_bwd_config(R, F, rows, cols):
    """(BLOCK_R, BLOCK_F, num_warps) of a SwiGLU backward over sorted rows (moe_act_bwd; moe_glu's
    with rows=1, cols=1024): on a GPU `rows` rows a program and column blocks of at most `cols`,
    4 warps; the interpreter as _rows_config. H200, bf16, CUDA-graph medians (tools/moe_rows_probe.py's
    loop, 2026-11-29; read G, h, write dh, act): moe_act_bwd P 65,536 F 768 (Qwen3-30B-A3B) 168.5 us
    at _rows_config's (2, 1024, 4) -> 149.5 at (4, 256, 4) (next (8, 256, 8) 150.3, (1, 1024, 4)
    165.9); moe_glu_bwd P 32,768 F 2,880 (gpt-oss-20b) 468.6 -> 349.7 at (1, 1024, 4) (next (8, 256,
    8) 394.0)."""
    if _interpreting():
        return _rows_config(R, F)
    return rows, min(triton.next_power_of_2(F), cols), 4


def moe_combine(out, ys, slot_pos, weights=None, *, accumulate=False):
    """out (N, C) (+)= sum_i w[n, i] * ys[slot_pos[n*K + i]] (fp32 sum in top-k order, one rounding);
    ys (P, C) sorted expert outputs, slot_pos (P,) int32, weights (N, K) or None (unweighted).
    Returns nothing."""
    check(out, "out", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, C = out.shape
    dev = out.device
    check(slot_pos, "slot_pos", shape=(None,), dtype=torch.int32, device=dev, contiguous=True)
    P = slot_pos.shape[0]
    if N == 0 or P % N:
        if N == 0 and P == 0:
            return
        raise ValueError(f"slot_pos: {P} slots is not a multiple of N = {N} tokens")
    K = P // N
    check(ys, "ys", shape=(P, C), dtype=_DTYPES, device=dev, last_contiguous=True)
    if weights is not None:
        check(weights, "weights", shape=(N, K), dtype=_DTYPES, device=dev, contiguous=True)
    if C == 0:
        return
    BLOCK_N, BLOCK_C, num_warps = _rows_config(N, C)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(C, BLOCK_C))
    _moe_combine_kernel[grid](
        out, ys, slot_pos, weights if weights is not None else ys,
        out.stride(0), ys.stride(0),
        N, C, K,
        WEIGHTED=weights is not None, ACCUMULATE=bool(accumulate), BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
        num_warps=num_warps,
    )


def moe_act_bwd(dh, dweights, G, h, weights, order, *, act=None):
    """dh (P, 2F) = [dgate | dup] of the SwiGLU at h with dact = w * G; dweights (N, K) fp32
    = <G, a> per slot (written); act (P, F), optional: a = the forward's SwiGLU output. G (P, F)
    unweighted, h (P, 2F) sorted gate/up, weights (N, K), order (P,) int32. dh may be h.
    Returns nothing."""
    check(h, "h", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    P, F2 = h.shape
    dev, dt = h.device, h.dtype
    if F2 % 2:
        raise ValueError(f"h: expected (P, 2F) gate | up, got {F2} columns")
    F = F2 // 2
    check(dh, "dh", shape=(P, F2), dtype=dt, device=dev, last_contiguous=True)
    check(G, "G", shape=(P, F), dtype=dt, device=dev, last_contiguous=True)
    check(weights, "weights", shape=(None, None), dtype=_DTYPES, device=dev, contiguous=True)
    check(dweights, "dweights", shape=tuple(weights.shape), dtype=torch.float32, device=dev, contiguous=True)
    if weights.numel() != P:
        raise ValueError(f"weights: expected N * K = P = {P} entries, got shape {tuple(weights.shape)}")
    check(order, "order", shape=(P,), dtype=torch.int32, device=dev, contiguous=True)
    if act is not None:
        check(act, "act", shape=(P, F), dtype=dt, device=dev, last_contiguous=True)
    if P == 0 or F == 0:
        return
    BLOCK_R, BLOCK_F, num_warps = act_bwd_config(P, F, rows=4, cols=256)
    _moe_act_bwd_kernel[(triton.cdiv(P, BLOCK_R),)](
        dh, dweights, act if act is not None else dh,
        G, h, weights, order,
        dh.stride(0), G.stride(0), h.stride(0), act.stride(0) if act is not None else 0,
        P, F,
        WRITE_ACT=act is not None, BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )
