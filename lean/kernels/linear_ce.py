"""Fused lm_head + cross-entropy: the summed token loss and dL/dh without an N x V logits tensor.

Shapes: N tokens in the packed batch, C hidden, V vocab.

    logits = h @ w^T                                   (N, V), never materialised whole
    m_i    = max_v logits_iv,  lse_i = m_i + log sum_v exp(logits_iv - m_i)        fp32
    loss   = [sum_{i valid} (lse_i - logits_i,t_i),  #valid]
    dh     = grad_scale * (softmax(logits) - onehot(t)) @ w,   rows of ignored tokens = 0

Inputs:  h (N, C) fp32/fp16/bf16, unit last stride (the final hidden states, after the final norm);
         w (V, C) same dtype, unit last stride (lm_head weight or the tied embedding table, frozen:
         there is no dw); targets (N,) int32/int64, contiguous, `ignore_index` marks tokens with no
         target (any other value must lie in [0, V): it is not checked, that would be a host sync).
Outputs: loss (2,) fp32 written with `=`: [sum of CE over valid tokens, valid-token count as float];
         dh (N, C) in h's dtype written with `=`, or None for evaluation (the second GEMM is skipped).
Saves:   nothing; forward and backward are one pass (the lm_head is frozen, so dh is all we need).

Per chunk of `chunk_rows` tokens: (1) one GEMM writes logits_chunk = h_chunk @ w^T into a scratch
(chunk_rows, V) buffer in h's dtype; (2) `_linear_ce_fwd_bwd_kernel`, persistent programs (4 a
SM) taking a row at a time, reads the row once for an online max / sum-exp (fp32), reads the target
logit, writes the row's loss, then reads the row again from its end (the blocks pass 1 read last,
likely still in L2) and overwrites it in place with grad_scale * (softmax - onehot) in h's dtype
(zeros for ignored rows); (3) one GEMM dh_chunk = dlogits_chunk @ w (an under-filled output
over a long K: gemm_splitk.py's deterministic split-K path on Hopper). After the last chunk,
`_linear_ce_sum_kernel` (one program, fixed order, no atomics) sums the per-row losses and counts
the valid targets, so the loss is bit-for-bit deterministic.

Numerics (the same as HF transformers): HF's lm_head returns logits in the activation dtype and
upcasts them to fp32 for the cross-entropy; autograd then casts the fp32 gradient of the logits
back to the activation dtype before the dh matmul. lean does exactly this: the scratch holds the
logits rounded once to h's dtype (fp32 GEMM accumulation), log-sum-exp and softmax are fp32, and
the gradient is rounded once to h's dtype before the second GEMM. Keeping the scratch in h's
dtype (not fp32) also halves its memory and the bytes the row kernel and the second GEMM move.

Memory: scratch chunk_rows * V elements of h's dtype + N fp32 (per-row losses), and while the dh
GEMM runs, its split-K workspace (split, chunk_rows, C) fp32 (gemm_splitk.py; 16-bit on Hopper: 33 MiB for
Qwen3-0.6B's 768-row chunks, 15-16 MiB for Llama-3.2-1B's 640 and its last chunk of 512).
Default chunk_rows on GPU: the fewest rows (a multiple of 128) at which the chunk's two GEMMs, each
streaming all of w, stay compute-bound (_GPU_INTENSITY), capped so the scratch stays under
_GPU_CHUNK_BYTES: 768 rows for Qwen3-0.6B (C 1024, V 151936), 640 for Llama-3.2-1B (C 2048), 512
for Qwen3-8B (C 4096); under the interpreter 64 rows (512 for a model-sized lm_head:
_INTERP_BIG_CHUNK_ROWS). The step passes more rows (runtime/plan.CE_FAST_ROWS, measured faster)
where the activation plan shows they cost no peak memory; LEAN_CE_CHUNK_ROWS=R fixes the default
at R rows (experiments: tools/splitk_bench.py --ce-chunks, bench step).

Supported: any N >= 0, V >= 1, C >= 1; row * V may exceed 2^31 (int64 row offsets).
Tested: tests/test_linear_ce.py: fp32 and fp16 on CPU (interpreter), N 1..300, V 97..2053, C 64/80,
several chunks with a partial last one, ignored rows, all rows ignored, grad_scale != 1, dh=None,
logits of std 100; the gpu-marked cases (bf16 and fp32 up to N 16384, V 151936, C 1024, also as one
2.5e9-logit chunk) pass on the H100.
Speed (H100, bf16, N = 8192, tools/splitk_bench.py): Qwen3-0.6B 11.3 ms (14.3 before split-K),
Llama-3.2-1B 18.1 (20.2), Qwen3-8B 34.2 (41.1).
Caution: the launcher allocates its scratch through torch's caching allocator on every call.
Caution: fp32 inputs go through gemm.py's exact-fp32 (not tf32) path: correct but slow on a GPU.
Caution: a target outside [0, V) that is not ignore_index contributes lse (target logit read as 0).
Caution: the valid count is exact below 2^24 tokens.
grad_scale: a Python number, or a (1,) fp32 device tensor the row kernel reads on the device (a
captured CUDA graph then replays with whatever was last written into it; no host sync either way).
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check
from lean.kernels.arch import arch
from lean.kernels.gemm import matmul
from lean.kernels.gemm_splitk import splitk_workspace_bytes

# The row kernel (BLOCK_V, num_warps) and its walk (programs per SM, or 0 for one program per row;
# pass 2 reversed). H100, bf16, `tools/step_levers.py --only cerow` (28 variants, the default chunk):
# 16384 w16, 4 a SM, reversed: Qwen3-0.6B (768 x 151936) 245 us, Llama-3.2-1B (640 x 128256) 162 us
# (the three passes' bytes at 3.0 TB/s: 233, 164 us), against 299 and 175 us for the earlier 4096
# w8, a program a row; the best per shape (8192 w8 4r: 238 us; 16384 w16 4: 161) within 3%.
_GPU_BLOCK_V, _GPU_ROW_WARPS = 16384, 16
_GPU_ROW_PERSIST = (4, True)
# "A few hundred MB at most" for the logits scratch (untuned).
_GPU_CHUNK_BYTES = 256 << 20
# Chunk rows: each chunk's two GEMMs (logits = h w^T, dh = dlogits w) read all of w (V, C), so their
# arithmetic intensity is ~rows * C / (rows + C) flop/byte (H100 ridge: ~990 TF/s / 3.35 TB/s ~ 300).
# The default takes the fewest rows that reach _GPU_INTENSITY; more rows only cost scratch. The dh
# GEMM's output (rows, C) fills the GPU at any row count now (gemm_splitk.py's split-K path), so rows no
# longer have to fill ~132 dh tiles (the old rule). 430 reproduces the chunks the H100 step profile
# measured (Qwen3-0.6B 768 rows: intensity 439; Llama-3.2-1B 640 rows: 488; the logits GEMM ~680
# TF/s there); untuned beyond that (tools/splitk_bench.py times the op at other chunk sizes).
_GPU_INTENSITY = 430
_INTERP_BLOCK_V, _INTERP_CHUNK_ROWS = 512, 64  # small, so the CPU tests cross block and chunk edges
# ... but a model-sized lm_head (V * C >= 2^18; the tests' stay below) gets chunks of 512 rows (gemm's
# interpreter BLOCK_M: w is read once per chunk, not once per 64 rows) and the whole vocab in one
# block up to 2^16: the interpreter pays per program and per block step far more than per element.
# SmolLM2 (V 49152, C 576), 497 tokens, fp32, 1 core: fwd+bwd 80 s at 64 x 512 -> 7.5 s.
_INTERP_BIG_BLOCK_V, _INTERP_BIG_CHUNK_ROWS = 2**16, 512
_SUM_BLOCK = 1024


@triton.jit
def _linear_ce_fwd_bwd_kernel(
    logits_ptr,  # (rows, V) in: logits; out: grad_scale * (softmax - onehot) if WRITE_GRAD
    row_loss_ptr,  # (rows,) fp32 out: lse - target logit, 0 for ignored rows
    targets_ptr,  # (rows,) int32/int64
    rows, V, stride_row,  # sizes
    grad_scale_ptr,  # (1,) fp32: dL/dloss_sum, read on the device (graph-safe)
    ignore_index,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, REVERSE: tl.constexpr,
):
    """Rows pid, pid + programs, ... (a grid of `rows` programs: one row each). REVERSE: pass 2
    walks the row's blocks last to first, starting where pass 1 ended (the blocks most likely
    still in L2)."""
    zero = tl.zeros((), tl.int64)  # row + zero: int64 offsets (row * V passes 2^31 at N 16k, V 152k)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        _ce_row(logits_ptr, row_loss_ptr, targets_ptr, row + zero, V, stride_row, grad_scale_ptr,
                ignore_index, BLOCK_V, WRITE_GRAD, REVERSE)


@triton.jit
def _ce_row(logits_ptr, row_loss_ptr, targets_ptr, row, V, stride_row, grad_scale_ptr, ignore_index,
            BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, REVERSE: tl.constexpr):
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: online max (one block reduction per block) and per-lane sums of exp. Exponents are
    # taken of x - m (exact near the max, Sterbenz) and only then scaled to base 2: scaling x first
    # would add an error of ulp(x * log2 e) to every exponent, visible when |logits| ~ 100s.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"), eviction_policy="evict_last")
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.exp2((x - m_new) * 1.4426950408889634)
        m = m_new  # first block: m = -inf, so s = 0 * 0 + exp2(...)
    log2_s = tl.log2(tl.sum(s, axis=0))  # lse = m + log2_s * ln 2
    in_range = valid & (target >= 0) & (target < V)
    x_t = tl.load(base + target, mask=in_range, other=0.0).to(tl.float32)
    tl.store(row_loss_ptr + row, tl.where(valid, (m - x_t) + log2_s * 0.6931471805599453, 0.0))

    # Pass 2: overwrite the row with its gradient (zeros for an ignored row).
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(grad_scale_ptr), 0.0)
        n_blocks = tl.cdiv(V, BLOCK_V)
        for i in range(0, n_blocks):
            offs = (n_blocks - 1 - i if REVERSE else i) * BLOCK_V + cols
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            p = tl.exp2((x.to(tl.float32) - m) * 1.4426950408889634 - log2_s)  # softmax
            g = scale * (p - tl.where(offs == target, 1.0, 0.0))
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_ce_sum_kernel(
    loss_ptr,  # (2,) fp32 out: [sum of row losses, number of valid targets]
    row_loss_ptr,  # (N,) fp32
    targets_ptr,  # (N,) int32/int64
    N, ignore_index,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    cnt = tl.zeros((BLOCK,), tl.float32)  # exact: each lane counts at most N / BLOCK tokens
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        acc += tl.load(row_loss_ptr + offs, mask=mask, other=0.0)
        t = tl.load(targets_ptr + offs, mask=mask, other=0)
        cnt += tl.where(mask & (t != ignore_index), 1.0, 0.0)
    tl.store(loss_ptr, tl.sum(acc, axis=0))
    tl.store(loss_ptr + 1, tl.sum(cnt, axis=0))  # count < 2^24 stays exact in fp32


def _default_chunk_rows(N, V, C, elsize, interpret):
    if os.environ.get("LEAN_CE_CHUNK_ROWS"):  # a fixed chunk (experiments: tools/splitk_bench.py, bench step)
        return max(1, min(int(os.environ["LEAN_CE_CHUNK_ROWS"]), N))
    if interpret:
        if V * C < 2**18:
            return _INTERP_CHUNK_ROWS
        return max(_INTERP_CHUNK_ROWS, min(_INTERP_BIG_CHUNK_ROWS, _GPU_CHUNK_BYTES // (V * elsize)))
    cap = max(128, _GPU_CHUNK_BYTES // (V * elsize) // 128 * 128)  # rows within the budget
    if C <= _GPU_INTENSITY:  # a narrow model never reaches it: as many rows as the budget allows
        return max(1, min(cap, N))
    rows = triton.cdiv(triton.cdiv(_GPU_INTENSITY * C, C - _GPU_INTENSITY), 128) * 128
    return max(1, min(rows, cap, N))


def _gemm_workspace_bytes(N, V, C, elsize, chunk_rows):
    """The largest split-K workspace (gemm_splitk.py) the chunk GEMMs allocate, logits (rows, V) over C and
    dh (rows, C) over V, for a full and the last chunk (for the activation planner)."""
    rows = {min(chunk_rows, N), N % chunk_rows} - {0}
    return max([0] + [splitk_workspace_bytes(r, n, k, elsize) for r in rows for n, k in ((V, C), (C, V))])


def _row_config(device):
    """(BLOCK_V, num_warps, programs or None for one per row, REVERSE) of the row kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _INTERP_BLOCK_V, 4, 3, True  # a persistent walk with a reversed pass 2, as on the GPU
    per_sm, reverse = _GPU_ROW_PERSIST
    return _GPU_BLOCK_V, _GPU_ROW_WARPS, per_sm * arch(device).sms if per_sm else None, reverse


def linear_ce_fwd_bwd(loss, dh, h, w, targets, *, grad_scale=1.0, ignore_index=-100, chunk_rows=None,
                      row_config=None):
    """loss (2,) fp32 = [CE sum over valid tokens, valid count]; dh (N, C) = grad_scale * dCE/dh
    (or None: loss only). h (N, C), w (V, C), targets (N,). Both outputs are written with `=`.
    grad_scale: a number or a (1,) fp32 tensor on h's device. row_config (BLOCK_V, num_warps,
    programs, reverse): the row kernel's launch, for tools/step_levers.py's sweep."""
    check(h, "h", shape=(None, None), dtype=(torch.float32, torch.float16, torch.bfloat16),
          last_contiguous=True)
    N, C = h.shape
    dev = h.device
    check(w, "w", shape=(None, C), dtype=h.dtype, device=dev, last_contiguous=True)
    V = w.shape[0]
    check(targets, "targets", shape=(N,), dtype=(torch.int32, torch.int64), device=dev, contiguous=True)
    check(loss, "loss", shape=(2,), dtype=torch.float32, device=dev, contiguous=True)
    if dh is not None:
        check(dh, "dh", shape=(N, C), dtype=h.dtype, device=dev, last_contiguous=True)
    if V < 1 or C < 1:
        raise ValueError(f"linear_ce_fwd_bwd: needs V >= 1 and C >= 1, got V={V}, C={C}")
    if isinstance(grad_scale, torch.Tensor):
        check(grad_scale, "grad_scale", shape=(1,), dtype=torch.float32, device=dev)
    else:  # a number: one fill launch, so the kernel has one path (no host sync)
        grad_scale = torch.empty(1, dtype=torch.float32, device=dev).fill_(float(grad_scale))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if chunk_rows is None:
        chunk_rows = _default_chunk_rows(N, V, C, h.element_size(), interpret)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"linear_ce_fwd_bwd: chunk_rows must be a positive int, got {chunk_rows!r}")
    block_v, row_warps, row_programs, reverse = row_config or _row_config(dev)
    if interpret:
        block_v = _INTERP_BIG_BLOCK_V if V * C >= 2**18 else _INTERP_BLOCK_V
    block_v = min(block_v, triton.next_power_of_2(V))

    chunk_rows = max(1, min(chunk_rows, N))
    scratch = torch.empty((chunk_rows, V), dtype=h.dtype, device=dev)  # (chunk_rows, V): logits, dlogits
    row_loss = torch.empty((N,), dtype=torch.float32, device=dev)  # (N,) per-token CE
    for r0 in range(0, N, chunk_rows):
        r1 = min(N, r0 + chunk_rows)
        logits = scratch[: r1 - r0]  # (rows, V)
        matmul(logits, h[r0:r1], w.t())
        _linear_ce_fwd_bwd_kernel[(min(r1 - r0, row_programs or r1 - r0),)](
            logits, row_loss[r0:r1], targets[r0:r1],
            r1 - r0, V, logits.stride(0),
            grad_scale, ignore_index,
            BLOCK_V=block_v, WRITE_GRAD=dh is not None, REVERSE=reverse, num_warps=row_warps,
        )
        if dh is not None:
            matmul(dh[r0:r1], logits, w)  # (rows, C) = dlogits @ w
    _linear_ce_sum_kernel[(1,)](loss, row_loss, targets, N, ignore_index, BLOCK=_SUM_BLOCK, num_warps=4)
