"""AdamW over one flat fp32 buffer, with global-norm gradient clipping on the device.

Shape legend: P trainable parameters (every LoRA A and B matrix, packed into one flat buffer).

One optimizer step, exactly torch.nn.utils.clip_grad_norm_ followed by torch.optim.AdamW
(decoupled weight decay, amsgrad off), with lr and t read from the device tensor `hyper`:

    norm  = ||g||_2                                  (of the gradients as given, before clipping)
    g     = g * min(1, max_norm / (norm + 1e-6))     (only when max_grad_norm is given)
    p     = p * (1 - lr * wd)
    m     = m + (1 - b1) * (g - m)                   (= b1 m + (1-b1) g, the lerp torch uses)
    v     = v + (1 - b2) * (g^2 - v)                 (= b2 v + (1-b2) g^2)
    p     = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Three launches, no host sync, no atomics (bitwise deterministic on a given GPU and P):
  1. _adamw_sumsq_kernel:  one fp32 sum of g^2 per BLOCK of grads -> partials (n_partials,)
  2. _adamw_norm_kernel:   one program sums the partials in a fixed order -> grad_norm (1,)
  3. _adamw_update_kernel: reads grad_norm and hyper, updates p, m, v (and p_lowp) in one pass:
     one read of p, m, v, g and one write of p, m, v (+ p_lowp) per element.

In:   grads (P,) fp32, bf16 or fp16 (read only; upcast to fp32 before squaring or scaling).
      hyper (2,) fp32 on the device: [lr, t], t = 1 on the first update. Read inside the kernel, so
      a CUDA-graph-captured step replays with whatever was last written into it.
In/out: params (P,) fp32 master weights, m (P,) and v (P,) fp32 moments (start at zero), in place.
Out:  grad_norm (1,) fp32: the norm before clipping, written on every call.
      params_lowp (P,) bf16/fp16, optional: the updated params cast down (round to nearest even); fp32
      for a copy on the GPU of params in pinned host memory (runtime/host_state.py).
Nothing is saved. Supported: 1 <= P < 2^31 - 2^16 (int32 offsets), t >= 1, 0 <= b1, b2 < 1.

The bias corrections 1 - b^t are computed on the device as -expm1(t * log b) (a 9-term series for
|t log b| < 0.5, else 1 - exp), which keeps ~1e-7 relative accuracy where a plain fp32 1 - b^t
loses digits (b2 = 0.999, t = 1: fp32(0.999) alone is 1.3e-5 off in 1 - b2).

Tested: tests/test_adamw.py, against torch.optim.AdamW (+ clip_grad_norm_) over 5 steps: fp32 and
fp16 grads with P in {1, 37, 1024, 10007} through the CPU interpreter, fp32 and bf16 grads with
P = 2^24 + 4099 on the GPU; weight decay on/off, clipping active/inactive/off, b2 up to 0.99999,
an lr schedule through hyper, params_lowp == params cast, bitwise determinism.
Caution: the launcher allocates the (n_partials,) fp32 scratch with torch.empty on every call (fine
  under CUDA-graph capture, which takes it from the graph pool; at most 2^19 floats).
Caution: the sum of squares is fp32 without rescaling: gradients above ~1e19 overflow the norm to
  inf (torch's fp32 vector_norm does too). With clipping on, a NaN norm makes every gradient NaN
  and an inf norm zeroes them (NaN where g is inf), as in torch.
Caution: t = 0 divides by zero (1 - b^0 = 0), as in torch.
"""
import math
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check

# Untuned defaults, chosen for a memory-bound stream on H100: 4096 elements per program (16 per
# thread at 8 warps, i.e. 16-byte fp32 vectors) gives P/4096 programs, thousands for any real LoRA.
# The interpreter gets small blocks so CPU tests run several programs and the masked tails.
_GPU_BLOCKS = dict(SUMSQ=4096, NORM=4096, UPDATE=4096)
UPDATE_BLOCK = _GPU_BLOCKS["UPDATE"]  # the update's elements a program on a GPU (host_state's chunks)
_INTERP_BLOCKS = dict(SUMSQ=256, NORM=16, UPDATE=512)
# ... and big ones once P >= 2^18 (the tests' P stay below): the interpreter's cost is per program
# (SmolLM2 r=8 on all 7 projections, P = 2.44M, CPU: 22.6 s -> 0.7 s a step).
_INTERP_BIG_BLOCKS = dict(SUMSQ=2**16, NORM=1024, UPDATE=2**16)
_MAX_P = 2**31 - 2**16  # pid * BLOCK + BLOCK must stay in int32


@triton.jit
def _one_minus_pow(log_beta, t):
    """1 - beta^t = -expm1(t * log beta), accurate in fp32 also when t * log beta is near 0."""
    y = t * log_beta  # <= 0
    # expm1(y) = y (1 + y/2 (1 + y/3 (... (1 + y/9)))): truncation < 1e-9 relative for |y| < 0.5
    s = 1.0 + y / 9.0
    for k in tl.static_range(8, 1, -1):
        s = 1.0 + s * y / k
    return tl.where(y > -0.5, -y * s, 1.0 - tl.exp(y))


@triton.jit
def _adamw_sumsq_kernel(
    partials_ptr,  # (n_partials,) fp32 out: sum of g^2 over this program's BLOCK
    grads_ptr,  # (P,) fp32/bf16/fp16
    P,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= P:  # full block: unmasked, so it vectorises (see _adamw_update_kernel)
        g = tl.load(grads_ptr + offs).to(tl.float32)
    else:
        g = tl.load(grads_ptr + offs, mask=offs < P, other=0.0).to(tl.float32)
    tl.store(partials_ptr + pid, tl.sum(g * g, axis=0))


@triton.jit
def _adamw_norm_kernel(
    grad_norm_ptr,  # (1,) fp32 out
    partials_ptr,  # (n_partials,) fp32
    n_partials,
    BLOCK: tl.constexpr,
):
    # One program, a fixed walk and a fixed tree in tl.sum: the same bits on every run.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < n_partials, other=0.0)
    tl.store(grad_norm_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


@triton.jit
def _adamw_update_kernel(
    params_ptr, m_ptr, v_ptr,  # (P,) fp32, updated in place
    params_lowp_ptr,  # (P,) bf16/fp16 out (unused unless WRITE_LOWP)
    grads_ptr,  # (P,) fp32/bf16/fp16
    grad_norm_ptr,  # (1,) fp32, written by _adamw_norm_kernel
    hyper_ptr,  # (2,) fp32: [lr, t]
    P,
    one_minus_beta1, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay, max_grad_norm,
    BLOCK: tl.constexpr,
    CLIP: tl.constexpr,
    WRITE_LOWP: tl.constexpr,
):
    # Per-program scalars, from device memory (CUDA-graph safe).
    lr = tl.load(hyper_ptr)
    t = tl.load(hyper_ptr + 1)
    step_size = lr / _one_minus_pow(log_beta1, t)
    bias_correction2_sqrt = tl.sqrt_rn(_one_minus_pow(log_beta2, t))
    decay = 1.0 - lr * weight_decay

    # Full blocks go unmasked: a mask `offs < P` with P not a multiple of 16 stops Triton from
    # vectorising (sm_90 PTX: ld.global.b16/b32 instead of v4), so only the last block is masked.
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    full = (pid + 1) * BLOCK <= P
    mask = offs < P
    if full:
        g = tl.load(grads_ptr + offs).to(tl.float32)
        p = tl.load(params_ptr + offs)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        g = tl.load(grads_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(params_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    if CLIP:  # torch.nn.utils.clip_grad_norm_: clamp(max_norm / (norm + 1e-6), max=1), NaN kept
        norm = tl.load(grad_norm_ptr)
        clip = tl.minimum(max_grad_norm / (norm + 1e-6), 1.0, propagate_nan=tl.PropagateNan.ALL)
        g = g * clip

    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v + one_minus_beta2 * (g * g - v)
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)

    if full:
        tl.store(params_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if WRITE_LOWP:
            tl.store(params_lowp_ptr + offs, p.to(params_lowp_ptr.dtype.element_ty))
    else:
        tl.store(params_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if WRITE_LOWP:
            tl.store(params_lowp_ptr + offs, p.to(params_lowp_ptr.dtype.element_ty), mask=mask)


def _block(name, P):
    """The block size of kernel `name` for P elements (GPU, or the interpreter's smaller ones)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return (_INTERP_BIG_BLOCKS if P >= 2**18 else _INTERP_BLOCKS)[name]
    return _GPU_BLOCKS[name]


def adamw_partials(n, P=None):
    """How many fp32 partial sums adamw_sumsq writes for n gradients, in the blocks of a P-parameter
    buffer (default P = n; host arithmetic)."""
    return triton.cdiv(n, _block("SUMSQ", n if P is None else P))


def _on(t, device):
    """t is readable by a kernel on `device`: on it, or in pinned host memory a GPU kernel reads over
    the bus (Triton accepts pinned pointers; runtime/host_state.py keeps the LoRA state there)."""
    return t.device == device or (device.type == "cuda" and t.device.type == "cpu" and t.is_pinned())


def _check_flat(t, name, P, device, dtypes=(torch.float32,)):
    check(t, name, shape=(P,), dtype=dtypes, contiguous=True)
    if not _on(t, device):
        raise ValueError(f"{name}: expected device {device} (or pinned host memory), got {t.device}"
                         f"{' (not pinned)' if t.device.type == 'cpu' else ''}: move every argument to one device")


def adamw_sumsq(partials, grads, P=None):
    """partials[i] = sum of grads[i*BLOCK : (i+1)*BLOCK]^2, i < adamw_partials(P) (P = grads.numel()
    unless given: the block size is chosen for P, so a slice of a larger buffer can be summed in the
    blocks the whole one would use). partials may be a view into a larger array."""
    check(grads, "grads", shape=(None,), dtype=(torch.float32, torch.bfloat16, torch.float16), contiguous=True)
    n = grads.shape[0]
    block, k = _block("SUMSQ", n if P is None else P), adamw_partials(n, P)
    check(partials, "partials", shape=(None,), dtype=torch.float32, device=grads.device, contiguous=True)
    if partials.shape[0] < k:
        raise ValueError(f"partials: expected at least {k} elements for {n} gradients, got {partials.shape[0]}")
    if n:
        _adamw_sumsq_kernel[(k,)](partials, grads, n, BLOCK=block, num_warps=8)


def adamw_norm(grad_norm, partials, P):
    """grad_norm = sqrt(sum of partials), one program in a fixed order (bitwise deterministic); P: the
    gradient count the partials were summed for (it picks the block, as in adamw_sumsq)."""
    check(partials, "partials", shape=(None,), dtype=torch.float32, contiguous=True)
    check(grad_norm, "grad_norm", shape=(1,), dtype=torch.float32, device=partials.device)
    _adamw_norm_kernel[(1,)](grad_norm, partials, partials.shape[0], BLOCK=_block("NORM", P), num_warps=8)


def adamw_step(params, m, v, grad_norm, grads, hyper, *, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, max_grad_norm=None, params_lowp=None):
    """One AdamW step on the flat buffers (see the module docstring). Updates params, m, v (and
    params_lowp) in place, writes grad_norm; returns nothing. Reads no device value on the host."""
    _validate(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm, params_lowp)
    P = params.shape[0]
    partials = torch.empty(adamw_partials(P), dtype=torch.float32, device=grad_norm.device)  # scratch
    adamw_sumsq(partials, grads)
    adamw_norm(grad_norm, partials, P)
    _launch_update(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm,
                   params_lowp)


def adamw_update(params, m, v, grad_norm, grads, hyper, *, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0, max_grad_norm=None, params_lowp=None):
    """The update half of adamw_step, with grad_norm already written (adamw_sumsq + adamw_norm over
    partials summed elsewhere, e.g. one layer at a time). params, m, v and grads may be in pinned
    host memory (read and written over the bus by the kernel); grad_norm, hyper, params_lowp on the
    GPU. The same bits as adamw_step's update for the same grad_norm: every element is independent,
    so the buffers may also be updated a slice at a time (runtime/host_state.py's chunks)."""
    _validate(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm, params_lowp)
    _launch_update(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm,
                   params_lowp)


def _validate(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm, params_lowp):
    check(params, "params", shape=(None,), dtype=torch.float32, contiguous=True)
    check(grad_norm, "grad_norm", shape=(1,), dtype=torch.float32)
    P, device = params.shape[0], grad_norm.device
    if P < 1:
        raise ValueError("params: expected at least one element, got P = 0")
    if P >= _MAX_P:
        raise ValueError(f"params: P = {P} is too large for int32 offsets (need P < 2^31 - 2^16)")
    _check_flat(params, "params", P, device)
    _check_flat(m, "m", P, device)
    _check_flat(v, "v", P, device)
    _check_flat(grads, "grads", P, device, (torch.float32, torch.bfloat16, torch.float16))
    check(hyper, "hyper", shape=(2,), dtype=torch.float32, device=device, contiguous=True)
    if params_lowp is not None:
        check(params_lowp, "params_lowp", shape=(P,), dtype=(torch.bfloat16, torch.float16, torch.float32),
              device=device, contiguous=True)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: expected 0 <= {name} < 1, got {beta}")
    if not eps >= 0.0:
        raise ValueError(f"eps: expected eps >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay: expected weight_decay >= 0, got {weight_decay}")
    if max_grad_norm is not None and not max_grad_norm > 0.0:
        raise ValueError(f"max_grad_norm: expected None or a positive number, got {max_grad_norm}")
    ptrs = [t.data_ptr() for t in (params, m, v, grads, params_lowp) if t is not None]
    if len(set(ptrs)) != len(ptrs) and device.type != "meta":  # meta (compile-only runs) has no addresses
        raise ValueError("params, m, v, grads and params_lowp must be distinct buffers")


def _launch_update(params, m, v, grad_norm, grads, hyper, beta1, beta2, eps, weight_decay, max_grad_norm,
                   params_lowp):
    P = params.shape[0]
    block = _block("UPDATE", P)
    # log(b) in float64 on the host, so b^t loses nothing to an fp32 b; b = 0 -> exp(-huge) = 0.
    log_beta1 = math.log(beta1) if beta1 > 0.0 else -1e4
    log_beta2 = math.log(beta2) if beta2 > 0.0 else -1e4
    _adamw_update_kernel[(triton.cdiv(P, block),)](
        params, m, v, params if params_lowp is None else params_lowp,
        grads, grad_norm, hyper, P,
        1.0 - beta1, 1.0 - beta2, log_beta1, log_beta2, eps, weight_decay,
        0.0 if max_grad_norm is None else float(max_grad_norm),
        BLOCK=block, CLIP=max_grad_norm is not None, WRITE_LOWP=params_lowp is not None,
        num_warps=8,
    )
