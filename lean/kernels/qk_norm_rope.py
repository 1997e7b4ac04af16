"""Qwen3's per-head QK-norm fused with RoPE: q = rope(rmsnorm_head(q_pre) * w_q), k likewise.

Shape legend: N tokens in the packed batch, H/KVH query/key heads, D head dim, D2 = D/2.

    q_pre, q, dq, dq_pre : (N, H, D)    one activation dtype (fp32, fp16 or bf16); any token stride,
    k_pre, k, dk, dk_pre : (N, KVH, D)  heads packed (head stride D), unit stride in the last dim
    w_q, w_k             : (D,)         the activation dtype, contiguous
    rstd_q, rstd_k       : (N*H,), (N*KVH,) fp32, contiguous; row n*H + h is token n, head h
    cos, sin             : (N, D2)      fp32, contiguous: rope.rope_table's table

Forward, per (token, head) row x of q_pre (k_pre alike), rmsnorm.py's ops then rope.py's:
    rstd   = rsqrt(mean(fp32(x)^2) + eps)                fp32, saved
    y      = round(round(fp32(x) * rstd) * w)            rmsnorm_fwd's output
    q[:D2] = round(y1*cos - y2*sin),  q[D2:] = round(y2*cos + y1*sin),  y1, y2 = y[:D2], y[D2:]
Backward, rope_bwd's ops then rmsnorm_bwd's (w frozen: no dw):
    dy     = round(dq rotated by -angle)                 rope_bwd's in-place result, kept in registers
    nh = fp32(x) * rstd,  dn = dy * w
    dq_pre = round(rstd * (dn - nh * mean(dn * nh)))
Saves: rstd_q, rstd_k; q_pre, k_pre (the backward's x) are the caller's. dq, dk are only read.
Traffic (bf16): forward reads q_pre, writes q (4 bytes an element; the two kernels: 8); backward
reads dq and q_pre, writes dq_pre (6; the two kernels: 10).

The two-kernel path's math, forward (rmsnorm_fwd on (N*H, D) views, then rope_fwd) and backward
(rope_bwd, then rmsnorm_bwd): the same fp32 ops in the same order, rounded to the activation dtype
where those kernels store. Under the interpreter that gives the same bits; on the H100 the
compiler still contracts some products differently (measured at Qwen3 sizes: 63-68 of 16.8M bf16
outputs one ulp apart, fp32 8% of elements 1-2 ulp), so there the check is the tolerance rule.
What the kernel does to stay as close as it can:
  - a row's sum order. A program holds whole rows in rmsnorm's own tile (rmsnorm._config: rows x
    next_pow2(D), its warp count), loaded as rmsnorm loads them, so Triton lays out and reduces
    each row alike. Rope's pairs (c, c + D2) would split the row in halves, so each element reads
    its rotate-half partner a second time (an L1 hit) instead: the rotated gradient the backward
    reduces over then sits in the tile's layout. cos/sin are gathered per row (token = row // heads).
  - FMA contraction of a*cos -/+ b*sin: written x*cos + partner*s, s = sin times -1.0 on the first
    half (the backward's sin negated first, as rope.py does). The product that may fuse, x*cos, is
    the one rope.py's compiles into its fma.
  - signed zeros: s is sin * -1.0, an exact sign flip, not Triton's -sin (0 - sin, +0 at sin = +0,
    where rope.py's a - b*sin keeps a -0 that a + b*s would lose).
Checked without a GPU by compiling for sm_90 (triton 3.6): the reduced tiles have rmsnorm's layout
(fp32/fp16/bf16, D 64/128/256); for bf16 D=128 the PTX sums in rmsnorm's order (one fma chain per
thread, butterflies 8, 4, 2, 1) and rotates as rope.py's (fma(x, cos, -(partner*sin))).
One launch for q and k: row blocks 0 .. n_q_blocks-1 are q's, the rest k's. The tile is rmsnorm's
(D=128: 16 rows, 4 warps), untuned for this op.

Supported: even D, 2 <= D <= 512 (rope.py's range); any N, H, KVH >= 1; fp32 / fp16 / bf16; eps a
Python number.
Tested: tests/test_qk_norm_rope.py: bit equality (a GPU: 4 ulps) with rmsnorm_fwd + rope_fwd and rope_bwd +
rmsnorm_bwd (q, k, rstd_q, rstd_k; dq_pre, dk_pre; dq, dk untouched), fp32 and fp16 through the
interpreter (N 1, 7, 37; H/KVH 4/2, 3/1; D 16, 64, 80, 128; documents starting at position 0 and
positions deep into a long one; -0.0 inputs), the tolerance rule against rmsnorm_ref + rope_ref and
autograd, token-strided views, launcher rejections; on the H100 the tolerance rule in fp32 and bf16
at Qwen3-0.6B and -8B sizes. tests/test_step.py: the Qwen3 step against HF + PEFT.
Speed (H100, Qwen3-0.6B step, CUDA graph): 100,945 tok/s packed with it, 100,326 without (the same
day, different calls: within run-to-run noise of ~1%); the separate rope pass it removes cost
1.9 ms of the 82 ms step.

Caution:
  - Parity with the two kernels rests on Triton laying the tile out as in rmsnorm.py (the tile
    config is imported from it for that reason) and contracting as rope.py does; the tests compare
    bits under the interpreter and hold a GPU to 4 ulps. Change either kernel's math and they fail first.
  - Outputs must not overlap inputs (q over q_pre would work, rows are read before they are
    written, but is not tested).
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.rmsnorm import _config as _rmsnorm_tile

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _row_tile(blk, n_rows, heads, D, D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows blk*BLOCK_N.. of a (n_rows = N*heads, D) head-row view: row index, token, head offset
    (in elements, int64), column, rotate-half partner column and masks."""
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    tok = (rows // heads).to(tl.int64)
    head_off = (rows % heads).to(tl.int64) * D
    part = tl.where(cols < D2, cols + D2, cols - D2)   # x[part] is rotate_half's partner of x
    return rows, row_ok, mask, tok, head_off, cols, part


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, tok, cols, mask, BACKWARD: tl.constexpr, D2: tl.constexpr):
    """cos and the signed sin s (BLOCK_N, BLOCK_C) fp32: x rotated = x*cos + x[part]*s."""
    offs = tok[:, None] * D2 + (cols % D2)[None, :]
    cos = tl.load(cos_ptr + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + offs, mask=mask, other=0.0)
    if BACKWARD:
        sin = -sin  # the transpose of a rotation is the rotation by the opposite angle (as rope.py)
    # s = -sin on the first half: times -1.0, an exact sign flip (Triton's -x is 0 - x, +0 at sin = +0)
    return cos, sin * tl.where(cols < D2, -1.0, 1.0)[None, :]


@triton.jit
def _norm_rope_rows(out_ptr, rstd_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr,
                    blk, n_rows, heads, stride_out, stride_x, D, eps,
                    D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, row_ok, mask, tok, head_off, cols, part = _row_tile(blk, n_rows, heads, D, D2, BLOCK_N, BLOCK_C)
    act = out_ptr.dtype.element_ty
    x_row = x_ptr + (tok * stride_x + head_off)[:, None]
    # rmsnorm_fwd, on rmsnorm's tile
    xf = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)          # (BLOCK_N,) fp32
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    y = ((xf * rstd[:, None]).to(act).to(tl.float32) * w.to(tl.float32)[None, :]).to(act)
    # the same for the partner elements
    xpf = tl.load(x_row + part[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + part, mask=cols < D, other=0.0)
    yp = ((xpf * rstd[:, None]).to(act).to(tl.float32) * wp.to(tl.float32)[None, :]).to(act)
    # rope_fwd
    cos, s = _cos_sin(cos_ptr, sin_ptr, tok, cols, mask, False, D2)
    out = y.to(tl.float32) * cos + yp.to(tl.float32) * s
    tl.store(out_ptr + (tok * stride_out + head_off)[:, None] + cols[None, :], out.to(act), mask=mask)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    q_ptr, k_ptr, rstd_q_ptr, rstd_k_ptr,          # outputs: (N, H, D), (N, KVH, D), (N*H,), (N*KVH,)
    q_pre_ptr, k_pre_ptr, w_q_ptr, w_k_ptr,        # inputs: (N, H, D), (N, KVH, D), (D,), (D,)
    cos_ptr, sin_ptr,                              # (N, D2) fp32
    stride_q, stride_k, stride_qp, stride_kp,      # token strides, in elements
    N, H, KVH, D, n_q_blocks, eps,
    D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_q_blocks:
        _norm_rope_rows(q_ptr, rstd_q_ptr, q_pre_ptr, w_q_ptr, cos_ptr, sin_ptr, pid, N * H, H,
                        stride_q, stride_qp, D, eps, D2, BLOCK_N, BLOCK_C)
    else:
        _norm_rope_rows(k_ptr, rstd_k_ptr, k_pre_ptr, w_k_ptr, cos_ptr, sin_ptr, pid - n_q_blocks, N * KVH, KVH,
                        stride_k, stride_kp, D, eps, D2, BLOCK_N, BLOCK_C)


@triton.jit
def _rope_norm_bwd_rows(dx_ptr, dy_ptr, x_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr,
                        blk, n_rows, heads, stride_dx, stride_dy, stride_x, D,
                        D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, row_ok, mask, tok, head_off, cols, part = _row_tile(blk, n_rows, heads, D, D2, BLOCK_N, BLOCK_C)
    act = dx_ptr.dtype.element_ty
    # rope_bwd: the incoming gradient rotated back, rounded where rope_bwd stores it
    dy_row = dy_ptr + (tok * stride_dy + head_off)[:, None]
    g = tl.load(dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gp = tl.load(dy_row + part[None, :], mask=mask, other=0.0).to(tl.float32)
    cos, s = _cos_sin(cos_ptr, sin_ptr, tok, cols, mask, True, D2)
    dy = (g * cos + gp * s).to(act).to(tl.float32)
    # rmsnorm_bwd, on rmsnorm's tile
    x = tl.load(x_ptr + (tok * stride_x + head_off)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    nh = x * rstd[:, None]
    dn = dy * w[None, :]
    dx = rstd[:, None] * (dn - nh * (tl.sum(dn * nh, axis=1) / D)[:, None])
    tl.store(dx_ptr + (tok * stride_dx + head_off)[:, None] + cols[None, :], dx.to(act), mask=mask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    dq_pre_ptr, dk_pre_ptr,                        # outputs: (N, H, D), (N, KVH, D)
    dq_ptr, dk_ptr,                                # incoming gradients: (N, H, D), (N, KVH, D), read only
    q_pre_ptr, k_pre_ptr, w_q_ptr, w_k_ptr,        # inputs: (N, H, D), (N, KVH, D), (D,), (D,)
    rstd_q_ptr, rstd_k_ptr, cos_ptr, sin_ptr,      # (N*H,), (N*KVH,), (N, D2), (N, D2) fp32
    stride_dqp, stride_dkp, stride_dq, stride_dk, stride_qp, stride_kp,  # token strides, in elements
    N, H, KVH, D, n_q_blocks,
    D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_q_blocks:
        _rope_norm_bwd_rows(dq_pre_ptr, dq_ptr, q_pre_ptr, w_q_ptr, rstd_q_ptr, cos_ptr, sin_ptr, pid, N * H, H,
                            stride_dqp, stride_dq, stride_qp, D, D2, BLOCK_N, BLOCK_C)
    else:
        _rope_norm_bwd_rows(dk_pre_ptr, dk_ptr, k_pre_ptr, w_k_ptr, rstd_k_ptr, cos_ptr, sin_ptr, pid - n_q_blocks,
                            N * KVH, KVH, stride_dkp, stride_dk, stride_kp, D, D2, BLOCK_N, BLOCK_C)


# ----------------------------------------------------------------------------- launchers

def _check_heads(t, name, N, heads, D, dt, dev):
    check(t, name, shape=(N, heads, D), dtype=dt, device=dev, last_contiguous=True)
    if heads > 1 and t.stride(1) != D:
        raise ValueError(f"{name}: expected heads packed (head stride {D}), got strides {t.stride()}")


def _check_all(q, k, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin, names):
    """Common checks; names: what q, k are called (q, k forward; dq_pre, dk_pre backward)."""
    check(q_pre, "q_pre", shape=(None, None, None), dtype=_DTYPES, last_contiguous=True)
    N, H, D = q_pre.shape
    dt, dev = q_pre.dtype, q_pre.device
    check(k_pre, "k_pre", shape=(N, None, D), dtype=dt, device=dev, last_contiguous=True)
    KVH = k_pre.shape[1]
    if H == 0 or KVH == 0:
        raise ValueError(f"q_pre, k_pre: need at least one head, got {H} and {KVH}")
    if D % 2 or not 2 <= D <= 512:
        raise ValueError(f"q_pre: head dim must be even and in [2, 512], got {D}")
    _check_heads(q_pre, "q_pre", N, H, D, dt, dev)
    _check_heads(k_pre, "k_pre", N, KVH, D, dt, dev)
    _check_heads(q, names[0], N, H, D, dt, dev)
    _check_heads(k, names[1], N, KVH, D, dt, dev)
    check(w_q, "w_q", shape=(D,), dtype=dt, device=dev, contiguous=True)
    check(w_k, "w_k", shape=(D,), dtype=dt, device=dev, contiguous=True)
    check(rstd_q, "rstd_q", shape=(N * H,), dtype=torch.float32, device=dev, contiguous=True)
    check(rstd_k, "rstd_k", shape=(N * KVH,), dtype=torch.float32, device=dev, contiguous=True)
    check(cos, "cos", shape=(N, D // 2), dtype=torch.float32, device=dev, contiguous=True)
    check(sin, "sin", shape=(N, D // 2), dtype=torch.float32, device=dev, contiguous=True)
    return N, H, KVH, D


def _grid(N, H, KVH, D):
    """rmsnorm's row tile (see the module docstring: the bits depend on it), q's row blocks then k's."""
    BLOCK_N, BLOCK_C, num_warps = _rmsnorm_tile(D, N * (H + KVH))
    n_q_blocks = triton.cdiv(N * H, BLOCK_N)
    return (n_q_blocks + triton.cdiv(N * KVH, BLOCK_N),), n_q_blocks, BLOCK_N, BLOCK_C, num_warps


def qk_norm_rope_fwd(q, k, rstd_q, rstd_k, q_pre, k_pre, w_q, w_k, cos, sin, eps):
    """q (N, H, D) = rope(rmsnorm per head(q_pre) * w_q), k (N, KVH, D) likewise; writes q, k and
    rstd_q (N*H,), rstd_k (N*KVH,) fp32. The bits of rmsnorm_fwd then rope_fwd. Returns nothing."""
    N, H, KVH, D = _check_all(q, k, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin, ("q", "k"))
    if not isinstance(eps, (int, float)):
        raise TypeError(f"qk_norm_rope_fwd: eps must be a Python number (a tensor would sync), "
                        f"got {type(eps).__name__}")
    if N == 0:
        return
    grid, n_q_blocks, BLOCK_N, BLOCK_C, num_warps = _grid(N, H, KVH, D)
    _qk_norm_rope_fwd_kernel[grid](
        q, k, rstd_q, rstd_k,
        q_pre, k_pre, w_q, w_k,
        cos, sin,
        q.stride(0), k.stride(0), q_pre.stride(0), k_pre.stride(0),
        N, H, KVH, D, n_q_blocks, float(eps),
        D2=D // 2, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )


def qk_norm_rope_bwd(dq_pre, dk_pre, dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin):
    """dq_pre (N, H, D), dk_pre (N, KVH, D) = the gradient of qk_norm_rope_fwd's q, k (dq, dk) through
    rope, then the per-head norm. The bits of rope_bwd then rmsnorm_bwd; dq, dk are left unmodified
    (rope_bwd rotates them in place). Returns nothing."""
    N, H, KVH, D = _check_all(dq_pre, dk_pre, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin,
                              ("dq_pre", "dk_pre"))
    _check_heads(dq, "dq", N, H, D, q_pre.dtype, q_pre.device)
    _check_heads(dk, "dk", N, KVH, D, q_pre.dtype, q_pre.device)
    if N == 0:
        return
    grid, n_q_blocks, BLOCK_N, BLOCK_C, num_warps = _grid(N, H, KVH, D)
    _qk_norm_rope_bwd_kernel[grid](
        dq_pre, dk_pre,
        dq, dk,
        q_pre, k_pre, w_q, w_k,
        rstd_q, rstd_k, cos, sin,
        dq_pre.stride(0), dk_pre.stride(0), dq.stride(0), dk.stride(0), q_pre.stride(0), k_pre.stride(0),
        N, H, KVH, D, n_q_blocks,
        D2=D // 2, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )
