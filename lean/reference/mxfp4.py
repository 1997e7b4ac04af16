"""Plain-torch reference for lean/kernels/mxfp4.py: MXFP4 (OCP microscaling FP4) dequantisation of
gpt-oss checkpoints' expert weights, equal bit for bit to transformers' own dequantiser
(integrations/mxfp4.py, convert_moe_packed_tensors: a 16-entry value table, then torch.ldexp).

    blocks (..., G, 16) uint8   two e2m1 values a byte: value 2i in the LOW nibble, 2i+1 in the high
    scales (..., G)     uint8   e8m0: the block's scale is 2^(s - 127)
    out    (..., G * 32)        out[..., 32g + t] = round(FP4[nibble t of block g] * 2^(scales[..., g] - 127))
                                the exact product rounded once to out's dtype, as torch.ldexp gives it
Caution: OCP's e8m0 reads s = 255 as NaN; transformers does not (ldexp by 2^128: 0 for a zero
nibble, 2^127 for 0.5, inf above), and neither do we. The product is formed as (2 * FP4) * 2^(s - 128)
so that every scale's factor is a finite fp32 (2^-128 and 2^-127 subnormal).

In gpt-oss checkpoints (and transformers' loader) the 32-value blocks run along each weight's
reduced (input) dimension: gate_up_proj_blocks (E, 2F, C/32, 16) dequantises to (E, 2F, C), down_proj_blocks
(E, C, F/32, 16) to (E, C, F); transformers then transposes dims 1 and 2 to its parameter layout
(gate_up_proj (E, C, 2F), down_proj (E, F, C)). mxfp4_dequant_ref returns the untransposed
(..., G * 32), which is lean's gmm weight (E, O, Kd) as is: convert_moe_packed_tensors(b, s, dtype=dt)
== mxfp4_dequant_ref(b, s, dt).transpose(1, 2).
"""
import torch

# e2m1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; the same table as transformers' FP4_VALUES
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_half_fp32(scales):
    """2^(s - 128) as fp32 from its bits, for s in 0..255: (s - 1) << 23, with the subnormals
    2^-128 (s = 0) and 2^-127 (s = 1). Half the block scale, so that s = 255 stays finite."""
    s = scales.to(torch.int32)
    sub = torch.where(s == 0, torch.full_like(s, 1 << 21), torch.full_like(s, 1 << 22))
    return torch.where(s <= 1, sub, (s - 1) << 23).view(torch.float32)


def mxfp4_dequant_ref(blocks, scales, dtype=torch.bfloat16):
    """(..., G * 32) in dtype: (2 * FP4 value) * 2^(s - 128), exact in fp32 (inf only where the true
    value overflows fp32), rounded once to dtype."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8 and blocks.shape[-1] == 16
    assert blocks.shape[:-1] == scales.shape
    lut = 2 * torch.tensor(FP4, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)      # (..., G, 32)
    out = vals * e8m0_half_fp32(scales)[..., None]
    return out.to(dtype).flatten(-2)


def mxfp4_quantize_ref(w):
    """(blocks (..., G, 16) uint8, scales (..., G) uint8) of w (..., G * 32): per 32-value block the
    scale 2^(floor(log2(amax)) - 2) (e2m1's largest exponent is 2), each value rounded to the
    nearest e2m1 (ties to the lower magnitude), clipped at 6. For tests and random-init benches
    (checkpoints come quantised); mxfp4_dequant_ref of its output is what a model built from it holds."""
    *lead, n = w.shape
    assert n % 32 == 0
    x = w.detach().to(torch.float32).reshape(*lead, n // 32, 32)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, torch.zeros_like(amax))
    s = (e + 127).clamp(0, 254)
    mags = torch.tensor(FP4[:8], dtype=torch.float32, device=w.device)
    r = (x / torch.exp2(s - 127)[..., None]).clamp(-6, 6)
    idx = (r.abs()[..., None] - mags).abs().argmin(-1)                     # nearest magnitude, first on ties
    nib = (idx + 8 * (r < 0)).to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return blocks.contiguous(), s.to(torch.uint8)
