"""lm_head + cross-entropy over vocabulary chunks: the loss and dL/dh with only one chunk of the
lm_head on the device at a time (an lm_head held in pinned host memory: lean/runtime/head_host.py).

Shapes: N tokens, C hidden, V vocab, Vc the rows of one chunk (the last chunk may be shorter).

The same loss and dh as linear_ce.py (whose docstring has the numerics HF computes: logits rounded
once to h's dtype, fp32 log-sum-exp and softmax, the gradient rounded once to h's dtype), with the
lm_head w (V, C) visited one chunk w_c = w[v0:v1] at a time:

    pass 1, chunks 0 .. n-1:   logits_c = h @ w_c^T                  (N, Vc) scratch in h's dtype
                               (m, s) <- online max / sum of exp over the row's chunks so far (fp32)
                               x_t    <- logits_c[t - v0] for rows whose target is in the chunk
    then:                      row loss = m + ln s - x_t (0 for ignored rows); loss = [sum, count]
    pass 2, chunks n-1 .. 0:   logits_c again; in place g_c = grad_scale * (softmax - onehot(t))
                               dh32 (+)= g_c @ w_c                   (N, C) fp32
    then:                      dh = dh32, rounded once to h's dtype

Pass 2 walks the chunks last to first: the chunks pass 1 ended with are the first it needs, so a
source that holds two chunks (head_host.HostHead) fetches two fewer. The softmax uses the same
formula as linear_ce's row kernel (p = 2^((x - m) log2 e - log2 s), exponents of x - m exact near
the max); only the order in which sum-exp's terms are added differs (per chunk, then across), and
dh's fp32 sum is split at chunk edges before its single rounding.

Costs against linear_ce_fwd_bwd: one more logits GEMM (w is read three times, not twice) and the
fp32 dh accumulator (N, C); the scratch is (N, Vc) instead of (chunk_rows, V).

The chunk source (`src`): an object with
    n, chunk_v, V, C           the chunk count, the rows of a full chunk, the lm_head's shape
    dtype, device              the lm_head's dtype, and the device its chunks are handed out on
    bounds(c) -> (v0, v1)      chunk c's rows
    begin(order)               the chunk ids the next get/done calls follow, in order
    get(c) -> (v1 - v0, C)     the chunk on h's device, ready for the compute stream
    done(c)                    the compute stream has issued its last read of this get's chunk
DeviceChunks (below) is the source for an lm_head already on the device (views, nothing to copy):
what the tests compare the streamed schedule with.

Inputs/outputs as linear_ce_fwd_bwd: h (N, C), targets (N,), loss (2,) fp32 `=`, dh (N, C) in h's
dtype `=` or None (loss only: pass 1 alone). logits_vchunks writes the full logits (N, V) instead.
Supported: any N >= 0, V >= 1; chunks of any size. Tested: tests/test_linear_ce_vchunk.py (fp32 and
fp16 on the CPU against linear_ce_fwd_bwd and torch: odd V and chunk sizes, one-row chunks, a
single chunk, targets in every chunk, ignored rows, all rows ignored, grad_scale as a tensor).
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import interpreting
from lean.kernels.gemm import matmul
from lean.kernels.linear_ce import _linear_ce_sum_kernel, _SUM_BLOCK

_GPU_BLOCK_V, _GPU_ROW_WARPS = 4096, 8  # as linear_ce's row kernel (untuned)
_INTERP_BLOCK_V = 512
_FINISH_BLOCK = 1024


@triton.jit
def _ce_lse_chunk_kernel(
    m_ptr, s_ptr, xt_ptr,  # (N,) fp32 in/out: running max, sum of 2^((x - m) log2 e), target logit
    logits_ptr,  # (N, Vc) this chunk's logits
    targets_ptr,  # (N,) int32/int64
    Vc, v0, stride_row,
    FIRST: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, Vc, BLOCK_V):  # the chunk's own online max / sum (linear_ce's pass 1)
        offs = start + cols
        x = tl.load(base + offs, mask=offs < Vc, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.exp2((x - m_new) * 1.4426950408889634)
        m = m_new
    s_c = tl.sum(s, axis=0)
    if not FIRST:  # merge with the chunks before: both sums rescaled to the larger max
        m_old = tl.load(m_ptr + row)
        s_old = tl.load(s_ptr + row)
        m_new = tl.maximum(m_old, m)
        s_c = s_old * tl.exp2((m_old - m_new) * 1.4426950408889634) + s_c * tl.exp2((m - m_new) * 1.4426950408889634)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s_c)
    t = tl.load(targets_ptr + row).to(tl.int64) - v0
    here = (t >= 0) & (t < Vc)
    x_t = tl.load(base + t, mask=here, other=0.0).to(tl.float32)
    if FIRST:
        tl.store(xt_ptr + row, x_t)  # 0 unless the target is in chunk 0 (linear_ce reads 0 too)
    else:
        tl.store(xt_ptr + row, x_t, mask=here)


@triton.jit
def _ce_finish_kernel(
    row_loss_ptr,  # (N,) fp32 out: lse - target logit, 0 for ignored rows
    s_ptr,  # (N,) fp32 in: sum of 2^((x - m) log2 e); out: its log2 (pass 2 reads it)
    m_ptr, xt_ptr, targets_ptr,  # (N,) fp32, fp32, int
    N, ignore_index,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    log2_s = tl.log2(tl.load(s_ptr + offs, mask=mask, other=1.0))
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    x_t = tl.load(xt_ptr + offs, mask=mask, other=0.0)
    valid = tl.load(targets_ptr + offs, mask=mask, other=ignore_index) != ignore_index
    tl.store(row_loss_ptr + offs, tl.where(valid, (m - x_t) + log2_s * 0.6931471805599453, 0.0), mask=mask)
    tl.store(s_ptr + offs, log2_s, mask=mask)


@triton.jit
def _ce_grad_chunk_kernel(
    logits_ptr,  # (N, Vc) in: this chunk's logits; out: grad_scale * (softmax - onehot)
    m_ptr, log2_s_ptr,  # (N,) fp32: the row's max and log2 of its sum-exp, over every chunk
    targets_ptr,  # (N,) int32/int64
    Vc, v0, stride_row,
    grad_scale_ptr,  # (1,) fp32, read on the device
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row).to(tl.int64)
    scale = tl.where(target != ignore_index, tl.load(grad_scale_ptr), 0.0)
    m = tl.load(m_ptr + row)
    log2_s = tl.load(log2_s_ptr + row)
    t = target - v0
    for start in range(0, Vc, BLOCK_V):
        offs = start + cols
        mask = offs < Vc
        x = tl.load(base + offs, mask=mask, other=0.0)
        p = tl.exp2((x.to(tl.float32) - m) * 1.4426950408889634 - log2_s)
        g = scale * (p - tl.where(offs == t, 1.0, 0.0))
        tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


class DeviceChunks:
    """The chunk source for an lm_head w (V, C) on the device: chunk c is the view w[c*Vc:(c+1)*Vc]."""

    def __init__(self, w, chunk_v):
        if chunk_v < 1:
            raise ValueError(f"DeviceChunks: chunk_v must be >= 1, got {chunk_v}")
        self.w, self.chunk_v = w, int(chunk_v)
        self.V, self.C = w.shape
        self.n = triton.cdiv(self.V, self.chunk_v)
        self.dtype, self.device = w.dtype, w.device

    def bounds(self, c):
        return c * self.chunk_v, min(self.V, (c + 1) * self.chunk_v)

    def begin(self, order):
        pass

    def get(self, c):
        v0, v1 = self.bounds(c)
        return self.w[v0:v1]

    def done(self, c):
        pass


def _launch_config():
    return (_INTERP_BLOCK_V, 4) if interpreting() else (_GPU_BLOCK_V, _GPU_ROW_WARPS)


def _check_io(h, src, targets=None):
    check(h, "h", shape=(None, None), dtype=(torch.float32, torch.float16, torch.bfloat16), last_contiguous=True)
    N, C = h.shape
    if (src.C, src.dtype, torch.device(src.device)) != (C, h.dtype, h.device):
        raise ValueError(f"linear_ce_vchunks: the lm_head chunks are ({src.V}, {src.C}) {src.dtype} on {src.device}, "
                         f"h is (N, {C}) {h.dtype} on {h.device}")
    if targets is not None:
        check(targets, "targets", shape=(N,), dtype=(torch.int32, torch.int64), device=h.device, contiguous=True)
    return N, C


def linear_ce_vchunks(loss, dh, h, src, targets, *, grad_scale=1.0, ignore_index=-100):
    """loss (2,) fp32 = [CE sum over valid tokens, valid count]; dh (N, C) = grad_scale * dCE/dh, or
    None (loss only). h (N, C); src: the lm_head's chunk source (module docstring); targets (N,).
    Both outputs are written with `=`. grad_scale: a number or a (1,) fp32 tensor on h's device."""
    N, C = _check_io(h, src, targets)
    dev = h.device
    check(loss, "loss", shape=(2,), dtype=torch.float32, device=dev, contiguous=True)
    if dh is not None:
        check(dh, "dh", shape=(N, C), dtype=h.dtype, device=dev, last_contiguous=True)
    if isinstance(grad_scale, torch.Tensor):
        check(grad_scale, "grad_scale", shape=(1,), dtype=torch.float32, device=dev)
    else:  # a number: one fill launch, so the kernel has one path (no host sync)
        grad_scale = torch.empty(1, dtype=torch.float32, device=dev).fill_(float(grad_scale))
    block_v, warps = _launch_config()
    n = src.n
    back = dh is not None and (N or getattr(src, "collective", False))  # a collective source (ShardHead: every
    passes = list(range(n)) + (list(reversed(range(n))) if back else [])  # rank gathers alike) goes back at N = 0
    src.begin(passes)
    m, s, xt, row_loss = (torch.empty(N, dtype=torch.float32, device=dev) for _ in range(4))  # (N,) each
    scratch = torch.empty((N, src.chunk_v), dtype=h.dtype, device=dev)  # (N, Vc): logits, then gradients
    for k, c in enumerate(passes):
        v0, v1 = src.bounds(c)
        w_c = src.get(c)  # (Vc, C)
        logits = scratch[:, : v1 - v0]  # (N, Vc)
        if N:
            matmul(logits, h, w_c.t())
        if k < n:  # pass 1
            if N:
                _ce_lse_chunk_kernel[(N,)](m, s, xt, logits, targets, v1 - v0, v0, logits.stride(0),
                                           FIRST=k == 0, BLOCK_V=min(block_v, triton.next_power_of_2(v1 - v0)),
                                           num_warps=warps)
            if k == n - 1:
                if N:
                    _ce_finish_kernel[(triton.cdiv(N, _FINISH_BLOCK),)](row_loss, s, m, xt, targets, N, ignore_index,
                                                                        BLOCK=_FINISH_BLOCK, num_warps=4)
                _linear_ce_sum_kernel[(1,)](loss, row_loss, targets, N, ignore_index, BLOCK=_SUM_BLOCK, num_warps=4)
                if dh is not None:
                    acc = dh if dh.dtype == torch.float32 else torch.empty((N, C), dtype=torch.float32, device=dev)
        elif N:  # pass 2, chunks last to first
            _ce_grad_chunk_kernel[(N,)](logits, m, s, targets, v1 - v0, v0, logits.stride(0), grad_scale,
                                        ignore_index, BLOCK_V=min(block_v, triton.next_power_of_2(v1 - v0)),
                                        num_warps=warps)
            matmul(acc, logits, w_c, accumulate=k > n)  # (N, C) fp32 (+)= dlogits_c @ w_c
        src.done(c)
    if dh is not None:
        if N == 0:
            return
        if acc is not dh:
            dh.copy_(acc)  # the one rounding of the fp32 sum to h's dtype


def logits_vchunks(logits, h, src):
    """logits (N, V) = h @ w^T in h's dtype, chunk by chunk (evaluation and generation)."""
    N, _ = _check_io(h, src)
    check(logits, "logits", shape=(N, src.V), dtype=h.dtype, device=h.device, last_contiguous=True)
    src.begin(list(range(src.n)))
    for c in range(src.n):
        v0, v1 = src.bounds(c)
        w_c = src.get(c)
        if N:
            matmul(logits[:, v0:v1], h, w_c.t())
        src.done(c)
