"""GGUF quantisers on the GPU: float rows -> ggml's Q8_0, Q4_K and Q6_K block bytes, equal bit for bit
to lean/runtime/gguf_quants.quantize (numpy, itself equal to ggml's quantize_row_*_ref; its docstring
states the formats and the math, which this file does not repeat).

Shape legend: R rows, C values a row, B bytes a row (C/32*34 for Q8_0, C/256*144 for Q4_K,
C/256*210 for Q6_K). A sub-block is 32 values (Q8_0's block, Q4_K's scale group) or 16 (Q6_K's).

    x    (R, C)  fp32, fp16 or bf16, contiguous; widened exactly to fp32 in the kernel
    dst  (R, B)  uint8, contiguous, on x's device: ggml's blocks laid end to end, as GGUF stores them

    dst = torch.empty(R, row_bytes(C, qtype), dtype=torch.uint8, device=w.device)
    quantize_rows(dst, w, qtype)        # qtype a gguf GGMLQuantizationType (or its int): Q8_0, Q4_K, Q6_K
    raw = dst.cpu().numpy()             # sync: what GGUFWriter.add_tensor(..., raw_dtype=qtype) takes

Math: each formula is the numpy port's, operation by operation, in float32:
  - every sum over a sub-block runs left to right (as ggml's C loop): the sub-blocks of a program lie
    along the vector axis, the 32 (16) positions of each are held as a tuple of vectors and walked
    by tl.static_range, each step one vector add (a tl.sum would be a tree: other last bits);
  - nearest_int is ggml's: add 12582912.0 in float32, read the mantissa bits (round half to even,
    wrapping outside |v| < 2^22 as ggml does); Q8_0's roundf (half away from zero) is gguf's
    floor(a) + floor(2*(a - floor(a))) with the sign put back;
  - divisions and sqrt are IEEE (tl.math.div_rn, tl.sqrt_rn: div.rn / sqrt.rn.f32; Triton's `/`
    on fp32 compiles to div.full.f32, within two ulps); d and dmin round to fp16 to nearest even;
  - no multiply is contracted with an add into an FMA: every launch passes enable_fp_fusion=False,
    which compiles LLVM with fp-contract off and runs ptxas with --fmad=false. One option in place
    of nf4.py's per-operation mul.rn asm, since here nearly every product feeds a sum. Checked on the
    PTX for sm_90 (tools/gguf_quant_bench.py --ptx): no fma instruction in any of the three kernels
    (with fusion on: 415 in Q4_K's, 110 in Q6_K's); the SASS FFMAs left (232, 122, 172) are the
    div.rn.f32 expansions, about 5.4 per division in each kernel. floor compiles to
    cvt.rmi.ftz: it flushes a subnormal to zero, whose floor is 0 anyway.
  Extremes and selections (max |x|, first largest |scale|) use comparisons only, so their order
  does not matter; where the numpy port keeps a zero's sign and ggml's C does not (max_scale of a
  super-block whose scales are all <= 0), this file follows the C (+0.0): no such block was seen.

Programs: Q8_0 BLOCKS blocks of 32 a program (a (BLOCKS, 32) tile); Q4_K / Q6_K SB super-blocks a
program, 8*SB (16*SB) sub-blocks on the vector axis, one sub-block a thread at num_warps 4. The
trials run as a loop (21 for Q4_K's make_qkx2_quants, 18 for Q6_K's make_qx_quants), each two
(one) unrolled walks over the sub-block's positions, held in registers (ptxas -v for sm_90, bf16
rows: Q4_K 126 registers a thread, Q6_K 71, Q8_0 122, no spills; shared memory 512 / 512 / 2048 B).
Rows play no part: x and dst are read as R*C/256 super-blocks end to end.

Supported: C % 32 == 0 (Q8_0), C % 256 == 0 (Q4_K, Q6_K); any R; finite input (ggml's bytes for
NaN / inf are undefined; gguf_quants.quantize refuses them, this launcher cannot without a sync).
Tested: tests/test_gguf_quant_kernels.py (interpreter, fp32 / fp16 / bf16 inputs): bytes equal
gguf_quants.quantize on rows of 96 (Q8_0), 256, 512 and 2048 holding zero, signed-zero, constant,
negative-only, outlier, one-value and tiny sub-blocks (d in fp16's subnormals, and flushed to 0),
and on Gaussian blocks picked where a float64-sum, pairwise-sum or round-half-away numpy port writes
other bytes. On those, the kernel with its trial sums as trees changes 22 (Q4_K) and 26 (Q6_K) of
48 blocks (kept in the suite), and with its Q4_K sums' multiply-adds fused (emulated in float64,
run once) 20 of 128. Run once: 256 rows of 4096 (4096 super-blocks), stress and N(0, 0.02), equal
for all three types. On a GPU (the same file, marked gpu): bf16 4096x4096 and 14336x4096 against
the numpy on the same values; not run yet.
Measured: not yet on a GPU (tools/gguf_quant_bench.py --gpu prints GB/s next to a copy's).
Caution: the configs are untuned (one sub-block a thread, 4 warps) and have not run on a GPU; Q4_K's
22 trials of two walks each may well make it bound by arithmetic rather than by the 4 (2) bytes it
reads and 0.56 it writes a value: the bench will say.
Compiling Q4_K's kernel takes about 45 s a target on a CPU (the walks unroll), Q6_K's 15 s.
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check

# GGMLQuantizationType values (gguf.constants; an IntEnum, so the enum itself is accepted too):
# qtype -> (name, values a block, bytes a block)
QTYPES = {8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
_IN = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Shared pieces


@triton.jit
def _nearest_int(v):
    """ggml's nearest_int: float32 v + 1.5*2^23, the low 23 bits less 2^22 (int32)."""
    i = (v + 12582912.0).to(tl.int32, bitcast=True)
    return (i & 0x7FFFFF) - 0x400000


@triton.jit
def _fp16(v):
    """v (fp32) rounded to fp16 (nearest even): (its value as fp32, its 16 bits as int32)."""
    h = v.to(tl.float16, fp_downcast_rounding="rtne")
    return h.to(tl.float32), h.to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _store_fp16(ptr, bits, mask):
    """Two little-endian bytes of an fp16 at ptr (any alignment)."""
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _load_sub_blocks(x_ptr, n_sub, SUB: tl.constexpr, N: tl.constexpr):
    """This program's SUB sub-blocks of N values as a tuple of N (SUB,) fp32 vectors, xs[i] holding
    position i of each (sub-blocks g past n_sub read as zeros)."""
    g = tl.program_id(0).to(tl.int64) * SUB + tl.arange(0, SUB)
    ok = g < n_sub
    xs = ()
    for i in tl.static_range(N):
        xs = xs + (tl.load(x_ptr + g * N + i, mask=ok, other=0.0).to(tl.float32),)
    return xs


# ---------------------------------------------------------------------------------------------
# Q8_0: d = max|x| / 127, q = roundf(x * (1/d))


@triton.jit
def _q8_0_kernel(
    dst_ptr,                                      # out: (n_blk, 34) uint8
    x_ptr,                                        # in: (n_blk, 32) values
    n_blk,
    BLOCKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < n_blk
    j = tl.arange(0, 32)
    x = tl.load(x_ptr + b[:, None] * 32 + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    inv = tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))
    v = x * inv[:, None]
    a = tl.abs(v)
    f = tl.floor(a)
    q = f + tl.floor(2.0 * (a - f))                # roundf(|v|), exactly
    q = tl.where(v < 0, -q, q).to(tl.int32)
    tl.store(dst_ptr + b[:, None] * 34 + 2 + j[None, :], (q & 0xFF).to(tl.uint8), mask=ok[:, None])
    _, bits = _fp16(d)
    _store_fp16(dst_ptr + b * 34, bits, ok)


# ---------------------------------------------------------------------------------------------
# Q4_K: make_qkx2_quants(32, 15, x, w, rmin -1, rdelta 0.1, 21 steps) per sub-block, 6-bit scales


@triton.jit
def _qkx2_levels(x, iscale, base):
    """clamp(nearest_int(iscale * (x - base)), 0, 15) as fp32."""
    return tl.minimum(tl.maximum(_nearest_int(iscale * (x - base)), 0), 15).to(tl.float32)


@triton.jit
def _qkx2_error(xs, av, iscale, base, scale, shift):
    """sum_i w_i * (scale*l_i + shift - x_i)^2 left to right, l_i the levels of (iscale, base)."""
    for i in tl.static_range(32):
        x = xs[i]
        dx = scale * _qkx2_levels(x, iscale, base) + shift - x
        e = (av + tl.abs(x)) * (dx * dx)
        if i == 0:
            err = e
        else:
            err = err + e
    return err


@triton.jit
def _qkx2_sums(xs, av, iscale, base):
    """sum w*l, sum w*l*l, sum w*l*x left to right over the 32 positions."""
    for i in tl.static_range(32):
        x = xs[i]
        l = _qkx2_levels(x, iscale, base)
        wl = (av + tl.abs(x)) * l
        if i == 0:
            sum_l, sum_l2, sum_xl = wl, wl * l, wl * x
        else:
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * l, sum_xl + wl * x
    return sum_l, sum_l2, sum_xl


@triton.jit
def _make_qkx2_quants(xs):
    """ggml's make_qkx2_quants(32, 15, ...) as quantize_row_q4_K_ref calls it, per sub-block.
    Returns (scale, the_min, best_iscale, best_base, flat): x ~ scale*L - the_min, and the winning
    trial's levels are _qkx2_levels(x, best_iscale, best_base) (0 where flat)."""
    x = xs[0]
    sum_x2 = x * x
    for i in tl.static_range(1, 32):
        sum_x2 = sum_x2 + xs[i] * xs[i]
    av = tl.sqrt_rn(tl.math.div_rn(sum_x2, 32.0))          # weights w_i = av + |x_i|
    mn = x
    mx = x
    sum_w = av + tl.abs(x)
    sum_x = sum_w * x
    for i in tl.static_range(1, 32):
        x = xs[i]
        mn = tl.where(x < mn, x, mn)
        mx = tl.where(x > mx, x, mx)
        w = av + tl.abs(x)
        sum_w = sum_w + w
        sum_x = sum_x + w * x
    mn = tl.where(mn > 0, 0.0, mn)
    flat = mx == mn                                 # ggml returns at once; here no trial updates
    iscale = tl.math.div_rn(15.0, tl.where(flat, 1.0, mx - mn))
    scale = tl.math.div_rn(1.0, iscale)
    best = _qkx2_error(xs, av, iscale, mn, scale, mn)
    best_iscale = iscale
    best_base = mn
    for s in range(21):                             # iscale = (rmin + rdelta*s + nmax) / (max - min)
        step = (tl.full(mn.shape, -1.0, tl.float32) + tl.full(mn.shape, 0.1, tl.float32) * s) + 15.0
        iscale = tl.math.div_rn(step, tl.where(flat, 1.0, mx - mn))
        sum_l, sum_l2, sum_xl = _qkx2_sums(xs, av, iscale, mn)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = tl.where(ok, D, 1.0)
        this_scale = tl.math.div_rn(sum_w * sum_xl - sum_x * sum_l, Ds)
        this_min = tl.math.div_rn(sum_l2 * sum_x - sum_l * sum_xl, Ds)
        pos = this_min > 0
        this_min = tl.where(pos, 0.0, this_min)
        this_scale = tl.where(pos, tl.math.div_rn(sum_xl, tl.where(ok, sum_l2, 1.0)), this_scale)
        err = _qkx2_error(xs, av, iscale, mn, this_scale, this_min)
        upd = ok & (err < best)
        best_iscale = tl.where(upd, iscale, best_iscale)
        best_base = tl.where(upd, mn, best_base)
        best = tl.where(upd, err, best)
        scale = tl.where(upd, this_scale, scale)
        mn = tl.where(upd, this_min, mn)
    return tl.where(flat, 0.0, scale), -mn, best_iscale, best_base, flat


@triton.jit
def _scales_6bit(v, SB: tl.constexpr):
    """The super-blocks' (SB, 8) 6-bit ratios of v (SB*8,) to their max, and max/63 as fp16:
    (l (SB, 8) int32, d (SB,) fp32, d's fp16 bits (SB,))."""
    v = tl.reshape(v, (SB, 8))
    m = tl.max(v, axis=1)
    m = tl.where(m > 0, m, 0.0)                     # ggml: max_scale = 0, raised by scale > max_scale
    inv = tl.where(m > 0, tl.math.div_rn(63.0, tl.where(m > 0, m, 1.0)), 0.0)
    l = tl.minimum(_nearest_int(inv[:, None] * v) & 0xFF, 63)   # C's uint8_t, then MIN(63, .)
    d, bits = _fp16(tl.math.div_rn(m, 63.0))
    return l, d, bits


@triton.jit
def _halves(v, SB: tl.constexpr):
    """(SB, 8) -> columns 0..3 and 4..7, each (SB, 4)."""
    return tl.split(tl.permute(tl.reshape(v, (SB, 2, 4)), (0, 2, 1)))


@triton.jit
def _q4_k_kernel(
    dst_ptr,                                      # out: (n_sb, 144) uint8
    x_ptr,                                        # in: (n_sb, 256) values
    n_sb,
    SB: tl.constexpr,                             # super-blocks a program
):
    SUB: tl.constexpr = 8 * SB
    xs = _load_sub_blocks(x_ptr, n_sb * 8, SUB, 32)                    # sub-block j of block b: 8b + j
    scale, the_min, best_iscale, best_base, flat = _make_qkx2_quants(xs)
    ls, d, d_bits = _scales_6bit(scale, SB)
    lm, dmin, dmin_bits = _scales_6bit(the_min, SB)
    dj = tl.reshape(d[:, None] * ls.to(tl.float32), (SUB,))
    dmj = tl.reshape(dmin[:, None] * lm.to(tl.float32), (SUB,))
    live = dj != 0                                  # d*sc == 0: ggml keeps make_qkx2's levels
    djs = tl.where(live, dj, 1.0)
    # the 128 bytes of nibbles: byte 32k + i = L[64k + i] | L[64k + 32 + i] << 4 (sub-blocks 2k, 2k+1)
    p = tl.program_id(0).to(tl.int64) * (SUB // 2) + tl.arange(0, SUB // 2)   # pair 4b + k
    qs_ptr = dst_ptr + (p // 4) * 144 + 16 + (p % 4) * 32
    for i in tl.static_range(32):
        x = xs[i]
        q = tl.minimum(tl.maximum(_nearest_int(tl.math.div_rn(x + dmj, djs)), 0), 15)
        q = tl.where(live, q, tl.where(flat, 0, _qkx2_levels(x, best_iscale, best_base).to(tl.int32)))
        lo, hi = tl.split(tl.reshape(q, (SUB // 2, 2)))
        tl.store(qs_ptr + i, (lo | (hi << 4)).to(tl.uint8), mask=p < n_sb * 4)
    # the head: d, dmin (fp16) | 12 bytes of 6-bit scales and mins
    b = tl.program_id(0).to(tl.int64) * SB + tl.arange(0, SB)
    bok = b < n_sb
    head = dst_ptr + b * 144
    _store_fp16(head, d_bits, bok)
    _store_fp16(head + 2, dmin_bits, bok)
    ls_lo, ls_hi = _halves(ls, SB)
    lm_lo, lm_hi = _halves(lm, SB)
    c = tl.arange(0, 4)[None, :]
    hp = head[:, None] + c
    tl.store(hp + 4, (ls_lo | ((ls_hi >> 4) << 6)).to(tl.uint8), mask=bok[:, None])
    tl.store(hp + 8, (lm_lo | ((lm_hi >> 4) << 6)).to(tl.uint8), mask=bok[:, None])
    tl.store(hp + 12, ((ls_hi & 0xF) | ((lm_hi & 0xF) << 4)).to(tl.uint8), mask=bok[:, None])


# ---------------------------------------------------------------------------------------------
# Q6_K: make_qx_quants(16, 32, x, rmse_type 1) per sub-block of 16, int8 scales


@triton.jit
def _qx_sums(xs, iscale):
    """sum (x*x*x)*l and sum (x*x*l)*l left to right, l = clamp(nearest_int(iscale*x), -32, 31)."""
    for i in tl.static_range(16):
        x = xs[i]
        l = tl.minimum(tl.maximum(_nearest_int(iscale * x), -32), 31).to(tl.float32)
        w = x * x
        if i == 0:
            sumlx, suml2 = (w * x) * l, (w * l) * l
        else:
            sumlx, suml2 = sumlx + (w * x) * l, suml2 + (w * l) * l
    return sumlx, suml2


@triton.jit
def _make_qx_quants(xs):
    """ggml's make_qx_quants(16, 32, x, L, 1, NULL) per sub-block. Returns (scale, best_iscale,
    zero): the winning trial's levels are clamp(nearest_int(best_iscale*x), -32, 31) (-32 where zero)."""
    amax = tl.zeros(xs[0].shape, tl.float32)
    vmax = tl.zeros(xs[0].shape, tl.float32)
    for i in tl.static_range(16):                   # the first largest |x|, as the C loop's strict '>'
        gt = tl.abs(xs[i]) > amax
        amax = tl.where(gt, tl.abs(xs[i]), amax)
        vmax = tl.where(gt, xs[i], vmax)
    zero = amax < 1e-15                             # GROUP_MAX_EPS
    vmax = tl.where(zero, 1.0, vmax)
    best_iscale = tl.math.div_rn(-32.0, vmax)
    sumlx, suml2 = _qx_sums(xs, best_iscale)
    scale = tl.where(suml2 != 0, tl.math.div_rn(sumlx, tl.where(suml2 != 0, suml2, 1.0)), 0.0)
    best = scale * sumlx
    for t in range(18):                             # is = -9..-1, 1..9: iscale = -(nmax + 0.1*is) / max
        s = t - 9 + (t + 9) // 18                   # integer ops only (no bool to int)
        step = -(tl.full(vmax.shape, 32.0, tl.float32) + tl.full(vmax.shape, 0.1, tl.float32) * s)
        iscale = tl.math.div_rn(step, vmax)
        sumlx, suml2 = _qx_sums(xs, iscale)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = tl.where(upd, tl.math.div_rn(sumlx, tl.where(upd, suml2, 1.0)), scale)
        best = tl.where(upd, scale * sumlx, best)
        best_iscale = tl.where(upd, iscale, best_iscale)
    return tl.where(zero, 0.0, scale), best_iscale, zero


@triton.jit
def _q6_k_kernel(
    dst_ptr,                                      # out: (n_sb, 210) uint8
    x_ptr,                                        # in: (n_sb, 256) values
    n_sb,
    SB: tl.constexpr,                             # super-blocks a program
):
    SUB: tl.constexpr = 16 * SB
    xs = _load_sub_blocks(x_ptr, n_sb * 16, SUB, 16)                   # sub-block j of block b: 16b + j
    scale, best_iscale, zero = _make_qx_quants(xs)
    # the super-block: max_scale = the first scale of largest |.|; d = fp16(1 / (-128 / max_scale))
    sc2 = tl.reshape(scale, (SB, 16))
    a = tl.abs(sc2)
    amax = tl.max(a, axis=1)
    col = tl.arange(0, 16)[None, :]
    first = tl.min(tl.where(a == amax[:, None], col, 16), axis=1)
    max_scale = tl.sum(tl.where(col == first[:, None], sc2, 0.0), axis=1)   # one nonzero term
    empty = amax < 1e-15                            # ggml writes an all-zero block
    iscale = tl.math.div_rn(-128.0, tl.where(empty, 1.0, max_scale))
    d, d_bits = _fp16(tl.where(empty, 0.0, tl.math.div_rn(1.0, iscale)))
    sc = tl.where(empty[:, None], 0, tl.minimum(_nearest_int(iscale[:, None] * sc2), 127))   # (SB, 16)
    dj = tl.reshape(d[:, None] * sc.to(tl.float32), (SUB,))
    live = dj != 0                                  # d*sc == 0: ggml keeps make_qx's levels
    djs = tl.where(live, dj, 1.0)
    empty_sub = tl.reshape(tl.broadcast_to(empty[:, None], (SB, 16)), (SUB,))
    # value 128h + 32k + l of a block (sub-block 8h + 2k + l//16): low nibble in ql[64h + 32(k&1) + l]
    # (high half for k >= 2), top two bits in qh[32h + l] at bit 2k. m = 4b + 2h + l//16
    m = tl.program_id(0).to(tl.int64) * (SUB // 4) + tl.arange(0, SUB // 4)
    mok = m < n_sb * 4
    base = dst_ptr + (m // 4) * 210 + ((m // 2) % 2) * 64 + (m % 2) * 16
    qh_ptr = dst_ptr + (m // 4) * 210 + 128 + ((m // 2) % 2) * 32 + (m % 2) * 16
    for i in tl.static_range(16):
        x = xs[i]
        q = tl.minimum(tl.maximum(_nearest_int(tl.math.div_rn(x, djs)), -32), 31)
        q_make = tl.where(zero, -32, tl.minimum(tl.maximum(_nearest_int(best_iscale * x), -32), 31))
        q = tl.where(empty_sub, 0, tl.where(live, q, q_make) + 32)
        # (2b + h, k, l//16) -> (m, k) with k = 2*k1 + k0: split k0, then k1
        q = tl.reshape(tl.permute(tl.reshape(q, (SUB // 8, 4, 2)), (0, 2, 1)), (SUB // 4, 2, 2))
        q02, q13 = tl.split(q)
        q0, q2 = tl.split(q02)
        q1, q3 = tl.split(q13)
        tl.store(base + i, ((q0 & 0xF) | ((q2 & 0xF) << 4)).to(tl.uint8), mask=mok)
        tl.store(base + 32 + i, ((q1 & 0xF) | ((q3 & 0xF) << 4)).to(tl.uint8), mask=mok)
        tl.store(qh_ptr + i, ((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)).to(tl.uint8),
                 mask=mok)
    b = tl.program_id(0).to(tl.int64) * SB + tl.arange(0, SB)
    bok = b < n_sb
    tl.store(dst_ptr + b[:, None] * 210 + 192 + col, (sc & 0xFF).to(tl.uint8), mask=bok[:, None])
    _store_fp16(dst_ptr + b * 210 + 208, d_bits, bok)


# ---------------------------------------------------------------------------------------------
# Launcher


def row_bytes(C, qtype):
    """Bytes of one row of C values in qtype (Q8_0, Q4_K or Q6_K)."""
    name, block, size = _qtype(qtype)
    if C % block:
        raise ValueError(f"a row of {C} values does not split into {name} blocks of {block}")
    return C // block * size


def _qtype(qtype):
    if int(qtype) not in QTYPES:
        raise ValueError(f"quantize_rows: {getattr(qtype, 'name', qtype)} has no kernel here; "
                         f"use one of {', '.join(n for n, _, _ in QTYPES.values())} (others: gguf_quants.quantize)")
    return QTYPES[int(qtype)]


def _config(name, interpreting):
    """(blocks a program, num_warps). GPU: one sub-block a thread at 4 warps (untuned). Interpreter:
    64 super-blocks (2048 Q8_0 blocks) a program, its cost being per operation, not per value."""
    if interpreting:
        return (2048, 1) if name == "Q8_0" else (64, 1)
    return {"Q8_0": (64, 4), "Q4_K": (16, 4), "Q6_K": (8, 4)}[name]


def quantize_rows(dst, x, qtype):
    """dst (R, B) uint8 = ggml's qtype blocks of x (R, C) (fp32 / fp16 / bf16); see the docstring."""
    from lean.kernels.gemm import interpreting

    name, block, _ = _qtype(qtype)
    check(x, "x", shape=(None, None), dtype=_IN, contiguous=True)
    R, C = x.shape
    check(dst, "dst", shape=(R, row_bytes(C, qtype)), dtype=torch.uint8, device=x.device, contiguous=True)
    n = R * C // block                              # blocks (Q8_0) or super-blocks
    if n == 0:
        return dst
    per, warps = _config(name, interpreting())
    kernel = {"Q8_0": _q8_0_kernel, "Q4_K": _q4_k_kernel, "Q6_K": _q6_k_kernel}[name]
    meta = {"BLOCKS": per} if name == "Q8_0" else {"SB": per}
    kernel[(triton.cdiv(n, per),)](dst, x, n, **meta, num_warps=warps, enable_fp_fusion=False)
    return dst
