"""Test configuration: CPU runs the real Triton kernels through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, when pytest
loads this file and before any test module imports lean.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tools/gpu_check.sh on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
