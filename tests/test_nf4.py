"""NF4 with double quantisation: lean/kernels/nf4.py against the numpy reference (lean/reference/nf4.py)
bit for bit, the dynamic map against bitsandbytes' construction, round trips, and the LoRA GEMMs on an
NF4 weight (fused decode and scratch copy) against the same kernels on the dequantised weight; on a
GPU, against bitsandbytes itself (when installed: the device carries its wheel)."""
import numpy as np
import pytest
import torch

import lean.kernels.nf4 as nf4mod
from lean.kernels.lora_linear import linear_bwd, linear_fwd, lora_linear_bwd, lora_linear_fwd
from lean.kernels.nf4 import NF4_BOUNDS, NF4_CODE, bounds_f32, dynamic_map, empty_nf4, nf4_dequant, nf4_quantize
from lean.reference.nf4 import dequantize_nf4_ref, dynamic_map_ref, quantize_nf4_ref
from tests.util import DEVICE, ON_GPU, fresh_generator

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _weight(O, K, dtype, g, kind="randn", blocksize=64):
    w = torch.randn(O, K, generator=g) * 0.02
    if kind == "special":  # an all-zero block, a constant block, values on the NF4 thresholds, a huge outlier
        w[0, :blocksize] = 0.0
        if O > 1:
            w[1, :blocksize] = 0.5
        if O > 2:
            t = torch.tensor(NF4_BOUNDS, dtype=torch.float32)
            w[2, :15], w[2, 15] = t * 0.25, 0.25  # absmax 0.25 (a power of two): s = t exactly
        w[-1, -1] = 3.0
    return w.to(dtype).to(DEVICE)


def test_tables():
    """lean's dynamic map equals bitsandbytes' construction (torch.linspace and all); the NF4
    thresholds are the midpoints of the NF4 values, as fp32 within one ulp of np.float32's rounding of
    them (bounds_f32: the C compiler's rounding of the decimal literals; known pairs checked)."""
    assert torch.equal(torch.tensor(dynamic_map(), dtype=torch.float32), dynamic_map_ref())
    code = np.array(NF4_CODE, dtype=np.float64)
    mids = (code[:-1] + code[1:]) / 2
    assert np.allclose(mids, np.array(NF4_BOUNDS), rtol=0, atol=1e-15)
    b = np.array(bounds_f32(), dtype=np.float32)
    ulps = np.abs(b.view(np.int32) - np.float32(mids).view(np.int32))
    assert ulps.max() == 1 and (ulps == 1).sum() == 4 and np.all(np.diff(b) > 0)
    # the decimal literal's nearest fp32: 0.1202552504837513 -> 0x3df64863 (np.float32 of the double: 0x3df64862)
    assert b[8].view(np.int32) == 0x3df64863 and np.float32(0.1202552504837513).view(np.int32) == 0x3df64862


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("O,K,kind,blocksize", [(1, 64, "randn", 64), (5, 192, "special", 64), (37, 128, "randn", 64),
                                                (300, 64, "special", 64), (37, 256, "special", 128),
                                                (300, 256, "randn", 128), (9, 96, "special", 32)])
def test_quantize_matches_ref(dtype, O, K, kind, blocksize):
    """Every packed byte, nested absmax byte, absmax2 and the offset equal the reference, in blocks of
    64 and of 32 and 128 (other bnb_4bit_blocksize values a checkpoint may hold); nb not a multiple of
    256 (a short last nested block) in every case, more than 256 in some."""
    g = fresh_generator("cpu")
    w = _weight(O, K, dtype, g, kind, blocksize)
    q = empty_nf4(O, K, DEVICE, blocksize)
    nf4_quantize(q, w)
    p, aq, a2, off = quantize_nf4_ref(w, blocksize)
    assert np.array_equal(q.packed.cpu().numpy(), p)
    assert np.array_equal(q.absmax.cpu().numpy(), aq)
    assert np.array_equal(q.absmax2.cpu().numpy().view(np.int32), a2.view(np.int32))
    assert q.offset.item() == float(off)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_given_offset(dtype):
    """offset= replaces lean's mean (bitsandbytes' own, in the GPU test): the nested bytes follow it."""
    g = fresh_generator("cpu")
    w = _weight(9, 128, dtype, g)
    off = torch.tensor([0.0123], dtype=torch.float32, device=DEVICE)
    q = empty_nf4(9, 128, DEVICE)
    nf4_quantize(q, w, offset=off)
    p, aq, a2, o = quantize_nf4_ref(w, offset=np.float32(0.0123))
    assert q.offset.item() == float(o) and np.array_equal(q.absmax.cpu().numpy(), aq)
    assert np.array_equal(q.absmax2.cpu().numpy(), a2) and np.array_equal(q.packed.cpu().numpy(), p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("O,K,blocksize", [(3, 64, 64), (37, 192, 64), (130, 256, 64), (37, 256, 128), (9, 96, 32)])
def test_dequant_matches_ref(dtype, O, K, blocksize):
    """nf4_dequant: the reference's bits (signed zeros included), and a round trip within half the
    widest NF4 gap times the block absmax (plus the nested absmax's own error); blocks of 64, 32, 128."""
    g = fresh_generator("cpu")
    w = _weight(O, K, torch.float32, g, "special", blocksize)
    q = empty_nf4(O, K, DEVICE, blocksize)
    nf4_quantize(q, w)
    out = torch.full((O, K), float("nan"), dtype=dtype, device=DEVICE)
    nf4_dequant(out, q)
    ref = dequantize_nf4_ref(q.packed.cpu().numpy(), q.absmax.cpu().numpy(), q.absmax2.cpu().numpy(),
                             q.offset.item(), (O, K), dtype, blocksize)
    assert torch.equal(_bits(out.cpu()), _bits(ref))
    blk = w.reshape(-1, blocksize).abs().amax(1, keepdim=True).cpu()              # (nb, 1) true absmax
    code2 = torch.tensor(dynamic_map())
    A = code2[q.absmax.cpu().long()] * q.absmax2.cpu()[torch.arange(blk.shape[0]) // 256] + q.offset.cpu()
    gap = float(np.max(np.diff(NF4_CODE))) / 2
    err = (out.float().cpu() - w.cpu()).reshape(-1, blocksize).abs()
    # NF4's rounding (half the widest gap of the block's absmax), the nested absmax's error, out's
    rnd = out.float().cpu().abs().reshape(-1, blocksize) * torch.finfo(dtype).eps  # out's own rounding
    assert bool((err <= blk * gap + (A[:, None] - blk).abs() + 1e-2 * blk + rnd + 1e-6).all())
    # q.dense(): the same bits
    assert torch.equal(_bits(q.dense(dtype).cpu()), _bits(out.cpu()))


def test_rejects():
    q = empty_nf4(4, 64, DEVICE)
    with pytest.raises(ValueError, match="blocksize"):
        nf4_quantize(empty_nf4(4, 96, DEVICE), torch.zeros(4, 96, device=DEVICE))
    with pytest.raises(ValueError, match="w: expected shape"):
        nf4_quantize(q, torch.zeros(4, 128, device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        nf4_dequant(torch.zeros(4, 64, dtype=torch.int32, device=DEVICE), q)


def _lora_case(N, K, O, R, dtype, g):
    x = (torch.randn(N, K, generator=g)).to(dtype).to(DEVICE)
    a = (torch.randn(R, K, generator=g) * 0.1).to(dtype).to(DEVICE)
    b = (torch.randn(O, R, generator=g) * 0.1).to(dtype).to(DEVICE)
    dy = (torch.randn(N, O, generator=g)).to(dtype).to(DEVICE)
    return x, a, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("N,K,O,R,dropout", [(37, 128, 96, 8, 0.0), (5, 192, 33, 16, 0.1), (64, 64, 257, 16, 0.0)])
def test_lora_linear_nf4(dtype, fused, N, K, O, R, dropout, monkeypatch):
    """lora_linear_fwd / _bwd with an NF4 weight (fused decode, or the dequantised scratch copy)
    give the bits of the same kernels on nf4_dequant's weight; linear_fwd / _bwd too."""
    monkeypatch.setattr(nf4mod, "FUSED", fused)
    g = fresh_generator("cpu")
    w = _weight(O, K, torch.float32, g)
    q = empty_nf4(O, K, DEVICE)
    nf4_quantize(q, w)
    wd = torch.empty(O, K, dtype=dtype, device=DEVICE)
    nf4_dequant(wd, q)
    x, a, b, dy = _lora_case(N, K, O, R, dtype, g)
    outs = []
    for wt in (q, wd):
        y = torch.empty(N, O, dtype=dtype, device=DEVICE)
        xa = torch.empty(N, R, dtype=dtype, device=DEVICE)
        lora_linear_fwd(y, xa, x, wt, a, b, 0.5, dropout=dropout, seed=3)
        dx = torch.empty(N, K, dtype=dtype, device=DEVICE)
        da = torch.zeros(R, K, dtype=torch.float32, device=DEVICE)
        db = torch.zeros(O, R, dtype=torch.float32, device=DEVICE)
        lora_linear_bwd(dx, da, db, dy, x, xa, wt, a, b, 0.5, dropout=dropout, seed=3)
        y2 = torch.empty(N, O, dtype=dtype, device=DEVICE)
        linear_fwd(y2, x, wt)
        dx2 = torch.empty(N, K, dtype=dtype, device=DEVICE)
        linear_bwd(dx2, dy, wt)
        outs.append((y, xa, dx, da, db, y2, dx2))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("O,K", [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (37, 192)])
@pytest.mark.timeout(300)
def test_matches_bitsandbytes(dtype, O, K):
    """On the GPU, against bitsandbytes 0.50's CUDA quantize_4bit / dequantize_4bit (nf4, blocksize
    64, compress_statistics): packed bytes, nested absmax, absmax2, tables and dequantised values
    bit for bit given bitsandbytes' offset; lean's own offset within 8 ulps of torch.mean's."""
    F = pytest.importorskip("bitsandbytes.functional")
    g = fresh_generator("cpu")
    w = (torch.randn(O, K, generator=g) * 0.02).to(dtype).to(DEVICE)
    qb, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = empty_nf4(O, K, DEVICE)
    nf4_quantize(q, w, offset=st.offset.reshape(1).float())
    assert torch.equal(q.packed.reshape(-1), qb.reshape(-1))
    assert torch.equal(q.absmax, st.absmax)
    assert torch.equal(_bits(q.absmax2), _bits(st.state2.absmax))
    assert torch.equal(q.code2, st.state2.code.float()) and torch.equal(q.code, st.code.float())
    out = torch.empty(O, K, dtype=dtype, device=DEVICE)
    nf4_dequant(out, q)
    assert torch.equal(_bits(out), _bits(F.dequantize_4bit(qb, st)))
    own = empty_nf4(O, K, DEVICE)
    nf4_quantize(own, w)
    # torch.mean's float32 tree sum against lean's float64 one: a few ulps apart at most
    ulp = abs(own.offset.view(torch.int32).item() - st.offset.float().reshape(1).view(torch.int32).item())
    assert ulp <= 8
