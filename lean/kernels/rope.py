"""RoPE: rotary position embedding in HF's half-split (rotate_half) layout, applied in place.

Shape legend: N tokens in the packed batch, H query heads, KVH key/value heads, D head dim (even),
D2 = D/2 rotary frequencies.

    rope_inv_freq(D, theta, scaling) -> inv_freq (D2,) numpy float32, attention_scaling (float)
        host, once per model: HF's `modeling_rope_utils` for rope_type default, linear, llama3, yarn.
    rope_table(cos, sin, positions, inv_freq, attention_scaling)        once per batch
        angle[n, i] = float32(positions[n]) * inv_freq[i]          (one fp32 product, as HF)
        cos[n, i] = cos(angle) * attention_scaling,  sin[n, i] = sin(angle) * attention_scaling
        positions (N,) int32, restarting at every packed document; inv_freq (D2,) fp32;
        cos, sin (N, D2) fp32.
    rope_fwd(q, k, cos, sin)                                             every layer, forward
        for x in q (N, H, D) and k (N, KVH, D), x1 = x[..., :D2], x2 = x[..., D2:]:
        x1 <- x1*cos - x2*sin,  x2 <- x2*cos + x1*sin
    rope_bwd(dq, dk, cos, sin)                                           every layer, backward
        the transpose of that rotation (sin negated), in place on the gradients:
        dx1 <- dx1*cos + dx2*sin,  dx2 <- dx2*cos - dx1*sin

Dtypes: q, k (and dq, dk) fp32, fp16 or bf16, one dtype for both; math in fp32, rounded once on
store. HF instead casts cos/sin to the activation dtype and rounds after every op, so our bf16 result
is closer to the fp32 reference than HF's own bf16 result.
One launch rotates q and k: head blocks 0.. rotate q, the rest k. With GQA k is a fifth to a ninth
of the work; a launch of its own would cost a launch latency and a partly empty last wave each layer.
Saves: nothing. The (N, D2) fp32 table is built once per batch and read by every layer, both ways.
Supported: any even D up to 512 (D2 is padded to a power of two inside the kernel, so D=80 works),
any H, KVH; q, k may be strided views (e.g. slices of a fused (N, (H+2*KVH)*D) qkv buffer) as long
as the last dim is contiguous.
Tested: tests/test_rope.py -- inv_freq and attention_scaling against transformers' own init
functions (default, linear, llama3, yarn; legacy `type` key); the table against HF's rotary class;
forward against HF's rotary class + apply_rotary_pos_emb (default, llama3 3.1/3.2, yarn Qwen-style
and DeepSeek-style); backward against autograd; bwd(fwd(x)) == x; D = 32, 64, 80, 128; GQA; packed
positions with length-1 documents; fp32 and fp16 on CPU (interpreter), bf16 on GPU.

Caution:
  - In place: rope_fwd overwrites q and k, rope_bwd overwrites dq and dk.
  - bwd(fwd(x)) == x * attention_scaling**2: yarn's attention factor is not 1.
  - inv_freq repeats HF's float32 operations in HF's order (`2*pi / t` is `t.reciprocal() * 2*pi`
    in torch, and so on) but takes a correctly rounded pow: torch's vectorised float32 pow (Sleef,
    <= 1 ulp) is not, and which elements take the vector path depends on the CPU's vector width.
    So an element of inv_freq can differ from HF's by an ulp (32 of 4592 elements, at most 2 ulp,
    over the configurations in the test); the angle then differs by about pos * 6e-8 relative, the
    size of HF's own fp32 rounding of that angle.
  - positions are exact in fp32 below 2**24 (as in HF). On NVIDIA tl.cos/tl.sin should lower to
    libdevice __nv_cosf/__nv_sinf (full range reduction), not the .approx instructions: angles reach
    1e5 rad. The gpu-marked table test (positions to 131000, fp32 tolerance) is what checks it.
  - yarn needs `factor`: transformers derives a missing one from max_position_embeddings, which
    this function does not take. yarn follows transformers 5.x (4.5x computed it differently).
"""
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- host set-up

def _need(scaling, key, rope_type):
    if scaling.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs {key!r} in the scaling dict, got {sorted(scaling)}")
    return scaling[key]


def rope_inv_freq(head_dim, theta, scaling=None):
    """HF's inverse frequencies and attention scaling, in numpy float32 step by step as torch does.

    scaling: the HF rope dict (4.x `rope_scaling`, or 5.x `rope_parameters`) or None.
    Returns (inv_freq: np.float32 (head_dim/2,), attention_scaling: float).
    """
    if int(head_dim) != head_dim or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim}")
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}: supported are {', '.join(_ROPE_TYPES)}")
    if scaling.get("rope_theta", theta) != theta:
        raise ValueError(f"scaling has rope_theta={scaling['rope_theta']} but theta={theta}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={scaling['partial_rotary_factor']} is not supported (only 1.0)")
    f32 = np.float32
    dim = int(head_dim)
    # base ** (arange(0, dim, 2).float() / dim), the pow correctly rounded (see Caution)
    exponent = np.arange(0, dim, 2).astype(f32) / f32(dim)
    pos_freqs = (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    inv_freq = f32(1.0) / pos_freqs
    attention_scaling = 1.0

    if rope_type == "linear":
        inv_freq = inv_freq / f32(_need(scaling, "factor", rope_type))

    elif rope_type == "llama3":
        factor = _need(scaling, "factor", rope_type)
        low = _need(scaling, "low_freq_factor", rope_type)
        high = _need(scaling, "high_freq_factor", rope_type)
        old_len = _need(scaling, "original_max_position_embeddings", rope_type)
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)
        inv_llama = np.where(wavelen > f32(low_freq_wavelen), inv_freq / f32(factor), inv_freq)
        smooth = ((f32(1.0) / wavelen) * f32(old_len) - f32(low)) / f32(high - low)
        smoothed = (f32(1.0) - smooth) * inv_llama / f32(factor) + smooth * inv_llama
        medium = ~(wavelen < f32(high_freq_wavelen)) & ~(wavelen > f32(low_freq_wavelen))
        inv_freq = np.where(medium, smoothed, inv_llama)

    elif rope_type == "yarn":
        factor = _need(scaling, "factor", rope_type)
        old_len = _need(scaling, "original_max_position_embeddings", rope_type)
        attention_factor = scaling.get("attention_factor")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        attention_scaling = attention_factor
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(num_rotations):
            return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # HF: prevent a singular ramp
        ramp = np.clip((np.arange(dim // 2).astype(f32) - f32(lo)) / f32(hi - lo), f32(0.0), f32(1.0))
        extrapolation = f32(1.0) - ramp
        inv_extrapolation = f32(1.0) / pos_freqs
        inv_interpolation = f32(1.0) / (f32(factor) * pos_freqs)
        inv_freq = inv_interpolation * (f32(1.0) - extrapolation) + inv_extrapolation * extrapolation

    return np.ascontiguousarray(inv_freq, dtype=f32), float(attention_scaling)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _rope_table_kernel(cos_ptr, sin_ptr, pos_ptr, inv_freq_ptr, attention_scaling, N,
                       D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D2)
    mask_n = offs_n < N
    mask_d = offs_d < D2
    pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=mask_d, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]                     # one fp32 product, as HF
    offs = offs_n[:, None].to(tl.int64) * D2 + offs_d[None, :]
    mask = mask_n[:, None] & mask_d[None, :]
    tl.store(cos_ptr + offs, tl.cos(angle) * attention_scaling, mask=mask)
    tl.store(sin_ptr + offs, tl.sin(angle) * attention_scaling, mask=mask)


@triton.jit
def _rope_rotate_heads(x_ptr, cos, sin, offs_n, mask_nd, h0, n_heads, stride_n, stride_h,
                       D2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Rotate heads h0 .. h0+BLOCK_H-1 of BLOCK_N tokens; heads from n_heads on are masked (the GPU
    launches take a BLOCK_H that divides the head counts: all real; the interpreter one block of all)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D2)
    ptr1 = (x_ptr + offs_n[:, None, None].to(tl.int64) * stride_n
            + offs_h[None, :, None].to(tl.int64) * stride_h + offs_d[None, None, :])  # (BLOCK_N, BLOCK_H, BLOCK_D2)
    ptr2 = ptr1 + D2
    mask = mask_nd[:, None, :] & (offs_h < n_heads)[None, :, None]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr,
                 N, H, KVH, n_q_blocks, n_head_blocks, stride_qn, stride_qh, stride_kn, stride_kh,
                 D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
                 BACKWARD: tl.constexpr):
    # 1-D grid, head blocks fastest: neighbouring programs share one (BLOCK_N, D2) cos/sin tile in L2,
    # and the token-block count is not bounded by the 65535 limit of grid axes 1 and 2.
    # Head blocks 0 .. n_q_blocks-1 rotate q, the rest rotate k: one launch for both.
    pid = tl.program_id(0)
    pid_n = pid // n_head_blocks
    pid_h = pid % n_head_blocks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D2)
    mask_nd = (offs_n < N)[:, None] & (offs_d < D2)[None, :]
    offs_cs = offs_n[:, None].to(tl.int64) * D2 + offs_d[None, :]
    cos = tl.load(cos_ptr + offs_cs, mask=mask_nd, other=0.0)[:, None, :]    # (BLOCK_N, 1, BLOCK_D2)
    sin = tl.load(sin_ptr + offs_cs, mask=mask_nd, other=0.0)[:, None, :]
    if BACKWARD:
        sin = -sin  # the transpose of a rotation is the rotation by the opposite angle
    if pid_h < n_q_blocks:
        _rope_rotate_heads(q_ptr, cos, sin, offs_n, mask_nd, pid_h * BLOCK_H, H, stride_qn, stride_qh,
                           D2, BLOCK_H, BLOCK_D2)
    else:
        _rope_rotate_heads(k_ptr, cos, sin, offs_n, mask_nd, (pid_h - n_q_blocks) * BLOCK_H, KVH, stride_kn,
                           stride_kh, D2, BLOCK_H, BLOCK_D2)


# ----------------------------------------------------------------------------- launchers

# Untuned GPU defaults (no H100 measurement yet): about 8K q/k elements (16 KB in bf16) read and
# written per program with 4 warps, the usual size for a bandwidth-bound elementwise kernel.
_ELEMS_PER_PROGRAM = 8192
_NUM_WARPS = 4
# Under the interpreter: about four token blocks per call (odd N leaves a tail; 4 tokens at least);
# for model-sized calls (>= 2^18 elements in all, or a batch of 128+ tokens; most of the tests' stay
# below both) one token block, up to 2^18 elements per tile (tile_row per token): the interpreter's
# cost is ~2.5 ms per program (SmolLM2 q and k, 497 tokens, fp32, 1 core: 139 ms at 128 tokens per
# block, 52 ms at 512). lean-train's CPU default (SmolLM2, 9/3 heads: BLOCK_H 1, 160-token steps)
# ran 4-5 token blocks x 12 head blocks a call: 18.4 of a 128-token forward_backward's 110 s; one
# token block: 4.5 s. The interpreter also takes every q head into one head block and every k head
# into another (masked past the count): 12 -> 2 programs a token block at SmolLM2's 9/3 heads; its
# 3-token sample (prefill + 2 decode steps, 90 launches) 10.0 -> 2.1 s of rope.
def _interpret_block_n(N, elems, tile_row):
    if elems >= 2**18 or N >= 128:
        return max(1, min(triton.next_power_of_2(N), 2**18 // tile_row))
    return max(4, min(64, triton.next_power_of_2(triton.cdiv(N, 4))))


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def rope_table(cos, sin, positions, inv_freq, attention_scaling):
    """cos, sin (N, D2) fp32 <- cos/sin(positions * inv_freq) * attention_scaling."""
    check(positions, "positions", shape=(None,), dtype=torch.int32, contiguous=True)
    N, dev = positions.shape[0], positions.device
    check(inv_freq, "inv_freq", shape=(None,), dtype=torch.float32, device=dev, contiguous=True)
    D2 = inv_freq.shape[0]
    check(cos, "cos", shape=(N, D2), dtype=torch.float32, device=dev, contiguous=True)
    check(sin, "sin", shape=(N, D2), dtype=torch.float32, device=dev, contiguous=True)
    if not 0 < D2 <= 256:
        raise ValueError(f"inv_freq: expected 1 to 256 frequencies (head dim up to 512), got {D2}")
    if N == 0:
        return
    BLOCK_D2 = triton.next_power_of_2(D2)
    if _interpreting():
        BLOCK_N = _interpret_block_n(N, N * D2, BLOCK_D2)
    else:
        BLOCK_N = max(1, 4096 // BLOCK_D2)  # untuned, runs once a batch
    _rope_table_kernel[(triton.cdiv(N, BLOCK_N),)](
        cos, sin, positions, inv_freq, float(attention_scaling), N,
        D2=D2, BLOCK_N=BLOCK_N, BLOCK_D2=BLOCK_D2, num_warps=_NUM_WARPS)


def _check_rotate(q, k, cos, sin, qname, kname):
    check(q, qname, shape=(None, None, None), dtype=_ACT_DTYPES, last_contiguous=True)
    N, H, D = q.shape
    dev = q.device
    check(k, kname, shape=(N, None, D), dtype=q.dtype, device=dev, last_contiguous=True)
    if D % 2 or not 0 < D <= 512:
        raise ValueError(f"{qname}: head dim must be even and at most 512, got {D}")
    if H == 0 or k.shape[1] == 0:
        raise ValueError(f"{qname}, {kname}: need at least one head, got {H} and {k.shape[1]}")
    check(cos, "cos", shape=(N, D // 2), dtype=torch.float32, device=dev, contiguous=True)
    check(sin, "sin", shape=(N, D // 2), dtype=torch.float32, device=dev, contiguous=True)


def _launch_rotate(q, k, cos, sin, backward):
    N, H, D = q.shape
    KVH = k.shape[1]
    if N == 0:
        return
    D2 = D // 2
    BLOCK_D2 = triton.next_power_of_2(D2)
    if _interpreting():  # all q heads in one block, all k heads in another (masked past the count)
        BLOCK_H = min(64, triton.next_power_of_2(max(H, KVH)))
        BLOCK_N = _interpret_block_n(N, N * (H + KVH) * D, BLOCK_H * BLOCK_D2)
    else:
        g = math.gcd(H, KVH)
        BLOCK_H = min(8, g & -g)  # largest power of two dividing H and KVH (<= 8): no masked heads
        BLOCK_N = max(1, _ELEMS_PER_PROGRAM // (2 * BLOCK_D2 * BLOCK_H))  # a power of two: all factors are
    n_q_blocks = triton.cdiv(H, BLOCK_H)
    n_head_blocks = n_q_blocks + triton.cdiv(KVH, BLOCK_H)
    grid = (triton.cdiv(N, BLOCK_N) * n_head_blocks,)
    _rope_kernel[grid](
        q, k, cos, sin,
        N, H, KVH, n_q_blocks, n_head_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        D2=D2, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_D2=BLOCK_D2, BACKWARD=backward,
        num_warps=_NUM_WARPS)


def rope_fwd(q, k, cos, sin):
    """Rotate q (N, H, D) and k (N, KVH, D) in place by the table cos, sin (N, D/2) fp32."""
    _check_rotate(q, k, cos, sin, "q", "k")
    _launch_rotate(q, k, cos, sin, backward=False)


def rope_bwd(dq, dk, cos, sin):
    """Rotate dq (N, H, D) and dk (N, KVH, D) in place back by the same table: the transpose of rope_fwd."""
    _check_rotate(dq, dk, cos, sin, "dq", "dk")
    _launch_rotate(dq, dk, cos, sin, backward=True)
