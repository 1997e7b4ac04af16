"""The fused LoRA linear's Hopper path: persistent TMA kernels for lora_linear.py (p = 0).

Same math, shapes and rounding as lean/kernels/lora_linear.py's pointer kernels (see its
docstring): forward y = x W^T + bias + scale * (x A^T) B^T with xa = x A^T written; backward
kernel 1 dx (=, or +=) dy W + scale * (dy B) A with dy B written. Tiles arrive by TMA descriptors
(lean/kernels/gemm.py: tma_desc), one persistent program per SM walks grouped tiles. lora_linear
picks them when dropout is 0, the inputs are TMA-describable and the GEMM has at least
gemm.TMA_MIN_MACS multiply-adds (each launch costs ~45 us of host time for its descriptors).
Tested: tests/test_lora_linear.py::test_lora_linear_tma_kernels (H100, bf16, against the
reference by the tolerance rule; a spy checks these kernels ran).
"""
import triton
import triton.language as tl

from lean.kernels.gemm import GROUP_M, NUM_SMS, grouped_tile, tma_desc


@triton.jit
def _lora_linear_fwd_tma_kernel(
    y_ptr, xa_ptr,                          # (N, O) out; (N, R) out
    x_desc, w_desc, a_desc,                 # descriptors: x (N, K) tiles (BM, BK), w (O, K) (BN, BK), a (R, K) (BR, BK)
    b_ptr, bias_ptr,                        # (O, R); (O,) or dummy
    N, K, O, R, stride_y, scale, n_programs,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(O, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, O, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xt = x_desc.load([pid_m * BLOCK_M, k0])
            acc = tl.dot(xt, w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
            xa = tl.dot(xt, a_desc.load([0, k0]).T, xa)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < N, rn < O
        xa_lp = xa.to(xa_ptr.dtype.element_ty)
        if pid_n == 0:
            tl.store(xa_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], xa_lp, mask=m_ok[:, None] & r_ok[None, :])
        xs = (xa_lp.to(tl.float32) * scale).to(xa_lp.dtype)
        bt = tl.load(b_ptr + rn[None, :] * R + rr[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xs, bt, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_linear_bwd_tma_kernel(
    dx_ptr, dyb_ptr,                        # (N, K) out; (N, R) out: dy B in dy's dtype
    dy_desc, w_desc, b_desc,                # descriptors: dy (N, O) tiles (BM, BO), w (O, K) (BO, BN), b (O, R) (BO, BR)
    a_ptr,                                  # (R, K)
    N, K, O, R, stride_dx, scale, n_programs,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(K, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, n_programs):
        pid_m, pid_n = grouped_tile(tile, N, K, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dyb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for o0 in range(0, O, BLOCK_O):
            dyt = dy_desc.load([pid_m * BLOCK_M, o0])
            acc = tl.dot(dyt, w_desc.load([o0, pid_n * BLOCK_N]), acc)
            dyb = tl.dot(dyt, b_desc.load([o0, 0]), dyb)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < N, rn < K
        dyb_lp = dyb.to(dyb_ptr.dtype.element_ty)                     # rounded like torch's dy B
        if pid_n == 0:
            tl.store(dyb_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], dyb_lp, mask=m_ok[:, None] & r_ok[None, :])
        at = tl.load(a_ptr + rr[:, None] * K + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        dyb_s = (dyb_lp.to(tl.float32) * scale).to(dyb_lp.dtype)
        acc = tl.dot(dyb_s, at, acc)
        dx_ptrs = dx_ptr + rm.to(tl.int64)[:, None] * stride_dx + rn[None, :]
        if ACCUMULATE:
            acc += tl.load(dx_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# The Hopper TMA kernels (p = 0, TMA-describable inputs, >= gemm.TMA_MIN_MACS; the pointer kernels
# serve the rest). Evidence: tools/step_levers.py (now), H100, bf16, N = 8192, CUDA-graph medians,
# whole ops (backward: with its da/db passes): Llama-3.2-1B q/o fwd 131 us (pointer 144, cuBLAS base
# GEMM alone 100), gate/up 535 (581; 417), down 489 (532; 388); bwd q/o 162 (190), gate/up 554 (659),
# down 594 (694). Forward s4 beat s3 by 1-4% on these shapes, 256x128 trailed by 8-19%. The LoRA
# product inside the main loop (an N = 16 wgmma per K step) keeps them at 0.75-0.8x cuBLAS; the plain
# persistent TMA GEMM reaches 0.94-1.03x.
_FWD_TMA = (128, 256, 64, 8, 4)
_BWD_TMA = (128, 256, 64, 8, 3)


def _fwd_tma(y, xa, x, w, a, b, scale, bias, BR):
    """lora_linear_fwd (p = 0) on _lora_linear_fwd_tma_kernel."""
    (N, K), O, R = x.shape, w.shape[0], a.shape[0]
    BM, BN, BK, warps, stages = _FWD_TMA
    n_programs = min(NUM_SMS, triton.cdiv(N, BM) * triton.cdiv(O, BN))
    _lora_linear_fwd_tma_kernel[(n_programs,)](
        y, xa, tma_desc(x, (BM, BK)), tma_desc(w, (BN, BK)), tma_desc(a, (BR, BK)), b,
        bias if bias is not None else y, N, K, O, R, y.stride(0), float(scale), n_programs,
        HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR, GROUP_M=GROUP_M,
        num_warps=warps, num_stages=stages)


def _bwd_tma(dx, dyb, dy, w, a, b, scale, accumulate):
    """lora_linear_bwd's kernel 1 (p = 0, dx wanted) on _lora_linear_bwd_tma_kernel; a, b already
    padded to the rank RP of dyb."""
    (N, O), K, RP = dy.shape, w.shape[1], dyb.shape[1]
    BM, BN, BO, warps, stages = _BWD_TMA
    n_programs = min(NUM_SMS, triton.cdiv(N, BM) * triton.cdiv(K, BN))
    _lora_linear_bwd_tma_kernel[(n_programs,)](
        dx, dyb, tma_desc(dy, (BM, BO)), tma_desc(w, (BO, BN)), tma_desc(b, (BO, RP)), a,
        N, K, O, RP, dx.stride(0), float(scale), n_programs,
        ACCUMULATE=accumulate, BLOCK_M=BM, BLOCK_N=BN, BLOCK_O=BO, BLOCK_R=RP, GROUP_M=GROUP_M,
        num_warps=warps, num_stages=stages)
