"""Plain numpy/torch reference for lean/kernels/nf4.py: bitsandbytes' NF4 with double quantisation as
its CUDA kernels compute it (csrc kQuantizeBlockwise with dQuantizeNF4, then quantize_blockwise of
the absmax with dQuantize's binary search; kDequantizeBlockwise), written element by element in
numpy fp32 (no FMA), with none of lean's kernel code. It shares two constant tables with
lean/kernels/nf4.py, imported from there: NF4_CODE (bitsandbytes' 16 values, copied from its source)
and bounds_f32() (its 15 thresholds as its compiler rounds the decimal literals). They are data, not
computation, written once; tests/test_nf4.py::test_tables checks them on their own (the thresholds
against the midpoints of the values, the known one-ulp pairs).
One difference from the GPU: bitsandbytes is built with nvcc --use_fast_math, so its 1 / absmax is
rcp.approx.ftz.f32 (within one ulp), which numpy cannot reproduce; this reference divides exactly, as
lean's kernels do under the interpreter (on a GPU they issue the same rcp.approx as bitsandbytes:
tests/test_nf4.py compares them there).

    w (O, K)  ->  packed (O, K/2) uint8 (value 2i high nibble), absmax (nb,) uint8,
                  absmax2 (nb2,) fp32, offset fp32;  nb = O*K / blocksize, nested blocks of 256

dynamic_map_ref builds bitsandbytes' signed dynamic map with torch exactly as bitsandbytes'
create_dynamic_map does (torch.linspace, fp32 tensors); lean builds it in numpy.
"""
import numpy as np
import torch

F32 = np.float32


def dynamic_map_ref():
    """bitsandbytes.functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)."""
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _dquantize(code, x):
    """bitsandbytes' dQuantize<0>(code, 0, x) for one fp32 x: a binary search, then the nearer
    neighbour by fp32 midpoints."""
    pivot, upper_p, lower_p = 127, 255, 0
    lower, upper = F32(-1.0), F32(1.0)
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_p, lower, pivot = pivot, val, pivot + i
        else:
            upper_p, upper, pivot = pivot, val, pivot - i
        val = code[pivot]
        i >>= 1
    if upper_p == 255:
        upper = code[255]
    if lower_p == 0:
        lower = code[0]
    if x > val:
        return upper_p if x > (upper + val) * F32(0.5) else pivot
    return lower_p if x < (lower + val) * F32(0.5) else pivot


def quantize_nf4_ref(w, blocksize=64, offset=None):
    """(packed (O, K/2) uint8, absmax (nb,) uint8, absmax2 (nb2,) fp32, offset fp32) of w (a torch
    tensor, any float dtype). offset None: the mean of the block absmax, float64 sum rounded to
    fp32, times fp32(1/nb)."""
    from lean.kernels.nf4 import bounds_f32

    x = w.detach().float().cpu().numpy().astype(F32).reshape(-1, blocksize)      # (nb, QB)
    a = np.abs(x).max(axis=1).astype(F32)                                          # (nb,)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = (F32(1.0) / a).astype(F32)
        s = (x * inv[:, None]).astype(F32)
        q = np.zeros(x.shape, dtype=np.int32)
        for t in bounds_f32():                                # the CUDA comparison tree: #{t < s}
            q += (s > F32(t)).astype(np.int32)
    q = q.reshape(-1)
    packed = ((q[0::2] << 4) | q[1::2]).astype(np.uint8).reshape(w.shape[0], -1)
    if offset is None:
        offset = F32(F32(a.astype(np.float64).sum()) * (F32(1.0) / F32(a.size)))
    offset = F32(offset)
    v = (a - offset).astype(F32)
    code = dynamic_map_ref().numpy()
    nb = v.size
    nb2 = -(-nb // 256)
    aq = np.zeros(nb, dtype=np.uint8)
    absmax2 = np.zeros(nb2, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in range(nb2):
            blk = v[c * 256:(c + 1) * 256]
            a2 = F32(np.abs(blk).max())
            absmax2[c] = a2
            inv2 = F32(F32(1.0) / a2)
            for j, val in enumerate(blk):
                aq[c * 256 + j] = _dquantize(code, F32(val * inv2))
    return packed, aq, absmax2, offset


def dequantize_nf4_ref(packed, aq, absmax2, offset, shape, dtype=torch.float32, blocksize=64):
    """W (shape) in dtype from the parts (numpy arrays, offset a float): code[q] * A_b in fp32, with
    A_b = code2[aq] * absmax2[b // 256] + offset (two roundings), then one cast."""
    from lean.kernels.nf4 import NF4_CODE

    code = np.array(NF4_CODE, dtype=F32)
    code2 = dynamic_map_ref().numpy()
    p = np.asarray(packed).reshape(-1).astype(np.int32)
    q = np.empty(p.size * 2, dtype=np.int32)
    q[0::2], q[1::2] = p >> 4, p & 15
    nb = q.size // blocksize
    blocks = np.arange(nb)
    A = (code2[np.asarray(aq).astype(np.int64)] * np.asarray(absmax2, dtype=F32)[blocks // 256]).astype(F32)
    A = (A + F32(offset)).astype(F32)
    vals = (code[q].reshape(nb, blocksize) * A[:, None]).astype(F32)
    return torch.from_numpy(vals.reshape(shape)).to(dtype)
