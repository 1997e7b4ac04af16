"""MXFP4 dequantisation: lean/reference/mxfp4.py against transformers' own dequantiser, and
lean/kernels/mxfp4.py against the reference, bit for bit over every byte and every scale."""
import pytest
import torch

from lean.kernels.mxfp4 import mxfp4_dequant
from lean.reference.mxfp4 import mxfp4_dequant_ref
from tests.util import DEVICE, ON_GPU

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
