"""MXFP4 dequantisation: lean/reference/mxfp4.py against transformers' own dequantiser, bit for bit,
over every byte and every scale."""
import pytest
import torch

from lean.reference.mxfp4 import mxfp4_dequant_ref

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
