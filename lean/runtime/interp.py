"""The process settings that make Triton's CPU interpreter fast, for lean-train on a machine without a GPU.

    one_blas_thread()   # numpy's OpenBLAS on one thread (lean-train calls it when the kernels run on the CPU)

The interpreter runs each program's tl.dot as a numpy matmul of one tile: many small matmuls
between Python-heavy ops. OpenBLAS splits each over its threads and keeps them spinning between
calls, so on 2 cores the second thread takes the core the interpreter's Python needs: measured
on 2 cores, SmolLM2-135M's held-out evaluation (4 documents, fp32) 101-113 s -> 59-61 s wall,
one training step 157-166 s -> 130 s, with the same results to the last bits of the matmuls'
summation order. OpenBLAS reads OPENBLAS_NUM_THREADS only when it loads (with numpy, before lean
is imported), so the thread count is set through its C API on the library numpy loaded.
Caution: Linux finds that library in /proc/self/maps; elsewhere, or with another BLAS, nothing
changes (set OPENBLAS_NUM_THREADS=1 or the BLAS's own variable by hand).
Tested: tests/test_cli_guard.py (the thread count read back after the call).
"""
import ctypes
import re

# the C functions that set the thread count: plain OpenBLAS builds and numpy's scipy-openblas wheels
SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
           "scipy_openblas_set_num_threads_64_")
GETTERS = tuple(s.replace("set_", "get_") for s in SETTERS)


def _blas_libs() -> list:
    """The OpenBLAS libraries loaded in this process (numpy's; Linux only, else empty)."""
    import numpy  # noqa: F401  (loads its BLAS)

    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read()
    except OSError:
        return []
    return sorted(set(re.findall(r"(/\S*openblas\S*\.so[^\s]*)", maps)))


def _call(names, *args):
    for path in _blas_libs():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return fn(*args)
    return None


def one_blas_thread() -> bool:
    """Set numpy's OpenBLAS to one thread; False when no OpenBLAS was found (nothing changed)."""
    return _call(SETTERS, 1) is not None


def blas_threads():
    """numpy's OpenBLAS thread count, or None when no OpenBLAS was found."""
    return _call(GETTERS)
