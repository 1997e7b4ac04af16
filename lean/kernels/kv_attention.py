"""Causal attention of T new query tokens against a key/value cache: the decode path (GQA).

Shape legend: T new tokens, L cache rows (capacity), P tokens already in the cache before these T,
H query heads, KVH key/value heads (G = H // KVH query heads share kv head h // G), D head dim.

Math, for new token t (absolute position P + t) and query head h, over cache rows j <= P + t:
    s_tj = scale * q_t . k_j           o_t = sum_j softmax_j(s_tj) v_j
GPT-OSS's options (as lean/kernels/attention.py states them): sinks (H,), one logit per head in
the softmax's denominator only, sum_j exp(s_tj) + exp(sink_h); window W > 0, token t sees only
rows j with P + t - j < W (its W most recent keys, itself included); key blocks wholly before
the window of a query block are skipped.
The caller writes the T new keys/values into cache rows P..P+T-1 first (the projections write
straight into the cache), so prefill (P = 0, T = prompt length) and decode (T = 1) are one kernel.

Inputs and outputs:
    q (T, H, D); k_cache, v_cache (L, KVH, D) with L >= P + T: fp32, fp16 or bf16, one dtype,
        unit last stride.
    n_past P: host int (the generation loop knows it; no device read).
    sinks: None or (H,) fp32 / fp16 / bf16, read as fp32. window: host int, 0 = off.
    o (T, H, D) q's dtype. Nothing is saved: this is inference only (no backward).
Online softmax in fp32, exp2 with log2(e) folded into the scale, as in attention.py.

Supported: D from 16 to 256 (padded to a power of two with masks), any G.
Tested: tests/test_kv_attention.py against an fp64 reference (fp32 and fp16 on CPU through the
interpreter: P 0 / odd / with T 1 and T > 1, G 1 / 3, D 64 / 80; each also with sinks and windows
1 / 3 / 16); bf16 on the GPU (gpu-marked).
Caution: one program per (query block, head) loops over all P + T keys: fine for the short
generations lean-train prints (its samples), not a serving kernel (no split-K over the cache).
"""
import os

import torch
import triton
import triton.language as tl

from lean.kernels._check import check

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _kv_attention_fwd_kernel(
    o_ptr, q_ptr, k_ptr, v_ptr,             # (T, H, D) out; (T, H, D); (L, KVH, D) x2
    sinks_ptr,                              # (H,) sink logits (read only with SINKS)
    stride_ot, stride_oh, stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh,
    T, P, G, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SINKS: tl.constexpr, WINDOW: tl.constexpr,  # WINDOW 0: no window
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    kvh = h // G
    rt = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # new-token index t
    rd = tl.arange(0, BLOCK_D)
    t_ok, d_ok = rt < T, rd < HEAD_DIM
    q = tl.load(q_ptr + rt[:, None] * stride_qt + h * stride_qh + rd[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = scale * _LOG2E
    if SINKS:  # the sink: a key of score `sink` with no value row, counted from the start
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
        l_i = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    q_pos = P + rt                                                    # absolute positions
    end = P + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T)                # keys this block can see
    start = 0
    if WINDOW > 0:  # the first key block any query of this block sees
        start = tl.maximum(P + pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for j0 in range(start, end, BLOCK_N):
        rj = j0 + tl.arange(0, BLOCK_N)
        j_ok = rj < end
        kt = tl.load(k_ptr + rj[None, :] * stride_kl + kvh * stride_kh + rd[:, None],
                     mask=d_ok[:, None] & j_ok[None, :], other=0.0)   # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        keep = (rj[None, :] <= q_pos[:, None]) & j_ok[None, :]
        if WINDOW > 0:
            keep = keep & (q_pos[:, None] - rj[None, :] < WINDOW)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # rows past T see no key
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + rj[:, None] * stride_vl + kvh * stride_vh + rd[None, :],
                     mask=j_ok[:, None] & d_ok[None, :], other=0.0)   # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + rt[:, None] * stride_ot + h * stride_oh + rd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


def _config(T, dtype, width):
    """(BLOCK_M, BLOCK_N, num_warps): untuned; decode is a small part of lean-train's time.
    width = H * D."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        if width >= 512:  # model-sized (the tests' <= 384): one query block, up to 128 tokens
            return min(128, max(16, triton.next_power_of_2(T))), 128, 4  # SmolLM2 40-token prefill 175 -> 60 ms
        return 16, 128, 4                       # interpreter: few, wide key blocks
    if dtype == torch.float32:
        return 16, 32, 4
    return (16 if T <= 16 else 64), 64, 4


def kv_attention_fwd(o, q, k_cache, v_cache, n_past, scale, *, sinks=None, window=0):
    """o (T, H, D) <- causal attention of q (tokens at positions n_past..n_past+T-1) over cache
    rows 0..n_past+T-1 (the new tokens' keys/values already written there). sinks: None or (H,)
    logits in the denominator only; window: 0 (off) or W, each token's W most recent keys."""
    check(q, "q", shape=(None, None, None), dtype=(torch.float32, torch.float16, torch.bfloat16),
          last_contiguous=True)
    T, H, D = q.shape
    dev = q.device
    check(k_cache, "k_cache", shape=(None, None, D), dtype=q.dtype, device=dev, last_contiguous=True)
    L, KVH = k_cache.shape[:2]
    check(v_cache, "v_cache", shape=(L, KVH, D), dtype=q.dtype, device=dev, last_contiguous=True)
    check(o, "o", shape=(T, H, D), dtype=q.dtype, device=dev, last_contiguous=True)
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({KVH})")
    if not 16 <= D <= 256:
        raise ValueError(f"head dim {D} unsupported: expected 16 <= D <= 256")
    if not (isinstance(n_past, int) and 0 <= n_past and n_past + T <= L):
        raise ValueError(f"n_past: expected a host int with n_past + T <= cache rows ({L}), got "
                         f"{n_past!r} with T={T} (grow the cache)")
    if sinks is not None:
        check(sinks, "sinks", shape=(H,), dtype=(torch.float32, torch.float16, torch.bfloat16), device=dev,
              contiguous=True)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window: expected a host int >= 0 (0: no window), got {window!r}")
    if T == 0:
        return
    BLOCK_M, BLOCK_N, warps = _config(T, q.dtype, H * D)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    _kv_attention_fwd_kernel[(triton.cdiv(T, BLOCK_M), H)](
        o, q, k_cache, v_cache, q if sinks is None else sinks,
        o.stride(0), o.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        T, n_past, H // KVH, float(scale),
        HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SINKS=sinks is not None, WINDOW=window,
        num_warps=warps)
