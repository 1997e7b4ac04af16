"""Plain-torch fp32 references for every kernel, one module per op (mirroring lean/kernels/).

Backward references come from torch.autograd on the reference forward. Tests and tools/bench.py
import them from here: `from tests.reference import rmsnorm_ref`.
"""
