import os

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: no per-call re-patching, layout-free dots
    from lean.kernels._interp import contiguous_dots, patch_device_calls

    patch_device_calls()
    contiguous_dots()
