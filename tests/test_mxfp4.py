"""MXFP4 dequantisation: lean/reference/mxfp4.py against transformers' own dequantiser, and
lean/kernels/mxfp4.py against the reference, bit for bit over every byte and every scale;
gmm_mxfp4 against gmm on the dequantised weight."""
import pytest
import torch

import lean.kernels.grouped_gemm as GG
from lean.kernels.grouped_gemm import gmm
from lean.kernels.mxfp4 import gmm_mxfp4, mxfp4_dequant
from lean.reference.grouped_gemm import gmm_ref
from lean.reference.mxfp4 import mxfp4_dequant_ref
from tests.util import DEVICE, LOWP, ON_GPU, assert_close_rule, fresh_generator, randn

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t):
    """Integer bits of a float tensor (-0.0 and 0.0 differ)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _every_byte_and_scale(E=2):
    """blocks (E, 256, 16, 16), scales (E, 256, 16): row s holds all 256 bytes (16 blocks) at scale s."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).expand(E, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(E, 256, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_matches_transformers(dtype):
    """Every (byte, scale) pair, and random blocks of gpt-oss-like shape: the same bits as
    transformers' convert_moe_packed_tensors (which transposes dims 1 and 2): subnormal scales,
    overflow to inf in fp16 and at s = 255, signed zeros included."""
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    cases = [_every_byte_and_scale(),
             (torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8),
              torch.randint(110, 135, (3, 10, 4), generator=g, dtype=torch.uint8))]
    for blocks, scales in cases:
        hf = mx.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        ours = mxfp4_dequant_ref(blocks, scales, dtype)
        assert hf.shape == ours.transpose(1, 2).shape
        assert torch.equal(_bits(ours.transpose(1, 2)), _bits(hf))
        assert not torch.isnan(hf).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_kernel_matches_ref(dtype):
    """mxfp4_dequant: the reference's bits on every byte at every scale (signed zeros, subnormal
    scales, overflow to inf), and on random blocks of an odd count (the last program's tail)."""
    g = torch.Generator().manual_seed(1)
    cases = [_every_byte_and_scale(1),
             (torch.randint(0, 256, (3, 7, 5, 16), generator=g, dtype=torch.uint8),
              torch.randint(100, 150, (3, 7, 5), generator=g, dtype=torch.uint8))]
    for blocks, scales in cases:
        blocks, scales = blocks.to(DEVICE), scales.to(DEVICE)
        out = torch.full(scales.shape[:-1] + (scales.shape[-1] * 32,), float("nan"), dtype=dtype, device=DEVICE)
        mxfp4_dequant(out, blocks, scales)
        assert torch.equal(_bits(out), _bits(mxfp4_dequant_ref(blocks, scales, dtype)))


def test_kernel_rejects_bad_arguments():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(2, 3, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 96\)"):
        mxfp4_dequant(torch.empty(2, 95, device=DEVICE), blocks, scales)
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 3\)"):
        mxfp4_dequant(torch.empty(2, 96, device=DEVICE), blocks, scales[:, :2])
    with pytest.raises(TypeError, match="blocks: expected dtype torch.uint8"):
        mxfp4_dequant(torch.empty(2, 96, device=DEVICE), blocks.to(torch.int8), scales)


# (P, E, A, G, transpose, gather_div or None, LoRA rank or 0, bias): Wd (E, A, 32 G)
GMM_CASES = [
    (37, 8, 19, 2, False, 4, 7, True),     # gate_up: gathered, LoRA, bias; blocks along Kd
    (37, 3, 45, 3, True, None, 5, False),  # dX: w = Wd^T, blocks along O
    (29, 4, 33, 1, False, None, 0, True),  # down
    (1, 1, 8, 1, True, 2, 3, True),
]


@pytest.mark.parametrize("case", GMM_CASES, ids=[f"P{c[0]}-E{c[1]}-{'T' if c[4] else 'N'}" for c in GMM_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, LOWP])
def test_gmm_mxfp4(dtype, case, monkeypatch):
    """gmm_mxfp4 on (blocks, scales) gives gmm's bits on the dequantised weight (the same tiles and
    products: gmm without its short tail tile, which gmm_mxfp4 does not have), first and last
    experts empty; and gmm's reference within the rule."""
    monkeypatch.setattr(GG, "TAIL", False)
    from tests.test_grouped_gemm import _counts, _gather, _offsets
    P, E, A, G, transpose, div, R, with_bias = case
    g = fresh_generator()
    offsets = _offsets(_counts(P, E, "ends", g))
    blocks = torch.randint(0, 256, (E, A, G, 16), generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(122, 130, (E, A, G), generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
    wd = torch.empty(E, A, G * 32, device=DEVICE, dtype=dtype)
    mxfp4_dequant(wd, blocks, scales)
    w = wd.transpose(1, 2) if transpose else wd
    O, Kd = w.shape[1:]
    X, gather = _gather(P, div, g)
    x = randn(X, Kd, g=g, dtype=dtype)
    lora = None if not R else (randn(P, R, g=g, dtype=dtype, scale=0.5), randn(E, O, R, g=g, dtype=dtype), 0.75)
    bias = randn(E, O, g=g, dtype=torch.float32) if with_bias else None
    kw = dict(gather=gather, gather_div=div or 1, lora=lora, bias=bias)
    y = torch.full((P, O), float("nan"), device=DEVICE, dtype=dtype)
    gmm_mxfp4(y, x, blocks, scales, offsets, transpose=transpose, **kw)
    y_gmm = torch.full((P, O), float("nan"), device=DEVICE, dtype=dtype)
    gmm(y_gmm, x, w, offsets, **kw)
    assert torch.equal(y, y_gmm), f"differs from gmm on the dequantised weight: {(y - y_gmm).abs().max()}"
    up = None if lora is None else (lora[0].double(), lora[1].double(), lora[2])
    ref = gmm_ref(x.double(), w.double(), offsets, gather=gather, gather_div=div or 1, lora=up,
                  bias=None if bias is None else bias.double())
    assert_close_rule(y, ref, None if dtype == torch.float32 else gmm_ref(x, w, offsets, **kw), name="y")


@pytest.mark.gpu
def test_gmm_mxfp4_gpu_gptoss_20b():
    """bf16 at gpt-oss-20b's gate_up (8192 tokens, top-4, E 32, C = F = 2880, R 16): gmm_mxfp4 on the
    packed weight against gmm on mxfp4_dequant's bf16 weight (torch's own bf16 error: the rule's
    lowp) and the fp32 reference; then the dX orientation."""
    from tests.test_grouped_gemm import _skewed_offsets
    g = fresh_generator()
    N, K, E, C, F, R, bf = 8192, 4, 32, 2880, 2880, 16, torch.bfloat16
    P = N * K
    offsets = _skewed_offsets(P, E, g)
    order = torch.randperm(P, generator=g, device=DEVICE).to(torch.int32)
    blocks = torch.randint(0, 256, (E, 2 * F, C // 32, 16), generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 122, (E, 2 * F, C // 32), generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
    wd = torch.empty(E, 2 * F, C, device=DEVICE, dtype=bf)
    mxfp4_dequant(wd, blocks, scales)
    x, bias = randn(N, C, g=g, dtype=bf), randn(E, 2 * F, g=g)
    lora = (randn(P, R, g=g, dtype=bf), randn(E, 2 * F, R, g=g, dtype=bf, scale=0.02), 2.0)
    kw = dict(gather=order, gather_div=K, lora=lora, bias=bias)
    y, y_gmm = (torch.empty(P, 2 * F, device=DEVICE, dtype=bf) for _ in range(2))
    gmm_mxfp4(y, x, blocks, scales, offsets, **kw)
    gmm(y_gmm, x, wd, offsets, **kw)
    f32 = (lora[0].float(), lora[1].float(), lora[2])
    ref = gmm_ref(x.float(), wd.float(), offsets, gather=order, gather_div=K, lora=f32, bias=bias)
    assert_close_rule(y, ref, y_gmm, name="gate_up")
    dh = randn(P, 2 * F, g=g, dtype=bf)
    dx, dx_gmm = (torch.empty(P, C, device=DEVICE, dtype=bf) for _ in range(2))
    gmm_mxfp4(dx, dh, blocks, scales, offsets, transpose=True)
    gmm(dx_gmm, dh, wd.transpose(1, 2), offsets)
    assert_close_rule(dx, gmm_ref(dh.float(), wd.float().transpose(1, 2), offsets), dx_gmm, name="dX")
