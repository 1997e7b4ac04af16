"""lean/kernels/gguf_quant.py against lean/runtime/gguf_quants.quantize (numpy, equal to ggml's C): the
same bytes, every one, on the same float32 values.

CPU (interpreter; fresh rows each run, the seed printed): stress rows (tests/test_gguf_quants.py's
zero, signed-zero, constant, negative-only, outlier, one-value and tiny sub-blocks, magnitudes 1e-6 to
55) plus the edge rows below, at widths 256, 512 and 2048 (Q8_0 also 96); Gaussian blocks picked where
a wrong numpy port (float64 or pairwise sums, rounding half away) writes other bytes; fp16 and bf16
inputs. Test of the test: a kernel whose sub-block sums are trees instead of left-to-right loops
writes other bytes on those picked blocks. GPU (marked gpu): bf16 4096x4096 and 14336x4096.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytest.importorskip("gguf")  # lean.runtime.gguf_quants' type enum (the device carries its wheel: .whl/)

import lean.kernels.gguf_quant as G  # noqa: E402
from lean.kernels.gguf_quant import quantize_rows, row_bytes  # noqa: E402
from lean.runtime.gguf_quants import T, quantize  # noqa: E402
from tests.test_gguf_quants import blocks_where_ports_disagree, stress_rows  # noqa: E402
from tests.util import DEVICE, ON_GPU, fresh_generator  # noqa: E402

f32 = np.float32
TYPES = (T.Q8_0, T.Q4_K, T.Q6_K)


def fresh_rng():
    """numpy's generator, seeded by tests.util.fresh_generator (new each run, printed, LEAN_TEST_SEED)."""
    return np.random.default_rng(torch.randint(2**62, (1,), generator=fresh_generator("cpu")).item())


def edge_rows(rng, C):
    """(4, C) float32 of super-blocks that take the rare branches: Q6_K's all-zero test (|x| < 1e-15)
    for a whole block and for one sub-block of a live block; a d that fp16 flushes to zero (every
    sub-block keeps make_qkx2's / make_qx's levels) and one in fp16's subnormals; constant positive
    and constant negative blocks; -0.0 only; Q8_0 products x/d on exact halves (d = 1)."""
    x = np.zeros((4, C), f32)
    k = C // 32
    g = rng.standard_normal((4, C)).astype(f32)
    x[0] = g[0] * f32(1e-16)                                   # whole Q6_K block below 1e-15
    x[1] = g[1] * f32(3e-9)                                    # Q4_K / Q6_K d flushed to 0 in fp16
    x[2] = g[2] * f32(1e-3)                                    # d in fp16's subnormals (6e-8 .. 6e-5)
    x[3] = (rng.integers(-254, 255, C) / 2).astype(f32)        # halves: roundf vs nearest even
    x[3, ::32] = 127                                           # amax 127: Q8_0's d = 1 exactly
    if C >= 512:
        x[0, 256:] = g[0, 256:]
        x[0, 256 + 16:256 + 32] *= f32(1e-16)                  # one dead sub-block in a live block
        x[1, 256:] = f32(0.37)                                 # constant positive (min 0, not flat)
        x[2, 256:] = f32(-0.37)                                # constant negative (flat)
        x[3, 256:] = -0.0
    if k > 16:
        x[1, 512:768] = -np.abs(g[1, 512:768])                 # negative-only
    return x


def assert_edges_taken(raw, qtype):
    """edge_rows' first super-blocks take the branches they were built for (ref's bytes)."""
    if qtype == T.Q8_0:
        return
    size, at = (144, 0) if qtype == T.Q4_K else (210, 208)
    d = raw.reshape(len(raw), -1, size)[:4, 0, at:at + 2].copy().view(np.uint16)[:, 0] & 0x7FFF   # |fp16 d|
    assert d[1] == 0 and 0 < d[2] < 0x400, f"d flushed {d[1]:#x}, subnormal {d[2]:#x}"
    if qtype == T.Q6_K:
        assert not raw[0, :210].any(), "a block below 1e-15 is all zero bytes"


def run(x, qtype, dtype=torch.float32):
    """The kernel's bytes of rows x (a float32 array or a tensor on DEVICE) in dtype, and the float32
    values it saw; dst starts poisoned (0xA5), so a byte never written fails."""
    xt = (torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x).to(DEVICE, dtype)
    dst = torch.full((x.shape[0], row_bytes(x.shape[1], qtype)), 0xA5, dtype=torch.uint8, device=DEVICE)
    quantize_rows(dst, xt, qtype)
    return dst.cpu().numpy(), xt.float().cpu().numpy()


def assert_same_bytes(got, ref, qtype):
    bad = np.argwhere(got != ref)
    assert bad.size == 0, (f"{qtype.name}: {len(bad)} bytes differ from gguf_quants.quantize, first (row, byte) "
                           f"{bad[:8].tolist()}")


@pytest.mark.parametrize("qtype,C,rows", [(T.Q8_0, 96, 9), (T.Q8_0, 256, 5), (T.Q8_0, 2048, 6),
                                          (T.Q4_K, 256, 20), (T.Q4_K, 512, 8), (T.Q4_K, 2048, 9),
                                          (T.Q6_K, 256, 20), (T.Q6_K, 512, 8), (T.Q6_K, 2048, 9)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_bytes_equal_numpy(qtype, C, rows):
    """Stress and edge rows; at 2048 x 9 (72 super-blocks) the interpreter's second program is partial."""
    rng = fresh_rng()
    x = np.concatenate([edge_rows(rng, C), stress_rows(rng, rows, C)])
    ref = quantize(x, qtype)
    assert_edges_taken(ref, qtype)
    assert_same_bytes(run(x, qtype)[0], ref, qtype)


def sensitive_blocks(monkeypatch, qtype, n=48):
    """(n, 256) Gaussian super-blocks, N(0, 0.02), on which some wrong numpy port differs."""
    rng = fresh_rng()
    x = (rng.standard_normal((256, 4096)) * 0.02).astype(f32)
    idx, _ = blocks_where_ports_disagree(monkeypatch, x, qtype)
    assert idx.size >= 8, f"only {idx.size} blocks tell a wrong port from ggml's: the data lost its teeth"
    return x.reshape(-1, 256)[rng.choice(idx, min(n, idx.size), replace=False)]


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_bytes_equal_numpy_where_ports_differ(monkeypatch, qtype):
    x = sensitive_blocks(monkeypatch, qtype)
    assert_same_bytes(run(x, qtype)[0], quantize(x, qtype), qtype)


@triton.jit
def _tree(t):
    """A tuple of 2^k vectors summed as a balanced tree (what tl.sum's order would give)."""
    while len(t) > 1:
        u = ()
        for i in tl.static_range(0, len(t), 2):
            u = u + (t[i] + t[i + 1],)
        t = u
    return t[0]


@triton.jit
def _tree_qkx2_sums(xs, av, iscale, base):
    wl, wl2, wlx = (), (), ()
    for i in tl.static_range(32):
        l = G._qkx2_levels(xs[i], iscale, base)
        w = (av + tl.abs(xs[i])) * l
        wl, wl2, wlx = wl + (w,), wl2 + (w * l,), wlx + (w * xs[i],)
    return _tree(wl), _tree(wl2), _tree(wlx)


@triton.jit
def _tree_qx_sums(xs, iscale):
    lx, l2 = (), ()
    for i in tl.static_range(16):
        l = tl.minimum(tl.maximum(G._nearest_int(iscale * xs[i]), -32), 31).to(tl.float32)
        w = xs[i] * xs[i]
        lx, l2 = lx + ((w * xs[i]) * l,), l2 + ((w * l) * l,)
    return _tree(lx), _tree(l2)


@pytest.mark.skipif(ON_GPU, reason="swaps a device function, which only the interpreter looks up per call")
@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_tree_sums_write_other_bytes(monkeypatch, qtype):
    """The test of the test: the same kernel with its trial sums taken as trees differs from numpy on
    the picked blocks, so the left-to-right loops are what the equality above rests on."""
    x = sensitive_blocks(monkeypatch, qtype)
    ref = quantize(x, qtype)
    name, tree = ("_qkx2_sums", _tree_qkx2_sums) if qtype == T.Q4_K else ("_qx_sums", _tree_qx_sums)
    monkeypatch.setattr(G, name, tree)
    differ = int((run(x, qtype)[0] != ref).any(axis=1).sum())
    print(f"{qtype.name}: tree sums change {differ} of {len(x)} blocks")
    assert differ >= 1


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_half_inputs_widen_exactly(dtype):
    rng = fresh_rng()
    x = np.concatenate([edge_rows(rng, 512), stress_rows(rng, 2, 512)])
    for qtype in TYPES:
        got, seen = run(x, qtype, dtype)
        assert_same_bytes(got, quantize(seen, qtype), qtype)


def test_launcher_refuses_bad_arguments():
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="Q5_K has no kernel"):
        quantize_rows(torch.empty(2, 176, dtype=torch.uint8), x, T.Q5_K)
    with pytest.raises(ValueError, match="does not split into Q4_K blocks of 256"):
        quantize_rows(torch.empty(2, 144, dtype=torch.uint8), torch.zeros(2, 96), T.Q4_K)
    with pytest.raises(ValueError, match=r"dst: expected shape \(2, 144\)"):
        quantize_rows(torch.empty(2, 210, dtype=torch.uint8), x, T.Q4_K)
    with pytest.raises(TypeError, match="x: expected dtype"):
        quantize_rows(torch.empty(2, 144, dtype=torch.uint8), x.double(), T.Q4_K)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(torch.empty(2, 272, dtype=torch.uint8), torch.zeros(256, 2).t(), T.Q8_0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gpu_bf16_real_shapes(qtype, shape):
    """An 8B's projections in bf16 on the GPU: every byte equals numpy's on the same (widened) values."""
    w = torch.randn(shape, generator=fresh_generator("cuda"), device="cuda") * 0.02
    w[:64] *= torch.logspace(-9, 3, 64, device="cuda")[:, None]            # rows of magnitudes 1e-9 .. 1e3
    got, seen = run(w, qtype, torch.bfloat16)
    assert_same_bytes(got, quantize(seen, qtype), qtype)
