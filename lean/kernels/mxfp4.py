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

Supported: any leading shape and block count (int64 offsets); contiguous tensors.
No shared memory beyond the interleave's layout change (BLOCK_B * 32 values), one config every tier.
Tested: tests/test_mxfp4.py: under the interpreter, fp32 and fp16 out, bit for bit against the
reference on every byte at every scale and random gpt-oss-like blocks, an odd block count.

Caution:
  - scale bytes 0 and 1 give subnormal factors (2^-128, 2^-127); a GPU build that flushes fp32
    subnormals would zero those values. Real checkpoints' scales sit near 127 (checked only in
    the interpreter so far).
  - bf16 out is not checked in the interpreter: its fp32 -> bf16 cast is not round-to-nearest-even
    (256 of the 65,536 byte-scale pairs differ); the test checks bf16 on a GPU (not run yet).
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_OUT = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e2m1_twice(n):
    """2 * the e2m1 value of nibbles n (int32 0..15), exact in fp32, -0.0 for n = 8."""
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)
    return mag * tl.where((n & 8) != 0, -1.0, 1.0)           # a product: -0.0 for n = 8 (negation is 0 - x)


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
    bits = tl.where(s == 0, 1 << 21, tl.where(s == 1, 1 << 22, (s - 1) << 23))
    scale = bits.to(tl.float32, bitcast=True)[:, None]                 # 2^(s - 128)
    lo = _e2m1_twice(byte & 0x0F) * scale
    hi = _e2m1_twice(byte >> 4) * scale
    vals = tl.interleave(lo, hi)                                       # (BLOCK_B, 32): lo, hi, lo, ...
    rv = tl.arange(0, 32)
    tl.store(out_ptr + rb[:, None] * 32 + rv[None, :], vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


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
