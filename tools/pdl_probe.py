"""What a kernel boundary costs inside a CUDA graph, and what programmatic dependent launch (PDL) saves.

    python tools/pdl_probe.py

A chain of K copies y_i = x_{i-1} * 1 + 0 (each reads the previous one's output, so nothing may
overlap but the launch), captured in one CUDA graph and replayed: graph-median us per kernel at
several sizes, launched plainly and with launch_pdl=True (each kernel waits, griddepcontrol.wait,
before its first load and lets the next one launch, griddepcontrol.launch_dependents, right after
it). Sizes span lean's small kernels: a few-us row pass to a one-wave GEMM-sized read.
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def _copy_kernel(y_ptr, x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, x * 1.0 + 0.0, mask=offs < n)


def chain(bufs, K, block, pdl, early):
    n = bufs[0].numel()
    grid = (triton.cdiv(n, block),)
    for i in range(K):
        _copy_kernel[grid](bufs[(i + 1) % 2], bufs[i % 2], n, BLOCK=block, PDL=pdl, EARLY=early,
                           num_warps=4, launch_pdl=pdl)


def main():
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    K = 200
    for mb in (0.25, 2, 16, 64):
        n = int(mb * 2**20) // 2
        bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        row = []
        for pdl, early in ((False, False), (True, False), (True, True)):
            chain(bufs, 2, 1024, pdl, early)
            torch.cuda.synchronize()
            ms = do_bench_cudagraph(lambda: chain(bufs, K, 1024, pdl, early), rep=200, return_mode="median")
            row.append(ms * 1e3 / K)
        print(f"{mb:6.2f} MB read + written a kernel: plain {row[0]:6.2f} us | PDL, trigger after the load "
              f"{row[1]:6.2f} us | PDL, trigger first {row[2]:6.2f} us a kernel", flush=True)


if __name__ == "__main__":
    main()
