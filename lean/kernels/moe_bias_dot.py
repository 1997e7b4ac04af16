"""The routing-weight gradient's bias term, for experts whose down projection has a bias (GPT-OSS).

Shape legend: N tokens, K experts per token, E experts, C hidden.

An expert's output is y = act Wd^T + bd (bd (C,) its down bias), and the block returns
m[n] = sum_i w[n, i] y_{e(n, i)}(n). The routing weight's gradient is <g[n], y> (models/moe.py):
moe_act_bwd computes the <g[n] Wd, act> part from the sorted rows; this kernel adds the rest,

    dweights[n, i] += <g[n], bd[experts[n, i]]>          fp32, in (n, i) order (no sorting needed)

    dweights (N, K) fp32, accumulated (+=)
    g        (N, C) the block's output gradient, any float dtype, unit last stride
    bias     (E, C) the experts' down biases, any float dtype, contiguous
    experts  (N, K) int32

Nothing is saved; no backward (the biases are frozen).
Supported: any N, K >= 1, C up to 16,384 (one row a program, looped over C in blocks).
Tested: tests/test_gpt_oss.py (against torch, fp32 and fp16, and in the GPT-OSS step against HF).
"""
import torch
import triton
import triton.language as tl

from lean.kernels._check import check


@triton.jit
def _bias_dot_kernel(
    dw_ptr,                                       # (N*K,) fp32, +=
    g_ptr, bias_ptr, experts_ptr,                 # (N, C), (E, C), (N*K,) int32
    stride_g, stride_b, P, K, C,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    slots = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = slots < P
    e = tl.load(experts_ptr + slots, mask=live, other=0).to(tl.int64)
    n = (slots // K).to(tl.int64)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = live[:, None] & (cols < C)[None, :]
        gv = tl.load(g_ptr + n[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        bv = tl.load(bias_ptr + e[:, None] * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(gv * bv, axis=1)
    old = tl.load(dw_ptr + slots, mask=live, other=0.0)
    tl.store(dw_ptr + slots, old + acc, mask=live)


def expert_bias_dot(dweights, g, bias, experts):
    """dweights (N, K) fp32 += <g[n], bias[experts[n, i]]>."""
    check(experts, "experts", shape=(None, None), dtype=torch.int32, contiguous=True)
    N, K = experts.shape
    dev = experts.device
    check(dweights, "dweights", shape=(N, K), dtype=torch.float32, device=dev, contiguous=True)
    check(g, "g", shape=(N, None), device=dev, last_contiguous=True)
    C = g.shape[1]
    check(bias, "bias", shape=(None, C), device=dev, contiguous=True)
    if N == 0:
        return
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    BLOCK_P = max(1, min(64, 8192 // BLOCK_C))
    _bias_dot_kernel[(triton.cdiv(N * K, BLOCK_P),)](
        dweights, g, bias, experts, g.stride(0), bias.stride(0), N * K, K, C,
        BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C, num_warps=4)
