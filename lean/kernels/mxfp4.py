"""MXFP4 dequantisation of gpt-oss checkpoints' expert weights (OCP microscaling FP4: e2m1 values
in blocks of 32 sharing one e8m0 scale), equal bit for bit to transformers' dequantiser.

Shape legend: G blocks along a row, E experts, O / Kd a weight's output / reduced dims.

    blocks (..., G, 16) uint8   two e2m1 values a byte: value 2i in the LOW nibble, 2i+1 in the high
    scales (..., G)     uint8   e8m0 exponents: the block's scale is 2^(s - 127)
    out    (..., G * 32)        fp32 / fp16 / bf16: out[..., 32g + t] = round(e2m1(nibble t) * 2^(s_g - 127))

Layout in gpt-oss checkpoints (transformers 5.24's loader, integrations/mxfp4.py): the 32-value
blocks run along each weight's REDUCED (input) dimension.
    gate_up_proj_blocks (E, 2F, C/32, 16), _scales (E, 2F, C/32)  ->  out (E, 2F, C)
    down_proj_blocks    (E, C, F/32, 16),  _scales (E, C, F/32)   ->  out (E, C, F)
out is gmm's weight (E, O, Kd) as is; transformers transposes dims 1 and 2 after dequantising
(gate_up_proj (E, C, 2F), down_proj (E, F, C)), and the gate_up columns (out's rows) interleave
gate (even) and up (odd), as lean/kernels/moe_glu.py reads them.

Math, exactly (lean/reference/mxfp4.py): e2m1 nibble n = sign bit 3, exponent e = bits 2..1,
mantissa m = bit 0: |2 * value| = m if e = 0, else (2 + m) << (e - 1), i.e. 0, 1, 2, 3, 4, 6, 8, 12.
out = round((2 * value) * 2^(s - 128)): both factors exact fp32 (2^(s-128) from its bits, subnormal
for s <= 1), so the fp32 product is the exact value (inf where it overflows) and one rounding to out's
dtype follows. That is torch.ldexp's result in transformers, s = 255 included (2^128: not NaN there).

gmm_mxfp4: lean/kernels/grouped_gemm.py's gmm with the weight held as MXFP4 (blocks, scales) of
    Wd (E, A, Bd) = dequant(blocks (E, A, Bd/32, 16), scales (E, A, Bd/32)), dequantised in the weight
    loads (each w tile's bytes and scales read, decoded as above, rounded to x's dtype: the same bits
    as mxfp4_dequant writes, so the products are gmm's on the dequantised weight):
        y[p] = x[r(p)] @ w[e(p)]^T [+ scale * xa[p] b[e(p)]^T] [+ bias[e(p)]]
        w = Wd (transpose=False: O = A, Kd = Bd, blocks along Kd; gate_up / down forward)
        w = Wd.transpose(1, 2) (transpose=True: O = Bd, Kd = A, blocks along O; the dX GEMMs)
    Flags GATHER, LORA, BIAS, PACK_K (no accumulate: no MoE GEMM on a frozen MXFP4 weight needs it).
    A w tile is read as whole bytes and scales along its packed dim ((BN, BK/2) and (BN, BK/32) with
    blocks along Kd, (BK, BN/2) and (BK, BN/32) transposed: BK / BN at least 32), decoded and
    scaled in registers (_decode); its own tiles (MX_TILES: gmm's spilled in the main loop), without
    gmm's short tail tile (grouped_gemm.TAIL).

Supported: any leading shape and block count (int64 offsets); contiguous tensors.
Shared memory (triton.compile for GPUTarget on the CPU, as tools/arch_compile.py; gpt-oss-20b's
shapes, bf16, N 8192, K 4, E 32, C = F = 2880, R 16): mxfp4_dequant 1,024 B on every tier;
gmm_mxfp4 (gate_up gathered + LoRA + bias, dX transposed + LoRA) at MX_TILES at most 38,912 B on
sm_80/86/89/120/121 (limit 101,376 B) and 94,208 B on sm_90 (the byte and scale tiles are decoded in
registers). tools/arch_compile.py launches them with the MoE preset.
Tested: tests/test_mxfp4.py: under the interpreter, fp32 and fp16 out, bit for bit against the
reference on every byte at every scale and random gpt-oss-like blocks, an odd block count;
gmm_mxfp4 (fp32, fp16) equal to gmm on mxfp4_dequant's weight, both orientations, with gather,
LoRA, bias, empty experts.

Caution:
  - scale bytes 0 and 1 give subnormal factors (2^-128, 2^-127); a GPU build that flushes fp32
    subnormals would zero those values. Real checkpoints' scales sit near 127 (checked only in
    the interpreter so far).
  - bf16 out is not checked in the interpreter: its fp32 -> bf16 cast is not round-to-nearest-even
    (256 of the 65,536 byte-scale pairs differ); the test checks bf16 on a GPU (passed on the H100).
  - gmm_mxfp4 measured 0.25-0.31x of gmm on the bf16 weight at gpt-oss-20b's shapes (H100, both at
    the 128 x 128 tile, before gmm's 128 x 256 on sm_90; BENCHMARKS.md; 0.09-0.14x before its loads
    became byte and scale tiles), mxfp4_dequant + gmm 0.79-0.84x: models/moe.py runs the latter (MXFP4_FUSED False). The decode (integer ops, an
    interleave and a reshape per tile) competes with the MMA for the SM; a lookup-table decode or
    a warp-specialised producer is where the rest would come from.
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import FLOATS, GROUP_M, grouped_tile, interpreting
from lean.kernels.grouped_gemm import MAX_E, _config, _expert_of_tile, _lora_first, _offsets, _pow2, _rows

# gmm_mxfp4's own tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), 16-bit x, by arch tier:
# the decode's integers and the byte tiles take registers gmm's do not. At gmm's tiles (128 x 256 x 64
# w8 on sm_90, 128 x 128 x 64 w8 s3 on sm86) ptxas spilled 60-152 B a thread with 16-45 spill
# instructions inside the main loop (tools/ptxas_report.py; gpt-oss-20b's GEMMs, sm_80/86/90); at
# these, none anywhere (155-176 registers; 94,208 B on sm_90, 32,768-38,912 B on sm_80/86). The
# 0.25-0.31x of gmm measured earlier was at 128 x 128 on the H100; these are untimed.
MX_TILES = {"sm90": (128, 128, 64, 8, 4), "sm80": (128, 128, 32, 8, 4), "sm86": (128, 128, 32, 8, 4)}


def _mx_config(rows, O, Kd, dtype, device):
    if interpreting() or dtype == torch.float32:  # gmm's (the interpreter's and fp32's tiles)
        return _config(rows, O, Kd, dtype, device)
    bm, bn, bk, warps, stages = MX_TILES[arch(device).tier]
    return bm, _pow2(O, 16, bn), bk, warps, stages

_OUT = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e2m1_twice(n):
    """2 * the e2m1 value of nibbles n (int32 0..15), exact in fp32, -0.0 for n = 8."""
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)
    return mag * tl.where((n & 8) != 0, -1.0, 1.0)           # a product: -0.0 for n = 8 (negation is 0 - x)


@triton.jit
def _e8m0_half(s):
    """2^(s - 128) in fp32 from its bits (s int32 0..255; subnormal for s <= 1)."""
    return tl.where(s == 0, 1 << 21, tl.where(s == 1, 1 << 22, (s - 1) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _decode(byte, sc, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(ROWS, COLS) fp32 values of (ROWS, COLS/2) bytes and their (ROWS, COLS/32) e8m0 scales."""
    byte = byte.to(tl.int32)
    vals = tl.interleave(_e2m1_twice(byte & 0x0F), _e2m1_twice(byte >> 4))          # (ROWS, COLS)
    vals = tl.reshape(vals, (ROWS, COLS // 32, 32)) * _e8m0_half(sc.to(tl.int32))[:, :, None]
    return tl.reshape(vals, (ROWS, COLS))


@triton.jit
def _mxfp4_dequant_kernel(
    out_ptr,                                      # output: (B, 32) values, contiguous
    blocks_ptr, scales_ptr,                       # inputs: (B, 16) uint8, (B,) uint8
    B,
    BLOCK_B: tl.constexpr,
):
    rb = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = rb < B
    rt = tl.arange(0, 16)
    byte = tl.load(blocks_ptr + rb[:, None] * 16 + rt[None, :], mask=ok[:, None], other=0).to(tl.int32)
    s = tl.load(scales_ptr + rb, mask=ok, other=127).to(tl.int32)
    scale = _e8m0_half(s)[:, None]                                    # 2^(s - 128)
    lo = _e2m1_twice(byte & 0x0F) * scale
    hi = _e2m1_twice(byte >> 4) * scale
    vals = tl.interleave(lo, hi)                                       # (BLOCK_B, 32): lo, hi, lo, ...
    rv = tl.arange(0, 32)
    tl.store(out_ptr + rb[:, None] * 32 + rv[None, :], vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _gmm_mxfp4_kernel(
    y_ptr,                                  # (P, O) out, row stride stride_ym, unit col stride
    x_ptr, q_ptr, s_ptr, off_ptr, gather_ptr,   # x (X, Kd); Wd's bytes (E, A, Bd/2), scales (E, A, Bd/32); offsets; gather
    xa_ptr, b_ptr, bias_ptr,                # LoRA: xa (P, R), b (E, O, R) strided; bias (E, O)
    O, Kd, R, E, tiles_m, gather_div, scale,
    stride_ym, stride_xm, stride_xk, stride_qe, stride_qa, stride_se, stride_sa,
    stride_am, stride_ar, stride_be, stride_bo, stride_br, stride_biase,
    GATHER: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr, PACK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tiles_m * BLOCK_M, O, BLOCK_M, BLOCK_N, GROUP_M)
    e, row0, row_end, total = _expert_of_tile(off_ptr, E, pid_m, BLOCK_M, BLOCK_E)
    if pid_m >= total:                      # past the last tile of the last expert
        return
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < row_end
    n_ok = rn < O
    if GATHER:
        rx = tl.load(gather_ptr + rm, mask=m_ok, other=0) // gather_div
    else:
        rx = rm
    e64 = e.to(tl.int64)
    x_ptrs = x_ptr + rx.to(tl.int64)[:, None] * stride_xm + rk[None, :] * stride_xk
    q_e = q_ptr + e64 * stride_qe
    s_e = s_ptr + e64 * stride_se
    if LORA:                                # the LoRA term first, the main loop onto it, as gmm
        acc = _lora_first(xa_ptr, b_ptr, rm, rn, m_ok, n_ok, e64, R, scale, stride_am, stride_ar,
                          stride_be, stride_bo, stride_br, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Kd, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < Kd
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # w[e]^T tile (BK, BN), element (k, n) = Wd[e, n, k] (PACK_K) or Wd[e, k, n]: read as tiles of
        # whole bytes and scales along the packed dim (coalesced), decoded and scaled in registers
        if PACK_K:                          # rows rn of Wd, packed columns k0 .. k0+BK: (BN, BK), transposed
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            rs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            byte = tl.load(q_e + rn[:, None] * stride_qa + rb[None, :],
                           mask=n_ok[:, None] & (rb < Kd // 2)[None, :], other=0)
            sc = tl.load(s_e + rn[:, None] * stride_sa + rs[None, :],
                         mask=n_ok[:, None] & (rs < Kd // 32)[None, :], other=127)
            wt = tl.trans(_decode(byte, sc, BLOCK_N, BLOCK_K).to(x_ptr.dtype.element_ty))
        else:                               # rows kk of Wd, packed columns rn: (BK, BN)
            rb = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            rs = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            byte = tl.load(q_e + kk[:, None] * stride_qa + rb[None, :],
                           mask=k_ok[:, None] & (rb < O // 2)[None, :], other=0)
            sc = tl.load(s_e + kk[:, None] * stride_sa + rs[None, :],
                         mask=k_ok[:, None] & (rs < O // 32)[None, :], other=127)
            wt = _decode(byte, sc, BLOCK_K, BLOCK_N).to(x_ptr.dtype.element_ty)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
    if BIAS:
        acc += tl.load(bias_ptr + e64 * stride_biase + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_dequant(out, blocks, scales):
    """out (..., G * 32) = the MXFP4 blocks (..., G, 16) uint8 times 2^(scales (..., G) uint8 - 127),
    rounded once to out's dtype (fp32 / fp16 / bf16); see the module docstring. Returns nothing."""
    check(blocks, "blocks", dtype=torch.uint8, contiguous=True)
    if blocks.dim() < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks: expected shape (..., G, 16), got {tuple(blocks.shape)}")
    lead = tuple(blocks.shape[:-1])
    check(scales, "scales", shape=lead, dtype=torch.uint8, device=blocks.device, contiguous=True)
    check(out, "out", shape=lead[:-1] + (lead[-1] * 32,), dtype=_OUT, device=blocks.device, contiguous=True)
    B = scales.numel()
    if B == 0:
        return
    BLOCK_B = 64                                  # 2048 values a program (untuned)
    _mxfp4_dequant_kernel[(triton.cdiv(B, BLOCK_B),)](out, blocks, scales, B, BLOCK_B=BLOCK_B, num_warps=4)


def gmm_mxfp4(y, x, blocks, scales, offsets, *, transpose=False, gather=None, gather_div=1, lora=None, bias=None):
    """y (P, O) = x[r(p)] @ w[e(p)]^T [+ scale * xa b[e(p)]^T] [+ bias[e(p)]], w = Wd or Wd^T (transpose)
    with Wd (E, A, Bd) the MXFP4 weight blocks (E, A, Bd/32, 16), scales (E, A, Bd/32) uint8, dequantised
    in the loads; see the module docstring (gmm_mxfp4) and gmm's. Returns nothing."""
    check(x, "x", shape=(None, None), dtype=FLOATS)
    X, Kd = x.shape
    dev = x.device
    check(blocks, "blocks", shape=(None, None, None, 16), dtype=torch.uint8, device=dev, contiguous=True)
    E, A, G, _ = blocks.shape
    check(scales, "scales", shape=(E, A, G), dtype=torch.uint8, device=dev, contiguous=True)
    O, want_kd = (G * 32, A) if transpose else (A, G * 32)
    if Kd != want_kd:
        raise ValueError(f"x: expected {want_kd} columns (the weight's reduced dim), got {Kd}")
    check(y, "y", shape=(None, O), dtype=FLOATS, device=dev, last_contiguous=True)
    P = y.shape[0]
    _offsets(offsets, E, dev)
    _rows(gather, "gather", P, dev)
    if gather is None and X != P:
        raise ValueError(f"x: expected {P} rows (one per row of y, no gather), got {X}")
    if int(gather_div) < 1:
        raise ValueError(f"gather_div: expected >= 1, got {gather_div}")
    xa = b = None
    R, scale = 0, 0.0
    if lora is not None:
        xa, b, scale = lora
        check(xa, "lora xa", shape=(P, None), dtype=x.dtype, device=dev)
        R = xa.shape[1]
        check(b, "lora b", shape=(E, O, R), dtype=x.dtype, device=dev)
    if bias is not None:
        check(bias, "bias", shape=(E, O), dtype=(x.dtype, torch.float32), device=dev, last_contiguous=True)
    if P == 0 or O == 0:
        return
    BM, BN, BK, warps, stages = _mx_config(triton.cdiv(P, E), O, Kd, x.dtype, dev)
    BN, BK = max(BN, 32), max(BK, 32)  # whole 32-value blocks along the packed dim of a tile
    if BK * x.stride(1) >= 2**31:
        raise ValueError("gmm_mxfp4: K-stride too large for int32 pointer steps (call .contiguous())")
    tiles_m = (P + min(E, P) * (BM - 1)) // BM
    nul = y
    _gmm_mxfp4_kernel[(tiles_m * triton.cdiv(O, BN),)](
        y, x, blocks, scales, offsets, gather if gather is not None else offsets,
        xa if xa is not None else nul, b if b is not None else nul, bias if bias is not None else nul,
        O, Kd, R, E, tiles_m, int(gather_div), float(scale),
        y.stride(0), x.stride(0), x.stride(1), A * G * 16, G * 16, A * G, G,
        *(xa.stride() if xa is not None else (0, 0)), *(b.stride() if b is not None else (0, 0, 0)),
        bias.stride(0) if bias is not None else 0,
        GATHER=gather is not None, LORA=lora is not None, BIAS=bias is not None, PACK_K=not transpose,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=_pow2(R, 16, 64), BLOCK_E=_pow2(E, 16, MAX_E), GROUP_M=GROUP_M,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
