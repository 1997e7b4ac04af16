"""RMSNorm, optionally fused with the residual add before it: y = w * norm(x [+ residual]).

Shape legend: N rows (tokens in the packed batch, or N*H heads for per-head QK-norm), C the
normalised width (hidden size C, or head dim D for QK-norm).

    x, residual, h, y, dy, dx, dresidual : (N, C) in one activation dtype (fp32, fp16 or bf16);
                                           any row stride, unit stride in the last dim, so a
                                           (N*H, D) view of a q/k buffer serves QK-norm.
    w                                    : (C,) in the activation dtype, contiguous.
    rstd                                 : (N,) fp32, contiguous.  dw: (C,) fp32, contiguous.

Forward, in HF LlamaRMSNorm / Qwen3RMSNorm cast order:
    h    = round(x + residual)                   only with residual; the residual stream is kept
                                                 in the activation dtype, as HF does
    rstd = rsqrt(mean(fp32(h)^2) + eps)          fp32, saved
    n    = round(fp32(h) * rstd)                 to the activation dtype
    y    = round(n * w)                          n * w is exact in fp32, so one rounding
Saved for backward: rstd. The normalised tensor (h, or x without residual) is the caller's.
The backward can write y again (y=): a layer that dropped y after its forward gets it back, the
same bits, from what the backward reads anyway (one more store, no extra pass).

Backward (the forward's roundings treated as identity; all in fp32, each output rounded once):
    nh = fp32(h) * rstd,   dn = dy * w
    dx = rstd * (dn - nh * mean(dn * nh))  [+ dresidual]
    dw = sum over rows of dy * nh          written with `=`, deterministic: each program sums its
                                           rows into one row of a (P, C) fp32 scratch, then a
                                           second kernel sums the P rows in a fixed order.

Supported: 1 <= C <= 65536 (a row is held in registers; past C = 16384 expect register spills,
correct but slower); fp32 / fp16 / bf16; eps a Python number.
Tested: tests/test_rmsnorm.py: fp32 and fp16 through the interpreter (C 37, 131, 1000; N 1, 7,
129), bf16 on GPU; residual, strided QK-norm view, dx aliasing dresidual, dw on/off, HF parity.

Caution:
  - Bit parity with HF holds up to the fp32 sum order of mean(h^2) and rsqrt's last bit: where
    those differ by one ulp, a rare element of y differs by one ulp of the activation dtype.
  - y and h may be the very tensor x or residual (each program reads its rows before writing);
    dx may be dresidual. Other aliasing (partly overlapping views) is not supported.
  - rmsnorm_bwd with dw allocates its (P, C) fp32 scratch (P <= 4 * SM count) on each call; in
    LoRA training w is frozen and dw is None, so nothing is allocated.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_C = 65536


@triton.jit
def _rmsnorm_fwd_kernel(
    y_ptr, h_ptr, rstd_ptr,                       # outputs: (N, C), (N, C) if residual, (N,)
    x_ptr, res_ptr, w_ptr,                        # inputs: (N, C), (N, C) if residual, (C,)
    stride_y, stride_h, stride_x, stride_res,     # row strides, in elements
    N, C, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]              # row * stride can pass 2^31
    act = y_ptr.dtype.element_ty

    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(act)         # h, rounded like HF's add
        tl.store(h_ptr + r64 * stride_h + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / C + eps)         # (BLOCK_N,) fp32
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)

    w = tl.load(w_ptr + cols, mask=cols < C, other=0.0)
    n = (xf * rstd[:, None]).to(act)                                 # HF: cast, then weight
    y = (n.to(tl.float32) * w.to(tl.float32)[None, :]).to(act)
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y, mask=mask)


@triton.jit
def _rmsnorm_bwd_kernel(
    dx_ptr, dw_part_ptr, y_ptr,                   # outputs: (N, C), (P, C) fp32 scratch if dw, (N, C) if WRITE_Y
    dy_ptr,                                       # incoming gradient: (N, C)
    x_ptr, w_ptr, rstd_ptr, dres_ptr,             # inputs: (N, C), (C,), (N,), (N, C) if dres
    stride_dx, stride_dy, stride_x, stride_dres, stride_y,  # row strides, in elements
    N, C,
    HAS_DRES: tl.constexpr, HAS_DW: tl.constexpr, WRITE_Y: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Program p takes row blocks p, p + P, p + 2P, ...; without dw, P = number of row blocks.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for blk in range(pid, tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        nh = x * rstd[:, None]
        dn = dy * w[None, :]
        dx = rstd[:, None] * (dn - nh * (tl.sum(dn * nh, axis=1) / C)[:, None])
        if HAS_DRES:   # read before the store: dx may be dresidual itself
            dx += tl.load(dres_ptr + r64 * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WRITE_Y:    # the forward's y again, the same ops on the same bits (dy was read above)
            n = nh.to(y_ptr.dtype.element_ty)
            y = (n.to(tl.float32) * w[None, :]).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + r64 * stride_y + cols[None, :], y, mask=mask)
        if HAS_DW:
            dw_acc += dy * nh
    if HAS_DW:
        tl.store(dw_part_ptr + pid.to(tl.int64) * C + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


@triton.jit
def _rmsnorm_dw_kernel(
    dw_ptr,                                       # output: (C,) fp32
    part_ptr,                                     # input: (P, C) fp32 partial sums
    P, C,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):               # fixed order: the same bits every run
        ps = p0 + tl.arange(0, BLOCK_P)
        m = (ps < P)[:, None] & col_ok[None, :]
        acc += tl.load(part_ptr + ps.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0), mask=col_ok)


def _config(C, N=0):
    """(BLOCK_N, BLOCK_C, num_warps): a whole row per program, a few rows when rows are short
    (QK-norm, D = 64..256), about 16 elements per thread. Untuned: from experience with
    bandwidth-bound row kernels on Hopper (16-byte vectors, 2048-8192 elements per program).
    The interpreter uses the same tiles: its cost is per program and per op, not per element."""
    BLOCK_C = triton.next_power_of_2(C)
    BLOCK_N = max(1, min(32, 2048 // BLOCK_C))
    if os.environ.get("TRITON_INTERPRET") == "1":
        # interpreter: cost per program, so about four programs per call (a tail when N is odd)
        BLOCK_N = max(BLOCK_N, min(64, triton.next_power_of_2(triton.cdiv(N, 4))))
    num_warps = max(1, min(16, BLOCK_N * BLOCK_C // 512))
    return BLOCK_N, BLOCK_C, num_warps


def _check_c(C):
    if not 1 <= C <= _MAX_C:
        raise ValueError(f"rmsnorm: C = {C} outside the supported range [1, {_MAX_C}] (a row lives in registers)")


def rmsnorm_fwd(y, rstd, x, w, eps, *, residual=None, h=None):
    """y = round(round(fp32(h) * rstd) * w), h = x, or h = round(x + residual) written to `h`.
    Writes y (N, C), rstd (N,) fp32 and, with residual, h (N, C). Returns nothing."""
    check(x, "x", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, C = x.shape
    dev, dt = x.device, x.dtype
    check(y, "y", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    check(rstd, "rstd", shape=(N,), dtype=torch.float32, device=dev, contiguous=True)
    check(w, "w", shape=(C,), dtype=dt, device=dev, contiguous=True)
    if (residual is None) != (h is None):
        raise ValueError("rmsnorm_fwd: residual and h go together (h = x + residual is written when residual is given)")
    if residual is not None:
        check(residual, "residual", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
        check(h, "h", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    _check_c(C)
    if not isinstance(eps, (int, float)):
        raise TypeError(f"rmsnorm_fwd: eps must be a Python number (a tensor would sync), got {type(eps).__name__}")
    if N == 0:
        return
    BLOCK_N, BLOCK_C, num_warps = _config(C, N)
    has_res = residual is not None
    _rmsnorm_fwd_kernel[(triton.cdiv(N, BLOCK_N),)](
        y, h if has_res else y, rstd,
        x, residual if has_res else x, w,
        y.stride(0), h.stride(0) if has_res else 0, x.stride(0), residual.stride(0) if has_res else 0,
        N, C, float(eps),
        HAS_RESIDUAL=has_res, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )


def rmsnorm_bwd(dx, dw, dy, x, w, rstd, *, dresidual=None, y=None):
    """dx (N, C) = gradient through the norm [+ dresidual] (dx may be dresidual itself);
    dw (C,) fp32 = sum_rows dy * fp32(x) * rstd, or None to skip. x is the normalised tensor
    (h in the fused case). y (N, C), optional: the forward's output rebuilt, bit for bit (y may
    be dy itself: its rows are read first). Returns nothing."""
    check(x, "x", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, C = x.shape
    dev, dt = x.device, x.dtype
    check(dx, "dx", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    if dw is not None:
        check(dw, "dw", shape=(C,), dtype=torch.float32, device=dev, contiguous=True)
    check(dy, "dy", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    check(w, "w", shape=(C,), dtype=dt, device=dev, contiguous=True)
    check(rstd, "rstd", shape=(N,), dtype=torch.float32, device=dev, contiguous=True)
    if dresidual is not None:
        check(dresidual, "dresidual", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    if y is not None:
        check(y, "y", shape=(N, C), dtype=dt, device=dev, last_contiguous=True)
    _check_c(C)
    if N == 0:
        if dw is not None:
            dw.zero_()
        return
    BLOCK_N, BLOCK_C, num_warps = _config(C, N)
    blocks = triton.cdiv(N, BLOCK_N)
    if dw is None:
        P, part = blocks, dx                      # part unused (HAS_DW=False)
    else:
        # A few programs per SM loop over the rows, so the scratch stays small (<= 4 * SMs rows);
        # the interpreter takes 3 programs, enough to test the partials and the loop.
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        P = min(blocks, 3 if interp else 4 * arch(dev).sms)
        part = torch.empty((P, C), dtype=torch.float32, device=dev)          # (P, C)
    has_dres = dresidual is not None
    _rmsnorm_bwd_kernel[(P,)](
        dx, part, y if y is not None else dx,
        dy,
        x, w, rstd, dresidual if has_dres else dx,
        dx.stride(0), dy.stride(0), x.stride(0), dresidual.stride(0) if has_dres else 0,
        y.stride(0) if y is not None else 0,
        N, C,
        HAS_DRES=has_dres, HAS_DW=dw is not None, WRITE_Y=y is not None,
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=num_warps,
    )
    if dw is not None:
        BLOCK_CR = min(BLOCK_C, 64)               # C / 64 programs, each summing P rows: untuned
        _rmsnorm_dw_kernel[(triton.cdiv(C, BLOCK_CR),)](dw, part, P, C, BLOCK_P=32, BLOCK_C=BLOCK_CR, num_warps=4)
