"""A measured lever for the portable x W^T (issue 23): warp-specialized pointer-load GEMMs, written in
Gluon (Triton 3.6's explicit-layout frontend), against cuBLAS and lean's persistent pointer kernel.

    python tools/gemm_ws.py                    # H100/H200: odd-size checks, then the nine shapes x cuBLAS
    python tools/gemm_ws.py --forms ws,ws:2,ws:1,sa   # "ws:2": 2 loader warps instead of 4
    python tools/gemm_ws.py --forms ws,ws-loads,ws-mma  # each half of ws timed alone (x cuBLAS's time)
    python tools/gemm_ws.py --compile-only     # any machine: compile both forms for sm_90, shared bytes

Why: `_matmul_kmajor_kernel`'s cp.async pipeline syncs the whole CTA twice every K step (SASS). These
kernels have no CTA-wide barrier in the main loop: loader warps issue cp.async into a ring of STAGES
shared buffers and signal each buffer through an mbarrier (cp.async.mbarrier.arrive.noinc, one arrival
per loader thread); two consumer warpgroups (64 rows of the 128 x 256 tile each, wgmma) wait on it, and
each releases a buffer by arriving on its "empty" mbarrier once the wgmma that read it has retired.
Persistent: one program per SM walking the tiles in grouped order; the loader runs ahead into the next
tile while the consumers store (epilogue through a layout conversion, 16-byte stores).

Forms:
  ws        loader warps (LOAD_WARPS) load both tiles; consumers only wait, multiply and store
  sa        loader warps load the weight tile only; each consumer loads its own 64 rows of x
  ws-loads  ws without the wgmmas (the loads and the ring's signalling alone)
  ws-mma    ws without the copies (the wgmmas on whatever the ring holds, and the stores)

Both are wgmma (sm_90) only: no RTX card runs them. H200 runs (2026-11-28, BENCHMARKS.md), x cuBLAS
at the nine shapes: `ws` 0.79-0.87 against the persistent pointer kernel's 0.83-0.91 in the same
runs; `sa` 0.65-0.68; `ws` with 2 / 1 loader warps 0.46-0.54 / 0.24-0.31 (8 do not compile: 512
threads cap ptxas at 128 registers, the 64 x 256 wgmma needs 154). Each half alone outruns cuBLAS:
`ws-loads` 1.44-1.85x, `ws-mma` 1.07-1.32x; together 0.79-0.86x. What binds is neither half nor the
barriers but the two at once, which fits cp.async's writes (through the load/store unit) and wgmma's
reads contending for the SM's shared memory; cuBLAS's TMA writes do not take that path. Not proven
(no profiler here). lean keeps `_matmul_kmajor_kernel`. Standalone: nothing of lean is imported but gemm_forms' persistent launch.
"""
import argparse
import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LOAD_WARPS, CONSUMER_REGS, LOAD_REGS): no spills (ptxas, sm_90a)
CONFIG = (128, 256, 64, 4, 4, 216, 72)
HALVES = ("ws-loads", "ws-mma")      # forms that time one half of ws alone (no product to check)


@gluon.jit
def _tile_of(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """gemm.grouped_tile: GROUP_M row blocks at a time, so neighbours share panels in L2."""
    grid_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(gl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _loader(a_ptr, b_ptr, a_smem, b_smem, ready, empty, M, N, K, stride_am, stride_bn, n_programs,
            LOAD_A: gl.constexpr, PART: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Ring position i = (tile, K step) in walk order: wait until buffer i % STAGES is empty, copy, and
    arrive on ready when this thread's copies land (the barrier counts every loader thread)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [LOAD_WARPS, 1], [1, 0])
    rk = gl.arange(0, BLOCK_K, gl.SliceLayout(0, blk))
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    i = 0
    for tile in range(gl.program_id(0), tiles, n_programs):
        pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, blk))
        rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, blk))
        a_rows = a_ptr + (rm % M).to(gl.int64)[:, None] * stride_am      # rows past M read row 0 (never stored)
        b_rows = b_ptr + (rn % N).to(gl.int64)[:, None] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)     # a fresh barrier passes parity 1
            if PART != 2:
                if LOAD_A:
                    cp.async_copy_global_to_shared(a_smem.index(s), a_rows + (k0 + rk)[None, :])
                cp.async_copy_global_to_shared(b_smem.index(s), b_rows + (k0 + rk)[None, :])
            cp.mbarrier_arrive(ready.index(s), increment_count=False)
            i += 1


@gluon.jit
def _own_a(j, a_ptr, a_smem, ready_a, M, N, K, stride_am, n_programs, tiles, k_steps,
           HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
           GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """`sa`: a consumer's own 64 rows of x for ring position j."""
    SUB_M: gl.constexpr = BLOCK_M // 2
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [4, 1], [1, 0])
    tile = gl.program_id(0) + (j // k_steps) * n_programs
    if tile < tiles:
        pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + HALF * SUB_M + gl.arange(0, SUB_M, gl.SliceLayout(1, blk))
        kk = (j % k_steps) * BLOCK_K + gl.arange(0, BLOCK_K, gl.SliceLayout(0, blk))
        cp.async_copy_global_to_shared(a_smem.index(j % STAGES),
                                       a_ptr + (rm % M).to(gl.int64)[:, None] * stride_am + kk[None, :])
        cp.mbarrier_arrive(ready_a.index(j % STAGES), increment_count=False)


@gluon.jit
def _consumer(c_ptr, a_ptr, a_smem, b_smem, ready, ready_a, empty, M, N, K, stride_am, stride_cm, n_programs,
              HALF: gl.constexpr, OWN_A: gl.constexpr, PART: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile. One wgmma group in flight; the
    buffer the previous one read is released as soon as it retires."""
    SUB_M: gl.constexpr = BLOCK_M // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    st: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    if OWN_A:
        for j in gl.static_range(STAGES - 1):
            _own_a(j, a_ptr, a_smem, ready_a, M, N, K, stride_am, n_programs, tiles, k_steps,
                   HALF, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)
    i = 0
    for tile in range(gl.program_id(0), tiles, n_programs):
        pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for kstep in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if OWN_A:
                mbarrier.wait(ready_a.index(s), (i // STAGES) & 1)
                a = a_smem.index(s)
            else:
                a = a_smem.index(s).slice(HALF * SUB_M, SUB_M, dim=0)
            if PART != 1:
                acc = warpgroup_mma(a, b_smem.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=kstep > 0)
            if OWN_A:
                _own_a(i + STAGES - 1, a_ptr, a_smem, ready_a, M, N, K, stride_am, n_programs, tiles, k_steps,
                       HALF, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
        out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), st)
        rm = pid_m * BLOCK_M + HALF * SUB_M + gl.arange(0, SUB_M, gl.SliceLayout(1, st))
        rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, st))
        gl.store(c_ptr + rm.to(gl.int64)[:, None] * stride_cm + rn[None, :], out,
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


@gluon.jit
def ws_matmul_kernel(c_ptr, a_ptr, b_ptr, M, N, K, stride_am, stride_bn, stride_cm, n_programs,
                     OWN_A: gl.constexpr, PART: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """c (M, N) = a (M, K) @ b (N, K)^T, K % BLOCK_K == 0, 16-bit, K-contiguous rows. PART 1 (loads
    only: the consumers skip the wgmma) and 2 (multiplies only: the loader skips the copies) are the
    two halves timed alone, to see which one bounds the whole; their c is not a product."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    SUB_M: gl.constexpr = BLOCK_M // 2
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    if OWN_A:       # each consumer's rows in its own ring, signalled by its own barriers
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, BLOCK_K], dtype)
        a0 = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, BLOCK_K], a_layout)
        a1 = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, BLOCK_K], a_layout)
        ra0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        ra1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    else:
        a_layout2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        a0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout2)
        a1 = a0
        ra0 = ready
        ra1 = ready
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=LOAD_WARPS * 32)
        mbarrier.init(empty.index(s), count=2)
        if OWN_A:
            mbarrier.init(ra0.index(s), count=128)
            mbarrier.init(ra1.index(s), count=128)
    gl.warp_specialize([
        (_consumer, (c_ptr, a_ptr, a0, b_smem, ready, ra0, empty, M, N, K, stride_am, stride_cm, n_programs,
                     gl.constexpr(0), OWN_A, PART, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_consumer, (c_ptr, a_ptr, a1, b_smem, ready, ra1, empty, M, N, K, stride_am, stride_cm, n_programs,
                     gl.constexpr(1), OWN_A, PART, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_loader, (a_ptr, b_ptr, a0, b_smem, ready, empty, M, N, K, stride_am, stride_bn, n_programs,
                   not OWN_A, PART, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, LOAD_WARPS)),
    ], [4, LOAD_WARPS], [CONSUMER_REGS, LOAD_REGS])


def ws_matmul(c, a, w, form="ws", config=CONFIG, sms=132):
    """c = a @ w.t() on ws_matmul_kernel (the launcher of the forms above); form "ws:2" is "ws" with 2
    loader warps."""
    bm, bn, bk, stages, load_warps, cregs, lregs = config
    if ":" in form:
        form, load_warps = form.split(":")[0], int(form.split(":")[1])
    part = {"ws-loads": 1, "ws-mma": 2}.get(form, 0)
    (M, K), N = a.shape, w.shape[0]
    assert K % bk == 0 and a.stride(1) == 1 and w.stride(1) == 1 and c.stride(1) == 1
    n = min(triton.cdiv(M, bm) * triton.cdiv(N, bn), sms)
    ws_matmul_kernel[(n,)](c, a, w, M, N, K, a.stride(0), w.stride(0), c.stride(0), n, OWN_A=form == "sa", PART=part,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, LOAD_WARPS=load_warps,
                           CONSUMER_REGS=cregs, LOAD_REGS=lregs, num_warps=4)


def compile_only(forms):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {k: v for k, v in zip(["c_ptr", "a_ptr", "b_ptr", "M", "N", "K", "stride_am", "stride_bn",
                                 "stride_cm", "n_programs"], ["*bf16"] * 3 + ["i32"] * 7)}
    names = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "LOAD_WARPS", "CONSUMER_REGS", "LOAD_REGS"]
    for form in forms:
        base = form.split(":")[0]
        ce = dict(zip(names, CONFIG), OWN_A=base == "sa", GROUP_M=8, PART={"ws-loads": 1, "ws-mma": 2}.get(base, 0))
        if ":" in form:
            ce["LOAD_WARPS"] = int(form.split(":")[1])
        attrs = {(x,): [["tt.divisibility", 16]] for x in (0, 1, 2, 4, 5, 6, 7, 8)}
        k = triton.compile(GluonASTSource(ws_matmul_kernel, {**sig, **{n: "constexpr" for n in ce}}, ce, attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(f"{form}: sm_90 compiles, {k.metadata.shared} B shared")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--forms", default="ws,sa")
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    forms = args.forms.split(",")
    if args.compile_only:
        return compile_only(forms)
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm_forms import bench, launch, relerr
    from gemm_tune import N_TOKENS, SHAPES
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; x cuBLAS (CUDA-graph medians)", flush=True)
    torch.manual_seed(0)
    for M, N, K in [(777, 1000, 1024), (8192, 520, 2048), (1, 256, 64), (300, 2048, 3072)]:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        ref = a.double() @ w.double().t()
        row = [f"torch {relerr(a @ w.t(), ref):.1e}"]
        for form in (f for f in forms if f.split(":")[0] not in HALVES):
            c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            ws_matmul(c, a, w, form, sms=sms)
            row.append(f"{form} {relerr(c, ref):.1e}")
        print(f"check {M}x{N}x{K} (rel. Frobenius error): " + " | ".join(row), flush=True)
    for K, O, name in SHAPES:
        x = torch.randn(N_TOKENS, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(O, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        ref, c = (torch.empty(N_TOKENS, O, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        t_cub = bench(lambda: torch.mm(x, w.t(), out=ref))
        row = [f"persist1 {t_cub / bench(lambda: launch('persist1', '128x256x64w8s4', c, x, w, sms)):.3f}"]
        for form in forms:
            try:
                c.fill_(float("nan"))
                ws_matmul(c, x, w, form, sms=sms)
                err = 0.0 if form.split(":")[0] in HALVES else relerr(c, ref)
                row.append(f"{form} BAD {err:.0e}" if not err < 2e-2 else
                           f"{form} {t_cub / bench(lambda: ws_matmul(c, x, w, form, sms=sms)):.3f}")
            except Exception as e:  # noqa: BLE001 (a form that does not launch: say so, go on)
                row.append(f"{form} ERR {type(e).__name__}: {str(e)[:80]}")
        print(f"{name:20s} " + " | ".join(row), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
