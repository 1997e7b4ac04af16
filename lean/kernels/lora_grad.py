"""LoRA weight gradients: g += factor * u^T v, summed over the tokens in a fixed order. The da / db
half of lora_linear_bwd (and all of lora_linear_bwd_da); nothing else calls it.

Shape legend: N tokens in the packed batch, P features of u (K for da, O for db), R LoRA rank (R'
its padded width, see below), S token chunks.

    da (R, K) += scale / (1 - p) * dyb^T drop(x)     u = x (N, K), v = dy B (N, R'), transposed
    db (O, R) += scale * dy^T xa                       u = dy (N, O), v = xa (N, R)
  u (N, P) unit last-dim stride, v (N, R') contiguous, both bf16 / fp16 / fp32; g fp32 contiguous,
  (R, P) if transposed, else (P, R). += lets micro-batches accumulate (the caller zeroes g once a
  step). Nothing is saved.

Two kernels. _lora_grad_partial_kernel, grid (P blocks, S): part[s] = u[chunk s]^T v[chunk s] in
fp32, the tokens cut into S chunks so that every SM gets ~two programs (S ~ 2 * 132 / P blocks,
from the shapes alone); with dropout it zeroes the elements of u = x that the forward's mask
dropped (_keep, the one definition of the mask). The partials (S, P*R') are laid out like g:
element (i, r) of chunk s at s*P*R' + r*P + i if transposed, else s*P*R' + i*R' + r, so that
_lora_grad_reduce_kernel sums S flat rows: g += factor * (part[0] + ... + part[S-1]), BLOCK_S rows
at a time (each group a tree, the groups in order). Transposed, v may carry zero padding columns
(R' = the padded rank of lora_linear's dy B): their partial rows come last and the sum leaves them
out. No atomics: g is bit-identical from run to run for a given shape and device.

Also here, because both files need them and lora_linear.py imports this module (not the reverse):
_keep, the dropout keep-mask, and _block_r, the rank padded for tl.dot.
Tested: through lora_linear_bwd / lora_linear_bwd_da in tests/test_lora_linear.py: fp32 and fp16
(CPU interpreter), bf16 (H100), odd N, K, O, R 8 (padded dy B) and 16, dropout 0 and 0.1,
accumulation, bitwise repeatability, deferred da == whole backward.
Caution: the scratch (S, P*R') fp32 comes from torch's caching allocator on every call; runtime/
plan_bytes.py mirrors its size (_lora_partials) and the CPU tests fail when the two drift apart.
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
def _lora_grad_partial_kernel(
    part_ptr, part2_ptr, part3_ptr,         # (S, P*R) fp32 out each, element (i, r) at i*stride_pi + r*stride_pr
    u_ptr, v_ptr, v2_ptr, v3_ptr,           # u (N, P) row stride stride_u; v (N, R) contiguous each
    N, P, R, stride_u, stride_pi, stride_pr, chunk, seed, p,
    DROPOUT: tl.constexpr,                  # u is x: zero the elements the dropout mask drops
    NV: tl.constexpr,                       # 1..3 (v, part) pairs sharing u (dropout 0): one read of u
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    """part[s] = u[tokens of chunk s]^T @ v[same tokens]: da (u = x, v = dy B) and db (u = dy, v = xa).
    With NV > 1, part2 (part3) from v2 (v3) alike, each the bits it would have alone."""
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
    part_offs = s.to(tl.int64) * P * R + ri[:, None] * stride_pi + rr[None, :] * stride_pr
    part_mask = i_ok[:, None] & r_ok[None, :]
    tl.store(part_ptr + part_offs, acc, mask=part_mask)
    if NV > 1:
        tl.store(part2_ptr + part_offs, acc2, mask=part_mask)
    if NV > 2:
        tl.store(part3_ptr + part_offs, acc3, mask=part_mask)


@triton.jit
def _lora_grad_reduce_kernel(g_ptr, part_ptr, S, numel, stride_s, factor, BLOCK: tl.constexpr,
                             BLOCK_S: tl.constexpr = 1):
    """g (numel,) fp32 += factor * sum over s = 0, 1, ..., S-1 of part[s, :numel] (fixed order:
    BLOCK_S partials at a time, each group summed as a tree, the groups in order). BLOCK_S > 1
    puts a group's loads in flight together: one L2 latency per group, not per partial."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    rs = tl.arange(0, BLOCK_S)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ptrs = part_ptr + (s0 + rs).to(tl.int64)[:, None] * stride_s + offs[None, :]
        acc += tl.sum(tl.load(ptrs, mask=((s0 + rs) < S)[:, None] & ok[None, :], other=0.0), axis=0)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)
    tl.store(g_ptr + offs, g + factor * acc, mask=ok)


# ---------------------------------------------------------------------------------------------
# Launch configuration, H100.
# da/db partials (BLOCK_P, BLOCK_T, num_warps, num_stages): 64x64 w4 s3 beat 128x64 (the earlier
# untuned pick), 128x128 w8 and 256x64 w8 on all nine shapes, 8-30% (tools/step_levers.py lora).
_GRAD = (64, 64, 4, 3)
_REDUCE = 1024                  # reduce BLOCK under the interpreter (2^14 for a model-sized problem), untuned
# GPU reduce (BLOCK, BLOCK_S): a 1-D loop over S partials (S = 16..64 here) waited on one L2 latency
# per partial: 9.1 us a call, 392 calls = 3.6 ms of a Qwen3-0.6B step (H100 profile, graph replay).
_REDUCE_GPU, _REDUCE_GPU_S = 128, 64


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
    vs = [w for _, w in pairs]
    _lora_grad_partial_kernel[(triton.cdiv(P, BP), S)](
        *(parts + parts[:1] * (3 - len(parts))), u, *(vs + vs[:1] * (3 - len(vs))),  # unused slots: never touched
        N, P, R, u.stride(0), 1 if transposed else R, P if transposed else 1,
        chunk, seed, float(dropout),
        DROPOUT=dropout > 0.0, NV=len(pairs), BLOCK_P=BP, BLOCK_T=BT, BLOCK_R=_block_r(R), PRECISION=prec,
        num_warps=warps, num_stages=stages)
    for (gi, _), part in zip(pairs, parts):
        grad_reduce(gi, part, factor, big)


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


def grad_reduce(g, part, factor, big=False):
    """g (flat, fp32) += factor * (part[0] + ... + part[S-1]) over its first g.numel() columns:
    _lora_grad_reduce_kernel on the (S, width) partials of the partial pass."""
    S = part.shape[0]
    block, block_s = 2**14 if big else _REDUCE, 1
    if not interpreting():  # GPU: all partials of a column in flight at once (32 KB a program at most)
        block, block_s = _REDUCE_GPU, min(_REDUCE_GPU_S, triton.next_power_of_2(S))
    _lora_grad_reduce_kernel[(triton.cdiv(g.numel(), block),)](
        g, part, S, g.numel(), part.shape[1], float(factor), BLOCK=block, BLOCK_S=block_s)
