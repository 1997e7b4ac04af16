"""LoRA weight gradients: g += factor * u^T v, summed over the tokens in a fixed order. The da / db
half of lora_linear_bwd (and all of lora_linear_bwd_da); nothing else calls it.

Shape legend: N tokens in the packed batch, P features of u (K for da, O for db), R LoRA rank (R'
its padded width, see below), S token chunks.

    da (R, K) += scale / (1 - p) * dyb^T drop(x)     u = x (N, K), v = dy B (N, R'), transposed
    db (O, R) += scale * dy^T xa                       u = dy (N, O), v = xa (N, R)
  u (N, P) unit last-dim stride, v (N, R') contiguous, both bf16 / fp16 / fp32; g fp32 contiguous,
  (R, P) if transposed, else (P, R). += lets micro-batches accumulate (the caller zeroes g once a
  step). Nothing is saved.

One kernel. _lora_grad_partial_kernel, grid (P blocks, S): part[s] = u[chunk s]^T v[chunk s] in
fp32, the tokens cut into S chunks so that every SM gets ~two programs (S ~ 2 * 132 / P blocks,
from the shapes alone); with dropout it zeroes the elements of u = x that the forward's mask
dropped (_keep, the one definition of the mask). The partials (S, P*R') are laid out like g:
element (i, r) of chunk s at s*P*R' + r*P + i if transposed, else s*P*R' + i*R' + r. The last of a
column block's S programs to store its partial (an arrival counter a block, _last_of) adds the
block's S partials into g in chunk order, g += factor * (((part[0] + part[1]) + ...) + part[S-1])
(sum_partials): no second launch, and the same bits whichever program comes last. Transposed, v
may carry zero padding columns (R' = the padded rank of lora_linear's dy B): their partial rows
come last and the sum leaves them out. The only atomic counts arrivals: g is bit-identical from
run to run for a given shape and device. swiglu.py's partials are summed by the same two helpers.

Also here, because both files need them and lora_linear.py imports this module (not the reverse):
_keep, the dropout keep-mask, and _block_r, the rank padded for tl.dot.
Tested: through lora_linear_bwd / lora_linear_bwd_da in tests/test_lora_linear.py: fp32 and fp16
(CPU interpreter), bf16 (H100), odd N, K, O, R 8 (padded dy B) and 16, dropout 0 and 0.1,
accumulation, bitwise repeatability, deferred da == whole backward.
Caution: the scratch (S, P*R') fp32 comes from torch's caching allocator on every call; runtime/
plan_bytes.py mirrors its size (_lora_partials) and the CPU tests fail when the two drift apart.
The counters (counters(): a per-device ring of 65,536 int32, 256 KiB once) must be back at 0 after
every launch, which the last program of each block sees to (tests/test_swiglu.py runs launches
on the same slots). Only a launch that dies half-way leaves its slots set, in a CUDA context that
an error has ended anyway.
"""
import torch
import triton
import triton.language as tl

from lean.kernels.arch import arch
from lean.kernels.gemm import interpreting


@triton.jit
def _keep(seed, idx, p):
    """Dropout keep-mask of the x elements at flat int64 indices idx = n * K + k of an (N, K) x."""
    return tl.rand(seed, idx) >= p


@triton.jit
def _last_of(cnt_ptr, S):
    """True in the last of the S programs of this column block (grid axis 0: every chunk s of it) to
    get here, after each has stored its partials: that one sums them into g. cnt_ptr[pid 0] counts
    arrivals (an acq_rel atomic at GPU scope after a CTA barrier: every thread's partial stores are
    released with it); the last resets it to 0 for the next launch (counters())."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    last = arrived == S - 1
    if last:
        tl.store(cnt_ptr + tl.program_id(0), 0)
    return last


@triton.jit
def sum_partials(g_ptr, part_ptr, offs, mask, S, stride_s, factor, SUM_S: tl.constexpr):
    """g[offs] += factor * (((part[0] + part[1]) + part[2]) + ... + part[S-1])[offs], in that order
    whatever the tile's shape (so that two kernels that store the same partials get the same bits);
    SUM_S loads in flight at a time, read at L2 (.cg: other programs wrote them)."""
    acc = tl.zeros(offs.shape, tl.float32)
    stride_s = tl.cast(stride_s, tl.int64)
    for s0 in range(0, S, SUM_S):
        for j in tl.static_range(SUM_S):
            acc += tl.load(part_ptr + (s0 + j) * stride_s + offs, mask=mask & (s0 + j < S), other=0.0,
                           cache_modifier=".cg")
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    tl.store(g_ptr + offs, g + factor * acc, mask=mask)


@triton.jit
def _lora_grad_partial_kernel(
    part_ptr, part2_ptr, part3_ptr,         # (S, P*R) fp32 scratch each, element (i, r) at i*stride_pi + r*stride_pr
    u_ptr, v_ptr, v2_ptr, v3_ptr,           # u (N, P) row stride stride_u; v (N, R) contiguous each
    g_ptr, g2_ptr, g3_ptr, cnt_ptr,         # fp32 gradients +=, laid out like one partial; (P blocks,) int32 counters
    N, P, R, RG, stride_u, stride_pi, stride_pr, chunk, seed, p, factor,
    DROPOUT: tl.constexpr,                  # u is x: zero the elements the dropout mask drops
    NV: tl.constexpr,                       # 1..3 (v, part, g) sharing u (dropout 0): one read of u
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    SUM_S: tl.constexpr,
):
    """part[s] = u[tokens of chunk s]^T @ v[same tokens]: da (u = x, v = dy B) and db (u = dy, v = xa);
    the last of a column block's S programs adds its S partials into g (r < RG: padding rows of a
    transposed v stay out). With NV > 1, part2 / g2 (part3 / g3) from v2 (v3) alike, each the bits
    it would have alone."""
    s = tl.program_id(1)
    ri = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    rt = s * chunk + tl.arange(0, BLOCK_T)
    rr = tl.arange(0, BLOCK_R)
    i_ok, r_ok = ri < P, rr < R
    ut_ptrs = u_ptr + rt.to(tl.int64)[None, :] * stride_u + ri[:, None]    # u^T tile (BLOCK_P, BLOCK_T)
    v_offs = rt.to(tl.int64)[:, None] * R + rr[None, :]                    # v tile (BLOCK_T, BLOCK_R)
    acc = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    for t0 in range(0, chunk, BLOCK_T):
        t_ok = rt + t0 < N
        ut = tl.load(ut_ptrs, mask=i_ok[:, None] & t_ok[None, :], other=0.0)
        if DROPOUT:
            idx = (rt + t0).to(tl.int64)[None, :] * P + ri[:, None]
            ut = tl.where(_keep(seed, idx, p), ut, tl.zeros_like(ut))
        v_mask = t_ok[:, None] & r_ok[None, :]
        acc = tl.dot(ut, tl.load(v_ptr + v_offs, mask=v_mask, other=0.0), acc, input_precision=PRECISION)
        if NV > 1:
            acc2 = tl.dot(ut, tl.load(v2_ptr + v_offs, mask=v_mask, other=0.0), acc2, input_precision=PRECISION)
        if NV > 2:
            acc3 = tl.dot(ut, tl.load(v3_ptr + v_offs, mask=v_mask, other=0.0), acc3, input_precision=PRECISION)
        ut_ptrs += BLOCK_T * stride_u
        v_offs += BLOCK_T * R
    offs = ri[:, None] * stride_pi + rr[None, :] * stride_pr
    part_mask = i_ok[:, None] & r_ok[None, :]
    part_offs = s.to(tl.int64) * P * R + offs
    tl.store(part_ptr + part_offs, acc, mask=part_mask)
    if NV > 1:
        tl.store(part2_ptr + part_offs, acc2, mask=part_mask)
    if NV > 2:
        tl.store(part3_ptr + part_offs, acc3, mask=part_mask)
    if _last_of(cnt_ptr, tl.num_programs(1)):
        g_mask = i_ok[:, None] & (rr < RG)[None, :]
        sum_partials(g_ptr, part_ptr, offs, g_mask, tl.num_programs(1), P * R, factor, SUM_S)
        if NV > 1:
            sum_partials(g2_ptr, part2_ptr, offs, g_mask, tl.num_programs(1), P * R, factor, SUM_S)
        if NV > 2:
            sum_partials(g3_ptr, part3_ptr, offs, g_mask, tl.num_programs(1), P * R, factor, SUM_S)


# ---------------------------------------------------------------------------------------------
# Launch configuration, H100.
# da/db partials (BLOCK_P, BLOCK_T, num_warps, num_stages): 64x64 w4 s3 beat 128x64 (the earlier
# untuned pick), 128x128 w8 and 256x64 w8 on all nine shapes, 8-30% (tools/step_levers.py lora).
_GRAD = (64, 64, 4, 3)
# The sum of the partials (sum_partials): SUM_S loads in flight at a time. It was a kernel of its own,
# one a gradient (14 a Qwen3-0.6B layer: 392 launches, 1.05 ms of a 68.8 ms step, H200 graph
# profile); a 1-D loop there that waited one L2 latency a partial had cost 9.1 us a call (H100).
SUM_S = 8
_COUNTERS = {}                  # device -> [(n,) int32 counters, next free]: counters()
_N_COUNTERS = 1 << 16


def counters(n, device):
    """n int32 counters at 0 for one launch's column blocks (_last_of), from a per-device ring:
    the kernels leave each at 0 again, so a launch takes the next n and the ring wraps around. A
    captured launch keeps its slots on every replay; launches in flight together (another stream)
    get different ones unless 65,536 counters are taken between them."""
    ring = _COUNTERS.get(device)
    if ring is None:
        ring = _COUNTERS[device] = [torch.zeros(_N_COUNTERS, dtype=torch.int32, device=device), 0]
    if n > _N_COUNTERS:
        raise ValueError(f"counters: {n} column blocks in one launch (at most {_N_COUNTERS})")
    start = ring[1] if ring[1] + n <= _N_COUNTERS else 0
    ring[1] = start + n
    return ring[0][start:start + n]


def _block_r(R):
    """The rank padded for tl.dot (a power of two, at least 16): BLOCK_R, and lora_linear's RP."""
    return max(16, triton.next_power_of_2(R))


def _lora_grad(g, u, v, factor, seed, dropout, prec, *, transposed, big=False, more=()):
    """g += factor * u^T v, u (N, P), v (N, R'); g is (R, P) if transposed, else (P, R) with
    R = R'. Transposed, v may carry zero padding columns (R' > R): their partial rows come last
    and are left out of the sum. big: a model-sized problem under the interpreter. more: up to
    two further (g, v) pairs of the same shapes sharing u (dropout 0): one read of u for all."""
    N, P = u.shape
    R = v.shape[1]
    pairs = [(g, v)] + list(more)
    BP, BT, warps, stages, chunk, S = grad_chunking(N, P, u.device, big)
    parts = [torch.empty((S, P * R), device=u.device, dtype=torch.float32) for _ in pairs]  # (S, P*R) each
    vs, gs = [w for _, w in pairs], [gi for gi, _ in pairs]
    pad = lambda ts: ts + ts[:1] * (3 - len(ts))  # noqa: E731  (unused slots: never touched)
    _lora_grad_partial_kernel[(triton.cdiv(P, BP), S)](
        *pad(parts), u, *pad(vs), *pad(gs), counters(triton.cdiv(P, BP), u.device),
        N, P, R, g.numel() // P, u.stride(0), 1 if transposed else R, P if transposed else 1,
        chunk, seed, float(dropout), float(factor),
        DROPOUT=dropout > 0.0, NV=len(pairs), BLOCK_P=BP, BLOCK_T=BT, BLOCK_R=_block_r(R), PRECISION=prec,
        SUM_S=SUM_S, num_warps=warps, num_stages=stages)


def grad_chunking(N, P, device, big=False):
    """(BLOCK_P, BLOCK_T, num_warps, num_stages, chunk, S) of the partial pass over u (N, P): S
    token chunks of `chunk` rows, enough to give every SM two programs; shapes alone decide it (the
    bits of g depend on it). big: a model-sized problem under the interpreter (one chunk, one
    feature block up to 2048 wide: the interpreter runs programs one by one). Shared with
    swiglu.lora_chunking (on these tiles swiglu_bwd_lora's partials are this file's bits)."""
    BP, BT, warps, stages = (32, 32, 4, 1) if interpreting() else _GRAD
    if big:
        BP = min(triton.next_power_of_2(P), 2048)
        BT = max(16, min(triton.next_power_of_2(N), 2**18 // BP))
    p_blocks = triton.cdiv(P, BP)
    chunk = BT * triton.cdiv(triton.cdiv(N, 1 if big else triton.cdiv(2 * arch(device).sms, p_blocks)), BT)
    return BP, BT, warps, stages, chunk, triton.cdiv(N, chunk)
