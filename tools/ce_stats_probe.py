"""The lm_head + loss with the row statistics taken in the logits GEMM's epilogue: is it faster?

    python tools/ce_stats_probe.py                       # H100 / H200: time both forms, bf16
    TRITON_INTERPRET=1 python tools/ce_stats_probe.py --check   # CPU: the new form against torch, tiny

A question for the step (issues 17, 18), asked outside lean/kernels. linear_ce.py today, per chunk
of `rows` tokens: the logits GEMM writes the (rows, V) logits; the row kernel reads each row twice
(pass 1 online max / sum of exp, pass 2 the gradient written over it); the dh GEMM reads the
gradient. Three passes of the logits' bytes in the row kernel. Here:
  stats  the logits GEMM (lean's Hopper loop: TMA loads, the tile loop flattened, tiles stored by
         TMA) also writes, per row and column tile, the max m_t and sum_t exp(x - m_t) of the tile's
         logits as stored (rounded to the activation dtype first, as the row kernel reads them):
         (rows, tiles) fp32 twice, ~5 MB at 1024 rows.
  row1   one pass a row: lse from the tiles' pairs (m = max m_t, s = sum s_t exp(m_t - m)), the loss,
         then the gradient written over the logits: two passes of the bytes instead of three.
Printed per head (rows 1024, V 151936, C 2048: Qwen3-30B-A3B; C 1024: Qwen3-0.6B): CUDA-graph medians
of lean's GEMM, the stats GEMM, lean's row kernel, row1, and both pairs' sums; the new form's
loss and gradient against lean's (max |diff| / max |ref|).
Measured (H200, 2026-11-29; BENCHMARKS.md): here 1240 -> 1173 us (C 2048), 751 -> 738 (C 1024); built
into linear_ce (c46a95d, reverted), the step profile's logits GEMM + row pass went 9.26 -> 8.78 ms
(Qwen3-30B-A3B) and 7.91 -> 8.10 ms (Llama-3.2-1B, 640-row chunks): the epilogue costs the GEMM
9-13%, about what the row pass saves.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lean.kernels.linear_ce as CE  # noqa: E402
from lean.kernels.gemm import grouped_tile, matmul  # noqa: E402

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _logits_stats_kernel(c_desc, a_desc, b_desc, stat_m_ptr, stat_s_ptr, M, N, K, n_programs,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    """c = a @ b^T (b (N, K) K-contiguous) as gemm._matmul_tma_kernel's FLAT loop, and per (row,
    column tile) the max and the sum of exp(x - max) of the stored tile."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, n_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            acc = tl.dot(a, b_desc.load([pid_n * BLOCK_N, k0]).T, acc)
        lo = acc.to(c_desc.dtype)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], lo)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        x = tl.where((rn < N)[None, :], lo.to(tl.float32), float("-inf"))
        m = tl.max(x, axis=1)
        s = tl.sum(tl.exp2((x - m[:, None]) * LOG2E), axis=1)
        at = rm.to(tl.int64) * tiles_n + pid_n
        tl.store(stat_m_ptr + at, m, mask=rm < M)
        tl.store(stat_s_ptr + at, s, mask=rm < M)


@triton.jit
def _ce_row1_kernel(logits_ptr, row_loss_ptr, targets_ptr, stat_m_ptr, stat_s_ptr, rows, V, stride_row,
                    n_tiles, grad_scale_ptr, ignore_index, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    ts = tl.arange(0, BLOCK_T)
    zero = tl.zeros((), tl.int64)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = row + zero
        mt = tl.load(stat_m_ptr + row * n_tiles + ts, mask=ts < n_tiles, other=float("-inf"))
        st = tl.load(stat_s_ptr + row * n_tiles + ts, mask=ts < n_tiles, other=0.0)
        m = tl.max(mt, axis=0)
        log2_s = tl.log2(tl.sum(st * tl.exp2((mt - m) * LOG2E), axis=0))
        base = logits_ptr + row * stride_row
        target = tl.load(targets_ptr + row).to(tl.int64)
        valid = target != ignore_index
        in_range = valid & (target >= 0) & (target < V)
        x_t = tl.load(base + target, mask=in_range, other=0.0).to(tl.float32)
        tl.store(row_loss_ptr + row, tl.where(valid, (m - x_t) + log2_s * LN2, 0.0))
        scale = tl.where(valid, tl.load(grad_scale_ptr), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            p = tl.exp2((x.to(tl.float32) - m) * LOG2E - log2_s)
            g = scale * (p - tl.where(offs == target, 1.0, 0.0))
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def stats_gemm(logits, stat_m, stat_s, h, w, cfg=(128, 256, 64, 8, 3), programs=None):
    BM, BN, BK, warps, stages = cfg
    M, K = h.shape
    N = w.shape[0]
    a_desc = TensorDescriptor(h, [M, K], [h.stride(0), 1], [BM, BK])
    b_desc = TensorDescriptor(w, [N, K], [w.stride(0), 1], [BN, BK])
    c_desc = TensorDescriptor(logits, [M, N], [logits.stride(0), 1], [BM, BN])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    n = min(tiles, programs or torch.cuda.get_device_properties(h.device).multi_processor_count)
    _logits_stats_kernel[(n,)](c_desc, a_desc, b_desc, stat_m, stat_s, M, N, K, n, BLOCK_M=BM, BLOCK_N=BN,
                               BLOCK_K=BK, GROUP_M=8, num_warps=warps, num_stages=stages)


def row1(logits, row_loss, targets, stat_m, stat_s, grad_scale, programs, block_v=16384, warps=16):
    rows, V = logits.shape
    T = stat_m.shape[1]
    _ce_row1_kernel[(min(rows, programs),)](logits, row_loss, targets, stat_m, stat_s, rows, V, logits.stride(0),
                                            T, grad_scale, -100, BLOCK_V=min(block_v, triton.next_power_of_2(V)),
                                            BLOCK_T=triton.next_power_of_2(T), num_warps=warps)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:  # the row pass only (the stats from torch): the interpreter has no TMA descriptors
        rows, V, BN = 5, 1000, 64
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(rows, V, generator=g) * 4).to(torch.float16)
        x = logits.float()
        T = triton.cdiv(V, BN)
        xp = torch.nn.functional.pad(x, (0, T * BN - V), value=float("-inf")).view(rows, T, BN)
        stat_m = xp.amax(2).contiguous()
        stat_s = torch.exp(xp - stat_m[:, :, None]).sum(2).contiguous()
        t = torch.randint(0, V, (rows,), generator=g, dtype=torch.int32)
        t[1] = -100
        gs = torch.tensor([0.5])
        rl = torch.empty(rows)
        lg = logits.clone()
        row1(lg, rl, t, stat_m, stat_s, gs, 3, block_v=128, warps=4)
        lse = torch.logsumexp(x, 1)
        valid = t != -100
        want_loss = torch.where(valid, lse - x.gather(1, t.clamp_min(0).long()[:, None])[:, 0], 0.0)
        want_g = 0.5 * (torch.softmax(x, 1) - torch.nn.functional.one_hot(t.clamp_min(0).long(), V)) * valid[:, None]
        print(f"loss diff {_rel(rl, want_loss):.1e}  grad diff {_rel(lg, want_g):.1e}")
        return
    dev, bf = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3  # noqa: E731
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for C in (2048, 1024):
        rows, V = 1024, 151936
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(rows, C, device=dev, dtype=bf, generator=g)
        w = torch.randn(V, C, device=dev, dtype=bf, generator=g) * C ** -0.5 * 3
        t = torch.randint(0, V, (rows,), device=dev, dtype=torch.int32, generator=g)
        gs = torch.full((1,), 1.0 / 8192, device=dev)
        T = triton.cdiv(V, 256)
        sm, ss = torch.empty(rows, T, device=dev), torch.empty(rows, T, device=dev)
        la, lb = torch.empty(rows, V, device=dev, dtype=bf), torch.empty(rows, V, device=dev, dtype=bf)
        rla, rlb = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
        bv, warps, programs, rev = CE._row_config(torch.device(dev))

        def gemm_a():
            matmul(la, h, w.t())

        def row_a():
            CE._linear_ce_fwd_bwd_kernel[(min(rows, programs),)](la, rla, t, rows, V, la.stride(0), gs, -100,
                                                                BLOCK_V=bv, WRITE_GRAD=True, REVERSE=rev,
                                                                num_warps=warps)

        def gemm_b():
            stats_gemm(lb, sm, ss, h, w)

        def row_b(p=programs, b=bv, wp=warps):
            row1(lb, rlb, t, sm, ss, gs, p, b, wp)
        gemm_a(), row_a(), gemm_b(), row_b()
        torch.cuda.synchronize()
        err = max(_rel(rlb, rla), _rel(lb, la))
        ta, tra, tb, trb = bench(gemm_a), bench(lambda: (gemm_a(), row_a())), bench(gemm_b), \
            bench(lambda: (gemm_b(), row_b()))
        print(f"C {C} rows {rows} V {V}: lean GEMM {ta:.0f} us, + rows {tra:.0f} us | stats GEMM {tb:.0f} us, "
              f"+ row1 {trb:.0f} us | {tra / trb:.3f}x  diff {err:.1e}", flush=True)
        for p, b, wp in ((sms, 16384, 16), (2 * sms, 16384, 16), (4 * sms, 8192, 8), (rows, 8192, 8), (rows, 4096, 8)):
            print(f"   row1 at {p} programs, BLOCK_V {b}, {wp} warps: + {bench(lambda: (gemm_b(), row_b(p, b, wp))):.0f} us",
                  flush=True)


if __name__ == "__main__":
    main()
