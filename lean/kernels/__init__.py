import os

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter, without its per-call re-patching
    from lean.kernels._interp import patch_device_calls

    patch_device_calls()
