import os

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: no per-call re-patching, layout-free
    from lean.kernels._interp import contiguous_dots, patch_device_calls, scalar_index   # dots, numpy 2.4 scalars

    patch_device_calls()
    contiguous_dots()
    scalar_index()
