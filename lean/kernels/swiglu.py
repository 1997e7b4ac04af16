"""SwiGLU gate of the MLP: h = silu(g) * u, between the gate/up projections and the down one.

Shape legend: N tokens in the packed batch, F MLP hidden size.

    g, u, h, dh, dg, du : (N, F) in one activation dtype (fp32, fp16 or bf16); any row stride,
                          unit stride in the last dim, so g and u may be the two halves
                          [:, :F] and [:, F:] of one (N, 2F) gate-up buffer.

Forward:   s = sigmoid(g),  h = round(g * s * u)          all in fp32, rounded once
Backward:  dg = round(dh * u * s * (1 + g * (1 - s)))      silu'(g) = s * (1 + g * (1 - s))
           du = round(dh * g * s)
Saved for backward: nothing beyond g and u (the caller keeps the gate-up buffer). The backward
can write h again (h=, over dh if wanted): the down projection's input, the same bits, for a
layer that dropped it after its forward.

swiglu_bwd_lora: the backward with the MLP's LoRA weight gradients that read its tensors, summed
from the same pass over the tokens (dropout 0; R the rank, RP its padded width, S token chunks):
    db_gate (F, R)  += scale * dg^T xa_gate            xa_gate (N, R): the gate projection's x A^T
    db_up   (F, R)  += scale * du^T xa_up              xa_up   (N, R)
    da_down (R, F)  += scale * dyb_down^T h            dyb_down (N, RP): the down projection's dy B
  h (the down projection's input) is never written, and dg, du are not read again for db: each
  layer's backward moves 4 (N, F) tensors fewer (lora_linear_bwd + lora_linear_bwd_da would read
  dg, du and h, and swiglu_bwd write h). One program per (128 features, token chunk) tile, two a
  SM (_LORA_LAUNCH); the tile dots are lora_grad.py's (u^T v per (BLOCK_T, BLOCK_F) tile), so on
  lora_grad's tiles and chunks (_LORA_LAUNCH None) each gradient is the bits the separate passes
  give, and on these an fp32 sum of the same products in another order (tests/test_swiglu.py
  checks both); the fp32 partials (S, F*R) / (S, RP*F) are summed in fixed order by
  lora_grad.grad_reduce: deterministic.

Supported: any N, F >= 1; fp32 / fp16 / bf16.
Tested: tests/test_swiglu.py: fp32 and fp16 through the interpreter (F 37, 131, 1000; N 1, 7,
129), bf16 on GPU; g, u as halves of one buffer, strided h, dg/du written over g/u; the LoRA
variant against swiglu_bwd + lora_grad (ranks 8 and 16, each gradient alone or all; bit for bit on
lora_grad's tiles, fp32-close on the launch's).

Caution:
  - torch rounds silu(g) to the activation dtype before the product; we do not, so h is closer
    to the fp32 value than HF's and may differ from it by one ulp.
  - dg may be g and du may be u (each element is read before it is written, by the same
    program); h may be g or u. Partly overlapping views are not supported.
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import interpret_big, interpreting
from lean.kernels.lora_grad import _block_r, grad_chunking, grad_reduce

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr,                                        # output: (N, F)
    g_ptr, u_ptr,                                 # inputs: (N, F), (N, F)
    stride_h, stride_g, stride_u,                 # row strides, in elements
    N, F,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]              # row * stride can pass 2^31
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dg_ptr, du_ptr, h_ptr,                        # gradients out: (N, F), (N, F); h (N, F) if WRITE_H
    dh_ptr,                                       # incoming gradient: (N, F)
    g_ptr, u_ptr,                                 # inputs: (N, F), (N, F)
    stride_dg, stride_du, stride_h, stride_dh, stride_g, stride_u,
    N, F,
    WRITE_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    # All three loads come before either store: dg may be g and du may be u.
    dh = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * g * s
    tl.store(dg_ptr + r64 * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r64 * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)
    if WRITE_H:  # the forward's h: the same product on the same bits
        tl.store(h_ptr + r64 * stride_h + cols[None, :], (g * s * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_lora_kernel(
    dg_ptr, du_ptr, dh_ptr, g_ptr, u_ptr,         # (N, F) each: gradients out, incoming gradient, inputs
    xg_ptr, xu_ptr, dyb_ptr,                      # xa_gate (N, R), xa_up (N, R), dyb_down (N, RP); contiguous
    pg_ptr, pu_ptr, pd_ptr,                       # fp32 partials out: (S, F*R) at i*R + r (gate, up), (S, RP*F) at r*F + i
    stride_dg, stride_du, stride_dh, stride_g, stride_u,
    N, F, R, RP, chunk,
    DB_GATE: tl.constexpr, DB_UP: tl.constexpr, DA_DOWN: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    """_swiglu_bwd_kernel's math on the (BLOCK_T, BLOCK_F) tiles of token chunk s; each tile's
    dg, du (and h), rounded as stored, multiplied into fp32 (BLOCK_F, BLOCK_R) partials, tile^T v,
    as lora_grad's _lora_grad_partial_kernel multiplies them read back."""
    s = tl.program_id(1)
    rf = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    rt = s * chunk + tl.arange(0, BLOCK_T)
    rr = tl.arange(0, BLOCK_R)
    f_ok = rf < F
    accg = tl.zeros((BLOCK_F, BLOCK_R), dtype=tl.float32)
    accu = tl.zeros((BLOCK_F, BLOCK_R), dtype=tl.float32)
    accd = tl.zeros((BLOCK_F, BLOCK_R), dtype=tl.float32)
    for t0 in range(0, chunk, BLOCK_T):
        t_ok = rt + t0 < N
        t64 = (rt + t0).to(tl.int64)[:, None]
        mask = t_ok[:, None] & f_ok[None, :]
        # All three loads come before either store: dg may be g and du may be u.
        dh = tl.load(dh_ptr + t64 * stride_dh + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_g + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t64 * stride_u + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        sg = tl.sigmoid(g)
        dg = (dh * u * sg * (1.0 + g * (1.0 - sg))).to(dg_ptr.dtype.element_ty)
        du = (dh * g * sg).to(du_ptr.dtype.element_ty)
        tl.store(dg_ptr + t64 * stride_dg + rf[None, :], dg, mask=mask)
        tl.store(du_ptr + t64 * stride_du + rf[None, :], du, mask=mask)
        if DB_GATE:
            xg = tl.load(xg_ptr + t64 * R + rr[None, :], mask=t_ok[:, None] & (rr < R)[None, :], other=0.0)
            accg = tl.dot(tl.trans(dg), xg, accg, input_precision=PRECISION)
        if DB_UP:
            xu = tl.load(xu_ptr + t64 * R + rr[None, :], mask=t_ok[:, None] & (rr < R)[None, :], other=0.0)
            accu = tl.dot(tl.trans(du), xu, accu, input_precision=PRECISION)
        if DA_DOWN:
            h = (g * sg * u).to(dg_ptr.dtype.element_ty)
            d = tl.load(dyb_ptr + t64 * RP + rr[None, :], mask=t_ok[:, None] & (rr < RP)[None, :], other=0.0)
            accd = tl.dot(tl.trans(h), d, accd, input_precision=PRECISION)
    base = s.to(tl.int64) * F
    ri, rk = rf[:, None], rr[None, :]  # element (i, r) of the partials
    if DB_GATE:
        tl.store(pg_ptr + base * R + ri * R + rk, accg, mask=(ri < F) & (rk < R))
    if DB_UP:
        tl.store(pu_ptr + base * R + ri * R + rk, accu, mask=(ri < F) & (rk < R))
    if DA_DOWN:
        tl.store(pd_ptr + base * RP + rk * F + ri, accd, mask=(ri < F) & (rk < RP))


def _config(N, F):
    """(grid, BLOCK_N, BLOCK_F, num_warps). Column blocks of at most 1024 (F = 14336 = 14 * 1024
    leaves no masked tail), a few rows when F is short, 2048-element tiles, 16 elements per
    thread (two 16-byte vectors in bf16). Untuned, from experience with elementwise kernels on
    Hopper. The interpreter takes more rows and wider columns (below): it pays per program."""
    BLOCK_F = min(triton.next_power_of_2(F), 1024)
    BLOCK_N = max(1, min(32, 2048 // BLOCK_F))
    if os.environ.get("TRITON_INTERPRET") == "1":
        # interpreter: cost per program, so about four row blocks per call (a tail when N is odd),
        # and one column block up to F = 2048 (SmolLM2's 1536: decode 7.6 -> 3.6 ms, 497 rows -15%)
        BLOCK_N = max(BLOCK_N, min(64, triton.next_power_of_2(triton.cdiv(N, 4))))
        BLOCK_F = min(triton.next_power_of_2(F), 2048)
    num_warps = max(1, BLOCK_N * BLOCK_F // 512)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(F, BLOCK_F))
    return grid, BLOCK_N, BLOCK_F, num_warps


def swiglu_fwd(h, g, u):
    """h (N, F) = silu(g) * u, computed in fp32 and rounded once; h may be g or u (in place).
    Returns nothing."""
    check(g, "g", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, F = g.shape
    dev, dt = g.device, g.dtype
    check(h, "h", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(u, "u", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if N == 0 or F == 0:
        return
    grid, BLOCK_N, BLOCK_F, num_warps = _config(N, F)
    _swiglu_fwd_kernel[grid](
        h, g, u,
        h.stride(0), g.stride(0), u.stride(0),
        N, F,
        BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )


def swiglu_bwd(dg, du, dh, g, u, *, h=None):
    """dg = dh * u * silu'(g), du = dh * silu(g), each (N, F); dg may be g and du may be u
    (in place). h (N, F), optional: the forward's silu(g) * u rebuilt (h may be dh). Returns nothing."""
    check(g, "g", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, F = g.shape
    dev, dt = g.device, g.dtype
    check(dg, "dg", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(du, "du", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(dh, "dh", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    check(u, "u", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if h is not None:
        check(h, "h", shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    if N == 0 or F == 0:
        return
    grid, BLOCK_N, BLOCK_F, num_warps = _config(N, F)
    _swiglu_bwd_kernel[grid](
        dg, du, h if h is not None else dg, dh, g, u,
        dg.stride(0), du.stride(0), h.stride(0) if h is not None else 0, dh.stride(0), g.stride(0), u.stride(0),
        N, F,
        WRITE_H=h is not None, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )


# swiglu_bwd_lora: (BLOCK_F, BLOCK_T, num_warps, num_stages, programs a SM at most: the token
# chunks); None: lora_grad's tiles, launch and chunks (_GRAD: the bits of the separate passes).
# H100, bf16, N = 8192, R = 16, `tools/step_levers.py --only swiglu` (20 launches): 128 x 32 w4 s3,
# two programs a SM: Llama-3.2-1B (F 8192) 259 us, Qwen3-0.6B (F 3072) 106 us, against 439 and 174
# for swiglu_bwd (h written) + the three lora_grad passes, and 401 / 193 on lora_grad's tiles and
# chunks (2.4 programs a SM: the SMs with three finish last). Five (N, F) tensors at 3 TB/s: 224, 84.
_LORA_LAUNCH = (128, 32, 4, 3, 2)


def lora_chunking(N, F, device, big=False):
    """(BLOCK_F, BLOCK_T, num_warps, num_stages, chunk, S) of swiglu_bwd_lora over (N, F):
    lora_grad.grad_chunking's tiles and chunks without _LORA_LAUNCH or when big (a model-sized
    problem under the interpreter), else _LORA_LAUNCH's tiles in
    chunks of whole BLOCK_T steps, as many as fit per_sm programs a SM. runtime/plan.py sizes the (S, F*R)
    partials with it."""
    BF, BT, warps, stages, chunk, S = grad_chunking(N, F, device, big)
    if _LORA_LAUNCH is None or big:  # big: the interpreter's model-sized tiles (a program costs ms there)
        return BF, BT, warps, stages, chunk, S
    BF, BT, warps, stages, per_sm = _LORA_LAUNCH
    chunks = max(1, per_sm * arch(device).sms // triton.cdiv(F, BF))  # programs: at most per_sm a SM
    chunk = BT * triton.cdiv(triton.cdiv(N, chunks), BT)
    return BF, BT, warps, stages, chunk, triton.cdiv(N, chunk)


def swiglu_bwd_lora(dg, du, dh, g, u, *, scale, gate=None, up=None, down=None):
    """swiglu_bwd (h not written) and, from the same pass, the MLP's LoRA gradients that read its
    tensors (dropout 0): gate = (db (F, R), xa (N, R)): db += scale * dg^T xa; up alike with du;
    down = (da (R, F), dyb (N, RP)): da += scale * dyb^T silu(g) u. db, da fp32 contiguous (+=:
    the caller zeroes them once a step); xa, dyb contiguous in the activation dtype. Each may be
    None; with all three None it runs swiglu_bwd. Returns nothing."""
    check(g, "g", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    N, F = g.shape
    dev, dt = g.device, g.dtype
    for name, t in (("dg", dg), ("du", du), ("dh", dh), ("u", u)):
        check(t, name, shape=(N, F), dtype=dt, device=dev, last_contiguous=True)
    R = next((p[1].shape[1] for p in (gate, up) if p is not None), down[0].shape[0] if down is not None else 1)
    RP = _block_r(R)
    for name, pair in (("gate", gate), ("up", up)):
        if pair is not None:
            check(pair[0], f"{name} db", shape=(F, R), dtype=torch.float32, device=dev, contiguous=True)
            check(pair[1], f"{name} xa", shape=(N, R), dtype=dt, device=dev, contiguous=True)
    if down is not None:
        check(down[0], "down da", shape=(R, F), dtype=torch.float32, device=dev, contiguous=True)
        check(down[1], "down dyb", shape=(N, RP), dtype=dt, device=dev, contiguous=True)
    if N == 0 or F == 0:
        return
    if gate is None and up is None and down is None:  # nothing to sum (attention-only LoRA)
        return swiglu_bwd(dg, du, dh, g, u)
    big = interpreting() and interpret_big(N, F, F)  # lora_linear_bwd_da's choice for the down dA
    BF, BT, warps, stages, chunk, S = lora_chunking(N, F, dev, big)
    parts = {k: torch.empty((S, F * (RP if k == "down" else R)), device=dev, dtype=torch.float32)
             for k, p in (("gate", gate), ("up", up), ("down", down)) if p is not None}  # (S, F*R) / (S, RP*F)
    any_part = next(iter(parts.values()), dg)  # unused slots: never touched
    _swiglu_bwd_lora_kernel[(triton.cdiv(F, BF), S)](
        dg, du, dh, g, u,
        gate[1] if gate is not None else dg, up[1] if up is not None else dg, down[1] if down is not None else dg,
        parts.get("gate", any_part), parts.get("up", any_part), parts.get("down", any_part),
        dg.stride(0), du.stride(0), dh.stride(0), g.stride(0), u.stride(0),
        N, F, R, RP, chunk,
        DB_GATE=gate is not None, DB_UP=up is not None, DA_DOWN=down is not None,
        BLOCK_F=BF, BLOCK_T=BT, BLOCK_R=RP, PRECISION="ieee" if dt == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    for k, pair in (("gate", gate), ("up", up), ("down", down)):
        if pair is not None:
            grad_reduce(pair[0], parts[k], scale, big)
