"""Varlen causal flash attention, forward and backward, for packed documents (GQA).

Shape legend: N tokens in the packed batch, B documents, H query heads, KVH key/value heads
(G = H // KVH query heads share kv head h // G), D head dim.

Math, per document and query head h (i, j document-relative, only keys j <= i of the same document):
    s_ij  = scale * q_i . k_j
    lse_i = log sum_j exp(s_ij)                       natural log, saved for backward
    o_i   = sum_j exp(s_ij - lse_i) v_j
Backward, with p_ij = exp(s_ij - lse_i) recomputed from lse and delta_i = sum_d o_id do_id:
    dv_j = sum_i p_ij do_i         dp_ij = do_i . v_j        ds_ij = p_ij (dp_ij - delta_i)
    dq_i = scale * sum_j ds_ij k_j                 dk_j  = scale * sum_i ds_ij q_i
    (dk, dv of a kv head sum over its G query heads)
The kernels work in log2 units: scores are multiplied by scale * log2(e) and exponentiated with exp2.

Inputs and outputs:
    q (N, H, D), k, v (N, KVH, D): fp32, fp16 or bf16, one dtype; any strides with a unit last
        stride (slices of one fused qkv buffer are fine).
    cu_seqlens (B+1,) int32 on the device: document b is rows cu[b]:cu[b+1] (cu[0] = 0, cu[B] = N,
        non-decreasing; empty documents allowed). max_seqlen: host int >= the longest document.
    o (N, H, D) q's dtype; lse (H, N) fp32 -- the only thing forward saves besides its inputs and o.
    Backward: dq (N, H, D), dk, dv (N, KVH, D) in q's dtype, written with = (never accumulated);
        delta (H, N) fp32 is caller-provided scratch (delta = rowsum(o * do)).
Loads: the rows each loop step reads (k/v in forward and dq, q/do in dk/dv) come through TMA
descriptors over the (N, heads * D) views in a captured step on Hopper (16-bit, D = 64/128, packed
heads: _use_tma), else through masked pointer loads. A descriptor bounds the batch, not the
document, so the last block of a document reads the next document's rows where the pointer loads
read 0; those rows are masked either way (keys past the document fall above the causal diagonal of
every valid query; queries past it load lse = +inf, so p = 0), and both paths give the same bits at
the same block sizes (tested). One difference: a non-finite value in a neighbouring document's q/do
rows would reach dk/dv as 0 * inf -- the step's loss is non-finite then anyway.
Deterministic: no atomics. dk/dv are computed per (key block, kv head), looping over the G query
heads inside the program; dq is a second kernel that recomputes the scores (7 matmuls per tile pair
in backward instead of the atomic version's 5). Two runs give bit-identical gradients.

Supported: D from 16 to 256 (non powers of two padded to the next power of two with masks; GPU
block sizes are tuned for D = 64 and 128, D = 80/96 use the 128 table and D = 256 a small-tile one);
any G = H / KVH; fp16, bf16, and fp32 up to D = 128 (ieee dots on CUDA cores: for tests).

Tested: tests/test_attention.py against a padded per-document fp64 reference and torch SDPA per
document: fp32 and fp16 on CPU (Triton interpreter; D 32/64/80, G 1/2/4/8, lengths 0, 1, odd,
30 documents); bf16 on H100 (D 64/80/96/128/256, 100+ documents, one 2048-token document).
The final tuned block configs were also cross-checked against torch's flash kernel on the two
tools/attn_tune.py cases (max |diff| / max |ref| <= 7.5e-3 for o, dq, dk, dv).

Caution:
    * No host syncs, so cu_seqlens is not validated: if max_seqlen is below the longest document,
      the rows past max_seqlen of that document are never written; rows outside every document
      (cu[B] < N) are never written either.
    * Offsets inside one document are int32: max_seqlen * (row stride) must stay below 2^31
      (checked); document starts are int64.
    * Extensions kept to one place each: a sliding window (a WINDOW constexpr) would change `_keep`
      and the first key block of each loop; per-head sink logits would start the forward's online
      softmax at (m_i, l_i) = (sink * log2(e), 1) -- backward then reads the sink-inclusive lse as
      is, and only the sink's own gradient (-sum_i p_i,sink * delta_i) is new.
    * Block configs must nest (BLOCK_M % BLOCK_N == 0 for forward and dq, the reverse for dk/dv):
      the unmasked loops stop at the diagonal block's start. _config checks it.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.gemm import tma_desc, tma_ok

_LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)
_LN2 = tl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------------------------
# helpers shared by every kernel (inlined by the compiler)

@triton.jit
def _keep(q_idx, k_idx):
    """The mask, in one place: does key k_idx take part in query q_idx's softmax? Indices are
    document-relative and already broadcast to the score tile's shape. (Sliding window: also
    `q_idx - k_idx < WINDOW`.)"""
    return k_idx <= q_idx


@triton.jit
def _work_item(t, cu_ptr, n_docs, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, LAST_FIRST: tl.constexpr,
               SORTED: tl.constexpr):
    """Item t of the walk over every document's row blocks of BLOCK rows: (block index inside its
    document, document start, document length); past the last block the length is 0 (the program
    exits). One grid axis instead of (blocks x documents): with fixed-shape batches (a CUDA graph's
    64 document slots and max_seqlen = N) ~98% of that grid only exited, +10.7 ms a Qwen3-0.6B step
    (H100, bench_profile). BLOCK_B >= n_docs, a power of two.
    Order: SORTED, the documents longest first (ties in batch order; up to 128 slots), else in
    batch order; inside one its blocks first to last, or last to first with LAST_FIRST (a query
    block's work grows with its index, a key block's shrinks)."""
    rb = tl.arange(0, BLOCK_B)
    lo = tl.load(cu_ptr + rb, mask=rb < n_docs, other=0)
    hi = tl.load(cu_ptr + rb + 1, mask=rb < n_docs, other=0)
    nblk = (hi - lo + BLOCK - 1) // BLOCK                  # row blocks of each document (0 if empty)
    if SORTED and BLOCK_B <= 128:  # [b, c]: document c walks before b; first[b]: blocks walked before b's
        before = (nblk[None, :] > nblk[:, None]) | ((nblk[None, :] == nblk[:, None]) & (rb[None, :] < rb[:, None]))
        first = tl.sum(tl.where(before, nblk[None, :], 0), 1)
    else:
        first = tl.cumsum(nblk, 0) - nblk
    mine = (first <= t) & (t < first + nblk)              # the one document holding item t, if any
    if LAST_FIRST:  # block 0 where no document holds t: its seqlen 0 sends the program home
        block = tl.sum(tl.where(mine, nblk - 1 - (t - first), 0), 0)
    else:
        block = tl.sum(tl.where(mine, t - first, 0), 0)
    start = tl.sum(tl.where(mine, lo, 0), 0)
    seqlen = tl.sum(tl.where(mine, hi - lo, 0), 0)
    return block, start, seqlen


@triton.jit
def _query_program(cu_ptr, n_docs, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, SORTED: tl.constexpr):
    """(block, document start, document length, head) of a forward / dq program: SORTED, heads on
    grid axis 0 (item t of every head launches together) and the longest documents first, each
    one's last (heaviest) query block first; else items on axis 0 walked from the end."""
    if SORTED:
        block, start, seqlen = _work_item(tl.program_id(1), cu_ptr, n_docs, BLOCK, BLOCK_B, True, True)
        return block, start, seqlen, tl.program_id(0)
    else:
        block, start, seqlen = _work_item(tl.num_programs(0) - 1 - tl.program_id(0), cu_ptr, n_docs, BLOCK,
                                          BLOCK_B, False, False)
        return block, start, seqlen, tl.program_id(1)


@triton.jit
def _load_rows(base, rows, stride, seqlen, offs_d, HEAD_DIM: tl.constexpr):
    """(len(rows), BLOCK_D) tile of one head; rows past the document and padded columns read 0."""
    mask = (rows[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _loop_rows(src, row0, col, rows, stride, seqlen, offs_d, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """The (len(rows), BLOCK_D) tile a loop step reads. TMA: src is a descriptor over the (N,
    heads * D) view, read at absolute row row0 = document start + rows[0] and column col = head * D
    (rows past N read 0; rows past the document read the next one's, which every caller masks
    out: see the module notes). Otherwise src points at the head's first document row and rows
    past the document read 0 (_load_rows)."""
    if TMA:
        return src.load([row0, col])
    else:
        return _load_rows(src, rows, stride, seqlen, offs_d, HEAD_DIM)


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_src, v_src, row0, col, stride_kn, stride_vn, offs_m, offs_n, offs_d,
              seqlen, qk_scale, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """One key block of the forward: scores, mask, and the online-softmax update (log2 units)."""
    k = _loop_rows(k_src, row0, col, offs_n, stride_kn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    v = _loop_rows(v_src, row0, col, offs_n, stride_vn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                          # (BM, BN)
    if MASK:
        qk = tl.where(_keep(offs_m[:, None], offs_n[None, :]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _dkdv_step(dk, dv, k, v, q_src, do_src, row0, col, lse_row, delta_row, stride_qn, stride_don,
               offs_m, offs_n, offs_d, seqlen, qk_scale,
               HEAD_DIM: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """One query block against this program's key block, in transposed (key, query) layout.
    Rows past the document load lse = +inf (so p = 0) and delta = 0: they add exactly 0."""
    q = _loop_rows(q_src, row0, col, offs_m, stride_qn, seqlen, offs_d, HEAD_DIM, TMA)       # (BM, BD)
    do = _loop_rows(do_src, row0, col, offs_m, stride_don, seqlen, offs_d, HEAD_DIM, TMA)    # (BM, BD)
    lse2 = tl.load(lse_row + offs_m, mask=offs_m < seqlen, other=float("inf")) * _LOG2E
    delta = tl.load(delta_row + offs_m, mask=offs_m < seqlen, other=0.0)
    qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)                         # (BN, BM)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASK:
        pT = tl.where(_keep(offs_m[None, :], offs_n[:, None]), pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)                        # (BN, BM)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_src, v_src, row0, col, stride_kn, stride_vn, offs_m, offs_n,
             offs_d, seqlen, qk_scale, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
             PRECISION: tl.constexpr, TMA: tl.constexpr):
    """One key block of dq: recompute p, then dq += ds @ k."""
    k = _loop_rows(k_src, row0, col, offs_n, stride_kn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    v = _loop_rows(v_src, row0, col, offs_n, stride_vn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                          # (BM, BN)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASK:
        p = tl.where(_keep(offs_m[:, None], offs_n[None, :]), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                         # (BM, BN)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


# ----------------------------------------------------------------------------------------------
# kernels. Grid axis 0 heads, axis 1 walks the documents' blocks (_work_item); programs past the
# last block exit at once. Causal block skipping: a query block visits only key
# blocks up to its diagonal; only the diagonal blocks pay for the mask.

@triton.jit
def _attention_fwd_kernel(
    o_ptr, lse_ptr,                                  # outputs: (N, H, D), (H, N) fp32
    q_ptr, k_src, v_src, cu_ptr,                     # inputs: (N, H, D), (N, KVH, D) x2, (B+1,)
    stride_on, stride_oh, stride_qn, stride_qh,      # row / head strides (last stride is 1)
    stride_kn, stride_kh, stride_vn, stride_vh,
    N, B, GROUP, scale,                              # tokens (= lse row stride), documents, H // KVH, scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,   # TMA: k_src, v_src are descriptors
    SORTED: tl.constexpr,                            # the walk's order and grid: _query_program
):
    pid_m, seq_start, seqlen, h = _query_program(cu_ptr, B, BLOCK_M, BLOCK_B, SORTED)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen:
        return
    tok0 = seq_start.to(tl.int64)
    kvh = h // GROUP
    q_base = q_ptr + tok0 * stride_qn + h * stride_qh
    if TMA:
        k_base, v_base = k_src, v_src
    else:
        k_base = k_src + tok0 * stride_kn + kvh * stride_kh
        v_base = v_src + tok0 * stride_vn + kvh * stride_vh
    qk_scale = scale * _LOG2E

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_base, offs_m, stride_qn, seqlen, offs_d, HEAD_DIM)             # (BM, BD)
    # Sink logits would start from m_i = sink * log2(e), l_i = 1 instead.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, start_m, BLOCK_N):                 # keys before the block: no mask
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                                  stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                                  HEAD_DIM, False, PRECISION, TMA)
    for start_n in range(start_m, tl.minimum(start_m + BLOCK_M, seqlen), BLOCK_N):  # diagonal
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                                  stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                                  HEAD_DIM, True, PRECISION, TMA)

    o = acc / l_i[:, None]
    o_ptrs = o_ptr + tok0 * stride_on + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM))
    lse = (m_i + tl.math.log2(l_i)) * _LN2
    tl.store(lse_ptr + h * N + seq_start + offs_m, lse, mask=offs_m < seqlen)


@triton.jit
def _attention_bwd_delta_kernel(
    delta_ptr,                                       # output: (H, N) fp32
    do_ptr, o_ptr,                                   # (N, H, D) each
    stride_don, stride_doh, stride_on, stride_oh,
    N,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    do = _load_rows(do_ptr + h * stride_doh, rows, stride_don, N, offs_d, HEAD_DIM)
    o = _load_rows(o_ptr + h * stride_oh, rows, stride_on, N, offs_d, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + h * N + rows, delta, mask=rows < N)


@triton.jit
def _attention_bwd_dkdv_kernel(
    dk_ptr, dv_ptr,                                  # outputs: (N, KVH, D) each
    do_src, q_src, k_ptr, v_ptr,                     # (N, H, D) x2, (N, KVH, D) x2
    lse_ptr, delta_ptr, cu_ptr,                      # (H, N) fp32 x2, (B+1,) int32
    stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_don, stride_doh,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    N, B, GROUP, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,   # TMA: do_src, q_src are descriptors
    SORTED: tl.constexpr,                            # the walk's order and grid (below)
):
    if SORTED:  # heads on axis 0: every kv head's item t launches together, longest documents first
        pid_n, seq_start, seqlen = _work_item(tl.program_id(1), cu_ptr, B, BLOCK_N, BLOCK_B, False, True)
        kvh = tl.program_id(0)
    else:       # items on axis 0, each document's first key block (the most work) first
        pid_n, seq_start, seqlen = _work_item(tl.program_id(0), cu_ptr, B, BLOCK_N, BLOCK_B, False, False)
        kvh = tl.program_id(1)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen:
        return
    tok0 = seq_start.to(tl.int64)
    qk_scale = scale * _LOG2E

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr + tok0 * stride_kn + kvh * stride_kh, offs_n, stride_kn, seqlen, offs_d, HEAD_DIM)
    v = _load_rows(v_ptr + tok0 * stride_vn + kvh * stride_vh, offs_n, stride_vn, seqlen, offs_d, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):                           # the query heads sharing this kv head
        h = kvh * GROUP + g
        if TMA:
            q_base, do_base = q_src, do_src
        else:
            q_base = q_src + tok0 * stride_qn + h * stride_qh
            do_base = do_src + tok0 * stride_don + h * stride_doh
        lse_row = lse_ptr + h * N + seq_start
        delta_row = delta_ptr + h * N + seq_start
        for start_m in range(start_n, tl.minimum(start_n + BLOCK_N, seqlen), BLOCK_M):  # diagonal
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, seq_start + start_m, h * HEAD_DIM, lse_row,
                                delta_row, stride_qn, stride_don, start_m + offs_m, offs_n, offs_d, seqlen,
                                qk_scale, HEAD_DIM, True, PRECISION, TMA)
        for start_m in range(start_n + BLOCK_N, seqlen, BLOCK_M):                       # below it
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, seq_start + start_m, h * HEAD_DIM, lse_row,
                                delta_row, stride_qn, stride_don, start_m + offs_m, offs_n, offs_d, seqlen,
                                qk_scale, HEAD_DIM, False, PRECISION, TMA)

    mask = (offs_n[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = dk_ptr + tok0 * stride_dkn + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = dv_ptr + tok0 * stride_dvn + kvh * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attention_bwd_dq_kernel(
    dq_ptr,                                          # output: (N, H, D)
    do_ptr, q_ptr, k_src, v_src,                     # (N, H, D) x2, (N, KVH, D) x2
    lse_ptr, delta_ptr, cu_ptr,                      # (H, N) fp32 x2, (B+1,) int32
    stride_dqn, stride_dqh, stride_don, stride_doh,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    N, B, GROUP, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,   # TMA: k_src, v_src are descriptors
    SORTED: tl.constexpr,                            # the walk's order and grid: _query_program
):
    pid_m, seq_start, seqlen, h = _query_program(cu_ptr, B, BLOCK_M, BLOCK_B, SORTED)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen:
        return
    tok0 = seq_start.to(tl.int64)
    kvh = h // GROUP
    if TMA:
        k_base, v_base = k_src, v_src
    else:
        k_base = k_src + tok0 * stride_kn + kvh * stride_kh
        v_base = v_src + tok0 * stride_vn + kvh * stride_vh
    qk_scale = scale * _LOG2E

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr + tok0 * stride_qn + h * stride_qh, offs_m, stride_qn, seqlen, offs_d, HEAD_DIM)
    do = _load_rows(do_ptr + tok0 * stride_don + h * stride_doh, offs_m, stride_don, seqlen, offs_d, HEAD_DIM)
    row_ok = offs_m < seqlen
    lse2 = tl.load(lse_ptr + h * N + seq_start + offs_m, mask=row_ok, other=float("inf")) * _LOG2E
    delta = tl.load(delta_ptr + h * N + seq_start + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, start_m, BLOCK_N):                 # keys before the block: no mask
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                      stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                      HEAD_DIM, False, PRECISION, TMA)
    for start_n in range(start_m, tl.minimum(start_m + BLOCK_M, seqlen), BLOCK_N):  # diagonal
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                      stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                      HEAD_DIM, True, PRECISION, TMA)

    dq_ptrs = dq_ptr + tok0 * stride_dqn + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------------------------
# launch configuration: (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by the padded head dim.
# Forward and dq need BLOCK_M % BLOCK_N == 0, dk/dv needs BLOCK_N % BLOCK_M == 0 (diagonal split).
# Evidence: tools/attn_tune.py --sweep on an H100 (bf16, triton 3.6, two sweeps), time summed over
# the packed N=8192 (exponential lengths, mean 512) and 4x2048 cases, H=16/KVH=8 (D=128) and
# H=32/KVH=8 (D=64); every kernel timed with the others at their chosen configs:
#   fwd  (64, 64, 4, 3): D=128 0.290 ms vs 0.314 (64, 32, 4, 3), 0.322 (64, 64, 4, 2),
#                        0.324 (128, 64, 8, 3), 0.342 (128, 128, 8, 3), 0.426 (64, 64, 8, 3);
#                        D=64  0.300 ms vs 0.310 (64, 64, 4, 2), 0.325 (128, 64, 8, 3).
#   dkdv (bwd total)     D=128 (32, 64, 4, 2) 1.058 ms vs 1.116 (32, 64, 4, 3), 1.193 (16, 64, 4, 3),
#                        1.217 (64, 64, 4, 2), 1.284 (32, 128, 8, 3), 1.805 (32, 64, 8, 3);
#                        D=64  (32, 64, 4, 3) 1.255 ms vs 1.267 (32, 64, 4, 2), 1.361 (64, 64, 4, 2),
#                        1.430 (32, 128, 4, 3).
#   dq   (bwd total)     D=128 (64, 32, 4, 3) 1.119 ms ~ 1.120 (128, 64, 8, 3), 1.125 (64, 64, 4, 2),
#                        vs 1.214 (64, 64, 4, 3), 1.605 (64, 32, 8, 3);
#                        D=64  (64, 64, 4, 3) 1.255 ms ~ 1.247 (64, 64, 4, 2), vs 1.275 (64, 32, 4, 3).
# Result (fwd+bwd, causal TFLOP/s, 3.5x fwd FLOPs): D=128 packed 144 vs torch flash varlen 102,
# 4x2048 263 vs 210; D=64 packed 138 vs 93, 4x2048 228 vs 200 (fwd alone 194-360 vs 90-250),
# measured with dkdv D=128 at (32, 64, 4, 3); (32, 64, 4, 2) was adopted from the same sweep after.
# D=256 is untuned (small tiles that fit shared memory; tests pass on H100).
_FWD_CONFIG = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)}
_DKDV_CONFIG = {64: (32, 64, 4, 3), 128: (32, 64, 4, 2), 256: (16, 64, 8, 2)}
_DQ_CONFIG = {64: (64, 64, 4, 3), 128: (64, 32, 4, 3), 256: (64, 16, 8, 2)}
# fp32 (tests only; ieee dots run on CUDA cores, not tensor cores): small tiles that fit shared memory.
_FP32_CONFIG = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
# Triton interpreter (CPU tests): small, unequal blocks so several blocks and a split diagonal run.
_INTERPRET_CONFIG = {"fwd": (32, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}
# Interpreter, model-sized heads (H * D >= 512; the tests' are at most 320): the interpreter's cost
# is per program and per key/query step (~3-8 ms of Python each), not per score, so square blocks
# that cover the longest document, up to 256. SmolLM2 (9 heads of 64), 8 documents of 53-67
# tokens, fp32, 1 core, CPU time: fwd 2.4 s -> 0.86 s, bwd 4.3 s -> 1.4 s (128 x 128 blocks);
# 64 x 64 blocks: 1.2 s and 2.0 s, 256 x 256: 0.88 s and 1.6 s.
_INTERPRET_MAX_BLOCK = 256
_TABLES = {"fwd": _FWD_CONFIG, "dkdv": _DKDV_CONFIG, "dq": _DQ_CONFIG}
# The TMA loops (Hopper): the rows each loop step reads come through descriptors (the copy engine
# fills shared memory; no per-row address or mask math). H100, bf16, kernel medians over bench
# step's packed documents (11, max 3101) and 4 x 2048, pointer loops at their table configs above
# -> TMA at these (the outputs bit-equal):
#   (H, KVH, D) = (32, 8, 128): fwd 0.379 -> 0.318 ms, dkdv 0.958 -> 0.859, dq 0.468 -> 0.441;
#   (16, 8, 128): fwd 0.208 -> 0.176, dkdv 0.490 -> 0.446, dq 0.262 -> 0.244;
#   (32, 8, 64):  fwd 0.214 -> 0.202, dkdv 0.699 -> 0.638, dq 0.222 -> 0.204 (packed; 4 x 2048 alike).
# Runner-up configs within 3%: fwd (128, 128, 8, 3) at D=128, dkdv (32, 64, 4, 2) at D=64.
# With the sorted backward walk (_SORTED below), `tools/attn_tune.py --tma --sweep --kernels
# dkdv,dq` (backward ms summed over its three batches; 13 dk/dv and 10 dq configs a head dim): dkdv
# stays (32, 64, 4, 2) at D=128 (1.478; next (64, 64, 4, 2) 1.567) and (64, 64, 4, 3) at D=64;
# dq at D=128 (128, 64, 8, 3) 1.474 -> (64, 64, 4, 2) 1.424 (each batch 2-7% faster), at D=64
# (64, 64, 4, 3) stays (1.744; next (64, 64, 4, 2) 1.774).
_TMA_TABLES = {"fwd": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
               "dkdv": {64: (64, 64, 4, 3), 128: (32, 64, 4, 2)},
               "dq": {64: (64, 64, 4, 3), 128: (64, 64, 4, 2)}}
# The walk's order (_work_item, _query_program). SORTED takes the documents longest first and puts
# the heads on grid axis 0, so that every head's heaviest programs launch first; unsorted, the heads
# are axis 1 and the last heads' heavy programs launch after every other head's items, and a dk/dv
# program (a key block of one kv head, its G query heads inside: the longest program of the
# kernel) can then start late and run alone at the end. H100, bf16, TMA loops, the graph's 64
# document slots, backward (delta + dk/dv + dq) unsorted -> sorted: (32, 8, 128) 1.289 -> 1.078 ms
# on bench step's documents (11, max 3101), 1.086 -> 0.880 and 0.748 -> 0.646 on bench_offload's
# two batches (18 each), 1.298 -> 1.168 on 4 x 2048; (16, 8, 128) 0.699 -> 0.550, 0.582 -> 0.457,
# 0.403 -> 0.343, 0.679 -> 0.601; (32, 8, 64) 0.857 -> 0.669, 0.700 -> 0.544, 0.478 -> 0.400,
# 0.826 -> 0.723 (the same bits). dq alone gains 0-4% from it. The forward's programs are short
# (one head each): sorted it measured 3-10% slower at (32, 8, 128), within noise elsewhere.
_SORTED = {"fwd": False, "dkdv": True, "dq": True}
_DELTA_BLOCK_R = 64                                  # rows per delta program; a memory-bound pass


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"  # read at launch: tests set it before use


def _config(kernel, block_d, dtype, max_seqlen, width, tma=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); width = H * D."""
    if _interpreting() and width >= 512:
        b = min(_INTERPRET_MAX_BLOCK, max(16, triton.next_power_of_2(max_seqlen)))
        cfg = (b, b, 1, 1)
    elif _interpreting():
        cfg = _INTERPRET_CONFIG[kernel]
    elif dtype == torch.float32:
        cfg = _FP32_CONFIG[kernel]
    elif tma:
        cfg = _TMA_TABLES[kernel][block_d]
    else:
        cfg = _TABLES[kernel][max(64, block_d)]
    q_block, k_block = cfg[:2]
    if (k_block % q_block) if kernel == "dkdv" else (q_block % k_block):  # the diagonal split
        raise ValueError(f"attention {kernel} config {cfg}: the query and key blocks must nest "
                         "(BLOCK_N % BLOCK_M == 0 for dkdv, BLOCK_M % BLOCK_N == 0 otherwise)")
    return cfg


def _grid(kernel, heads, items):
    return (heads, items) if _SORTED[kernel] else (items, heads)


def _n_items(N, B, max_seqlen, block):
    """Grid axis 1 of the _work_item walk: the documents' blocks of `block` rows number at most
    cdiv(N, block) + B in all, and at most cdiv(max_seqlen, block) per document."""
    n = max(1, min(triton.cdiv(N, block) + B, B * triton.cdiv(max_seqlen, block)))
    if n > 65535:  # CUDA's limit on grid axis 1 (where the sorted walk puts it)
        raise ValueError(f"attention: {n} row blocks of {block} in one batch (at most 65535: fewer tokens "
                         "or documents per batch)")
    return n


def _block_b(B):
    return max(16, triton.next_power_of_2(B))


def _check_common(q, k, v, lse, cu_seqlens, max_seqlen, scale):
    """Checks shared by both directions; returns (N, H, KVH, D, BLOCK_D)."""
    check(q, "q", shape=(None, None, None), dtype=(torch.float32, torch.float16, torch.bfloat16),
          last_contiguous=True)
    N, H, D = q.shape
    dev = q.device
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpreting()):
        raise ValueError(f"q: expected a cuda device (cpu only under TRITON_INTERPRET=1), got {dev}")
    check(k, "k", shape=(N, None, D), dtype=q.dtype, device=dev, last_contiguous=True)
    KVH = k.shape[1]
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({KVH})")
    check(v, "v", shape=(N, KVH, D), dtype=q.dtype, device=dev, last_contiguous=True)
    if not 16 <= D <= 256:
        raise ValueError(f"head dim {D} unsupported: expected 16 <= D <= 256")
    if q.dtype == torch.float32 and D > 128:
        raise ValueError(f"head dim {D} unsupported in float32 (at most 128; its tiles would not fit)")
    check(lse, "lse", shape=(H, N), dtype=torch.float32, device=dev, contiguous=True)
    check(cu_seqlens, "cu_seqlens", shape=(None,), dtype=torch.int32, device=dev, contiguous=True)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected B+1 >= 2 entries, got {cu_seqlens.shape[0]}")
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen: expected a host int >= 1, got {max_seqlen!r}")
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale: expected a host float, got {type(scale).__name__}")
    if H * N >= 2**31:
        raise ValueError(f"H * N = {H * N} must stay below 2^31 (int32 lse/delta offsets)")
    return N, H, KVH, D, max(16, triton.next_power_of_2(D))


def _rows_2d(t):
    """The (N, heads * D) view of an (N, heads, D) tensor whose heads are packed in each row, else None."""
    N, heads, D = t.shape
    return t.as_strided((N, heads * D), (t.stride(0), 1)) if t.stride(1) == D else None


def _use_tma(tma, D, *tensors):
    """Whether the loops read through TMA descriptors. tma=None (auto): inside
    gemm.tma_at_every_size (the step StepGraph captures, where a launch's host cost is paid once),
    on a Hopper GPU, for 16-bit tensors with packed heads and aligned rows and D = 64 or 128 (the
    tuned tables). Not in eager steps: the descriptors' host cost (~0.25 ms a launch, H100 host)
    made eager Qwen3-0.6B 19% slower (92,590 -> 74,611 tok/s; its graph 103,145 -> 104,474).
    True forces them (D a power of two, packed heads: the interpreter runs them in the CPU tests);
    False never."""
    views = [_rows_2d(t) for t in tensors]
    fits = all(v is not None for v in views) and D == triton.next_power_of_2(D)
    if tma is None:   # macs=0: only where tma_at_every_size waives the size rule (a captured step)
        return fits and D in (64, 128) and tma_ok(*views, macs=0)
    if tma and not fits:
        raise ValueError(f"attention tma=True needs a power-of-two head dim (got {D}) and each row's "
                         "heads packed (stride(1) == D)")
    return bool(tma)


def _check_row_offsets(max_seqlen, **tensors):
    for name, t in tensors.items():
        if (max_seqlen + 256) * t.stride(0) >= 2**31:
            raise ValueError(f"{name}: max_seqlen * row stride ({max_seqlen} * {t.stride(0)}) must "
                             "stay below 2^31 (int32 offsets inside a document)")


def attention_fwd(o, lse, q, k, v, cu_seqlens, max_seqlen, scale, tma=None):
    """o (N, H, D) q.dtype and lse (H, N) fp32 <- causal attention of each document of q, k, v.
    tma: the loops' loads through descriptors (None: automatic, see _use_tma)."""
    N, H, KVH, D, BLOCK_D = _check_common(q, k, v, lse, cu_seqlens, max_seqlen, scale)
    check(o, "o", shape=(N, H, D), dtype=q.dtype, device=q.device, last_contiguous=True)
    _check_row_offsets(max_seqlen, o=o, q=q, k=k, v=v)
    if N == 0:
        return
    use_tma = _use_tma(tma, D, k, v)
    BLOCK_M, BLOCK_N, warps, stages = _config("fwd", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma)
    B = cu_seqlens.shape[0] - 1
    k_src, v_src = (tma_desc(_rows_2d(t), (BLOCK_N, D)) for t in (k, v)) if use_tma else (k, v)
    _attention_fwd_kernel[_grid("fwd", H, _n_items(N, B, max_seqlen, BLOCK_M))](
        o, lse, q, k_src, v_src, cu_seqlens,
        o.stride(0), o.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TMA=use_tma, SORTED=_SORTED["fwd"],
        num_warps=warps, num_stages=stages)


def attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, tma=None):
    """dq, dk, dv (written with =) <- gradients of attention_fwd for incoming do; delta is scratch.
    tma: the loops' loads through descriptors (None: automatic, see _use_tma)."""
    N, H, KVH, D, BLOCK_D = _check_common(q, k, v, lse, cu_seqlens, max_seqlen, scale)
    dev = q.device
    check(dq, "dq", shape=(N, H, D), dtype=q.dtype, device=dev, last_contiguous=True)
    check(dk, "dk", shape=(N, KVH, D), dtype=q.dtype, device=dev, last_contiguous=True)
    check(dv, "dv", shape=(N, KVH, D), dtype=q.dtype, device=dev, last_contiguous=True)
    check(delta, "delta", shape=(H, N), dtype=torch.float32, device=dev, contiguous=True)
    check(do, "do", shape=(N, H, D), dtype=q.dtype, device=dev, last_contiguous=True)
    check(o, "o", shape=(N, H, D), dtype=q.dtype, device=dev, last_contiguous=True)
    _check_row_offsets(max_seqlen, dq=dq, dk=dk, dv=dv, do=do, q=q, k=k, v=v)
    if N == 0:
        return
    B = cu_seqlens.shape[0] - 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    block_r = _DELTA_BLOCK_R
    if _interpreting() and H * D >= 512:  # model-sized: few programs of up to 2^17 elements
        block_r = max(16, min(triton.next_power_of_2(N), 2**17 // BLOCK_D))
    _attention_bwd_delta_kernel[(triton.cdiv(N, block_r), H)](
        delta, do, o, do.stride(0), do.stride(1), o.stride(0), o.stride(1), N,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_R=block_r, num_warps=4)

    use_tma = _use_tma(tma, D, q, k, v, do)
    BLOCK_M, BLOCK_N, warps, stages = _config("dkdv", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma)
    do_src, q_src = (tma_desc(_rows_2d(t), (BLOCK_M, D)) for t in (do, q)) if use_tma else (do, q)
    _attention_bwd_dkdv_kernel[_grid("dkdv", KVH, _n_items(N, B, max_seqlen, BLOCK_N))](
        dk, dv, do_src, q_src, k, v, lse, delta, cu_seqlens,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), do.stride(0), do.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B), PRECISION=precision,
        TMA=use_tma, SORTED=_SORTED["dkdv"], num_warps=warps, num_stages=stages)

    BLOCK_M, BLOCK_N, warps, stages = _config("dq", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma)
    k_src, v_src = (tma_desc(_rows_2d(t), (BLOCK_N, D)) for t in (k, v)) if use_tma else (k, v)
    _attention_bwd_dq_kernel[_grid("dq", H, _n_items(N, B, max_seqlen, BLOCK_M))](
        dq, do, q, k_src, v_src, lse, delta, cu_seqlens,
        dq.stride(0), dq.stride(1), do.stride(0), do.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B), PRECISION=precision,
        TMA=use_tma, SORTED=_SORTED["dq"], num_warps=warps, num_stages=stages)
