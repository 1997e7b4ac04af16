"""GGUF tensor encoders for the export: float32 rows -> ggml's block bytes, and back.

    raw = quantize(w, GGMLQuantizationType.Q4_K)          # (rows, C) float32 -> (rows, C/256*144) uint8
    w2 = dequantize(raw, GGMLQuantizationType.Q4_K, w.shape)

Types: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K and the fallbacks Q4_K_M picks for rows that are not
a multiple of 256 (Q5_0, Q5_1; F16 past those). Output is uint8 of shape (..., bytes per row);
gguf's GGUFWriter.add_tensor takes it with raw_dtype=qtype. F16 and BF16 round to nearest even
(BF16 as ggml_compute_fp32_to_bf16, NaN forced quiet); BF16 and Q8_0 are gguf.quants.quantize,
whose numpy equals ggml's bytes. Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 are this module's numpy after
ggml's quantize_row_*_ref (ggml/src/ggml-quants.c of the llama.cpp that llama-cpp-python 0.3.36
carries) with no importance matrix: what llama-quantize writes without --imatrix. (gguf.quants
quantizes Q5_0 / Q5_1 too, but takes a zero's sign from the block where ggml's loops keep their
+0.0 start: an all-zero block led by -0.0, which fp16 underflow makes, got another d.)

Block layouts (one block = one fp16/int group; rows are whole blocks, laid end to end):
  Q8_0   32 values,  34 bytes: d fp16 | 32 x int8 q.                   x = d*q
  Q5_0   32 values,  22 bytes: d fp16 | qh u32 (bit j = 5th bit of q_j) | 16 bytes of nibbles
                               (q_j low, q_j+16 high).                 x = d*(q - 16)
  Q5_1   32 values,  24 bytes: d fp16 | m fp16 | qh u32 | 16 bytes, as Q5_0.   x = d*q + m
  Q4_K  256 values, 144 bytes: d fp16 | dmin fp16 | 12 bytes: eight 6-bit scales sc_j and mins m_j
                               (bytes 0-3: sc_0..3 low 6 bits, sc_4..7 top 2; 4-7: m_0..3 likewise,
                               m_4..7 top 2; 8-11: sc_4..7 low 4 | m_4..7 low 4 << 4) | 128 bytes
                               of nibbles: byte 32*k + l = q[64k + l] | q[64k + 32 + l] << 4.
                               Sub-block j = values 32j..32j+31: x = d*sc_j*q - dmin*m_j, q in 0..15
  Q5_K  256 values, 176 bytes: Q4_K's head (16 bytes) | qh 32 (bit 2k + h of qh[l]: the fifth bit
                               of q[64k + 32h + l]) | 128 bytes of nibbles as Q4_K, q in 0..31
  Q6_K  256 values, 210 bytes: ql 128 | qh 64 | 16 x int8 scales | d fp16. For each half h (128
                               values), q in 0..63 of value 128h + 32k + l (k < 4, l < 32): low
                               nibble in ql[64h + 32(k & 1) + l] (high half of the byte for k >= 2),
                               top 2 bits in qh[32h + l] at bit 2k. x = d*sc_(value/16)*(q - 32)

Math (ggml's, replicated operation by operation in float32):
  Q4_K: per sub-block of 32, weights w = sqrt(sum x^2 / 32) + |x|; make_qkx2_quants fits
    x ~ scale*L - min, L in 0..15, min >= 0: start from L = round((x - min_x) * 15/(max_x - min_x)),
    then for 21 trial steps iscale = (14 + 0.1*s)/(max - min), s = 0..20, solve the weighted least
    squares for (scale, min) given L and keep the trial with the smallest weighted squared error.
    The super-block stores d = max scale/63, dmin = max min/63 in fp16 and the 6-bit ratios; the
    values are then re-rounded against the stored (fp16 d * sc, fp16 dmin * m):
    q = clamp(round((x + dmin*m)/(d*sc)), 0, 15) (a sub-block with d*sc = 0 keeps make_qkx2's L).
  Q6_K: per sub-block of 16, make_qx_quants(nmax=32, weights x^2): iscale = -(32 + 0.1*s)/x_amax
    for s = 0, -9..9, L = clamp(round(iscale*x), -32, 31), scale = sum w x L / sum w L^2, keep the
    trial maximising (sum w x L)^2 / sum w L^2. d = -max|scale|/128 with the sign that makes the
    largest scale's int8 -128; sc = min(127, round(scale/d)); q = clamp(round(x/(d*sc)), -32, 31) + 32.
  Rounding is ggml's nearest_int (add 1.5*2^23 in float32, read the mantissa: round half to even,
  reproduced bit for bit, including its wrap outside |v| < 2^22), fp16 by round-to-nearest-even.
  Every sum over a sub-block is accumulated left to right in float32, as the C loop does: the
  sub-blocks are laid out as (32, n) columns and reduced over axis 0, which numpy adds row after row
  (a reduction over the last, contiguous axis would be pairwise and differ in the last bit).
  Whole tensors run in chunks of CHUNK_BLOCKS super-blocks (vectorised across sub-blocks), so host
  memory is the input, the output and a few MB of temporaries.

Errors (what the tests assert per value; q the stored integers):
  K-quants: each value is its sub-block's nearest level, |x - xhat| = min over q of |x - (D*q - M)|
  (Q4_K, Q5_K; D = d*sc, M = dmin*m from the stored bytes) or of |x - D*q| (Q6_K), up to float32
  rounding of the level. The least-squares grid may leave a sub-block's extremes outside it; those
  sit on the end level. A sub-block whose 6-bit scale rounds to 0 is all -M (Q4_K/Q5_K) or 0 (Q6_K).
  Q8_0: q = round(x/d), d = amax/127 in float32, stored as fp16 d16: |x - d16*q| <= d/2 + 127|d - d16|.
  On N(0, 1) rows of 4096 the RMS error is 0.071 (Q4_K), 0.036 (Q5_K), 0.018 (Q6_K), 0.0053 (Q8_0).

Which type each tensor of a Q4_K_M file takes: gguf_types.py (q4_k_m_types).

Measured (tools/gguf_quant_bench.py at edfbbba: AMD EPYC, 2 cores shared with other jobs at load
  6-9, numpy 2.3.5; one thread, CPU seconds, N(0, 0.02) float32 rows; ggml = ggml_quantize_chunk of
  llama-cpp-python 0.3.36 on the same rows, bytes equal in every case):
    14336 x 4096: Q4_K 8.1 M values/s (ggml 9.5, 1.17x faster), Q6_K 13.5 (23.4), Q8_0 76 (143)
    4096 x 4096:  Q4_K 6.0 (9.6), Q6_K 13.0 (24.3), Q8_0 99 (168)
  Llama-3.1-8B's Q4_K_M is 6.50 G values of Q4_K and 1.53 G of Q6_K: 917 CPU s here against ggml's
  752 (its quantisation alone; llama.cpp's convert_hf_to_gguf pass comes on top). Two threads took
  the same CPU seconds (7.23 vs 7.27 s at 14336 x 4096): on two idle cores that would be about
  7.6 min; the wall-clock speed-up itself was not measurable on the loaded machine.
  Extra host memory per call: about 10 MiB per thread (K-quants), 30 MiB (Q8_0), by tracemalloc.
  CHUNK_BLOCKS = 1024 measured best of 64..4096 (Q4_K 9.7 M/s vs 5.5 at 256, 7.5 at 4096).
Tested: tests/test_gguf_quants.py. Everywhere: Q4_K / Q5_K / Q6_K bytes equal a scalar transcription
of ggml's C on the blocks where plausible wrong ports (float64 or pairwise sums, rounding half
away) part from it, and on stress blocks; every type decodes through gguf.quants.dequantize to
lean's dequantize bit for bit; each K-quant value sits on its stored grid's nearest level; Q8_0
within half a step; RMS error on Gaussian data; the Q4_K_M rules on hand-written model layouts.
Where llama_cpp imports: every type's bytes equal ggml_quantize_chunk's on rows of 576..14336, and
lean's Q4_K_M of four small F16 GGUF files (K-quants; 96 and 80 columns: the Q5_0 / Q8_0 / F16
fallbacks; an 8-expert qwen3moe) and of the real SmolLM2-135M (272 tensors) equals
llama_model_quantize's tensor for tensor, types and bytes.
Cautions:
  - Non-finite input is refused (ggml writes undefined bytes for it).
  - The bytes are ggml's as its x86-64 build computes them (ggml-base is compiled with no -march, so
    no FMA contraction). A build that contracts a*b + c into an FMA (GCC's default where the target
    has FMA, e.g. aarch64) rounds the sums differently and may write other bytes in some blocks;
    not measured.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

QK_K = 256
CHUNK_BLOCKS = 1024  # super-blocks per numpy pass: 1 MB per (32, n) temporary

F32 = np.float32
_MAGIC = F32(12582912.0)  # 1.5 * 2^23: ggml's nearest_int


def _nearest_int(v):
    """ggml's nearest_int on a float32 array, bit for bit (round half to even for |v| < 2^22)."""
    i = np.ascontiguousarray(v + _MAGIC, dtype=F32).view(np.int32)
    return (i & 0x007FFFFF) - 0x00400000


def _sum(a):
    """Sum over axis 0, row after row in float32: the C loop's order."""
    return np.add.reduce(a, axis=0, dtype=F32)


def _fp16(v):
    """fp32 -> fp16 (round to nearest even) -> back to fp32, and the fp16 itself."""
    h = np.asarray(v, dtype=F32).astype(np.float16)
    return h.astype(F32), h


# ----------------------------------------------------------------------------- Q4_K, Q5_K

_EXACT = F32(4194303)  # |v| bound under which np.rint equals nearest_int


def _steps(rmin, nstep, nmax):  # make_qkx2's trial numerators: rmin + rdelta*is + nmax, rdelta = 0.1
    return [F32(rmin) + F32(0.1) * F32(s) + F32(nmax) for s in range(nstep + 1)]


_QKX2 = {15: _steps(-1.0, 20, 15), 31: _steps(-0.5, 15, 31)}  # Q4_K, Q5_K


def _grid(out, x, base, iscale, hi, bound):
    """out = clamp(nearest_int(iscale*(x - base)), 0, hi) in float32; bound >= max |iscale*(x-base)|."""
    np.subtract(x, base, out=out)
    out *= iscale
    if (bound >= _EXACT).any():  # past rint's agreement with nearest_int: the exact bit trick
        out[...] = np.clip(_nearest_int(out), 0, hi)
        return out
    return np.clip(np.rint(out, out=out), F32(0), F32(hi), out=out)


def _wsq_err(out, x, w, l, scale, shift):
    """sum_i w_i*(scale*l_i + shift - x_i)^2, in the C loop's order: (32, n) -> (n,)."""
    np.multiply(l, scale, out=out)
    out += shift
    out -= x
    out *= out
    out *= w
    return _sum(out)


def _make_qkx2_quants(x, nmax):
    """ggml's make_qkx2_quants(32, nmax, x, weights, ...) as Q4_K (nmax 15) and Q5_K (31) call it,
    on (32, n) columns, weights = sqrt(mean x^2) + |x|.

    Returns scale (n,), the_min (n,) (x ~ scale*L - the_min) and levels(cols) -> L of those columns
    (recomputed from the winning trial's iscale and base, bit for bit the same expression).
    """
    t, u, v = np.empty_like(x), np.empty_like(x), np.empty_like(x)  # scratch, (32, n)
    w = np.abs(x)
    w += np.sqrt(_sum(np.multiply(x, x, out=t)) / F32(32))
    x_min, mx = x.min(axis=0), x.max(axis=0)
    mn = np.minimum(x_min, F32(0))
    sum_w, sum_x = _sum(w), _sum(np.multiply(w, x, out=t))
    flat = mx == mn  # every x equals mn: ggml returns at once; here each trial's L is 0, D = 0, no update
    one = F32(1)
    iscale = F32(nmax) / np.where(flat, one, mx - mn)
    scale = one / iscale
    best_iscale, best_base = iscale, mn
    best = _wsq_err(u, x, w, _grid(t, x, mn, iscale, nmax, F32(0)), scale, mn)
    for step in _QKX2[nmax]:  # min moves with each better trial: later trials measure from it
        iscale = step / np.where(flat, one, mx - mn)
        l = _grid(t, x, mn, iscale, nmax, np.abs(iscale) * np.maximum(mx - mn, np.abs(x_min - mn)))
        wl = np.multiply(w, l, out=u)
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(np.multiply(wl, l, out=v)), _sum(np.multiply(wl, x, out=v))
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, one)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, F32(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(ok, sum_l2, one), this_scale)
        err = _wsq_err(v, x, w, l, this_scale, this_min)
        upd = ok & (err < best)
        best_iscale, best_base = np.where(upd, iscale, best_iscale), np.where(upd, mn, best_base)
        best = np.where(upd, err, best)
        scale = np.where(upd, this_scale, scale)
        mn = np.where(upd, this_min, mn)
    scale[flat] = 0

    def levels(cols):
        xc, bi, bb = x[:, cols], best_iscale[cols], best_base[cols]
        bound = np.abs(bi) * np.maximum(np.abs(mx[cols] - bb), np.abs(x_min[cols] - bb))
        L = _grid(np.empty_like(xc), xc, bb, bi, nmax, bound)
        L[:, flat[cols]] = 0
        return L

    return scale, -mn, levels


def _k_levels(x, nmax):
    """(N, 256) float32 -> (N, 16) uint8 head (d, dmin, 12 scale bytes) and (N, 256) levels 0..nmax,
    as quantize_row_q4_K_ref (nmax 15) and quantize_row_q5_K_ref (nmax 31) compute them."""
    N = x.shape[0]
    cols = np.ascontiguousarray(x.reshape(N * 8, 32).T)  # (32, 8N): sub-block s = 8*block + j
    scale, the_min, levels = _make_qkx2_quants(cols, nmax)
    scale, the_min = scale.reshape(N, 8), the_min.reshape(N, 8)
    max_scale = np.maximum(scale.max(axis=1), F32(0))
    max_min = np.maximum(the_min.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scale) & 0xFF, 63).astype(np.uint8)  # C's uint8_t
    lm = np.minimum(_nearest_int(inv_min[:, None] * the_min) & 0xFF, 63).astype(np.uint8)
    d, d16 = _fp16(max_scale / F32(63))
    dmin, dmin16 = _fp16(max_min / F32(63))
    dj = (d[:, None] * ls.astype(F32)).reshape(-1)  # (8N,)
    dmj = (dmin[:, None] * lm.astype(F32)).reshape(-1)
    live = dj != 0
    L = np.clip(_nearest_int((cols + dmj) / np.where(live, dj, F32(1))), 0, nmax).astype(np.uint8)
    dead = np.flatnonzero(~live)
    if dead.size:  # d*sc == 0: ggml keeps make_qkx2's levels
        L[:, dead] = levels(dead)
    head = np.empty((N, 16), np.uint8)
    head[:, 0:2] = d16.view(np.uint8).reshape(N, 2)
    head[:, 2:4] = dmin16.view(np.uint8).reshape(N, 2)
    head[:, 4:8] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    head[:, 8:12] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    head[:, 12:16] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return head, L.T.reshape(N, QK_K)


def _q4_k_blocks(x):
    """(N, 256) float32 -> (N, 144) uint8, as quantize_row_q4_K_ref."""
    head, L = _k_levels(x, 15)
    L = L.reshape(-1, 4, 2, 32)  # (block, 64-value group, first/second 32, 32)
    return np.concatenate([head, (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def _q5_k_blocks(x):
    """(N, 256) float32 -> (N, 176) uint8, as quantize_row_q5_K_ref."""
    head, L = _k_levels(x, 31)
    L = L.reshape(-1, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    bit = (L >> 4).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]  # group g, half h: 2g + h
    return np.concatenate([head, np.bitwise_or.reduce(bit, axis=1), qs], axis=1)


def _q4_k_dequant(b):
    """(N, 144) uint8 -> (N, 256) float32, as dequantize_row_q4_K."""
    N = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(F32)  # (N, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(F32)
    s = b[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:].reshape(N, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(N, 8, 32).astype(F32)
    return ((d * sc.astype(F32))[:, :, None] * q - (dmin * m.astype(F32))[:, :, None]).reshape(N, QK_K)


# ----------------------------------------------------------------------------- Q6_K

_Q6_STEPS = [-(F32(32) + F32(0.1) * F32(s)) for s in range(-9, 10) if s != 0]  # -(nmax + 0.1f*is)


def _make_qx_quants(x):
    """ggml's make_qx_quants(16, 32, x, L, rmse_type=1, NULL) on (16, n) columns.

    Returns scale (n,) (x ~ scale*l, l in -32..31, stored as l + 32) and l as a function of the
    columns it is asked for (the winning trial's grid; -32, stored 0, in an all-zero column).
    """
    n = x.shape[1]
    t, u = np.empty_like(x), np.empty_like(x)
    ax = np.abs(x, out=t)
    imax = ax.argmax(axis=0)  # the first largest |x|, as the C loop's strict '>'
    vmax = x[imax, np.arange(n)]
    zero = np.abs(vmax) < F32(1e-15)
    vmax = np.where(zero, F32(1), vmax)
    w = x * x
    wx = w * x

    def trial(iscale):  # |iscale*x| <= 33: np.rint is nearest_int here
        l = np.clip(np.rint(np.multiply(x, iscale, out=t), out=t), F32(-32), F32(31), out=t)
        sumlx = _sum(np.multiply(wx, l, out=u))
        return sumlx, _sum(np.multiply(np.multiply(w, l, out=u), l, out=u))

    best_iscale = F32(-32) / vmax
    sumlx, suml2 = trial(best_iscale)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    best = scale * sumlx
    for step in _Q6_STEPS:
        iscale = step / vmax
        sumlx, suml2 = trial(iscale)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(upd, sumlx / np.where(upd, suml2, F32(1)), scale)
        best = np.where(upd, scale * sumlx, best)
        best_iscale = np.where(upd, iscale, best_iscale)
    scale[zero] = 0

    def levels(cols):
        l = np.clip(np.rint(x[:, cols] * best_iscale[cols]), F32(-32), F32(31))
        l[:, zero[cols]] = -32
        return l

    return scale, levels


def _q6_k_blocks(x):
    """(N, 256) float32 -> (N, 210) uint8, as quantize_row_q6_K_ref."""
    N = x.shape[0]
    cols = np.ascontiguousarray(x.reshape(N * 16, 16).T)  # (16, 16N)
    scale, levels = _make_qx_quants(cols)
    scale = scale.reshape(N, 16)
    imax = np.abs(scale).argmax(axis=1)
    max_scale = scale[np.arange(N), imax]
    zero = np.abs(max_scale) < F32(1e-15)
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d, d16 = _fp16(np.where(zero, F32(0), F32(1) / iscale))
    sc = np.minimum(_nearest_int(iscale[:, None] * scale), 127)
    sc[zero] = 0
    dj = (d[:, None] * sc.astype(F32)).reshape(-1)  # (16N,)
    live = dj != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.clip(_nearest_int(cols / np.where(live, dj, F32(1))), -32, 31) + 32
    dead = np.flatnonzero(~live)
    if dead.size:  # d*sc == 0: ggml keeps make_qx's levels
        L[:, dead] = levels(dead).astype(np.int32) + 32
    L = L.reshape(16, N, 16)
    L[:, zero] = 0  # ggml memsets an all-zero block
    L = L.transpose(1, 2, 0).reshape(N, 2, 4, 32).astype(np.uint8)  # (block, half, k, l)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(N, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(N, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d16.view(np.uint8).reshape(N, 2)],
                          axis=1)


def _q6_k_dequant(b):
    """(N, 210) uint8 -> (N, 256) float32, as dequantize_row_q6_K."""
    N = b.shape[0]
    ql = b[:, 0:128].reshape(N, 2, 2, 32)
    qh = b[:, 128:192].reshape(N, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(F32)
    d = b[:, 208:210].copy().view(np.float16).astype(F32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # (N, half, k, 32): k = 0..3
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(N, 16, 16).astype(F32)
    return ((d * sc)[:, :, None] * q).reshape(N, QK_K)


# ----------------------------------------------------------------------------- Q5_0, Q5_1 (blocks of 32)

def _first(x, idx):
    return np.take_along_axis(x, idx[:, None], axis=1)[:, 0]


def _q5_pack(q):
    """(N, 32) levels 0..31 -> (N, 20): qh (u32, bit j = level j's fifth bit) | 16 bytes of nibbles."""
    qh = np.packbits(q >> 4, axis=1, bitorder="little")
    return np.concatenate([qh, (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)], axis=1)


def _q5_0_blocks(x):
    """(N, 32) float32 -> (N, 22) uint8, as quantize_row_q5_0_ref: d = (the first largest-|x| value,
    +0.0 in an all-zero block) / -16, q = min(31, trunc(x/d + 16.5))."""
    a = np.abs(x)
    i = a.argmax(axis=1)
    d = np.where(_first(a, i) > 0, _first(x, i), F32(0)) / F32(-16)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    q = np.minimum(np.trunc(x * inv[:, None] + F32(16.5)), F32(31)).astype(np.uint8)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), _q5_pack(q)], axis=1)


def _q5_1_blocks(x):
    """(N, 32) float32 -> (N, 24) uint8, as quantize_row_q5_1_ref: min and max the first occurrences
    (their zeros' signs kept), d = (max - min)/31, q = trunc((x - min)/d + 0.5)."""
    mn, mx = _first(x, x.argmin(axis=1)), _first(x, x.argmax(axis=1))
    d = (mx - mn) / F32(31)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    q = np.trunc((x - mn[:, None]) * inv[:, None] + F32(0.5)).astype(np.uint8)
    head = np.stack([d, mn], axis=1).astype(np.float16).view(np.uint8)
    return np.concatenate([head, _q5_pack(q)], axis=1)


# ----------------------------------------------------------------------------- public

_OWN = {T.Q4_K: _q4_k_blocks, T.Q5_K: _q5_k_blocks, T.Q6_K: _q6_k_blocks,  # float32 -> blocks
        T.Q5_0: _q5_0_blocks, T.Q5_1: _q5_1_blocks}
_OWN_DEQUANT = {T.Q4_K: _q4_k_dequant, T.Q6_K: _q6_k_dequant}  # others: gguf.quants.dequantize
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


def row_bytes(cols, qtype):
    """Bytes of one row of `cols` values in `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"a row of {cols} values does not split into {qtype.name} blocks of {block}: "
                         f"choose the type with gguf_types.q4_k_m_types, which falls back for such rows")
    return cols // block * size


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def quantize(x, qtype, threads=None):
    """(..., C) float32 or float16 -> (..., row_bytes(C, qtype)) uint8 in ggml's layout, C % block == 0.

    Works CHUNK_BLOCKS super-blocks (K-quants) or 4M values (the rest) at a time, on `threads`
    threads (default: the CPUs this process may use, at most 8; numpy releases the GIL inside each
    operation). Host memory: x, the result and a few MB per thread. The bytes do not depend on it.
    """
    qtype = T(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"quantize: {qtype.name} is not supported; use one of "
                         f"{', '.join(t.name for t in SUPPORTED)}")
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16) or x.ndim == 0:
        raise ValueError(f"quantize: expected a float32 or float16 array, got {x.dtype} of shape "
                         f"{x.shape}; convert the tensor first")
    C = x.shape[-1]
    rows = x.reshape(-1, C)
    out = np.empty((rows.shape[0], row_bytes(C, qtype)), np.uint8)
    block = GGML_QUANT_SIZES[qtype][0]
    step = max(1, (CHUNK_BLOCKS * QK_K if block == QK_K else 1 << 22) // C)

    def encode(r0):
        chunk = rows[r0:r0 + step].astype(F32)
        if qtype not in (T.F32, T.F16, T.BF16) and not np.isfinite(chunk).all():
            raise ValueError(f"quantize: rows {r0}..{r0 + len(chunk) - 1} hold NaN or inf, which "
                             f"{qtype.name} cannot encode; fix the weights before export")
        if qtype in _OWN:
            enc = _OWN[qtype](chunk.reshape(-1, block))
        elif qtype == T.F32:
            enc = chunk.view(np.uint8)
        elif qtype == T.F16:
            enc = chunk.astype(np.float16).view(np.uint8)
        else:  # BF16, Q8_0: gguf's numpy is ggml's rounding (zeros' signs included)
            enc = gq.quantize(chunk, qtype)
        out[r0:r0 + len(chunk)] = enc.reshape(len(chunk), -1)

    starts = range(0, rows.shape[0], step)
    threads = min(threads or min(8, _cpus()), len(starts))
    if threads <= 1:
        for r0 in starts:
            encode(r0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(encode, starts):  # re-raises a chunk's error here
                pass
    return out.reshape(*x.shape[:-1], out.shape[-1])


def dequantize(raw, qtype, shape):
    """uint8 bytes of a (..., C) tensor in `qtype` -> float32 array of `shape`."""
    qtype = T(qtype)
    shape = tuple(int(n) for n in shape)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size != int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(shape[-1], qtype):
        raise ValueError(f"dequantize: {raw.size} bytes do not hold a {qtype.name} tensor of shape "
                         f"{shape}; pass the tensor's own shape and type")
    if qtype in _OWN_DEQUANT:
        return _OWN_DEQUANT[qtype](raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])).reshape(shape)
    return gq.dequantize(raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1])))), qtype).reshape(shape)
