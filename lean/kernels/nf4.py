"""NF4 (QLoRA's 4-bit NormalFloat) with double quantisation: quantise, dequantise, and the tile
decoder the LoRA GEMMs read frozen NF4 weights through. Equal bit for bit to bitsandbytes 0.50's
CUDA `quantize_4bit(..., quant_type="nf4", compress_statistics=True)` / `dequantize_4bit`, given the
same offset (below).

Shape legend: W (O, K) a frozen weight, n = O*K its values in row-major order, QB the blocksize (64),
nb = n / QB blocks, QB2 the nested blocksize (256), nb2 = ceil(nb / QB2).

    packed  (O, K/2)  uint8   two 4-bit codes a byte: value 2i in the HIGH nibble, 2i+1 in the low
                              (bitsandbytes stores it as (n/2, 1); the bytes are the same)
    absmax  (nb,)     uint8   each block's absmax, itself quantised: 8-bit index into code2
    absmax2 (nb2,)    fp32    the nested blocks' absmax
    offset  (1,)      fp32    mean of the blocks' absmax, subtracted before the nested quantisation
    code2   (256,)    fp32    bitsandbytes' signed dynamic map (dynamic_map())
    code    (16,)     fp32    the NF4 values (NF4_CODE)

Math, exactly (lean/reference/nf4.py is the same in numpy):
  quantise, per block b of QB values x (fp32; 16-bit inputs widen exactly):
    a_b  = max |x|                    inv = 1 / a_b: rcp.approx.ftz.f32 on a GPU, as bitsandbytes'
                                      build (nvcc --use_fast_math); exact in the interpreter
    q    = #{t in NF4_BOUNDS : x * inv > t}       (the CUDA kernel's comparison tree; NaN -> 0, so an
                                                  all-zero block codes to 0 = -1.0 times a_b = 0)
  offset = mean(a) (see Caution), then per nested block c of QB2 values v = a - offset (fp32):
    a2_c = max |v|,  inv2 = 1 / a2_c,  absmax = dquantize(v * inv2): the CUDA kernel's binary
    search over code2 (pivot 127, steps 64 .. 1, then the nearer neighbour by fp32 midpoints)
  dequantise: A_b = code2[absmax_b] * absmax2[b / QB2] + offset   (two fp32 roundings, no FMA)
              W   = code[q] * A_b, rounded once to the output dtype
A_b's product is an explicit mul.rn on a GPU, so that it is never contracted with the sum into an
FMA: it rounds separately, as in bitsandbytes' two kernels.

nf4_tile is the GEMMs' decoder: a (ROWS, COLS) fp32 tile of W from the packed bytes, the block
absmax decoded per (row, block) and broadcast; the same bits as nf4_dequant writes before the
final cast. lora_linear.py runs it inside its pointer kernels when given an Nf4 weight.

Supported: K a multiple of QB (every block lies in one row; all Llama / Qwen projections), QB a
power of two 32..4096 (checkpoints: read from the file), QB2 = 256 (bitsandbytes' only nested size),
out fp32 / fp16 / bf16, any O.
Tested: tests/test_nf4.py (interpreter): quantise and dequantise against the numpy reference bit for
bit on random, all-zero, constant, tied and tail-block inputs, in blocks of 32, 64 and 128 (checkpoints
of 32 and 128 load: tests/test_qlora.py); the dynamic map against
bitsandbytes' construction; round trips; the LoRA GEMMs on an Nf4 both ways. On the GPU (H100, the
same file): against bitsandbytes 0.50's CUDA quantize_4bit / dequantize_4bit at 4096^2, 1024x4096,
12288x4096, 4096x12288 and 37x192, bf16 / fp16 / fp32, bit for bit given its offset (the NF4 decimal
thresholds and its fast-math reciprocal were what it took: bounds_f32, _rcp).
Caution: bitsandbytes takes offset = torch.mean(absmax), a float32 tree reduction whose order
depends on the device; lean sums in float64 and rounds once, which measured up to a few ulps from it
(the test allows 8). Given the same offset (nf4_quantize(offset=...)), every byte and absmax2 match.
The fused decode (nf4_tile in the GEMMs) is correct but slow on a GPU: see nf4_fused.
"""
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from lean.kernels._check import check

QB, QB2 = 64, 256
_OUT = (torch.float32, torch.float16, torch.bfloat16)

# bitsandbytes' NF4 values (functional.get_4bit_type("nf4")), fp32.
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
# Its CUDA quantiser's thresholds (csrc dQuantizeNF4's float literals, ascending): the midpoints of
# adjacent NF4 values. As `...f` literals the compiler rounds each decimal straight to fp32; several sit
# next to an fp32 tie, where Python's float -> fp32 (two roundings) goes the other way: bounds_f32().
NF4_BOUNDS = (-0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
              -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
              0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
              0.5016634166240692, 0.6427869200706482, 0.8614784181118011)


def bounds_f32():
    """NF4_BOUNDS as the CUDA compiler reads its literals: each decimal rounded once, to the nearest fp32
    (4 of the 15 differ by one ulp from np.float32(float(literal)))."""
    from decimal import Decimal
    from fractions import Fraction

    out = []
    for t in NF4_BOUNDS:
        exact = Fraction(Decimal(repr(t)))
        f = np.float32(t)
        near = [np.nextafter(f, np.float32(-2)), f, np.nextafter(f, np.float32(2))]
        out.append(float(min(near, key=lambda c: abs(Fraction(float(c)) - exact))))
    return out


def dynamic_map():
    """bitsandbytes' create_dynamic_map(signed=True, 7, 8) as 256 fp32 values, built in numpy with
    the same roundings: torch.linspace's fp32 (start + step * i as one FMA from either end), fp32
    means, the power of ten rounded to fp32 before the product."""
    f = np.float32

    def linspace(n):
        s, e = f(0.1), f(1.0)
        step, h = (e - s) / f(n - 1), n // 2
        return np.array([f(np.float64(s) + np.float64(step) * i) if i < h else
                         f(np.float64(e) - np.float64(step) * (n - 1 - i)) for i in range(n)], dtype=f)

    data = []
    for i in range(7):
        b = linspace(2 ** i + 1)
        means = (b[:-1] + b[1:]) / f(2.0)
        data += (f(10.0 ** (i - 6)) * means).tolist() + (f(-(10.0 ** (i - 6))) * means).tolist()  # sync: none, numpy arrays
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return sorted(data)


class Nf4(NamedTuple):
    """A frozen weight W (O, K) held in NF4 with double quantisation (see the module docstring)."""
    packed: torch.Tensor   # (O, K/2) uint8
    absmax: torch.Tensor   # (nb,) uint8
    absmax2: torch.Tensor  # (nb2,) fp32
    offset: torch.Tensor   # (1,) fp32
    code2: torch.Tensor    # (256,) fp32
    code: torch.Tensor     # (16,) fp32
    blocksize: int = QB

    @property
    def shape(self):
        O, K2 = self.packed.shape
        return (O, 2 * K2)

    @property
    def device(self):
        return self.packed.device

    def dense(self, dtype=torch.float32):
        """W (O, K) in dtype, dequantised on the weight's device (a new tensor)."""
        out = torch.empty(self.shape, dtype=dtype, device=self.packed.device)
        nf4_dequant(out, self)
        return out


def nf4_sizes(O, K, blocksize=QB):
    """(nb, nb2) of a W (O, K)."""
    nb = O * K // blocksize
    return nb, triton.cdiv(nb, QB2)


def fill_tables(q: Nf4):
    """Write the constant tables (code2, code) of q from lean's own construction."""
    q.code2.copy_(torch.tensor(dynamic_map(), dtype=torch.float32))
    q.code.copy_(torch.tensor(NF4_CODE, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Kernels. PTX: compiled for a GPU (True) or run by the interpreter (False, numpy's exact fp32).

@triton.jit
def _rcp(x, PTX: tl.constexpr):
    """1 / x as bitsandbytes' CUDA build computes it (nvcc --use_fast_math: rcp.approx.ftz.f32, within
    one ulp, +inf at 0); the interpreter divides exactly."""
    if PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """a * b rounded on its own, never contracted with a following add into an FMA."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _nf4_quantize_kernel(
    packed_ptr, absmax_ptr,                       # out: (nb, QB/2) uint8; (nb,) fp32 block absmax
    w_ptr, bounds_ptr,                            # in: (nb, QB) values; (16,) fp32, 15 used
    nb,
    BLOCKS: tl.constexpr, QB: tl.constexpr, PTX: tl.constexpr,
):
    rb = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = rb < nb
    x = tl.load(w_ptr + rb[:, None] * QB + tl.arange(0, QB)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    a = tl.max(tl.abs(x), axis=1)                                      # (BLOCKS,)
    inv = _rcp(tl.where(ok, a, 1.0), PTX)                            # a zero block: inf, as CUDA
    s = x * inv[:, None]
    q = tl.zeros((BLOCKS, QB), dtype=tl.int32)
    for j in tl.static_range(15):
        q += (s > tl.load(bounds_ptr + j)).to(tl.int32)
    hi, lo = tl.split(tl.reshape(q, (BLOCKS, QB // 2, 2)))
    byte = ((hi << 4) | lo).to(tl.uint8)
    tl.store(packed_ptr + rb[:, None] * (QB // 2) + tl.arange(0, QB // 2)[None, :], byte, mask=ok[:, None])
    tl.store(absmax_ptr + rb, a, mask=ok)


@triton.jit
def _mean_kernel(offset_ptr, a_ptr, n, factor, BLOCK: tl.constexpr):
    """offset = fp32(sum(a) in float64) * factor (fp32(1 / n), as torch.mean scales): one program."""
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    r = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        acc += tl.load(a_ptr + i + r, mask=i + r < n, other=0.0).to(tl.float64)
    total = tl.sum(acc, axis=0).to(tl.float32)
    tl.store(offset_ptr, total * factor)


@triton.jit
def _dquantize(code2_ptr, x):
    """bitsandbytes' CUDA dQuantize<0>: the index of x's code2 entry, as its kernel searches."""
    pivot = tl.full(x.shape, 127, tl.int32)
    upper_p = tl.full(x.shape, 255, tl.int32)
    lower_p = tl.zeros(x.shape, tl.int32)
    lower = tl.full(x.shape, -1.0, tl.float32)
    upper = tl.full(x.shape, 1.0, tl.float32)
    val = tl.load(code2_ptr + pivot)
    for step in tl.static_range(7):
        i = 64 >> step
        up = x > val
        lower_p = tl.where(up, pivot, lower_p)
        lower = tl.where(up, val, lower)
        upper_p = tl.where(up, upper_p, pivot)
        upper = tl.where(up, upper, val)
        pivot = tl.where(up, pivot + i, pivot - i)
        val = tl.load(code2_ptr + pivot)
    upper = tl.where(upper_p == 255, tl.load(code2_ptr + 255), upper)
    lower = tl.where(lower_p == 0, tl.load(code2_ptr), lower)
    above = x > val
    hi_pick = tl.where(x > (upper + val) * 0.5, upper_p, pivot)
    lo_pick = tl.where(x < (lower + val) * 0.5, lower_p, pivot)
    return tl.where(above, hi_pick, lo_pick)


@triton.jit
def _nested_quantize_kernel(
    q_ptr, absmax2_ptr,                           # out: (nb,) uint8; (nb2,) fp32
    a_ptr, offset_ptr, code2_ptr,                 # in: (nb,) fp32 block absmax; (1,); (256,)
    nb,
    QB2: tl.constexpr, PTX: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * QB2 + tl.arange(0, QB2)
    ok = r < nb
    v = tl.load(a_ptr + r, mask=ok, other=0.0) - tl.load(offset_ptr)
    v = tl.where(ok, v, 0.0)
    a2 = tl.max(tl.abs(v), axis=0)
    q = _dquantize(code2_ptr, v * _rcp(a2, PTX))
    tl.store(q_ptr + r, q.to(tl.uint8), mask=ok)
    tl.store(absmax2_ptr + tl.program_id(0), a2)


@triton.jit
def block_absmax(aq_ptr, absmax2_ptr, code2_ptr, offset, blk, ok, QB2: tl.constexpr, PTX: tl.constexpr):
    """A_b = code2[absmax[b]] * absmax2[b / QB2] + offset for block indices blk (any shape; where not
    ok, the masked loads read 0 and it is `offset`: callers mask it); the product and the sum round
    separately, as bitsandbytes' two kernels do."""
    aq = tl.load(aq_ptr + blk, mask=ok, other=0).to(tl.int32)
    return _mul_rn(tl.load(code2_ptr + aq), tl.load(absmax2_ptr + blk // QB2, mask=ok, other=0.0), PTX) + offset


@triton.jit
def nf4_tile(packed_ptr, aq_ptr, absmax2_ptr, code2_ptr, code_ptr, offset,
             rows, row_ok, c0, K,
             COLS: tl.constexpr, QB: tl.constexpr, QB2: tl.constexpr, PTX: tl.constexpr):
    """W[rows, c0 : c0 + COLS] (ROWS, COLS) fp32, 0 outside (row_ok, < K). c0 a multiple of
    min(COLS, QB); rows int64. The bytes of a row are contiguous (K/2 a row)."""
    SUB: tl.constexpr = COLS if COLS < QB else QB
    NBLK: tl.constexpr = COLS // SUB
    ROWS: tl.constexpr = rows.shape[0]
    rc = c0 // 2 + tl.arange(0, COLS // 2)
    byte = tl.load(packed_ptr + rows[:, None] * (K // 2) + rc[None, :],
                   mask=row_ok[:, None] & (rc < K // 2)[None, :], other=0).to(tl.int32)
    nib = tl.interleave(byte >> 4, byte & 15)                           # (ROWS, COLS): hi first
    vals = tl.load(code_ptr + nib)
    cb = c0 + tl.arange(0, NBLK) * SUB
    ok = row_ok[:, None] & (cb < K)[None, :]
    am = block_absmax(aq_ptr, absmax2_ptr, code2_ptr, offset, rows[:, None] * (K // QB) + (cb // QB)[None, :],
                      ok, QB2, PTX)                                     # (ROWS, NBLK)
    vals = tl.reshape(tl.reshape(vals, (ROWS, NBLK, SUB)) * am[:, :, None], (ROWS, COLS))
    col_ok = (c0 + tl.arange(0, COLS)) < K
    return tl.where(row_ok[:, None] & col_ok[None, :], vals, 0.0)


@triton.jit
def _nf4_dequant_kernel(
    out_ptr,                                      # out: (nb, QB) values
    packed_ptr, aq_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr,
    nb,
    BLOCKS: tl.constexpr, QB: tl.constexpr, QB2: tl.constexpr, PTX: tl.constexpr,
):
    rb = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = rb < nb
    vals = nf4_tile(packed_ptr, aq_ptr, absmax2_ptr, code2_ptr, code_ptr, tl.load(offset_ptr),
                    rb, ok, 0, QB, COLS=QB, QB=QB, QB2=QB2, PTX=PTX)
    tl.store(out_ptr + rb[:, None] * QB + tl.arange(0, QB)[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


# ---------------------------------------------------------------------------------------------
# Launchers

def ptx():
    """The kernels' PTX flag: compiled for a GPU (not the interpreter)."""
    from lean.kernels.gemm import interpreting

    return not interpreting()


def _blocks(blocksize):
    return max(1, 2048 // blocksize)                  # 2048 values a program (untuned)


def check_nf4(q: Nf4, name="w", device=None):
    """Validate an Nf4 weight's parts; returns (O, K)."""
    if not isinstance(q, Nf4):
        raise TypeError(f"{name}: expected an Nf4 weight, got {type(q).__name__}")
    check(q.packed, f"{name}.packed", shape=(None, None), dtype=torch.uint8, device=device, contiguous=True)
    dev = q.packed.device
    O, K = q.shape
    QBk = q.blocksize
    if QBk not in (32, 64, 128, 256, 512, 1024, 2048, 4096) or K % QBk:
        raise ValueError(f"{name}: NF4 blocksize {QBk} must be a power of two 32..4096 dividing K={K}")
    nb, nb2 = nf4_sizes(O, K, QBk)
    check(q.absmax, f"{name}.absmax", shape=(nb,), dtype=torch.uint8, device=dev, contiguous=True)
    check(q.absmax2, f"{name}.absmax2", shape=(nb2,), dtype=torch.float32, device=dev, contiguous=True)
    check(q.offset, f"{name}.offset", shape=(1,), dtype=torch.float32, device=dev)
    check(q.code2, f"{name}.code2", shape=(256,), dtype=torch.float32, device=dev, contiguous=True)
    check(q.code, f"{name}.code", shape=(16,), dtype=torch.float32, device=dev, contiguous=True)
    return O, K


def nf4_quantize(q: Nf4, w, *, offset=None):
    """Quantise w (O, K) (fp32 / fp16 / bf16, contiguous) into q's parts (written; q.blocksize, the
    tables filled here). offset: a (1,) fp32 tensor to use instead of lean's mean (bitsandbytes'
    own, for the bit-for-bit tests). One device-side scratch of nb fp32; no host sync."""
    O, K = check_nf4(q, "q")
    check(w, "w", shape=(O, K), dtype=_OUT, device=q.packed.device, contiguous=True)
    fill_tables(q)
    nb, _ = nf4_sizes(O, K, q.blocksize)
    if nb == 0:
        return
    a = torch.empty(nb, dtype=torch.float32, device=w.device)                       # (nb,) block absmax
    bounds = torch.tensor(bounds_f32() + [0.0], dtype=torch.float32).to(w.device)
    B = _blocks(q.blocksize)
    _nf4_quantize_kernel[(triton.cdiv(nb, B),)](q.packed, a, w, bounds, nb, BLOCKS=B, QB=q.blocksize, PTX=ptx())
    if offset is None:
        _mean_kernel[(1,)](q.offset, a, nb, float(np.float32(1.0) / np.float32(nb)), BLOCK=1024)
    else:
        check(offset, "offset", shape=(1,), dtype=torch.float32, device=w.device)
        q.offset.copy_(offset)
    _nested_quantize_kernel[(triton.cdiv(nb, QB2),)](q.absmax, q.absmax2, a, q.offset, q.code2, nb, QB2=QB2,
                                                     PTX=ptx())


def nf4_dequant(out, q: Nf4):
    """out (O, K) = W, dequantised (fp32 / fp16 / bf16; see the module docstring)."""
    O, K = check_nf4(q, "q")
    check(out, "out", shape=(O, K), dtype=_OUT, device=q.packed.device, contiguous=True)
    nb, _ = nf4_sizes(O, K, q.blocksize)
    if nb == 0:
        return
    B = _blocks(q.blocksize)
    _nf4_dequant_kernel[(triton.cdiv(nb, B),)](out, q.packed, q.absmax, q.absmax2, q.code2, q.offset, q.code, nb,
                                               BLOCKS=B, QB=q.blocksize, QB2=QB2, PTX=ptx())


def empty_nf4(O, K, device, blocksize=QB):
    """An Nf4 of fresh tensors for a W (O, K) (tests, and quantising outside a layer buffer)."""
    nb, nb2 = nf4_sizes(O, K, blocksize)
    u8 = lambda *s: torch.empty(*s, dtype=torch.uint8, device=device)  # noqa: E731
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=device)  # noqa: E731
    return Nf4(u8(O, K // 2), u8(nb), f32(nb2), f32(1), f32(256), f32(16), blocksize)


# ---------------------------------------------------------------------------------------------
# Fused or scratch: how the LoRA GEMMs read an NF4 weight (lora_linear.py).

FUSED = None  # None: nf4_fused's per-shape choice; True / False: forced (tests, tools/gemm_tune.py)


def nf4_fused(N, K, O):
    """True: the GEMM decodes W's NF4 tiles in registers; False: W is dequantised into an (O, K)
    scratch buffer first and the 16-bit kernels (the TMA ones on Hopper) run on it.
    Measured (H100, bf16, N 8192, R 16, the Qwen3-8B / 14B shapes, tools/nf4_bench.py, BENCHMARKS.md):
    scratch 0.93-1.00x the bf16 weight's time on both the Hopper and the portable path, fused
    0.04-0.07x (each element a gather from the 16-value table, the block absmax two more). So a GPU
    takes the scratch copy at every shape; the interpreter runs the fused decode (no scratch; the
    CPU tests cover both, tests/test_nf4.py and tests/test_qlora*.py)."""
    if FUSED is not None:
        return FUSED
    from lean.kernels.gemm import interpreting

    return interpreting()
