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

GPT-OSS's two options (transformers 5.24, models/gpt_oss/modeling_gpt_oss.py and masking_utils.py):
    sinks (H,): one logit per head, appended to every row's scaled scores and dropped after the
        softmax (HF's eager_attention_forward: it is not multiplied by `scaling`), so it enters
        the denominator only:  p_ij = exp(s_ij - lse_i),  lse_i = log(sum_j exp(s_ij) + exp(sink_h)).
        The forward starts the online softmax from the sink, (m, l) = (sink, 1); the saved lse
        includes it, so backward's recomputed p_ij is right as is, and delta_i = o_i . do_i still
        equals sum_j p_ij dp_ij (the sink has no value row: its dp is 0). dq/dk/dv are exact; the
        sink's own gradient (-sum_i p_i,sink delta_i) is not computed (GPT-OSS's sinks are frozen).
    window W >= 1 (0: off): key j is visible from query i iff j <= i and i - j < W (HF's
        sliding_window_overlay is `kv_idx > q_idx - sliding_window`, anded with the causal mask):
        each query sees its W most recent keys, itself included. Key blocks wholly outside a query
        block's window are never visited (forward and dq: _key_blocks; dk/dv: _query_blocks give
        the loops' bounds); blocks the window's edge cuts are masked, blocks wholly inside are not.
        The kernels visit exactly the tiles holding a visible pair (tested by counting them).

Inputs and outputs:
    q (N, H, D), k, v (N, KVH, D): fp32, fp16 or bf16, one dtype; any strides with a unit last
        stride (slices of one fused qkv buffer are fine).
    cu_seqlens (B+1,) int32 on the device: document b is rows cu[b]:cu[b+1] (cu[0] = 0, cu[B] = N,
        non-decreasing; empty documents allowed). max_seqlen: host int >= the longest document.
    sinks: None or (H,) contiguous, fp32 or a 16-bit dtype (the checkpoint's), read as fp32.
    window: host int, 0 (full causal) or W >= 1; one per layer (GPT-OSS: its sliding_attention layers).
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
in backward instead of the atomic version's 5). Two runs give bit-identical gradients. At large G
(attention_config.DKDV_SPLIT) SPLIT programs share a (key block, kv head), each taking every
SPLIT-th query head and writing fp32 partial sums to a (2, SPLIT, N, KVH, D) scratch that
gemm_splitk.reduce_partials adds in split order: the longest program is SPLIT times shorter.

Launches: the forward has five constexpr switches (PRECISION, TMA, SORTED, SINKS, WINDOW: the
window is a constexpr, compiled per size; GPT-OSS has one, 128), the backward kernels four (no
SINKS: lse carries them). The options add no tiles: shared memory is unchanged (sm_80/sm_90,
checked with tools/arch_compile.py's launches), and both the pointer and the TMA loops take them.

Supported: D from 16 to 256 (non powers of two padded to the next power of two with masks; GPU
block sizes are tuned for D = 64 and 128, D = 80/96 use the 128 table and D = 256 a small-tile one);
any G = H / KVH; fp16, bf16, and fp32 up to D = 128 (ieee dots on CUDA cores: for tests).

Tested: tests/test_attention.py against a padded per-document fp64 reference and torch SDPA per
document: fp32 and fp16 on CPU (Triton interpreter; D 32/64/80, G 1/2/4/8, lengths 0, 1, odd,
30 documents); bf16 on H100 (D 64/80/96/128/256, 100+ documents, one 2048-token document).
Sinks and window (fp32 and fp16 on CPU: windows 1, 3, 16 with documents longer than them, length-1
and empty documents, G 1 to 8, D 32/80, sinks drawn in fp32 or the inputs' dtype, with and without
TMA; bf16 GPU cases with window 128 and D 64/128/256 are gpu-marked, not yet run). The
reference itself equals transformers' gpt_oss eager_attention_forward under its sliding-window mask.
The final tuned block configs were also cross-checked against torch's flash kernel on the two
tools/attn_tune.py cases (max |diff| / max |ref| <= 7.5e-3 for o, dq, dk, dv).

Caution:
    * No host syncs, so cu_seqlens is not validated: if max_seqlen is below the longest document,
      the rows past max_seqlen of that document are never written; rows outside every document
      (cu[B] < N) are never written either.
    * Offsets inside one document are int32: max_seqlen * (row stride) must stay below 2^31
      (checked); document starts are int64.
    * backward must be given the forward's window (its sinks are in lse; passing them is only
      checked); a window or sinks different from the forward's give wrong gradients silently.
    * Block configs must nest (BLOCK_M % BLOCK_N == 0 for forward and dq, the reverse for dk/dv):
      the unmasked loops stop at the diagonal block's start. attention_config.config checks it.
"""

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.attention_config import DELTA_BLOCK_R, SORTED, config, dkdv_split, grid, interpreting
from lean.kernels.gemm import in_tma_at_every_size, tma_desc, tma_ok
from lean.kernels.gemm_splitk import reduce_partials

_LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)
_LN2 = tl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------------------------
# helpers shared by every kernel (inlined by the compiler)

@triton.jit
def _keep(q_idx, k_idx, WINDOW: tl.constexpr):
    """The mask, in one place: does key k_idx take part in query q_idx's softmax? Indices are
    document-relative and already broadcast to the score tile's shape. Causal, and with a
    window (WINDOW > 0) the WINDOW most recent keys only, the query's own included (HF's rule)."""
    keep = k_idx <= q_idx
    if WINDOW > 0:
        keep = keep & (q_idx - k_idx < WINDOW)
    return keep


@triton.jit
def _key_blocks(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """(lo, full): the key blocks below query block [start_m, start_m + BLOCK_M)'s diagonal that
    it visits (forward, dq): [lo, full) partly inside the window (masked), [full, start_m)
    wholly inside (unmasked). Key blocks before lo hold no key any query of the block sees: they
    are never visited. No window: (0, 0)."""
    if WINDOW > 0:
        lo = tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full = (tl.maximum(start_m + BLOCK_M - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        return lo, tl.minimum(full, start_m)
    else:
        return 0, 0


@triton.jit
def _query_blocks(start_n, seqlen, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """(full, hi): the query blocks below key block [start_n, start_n + BLOCK_N)'s diagonal that
    visit it (dk/dv): [start_n + BLOCK_N, full) wholly inside the window (unmasked), [full, hi)
    partly (masked). Queries from hi on see none of its keys: never visited. No window:
    (seqlen, seqlen)."""
    if WINDOW > 0:
        hi = tl.minimum(seqlen, start_n + BLOCK_N - 1 + WINDOW)
        full = start_n + tl.maximum(WINDOW // BLOCK_M * BLOCK_M, BLOCK_N)
        return tl.minimum(full, hi), hi
    else:
        return seqlen, seqlen


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
        before = ((nblk[None, :] > nblk[:, None])
                  | ((nblk[None, :] == nblk[:, None]) & (rb[None, :] < rb[:, None])))
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
              TMA: tl.constexpr, WINDOW: tl.constexpr):
    """One key block of the forward: scores, mask, and the online-softmax update (log2 units).
    A window's first blocks can hide every key from a row (m = -inf so far): exponents then
    subtract 0 instead of -inf (p = 0, alpha = 0, no NaN)."""
    k = _loop_rows(k_src, row0, col, offs_n, stride_kn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    v = _loop_rows(v_src, row0, col, offs_n, stride_vn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                          # (BM, BN)
    if MASK:
        qk = tl.where(_keep(offs_m[:, None], offs_n[None, :], WINDOW), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_sub = m_new
    if MASK and WINDOW > 0:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _dkdv_step(dk, dv, k, v, q_src, do_src, row0, col, lse_row, delta_row, stride_qn, stride_don,
               offs_m, offs_n, offs_d, seqlen, qk_scale,
               HEAD_DIM: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
               WINDOW: tl.constexpr):
    """One query block against this program's key block, in transposed (key, query) layout.
    Rows past the document load lse = +inf (so p = 0) and delta = 0: they add exactly 0."""
    q = _loop_rows(q_src, row0, col, offs_m, stride_qn, seqlen, offs_d, HEAD_DIM, TMA)       # (BM, BD)
    do = _loop_rows(do_src, row0, col, offs_m, stride_don, seqlen, offs_d, HEAD_DIM, TMA)    # (BM, BD)
    lse2 = tl.load(lse_row + offs_m, mask=offs_m < seqlen, other=float("inf")) * _LOG2E
    delta = tl.load(delta_row + offs_m, mask=offs_m < seqlen, other=0.0)
    qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)                         # (BN, BM)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASK:
        pT = tl.where(_keep(offs_m[None, :], offs_n[:, None], WINDOW), pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)                        # (BN, BM)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_src, v_src, row0, col, stride_kn, stride_vn, offs_m, offs_n,
             offs_d, seqlen, qk_scale, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
             PRECISION: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr):
    """One key block of dq: recompute p, then dq += ds @ k."""
    k = _loop_rows(k_src, row0, col, offs_n, stride_kn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    v = _loop_rows(v_src, row0, col, offs_n, stride_vn, seqlen, offs_d, HEAD_DIM, TMA)  # (BN, BD)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                          # (BM, BN)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASK:
        p = tl.where(_keep(offs_m[:, None], offs_n[None, :], WINDOW), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                         # (BM, BN)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


# ----------------------------------------------------------------------------------------------
# kernels. Grid axis 0 heads, axis 1 walks the documents' blocks (_work_item); programs past the
# last block exit at once. Causal block skipping: a query block visits only key
# blocks up to its diagonal (and from its window's first block on); only the diagonal blocks (and
# those the window's edge cuts) pay for the mask.

@triton.jit
def _attention_fwd_kernel(
    o_ptr, lse_ptr,                                  # outputs: (N, H, D), (H, N) fp32
    q_ptr, k_src, v_src, cu_ptr,                     # inputs: (N, H, D), (N, KVH, D) x2, (B+1,)
    sinks_ptr,                                       # (H,) sink logits (read only with SINKS)
    stride_on, stride_oh, stride_qn, stride_qh,      # row / head strides (last stride is 1)
    stride_kn, stride_kh, stride_vn, stride_vh,
    N, B, GROUP, scale,                              # tokens (= lse row stride), documents, H // KVH, scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,   # TMA: k_src, v_src are descriptors
    SORTED: tl.constexpr,                            # the walk's order and grid: _query_program
    SINKS: tl.constexpr, WINDOW: tl.constexpr,       # a sink logit per head; sliding window (0: off)
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
    if SINKS:  # the sink is a key of score `sink` and no value: the softmax starts from it
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full = _key_blocks(start_m, BLOCK_M, BLOCK_N, WINDOW)
    if WINDOW > 0:
        for start_n in range(lo, full, BLOCK_N):               # the window's edge: masked
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                                      stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen,
                                      qk_scale, HEAD_DIM, True, PRECISION, TMA, WINDOW)
    for start_n in range(full, start_m, BLOCK_N):              # keys before the block: no mask
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                                  stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                                  HEAD_DIM, False, PRECISION, TMA, WINDOW)
    for start_n in range(start_m, tl.minimum(start_m + BLOCK_M, seqlen), BLOCK_N):  # diagonal
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                                  stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                                  HEAD_DIM, True, PRECISION, TMA, WINDOW)

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
    dk_ptr, dv_ptr, part_ptr,                        # outputs: (N, KVH, D) each, or (2, SPLIT, N, KVH, D) fp32
    do_src, q_src, k_ptr, v_ptr,                     # (N, H, D) x2, (N, KVH, D) x2
    lse_ptr, delta_ptr, cu_ptr,                      # (H, N) fp32 x2, (B+1,) int32
    stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_don, stride_doh,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    N, B, GROUP, KVH, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,   # TMA: do_src, q_src are descriptors
    SORTED: tl.constexpr,                            # the walk's order and grid (below)
    WINDOW: tl.constexpr,                            # sliding window (0: off); sinks live in lse
    SPLIT: tl.constexpr,                             # programs per kv head; > 1: fp32 partials in part_ptr
):
    if SORTED:  # heads on axis 0: every kv head's item t launches together, longest documents first
        pid_n, seq_start, seqlen = _work_item(tl.program_id(1), cu_ptr, B, BLOCK_N, BLOCK_B, False, True)
        head = tl.program_id(0)
    else:       # items on axis 0, each document's first key block (the most work) first
        pid_n, seq_start, seqlen = _work_item(tl.program_id(0), cu_ptr, B, BLOCK_N, BLOCK_B, False, False)
        head = tl.program_id(1)
    kvh = head // SPLIT                              # SPLIT > 1: this program takes the query heads
    part = head % SPLIT                              # g = part, part + SPLIT, ... of its kv head
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
    full, hi = _query_blocks(start_n, seqlen, BLOCK_M, BLOCK_N, WINDOW)
    for g in range(part, GROUP, SPLIT):              # the query heads sharing this kv head
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
                                qk_scale, HEAD_DIM, True, PRECISION, TMA, WINDOW)
        for start_m in range(start_n + BLOCK_N, full, BLOCK_M):                         # below it
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, seq_start + start_m, h * HEAD_DIM, lse_row,
                                delta_row, stride_qn, stride_don, start_m + offs_m, offs_n, offs_d, seqlen,
                                qk_scale, HEAD_DIM, False, PRECISION, TMA, WINDOW)
        if WINDOW > 0:
            for start_m in range(full, hi, BLOCK_M):                                    # the window's edge
                dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, seq_start + start_m, h * HEAD_DIM, lse_row,
                                    delta_row, stride_qn, stride_don, start_m + offs_m, offs_n, offs_d, seqlen,
                                    qk_scale, HEAD_DIM, True, PRECISION, TMA, WINDOW)

    mask = (offs_n[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    if SPLIT > 1:  # part_ptr (2, SPLIT, N, KVH, D) fp32: dk's unscaled partial sums, then dv's
        p_ptrs = part_ptr + ((part * N + tok0 + offs_n[:, None]) * (KVH * HEAD_DIM)
                             + kvh * HEAD_DIM + offs_d[None, :])
        tl.store(p_ptrs, dk, mask=mask)
        tl.store(p_ptrs + N.to(tl.int64) * (SPLIT * KVH * HEAD_DIM), dv, mask=mask)
    else:
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
    WINDOW: tl.constexpr,                            # sliding window (0: off); sinks live in lse
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
    lo, full = _key_blocks(start_m, BLOCK_M, BLOCK_N, WINDOW)
    if WINDOW > 0:
        for start_n in range(lo, full, BLOCK_N):               # the window's edge: masked
            dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                          stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                          HEAD_DIM, True, PRECISION, TMA, WINDOW)
    for start_n in range(full, start_m, BLOCK_N):              # keys before the block: no mask
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                      stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                      HEAD_DIM, False, PRECISION, TMA, WINDOW)
    for start_n in range(start_m, tl.minimum(start_m + BLOCK_M, seqlen), BLOCK_N):  # diagonal
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, seq_start + start_n, kvh * HEAD_DIM,
                      stride_kn, stride_vn, offs_m, start_n + offs_n, offs_d, seqlen, qk_scale,
                      HEAD_DIM, True, PRECISION, TMA, WINDOW)

    dq_ptrs = dq_ptr + tok0 * stride_dqn + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


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
    if dev.type not in ("cuda", "meta") and not (dev.type == "cpu" and interpreting()):  # meta: compile-only runs
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
    if tma is False or (tma is None and not in_tma_at_every_size()):  # eager: no views built
        return False
    views = [_rows_2d(t) for t in tensors]
    fits = all(v is not None for v in views) and D == triton.next_power_of_2(D)
    if tma is None:
        return fits and D in (64, 128) and tma_ok(*views, macs=0)
    if not fits:
        raise ValueError(f"attention tma=True needs a power-of-two head dim (got {D}) and each row's "
                         "heads packed (stride(1) == D)")
    return bool(tma)


def _check_row_offsets(max_seqlen, **tensors):
    for name, t in tensors.items():
        if (max_seqlen + 256) * t.stride(0) >= 2**31:
            raise ValueError(f"{name}: max_seqlen * row stride ({max_seqlen} * {t.stride(0)}) must "
                             "stay below 2^31 (int32 offsets inside a document)")


def _check_options(H, dev, sinks, window):
    if sinks is not None:
        check(sinks, "sinks", shape=(H,), dtype=(torch.float32, torch.float16, torch.bfloat16), device=dev,
              contiguous=True)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window: expected a host int >= 0 (0: no window), got {window!r}")


def attention_fwd(o, lse, q, k, v, cu_seqlens, max_seqlen, scale, *, sinks=None, window=0, tma=None):
    """o (N, H, D) q.dtype and lse (H, N) fp32 <- causal attention of each document of q, k, v.
    sinks: None or (H,) sink logits (fp32 or a 16-bit dtype, read as fp32), in the softmax's
    denominator only; lse includes them. window: 0 (off) or W >= 1, each query sees its W most
    recent keys (itself included). tma: the loops' loads through descriptors (None: automatic,
    see _use_tma)."""
    N, H, KVH, D, BLOCK_D = _check_common(q, k, v, lse, cu_seqlens, max_seqlen, scale)
    check(o, "o", shape=(N, H, D), dtype=q.dtype, device=q.device, last_contiguous=True)
    _check_options(H, q.device, sinks, window)
    _check_row_offsets(max_seqlen, o=o, q=q, k=k, v=v)
    if N == 0:
        return
    use_tma = _use_tma(tma, D, k, v)
    BLOCK_M, BLOCK_N, warps, stages = config("fwd", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma, arch(q.device).tier)
    B = cu_seqlens.shape[0] - 1
    k_src, v_src = (tma_desc(_rows_2d(t), (BLOCK_N, D)) for t in (k, v)) if use_tma else (k, v)
    _attention_fwd_kernel[grid("fwd", H, _n_items(N, B, max_seqlen, BLOCK_M))](
        o, lse, q, k_src, v_src, cu_seqlens, q if sinks is None else sinks,
        o.stride(0), o.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TMA=use_tma, SORTED=SORTED["fwd"],
        SINKS=sinks is not None, WINDOW=window, num_warps=warps, num_stages=stages)


def attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, *, sinks=None,
                  window=0, tma=None):
    """dq, dk, dv (written with =) <- gradients of attention_fwd for incoming do; delta is scratch.
    sinks, window: as given to attention_fwd (the sinks are already inside lse: only checked here;
    their own gradient is not computed). tma: the loops' loads through descriptors (None:
    automatic, see _use_tma)."""
    N, H, KVH, D, BLOCK_D = _check_common(q, k, v, lse, cu_seqlens, max_seqlen, scale)
    dev = q.device
    _check_options(H, dev, sinks, window)
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

    block_r = DELTA_BLOCK_R
    if interpreting() and H * D >= 512:  # model-sized: few programs of up to 2^17 elements
        block_r = max(16, min(triton.next_power_of_2(N), 2**17 // BLOCK_D))
    _attention_bwd_delta_kernel[(triton.cdiv(N, block_r), H)](
        delta, do, o, do.stride(0), do.stride(1), o.stride(0), o.stride(1), N,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_R=block_r, num_warps=4)

    use_tma = _use_tma(tma, D, q, k, v, do)
    BLOCK_M, BLOCK_N, warps, stages = config("dkdv", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma, arch(q.device).tier)
    do_src, q_src = (tma_desc(_rows_2d(t), (BLOCK_M, D)) for t in (do, q)) if use_tma else (do, q)
    S = dkdv_split(H // KVH, D, window)
    part = torch.empty((2, S, N, KVH, D), dtype=torch.float32, device=dev) if S > 1 else dk  # dk, dv partials
    _attention_bwd_dkdv_kernel[grid("dkdv", KVH * S, _n_items(N, B, max_seqlen, BLOCK_N))](
        dk, dv, part, do_src, q_src, k, v, lse, delta, cu_seqlens,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), do.stride(0), do.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B), PRECISION=precision,
        TMA=use_tma, SORTED=SORTED["dkdv"], WINDOW=window, SPLIT=S, num_warps=warps, num_stages=stages)
    for out, p, alpha in ((dk, part[0], scale), (dv, part[1], 1.0)) if S > 1 else ():  # the partials summed
        rows = _rows_2d(out)  # (N, KVH * D) with out's row stride, None when a row's heads are not packed
        packed = rows if rows is not None else torch.empty((N, KVH * D), dtype=out.dtype, device=dev)
        reduce_partials(packed, p.view(S, N, KVH * D), alpha)
        if rows is None:
            out.copy_(packed.view(N, KVH, D))

    BLOCK_M, BLOCK_N, warps, stages = config("dq", BLOCK_D, q.dtype, max_seqlen, H * D, use_tma, arch(q.device).tier)
    k_src, v_src = (tma_desc(_rows_2d(t), (BLOCK_N, D)) for t in (k, v)) if use_tma else (k, v)
    _attention_bwd_dq_kernel[grid("dq", H, _n_items(N, B, max_seqlen, BLOCK_M))](
        dq, do, q, k_src, v_src, lse, delta, cu_seqlens,
        dq.stride(0), dq.stride(1), do.stride(0), do.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N, B, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=_block_b(B), PRECISION=precision,
        TMA=use_tma, SORTED=SORTED["dq"], WINDOW=window, num_warps=warps, num_stages=stages)
