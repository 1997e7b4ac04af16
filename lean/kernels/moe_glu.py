"""GPT-OSS's clamped SwiGLU on the sorted expert rows (HF GptOssExperts._apply_gate), forward and
a backward fused with the routing-weight gradient (as moe_group.moe_act_bwd for Qwen3-MoE's SwiGLU).

Shape legend: N tokens, K experts per token, P = N * K sorted slot rows (p a sorted position,
j = order[p] the slot n*K + i it holds), F expert MLP hidden size.

    h (P, 2F)  the gate_up GEMM's output, columns INTERLEAVED: gate = h[:, 0::2], up = h[:, 1::2]
    act (P, F), G (P, F) = dL/dact unweighted, dh (P, 2F) interleaved like h; one activation dtype

Forward (fp32, one rounding; limit = 7.0 and alpha = 1.702 in gpt-oss, arguments here):
    gc  = min(gate, limit)                 uc = clamp(up, -limit, limit)
    s   = sigmoid(alpha * gc)              glu = gc * s
    act = round((uc + 1) * glu)
Backward (moe_glu_bwd, over sorted rows):
    dweights[j] = sum_f G[p] * act[p]      fp32, act rounded as the forward writes it
    dact  = w[j] * G[p]                    fp32, not rounded
    dgate = round(dact * (uc + 1) * s * (1 + alpha * gc * (1 - s)))   where gate <= limit, else 0
    dup   = round(dact * glu)                                          where -limit <= up <= limit, else 0
  written to dh (which may be h itself); act (P, F), optional: the forward's bits again.
Nothing is saved by these kernels; the caller keeps h (or recomputes it), order and the weights.
Memory access: h's gate / up pairs are read as one contiguous (BLOCK_R, 2 BLOCK_F) tile and split in
registers, and dh is written as one (_load_pairs / _store_pairs): the stride-2 loads and stores they
replace (one per half) do not vectorise, and the backward ran at 37% of the H100's copy rate with them
(BENCHMARKS.md, GPT-OSS). The same bits either way; with them the backward runs at 3.24 TB/s on
the H200 at moe_group.act_bwd_config's one row a program (gpt-oss-20b's F 2,880).

Supported: any P, F >= 0; fp32 / fp16 / bf16; any row strides, unit column stride. Elementwise
tiles and one (BLOCK_R,) reduction: 4,096 B of shared memory on sm_80/86/90/120 (triton.compile
for GPUTarget on the CPU, bf16, P 32768, F 2880), one config for every tier.
Tested: tests/test_moe_glu.py: fp32 (tight) and fp16 (the tolerance rule) through the interpreter
against the reference's forward and its autograd (lean/reference/moe_glu.py): odd F, F past one
column block, gates and ups straddling the limits with exact +-limit and huge values, dh over h.

Caution:
  - the clamps' gradient at the boundary follows torch.clamp: it passes where x == limit exactly
    (and where up == -limit), so dgate at gate == limit is the unclamped derivative, not 0.
  - NaN in gate or up gives a zero gradient there (the comparisons fail), as torch's clamp does.
  - HF computes in the model dtype step by step (bf16 sigmoid, product, +1); we compute in fp32
    and round once, so act is closer to the fp32 value than HF's and may differ by an ulp.
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.moe_group import _rows_config, act_bwd_config

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _glu(g, u, limit, alpha):
    """(gc, uc, s, glu, act) in fp32 from fp32 gate and up."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(alpha * gc)
    glu = gc * s
    return gc, uc, s, glu, (uc + 1.0) * glu


@triton.jit
def _load_pairs(row_ptrs, f0, F, rmask, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """(gate, up) fp32 (BLOCK_R, BLOCK_F) at pair columns f0.. of interleaved rows: one contiguous
    (BLOCK_R, 2 BLOCK_F) load split in registers (two stride-2 loads would not vectorise)."""
    c2 = 2 * f0 + tl.arange(0, 2 * BLOCK_F)
    x = tl.load(row_ptrs + c2[None, :], mask=rmask[:, None] & (c2 < 2 * F)[None, :], other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (BLOCK_R, BLOCK_F, 2)))


@triton.jit
def _store_pairs(row_ptrs, a, b, f0, F, rmask, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """Interleave a (even columns) and b (odd) into rows at pair columns f0..: one contiguous store."""
    c2 = 2 * f0 + tl.arange(0, 2 * BLOCK_F)
    x = tl.reshape(tl.join(a, b), (BLOCK_R, 2 * BLOCK_F)).to(row_ptrs.dtype.element_ty)
    tl.store(row_ptrs + c2[None, :], x, mask=rmask[:, None] & (c2 < 2 * F)[None, :])


@triton.jit
def _moe_glu_fwd_kernel(
    act_ptr,                                      # output: (P, F)
    h_ptr,                                        # input: (P, 2F) interleaved gate / up
    stride_act, stride_h,
    P, F, limit, alpha,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    f0 = tl.program_id(1) * BLOCK_F
    cols = f0 + tl.arange(0, BLOCK_F)
    rmask = rows < P
    mask = rmask[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g, u = _load_pairs(h_ptr + r64 * stride_h, f0, F, rmask, BLOCK_R, BLOCK_F)
    _, _, _, _, a = _glu(g, u, limit, alpha)
    tl.store(act_ptr + r64 * stride_act + cols[None, :], a.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_glu_bwd_kernel(
    dh_ptr, dw_ptr, act_ptr,                      # outputs: (P, 2F), (N*K,) fp32, (P, F) if WRITE_ACT
    g_ptr,                                        # incoming gradient G: (P, F)
    h_ptr, w_ptr, order_ptr,                      # inputs: (P, 2F), (N*K,) routing weights, (P,) int32
    stride_dh, stride_g, stride_h, stride_act,
    P, F, limit, alpha,
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
        # All loads come before the stores: dh may be h.
        G = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g, u = _load_pairs(h_ptr + r64 * stride_h, f0, F, rmask, BLOCK_R, BLOCK_F)
        gc, uc, s, glu, a = _glu(g, u, limit, alpha)
        a = a.to(h_ptr.dtype.element_ty)          # the forward's rounding
        dot += G * a.to(tl.float32)
        dact = w * G
        dg = tl.where(g <= limit, dact * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dact * glu, 0.0)
        _store_pairs(dh_ptr + r64 * stride_dh, dg, du, f0, F, rmask, BLOCK_R, BLOCK_F)
        if WRITE_ACT:
            tl.store(act_ptr + r64 * stride_act + cols[None, :], a.to(act_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + j, tl.sum(dot, axis=1), mask=rmask)


def _check_h(h):
    check(h, "h", shape=(None, None), dtype=_DTYPES, last_contiguous=True)
    P, F2 = h.shape
    if F2 % 2:
        raise ValueError(f"h: expected (P, 2F) interleaved gate / up, got {F2} columns")
    return P, F2 // 2


def moe_glu_fwd(act, h, *, limit=7.0, alpha=1.702):
    """act (P, F) = (clamp(up) + 1) * min(gate, limit) * sigmoid(alpha * min(gate, limit)), gate / up
    the even / odd columns of h (P, 2F); see the module docstring. Returns nothing."""
    P, F = _check_h(h)
    check(act, "act", shape=(P, F), dtype=h.dtype, device=h.device, last_contiguous=True)
    if P == 0 or F == 0:
        return
    BLOCK_R, BLOCK_F, num_warps = _rows_config(P, F)
    _moe_glu_fwd_kernel[(triton.cdiv(P, BLOCK_R), triton.cdiv(F, BLOCK_F))](
        act, h, act.stride(0), h.stride(0), P, F, float(limit), float(alpha),
        BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F, num_warps=num_warps)


def moe_glu_bwd(dh, dweights, G, h, weights, order, *, limit=7.0, alpha=1.702, act=None):
    """dh (P, 2F) interleaved [dgate, dup] of the clamped GLU at h with dact = w * G; dweights (N, K)
    fp32 = <G, act> per slot (written); act (P, F), optional: the forward's output again. G (P, F)
    unweighted, h (P, 2F) sorted, weights (N, K), order (P,) int32. dh may be h. Returns nothing."""
    P, F = _check_h(h)
    dev, dt = h.device, h.dtype
    check(dh, "dh", shape=(P, 2 * F), dtype=dt, device=dev, last_contiguous=True)
    check(G, "G", shape=(P, F), dtype=dt, device=dev, last_contiguous=True)
    check(weights, "weights", shape=(None, None), dtype=_DTYPES, device=dev, contiguous=True)
    check(dweights, "dweights", shape=tuple(weights.shape), dtype=torch.float32, device=dev, contiguous=True)
    if weights.numel() != P:
        raise ValueError(f"weights: expected N * K = P = {P} entries, got shape {tuple(weights.shape)}")
    check(order, "order", shape=(P,), dtype=torch.int32, device=dev, contiguous=True)
    if act is not None:
        check(act, "act", shape=(P, F), dtype=dt, device=dev, last_contiguous=True)
    if P == 0:
        return
    BLOCK_R, BLOCK_F, num_warps = act_bwd_config(P, max(F, 1), rows=1, cols=1024)
    _moe_glu_bwd_kernel[(triton.cdiv(P, BLOCK_R),)](
        dh, dweights, act if act is not None else dh,
        G, h, weights, order,
        dh.stride(0), G.stride(0), h.stride(0), act.stride(0) if act is not None else 0,
        P, F, float(limit), float(alpha),
        WRITE_ACT=act is not None, BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F, num_warps=num_warps,
    )
