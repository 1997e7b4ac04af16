"""lean/kernels/_interp.py: the interpreter without its per-device-call re-patching computes the same
bits, undoes every swap when a launch ends, and skips the device calls' swaps."""
import os
import subprocess
import sys

import pytest
import torch

from tests.util import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the patch is for Triton's CPU interpreter")

# attention forward and backward (helpers _load_rows, _fwd_step, tl.sum, tl.zeros, ... inside) and rope
SCRIPT = r"""
import sys, torch
from lean.kernels import _interp
from lean.kernels.attention import attention_bwd, attention_fwd
from lean.kernels.rope import rope_fwd
g = torch.Generator().manual_seed(int(sys.argv[1]))
N, H, KVH, D = 45, 4, 2, 32
q, k, v, do = (torch.randn(N, h, D, generator=g) for h in (H, KVH, KVH, H))
cu = torch.tensor([0, 1, 20, 45], dtype=torch.int32)
o, lse = torch.empty_like(q), torch.empty(H, N)
attention_fwd(o, lse, q, k, v, cu, 25, D ** -0.5)
dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty(H, N)
attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, 25, D ** -0.5)
cos, sin = torch.rand(N, D // 2, generator=g), torch.rand(N, D // 2, generator=g)
rope_fwd(q, k, cos, sin)
torch.save({"applied": _interp._applied, "out": [o, lse, dq, dk, dv, q, k]}, sys.argv[2])
"""


def _run(tmp_path, patch, seed):
    path = tmp_path / f"out{patch}.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", LEAN_INTERP_PATCH=patch)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(seed), str(path)], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(path)


def test_same_bits_with_and_without(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    on, off = _run(tmp_path, "1", seed), _run(tmp_path, "0", seed)
    assert on["applied"] and not off["applied"]
    for i, (a, b) in enumerate(zip(on["out"], off["out"])):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"output {i} differs"


def test_builtins_restored_and_device_calls_skipped(monkeypatch):
    import triton.language as tl
    import triton.runtime.interpreter as interp

    from lean.kernels import _interp
    from lean.kernels.attention import attention_fwd

    assert _interp.patch_device_calls() and interp._patch_lang.__module__ == _interp.__name__
    swaps = []
    original = interp._patch_builtin
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a: swaps.append(a[0]) or original(*a))
    calls = []
    original_call = interp.InterpretedFunction.__call__
    monkeypatch.setattr(interp.InterpretedFunction, "__call__",
                        lambda self, *a, **k: calls.append(self.fn.__name__) or original_call(self, *a, **k))
    N, H, D = 40, 2, 16
    q = torch.randn(N, H, D)
    o, lse = torch.empty_like(q), torch.empty(H, N)
    attention_fwd(o, lse, q, q, q, torch.tensor([0, 17, 40], dtype=torch.int32), 23, 0.25)
    assert len(calls) >= 20, calls                         # device functions called inside the kernel
    # the launch swaps tl (tl, tl.tensor, tl.math, descriptors), and the first device calls whose module
    # sees another language module (tl.core) swap that one once (3-4 each); unpatched every device call
    # swaps 3-5: 60+ here
    assert len(swaps) <= 16, f"{len(swaps)} swaps for {len(calls)} device calls"
    assert _interp._STATE["scope"] is None
    with pytest.raises(ValueError, match="triton.jit"):   # the real builtin is back: it needs a JIT context
        tl.arange(0, 4)
    with pytest.raises(ValueError, match="triton.jit"):
        tl.core.full((4,), 0, tl.float32)


def test_an_interrupt_in_a_launch_waits_for_its_undo(monkeypatch):
    """lean-train's SIGINT / SIGTERM handler inside an interpreter launch holds the interrupt, and the
    launch's undo raises it with every builtin back; outside a launch it raises at once. (An interrupt
    in the middle of the swap left triton.language swapped, and the next kernel failed.)"""
    import signal

    import triton.language as tl
    import triton.runtime.interpreter as interp

    from lean import cli
    from lean.kernels import _interp
    from lean.kernels.rope import _rope_kernel

    assert _interp.patch_device_calls()
    terminated = []
    old_int = signal.getsignal(signal.SIGINT)
    previous = cli._sigterm_as_interrupt(terminated)
    try:
        handler = signal.getsignal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is (handler if old_int is signal.default_int_handler else old_int)
        with pytest.raises(KeyboardInterrupt):              # no launch: now
            handler(signal.SIGTERM, None)
        scope = interp._patch_lang(_rope_kernel.fn)     # a launch's swap, as GridExecutor makes it
        assert _interp.in_launch()
        handler(signal.SIGTERM, None)                       # held: no exception inside the launch
        handler(signal.SIGTERM, None)
        assert terminated == [signal.SIGTERM] * 3
        with pytest.raises(KeyboardInterrupt):              # raised by the undo, once
            scope.restore()
        assert not _interp.in_launch() and not _interp._STATE["pending"]
        with pytest.raises(ValueError, match="triton.jit"):  # the builtins are back
            tl.arange(0, 4)
        interp._patch_lang(_rope_kernel.fn).restore()  # the next launch: nothing held over
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, old_int)


def test_dots_get_contiguous_tiles(monkeypatch):
    """contiguous_dots: np.matmul sees C-contiguous tiles even where the kernel dots a transposed
    view (tl.trans), so the bits follow the values, not the layout (OpenBLAS's AVX-512 kernels sum
    the two layouts in different orders); and the transposed dot equals the one on a copy laid out
    plainly, bit for bit."""
    import numpy as np
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    from lean.kernels import _interp

    @triton.jit
    def dots(out_t, out_c, a_ptr, b_ptr, bt_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])                      # (M, K)
        b = tl.load(b_ptr + rn[:, None] * K + rk[None, :])                      # (N, K)
        bt = tl.load(bt_ptr + rk[:, None] * N + rn[None, :])                    # (K, N), b^T stored plainly
        tl.store(out_t + rm[:, None] * N + rn[None, :], tl.dot(a, tl.trans(b), input_precision="ieee"))
        tl.store(out_c + rm[:, None] * N + rn[None, :], tl.dot(a, bt, input_precision="ieee"))

    assert _interp.contiguous_dots() and interp.InterpreterBuilder.create_dot.contiguous
    layouts = []
    matmul = np.matmul

    def recorded(x, y, **kw):
        layouts.append((x.flags.c_contiguous, y.flags.c_contiguous))
        return matmul(x, y, **kw)
    monkeypatch.setattr(interp.np, "matmul", recorded)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    M, N, K = 32, 16, 64
    a, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    out_t, out_c = torch.empty(M, N), torch.empty(M, N)
    dots[(1,)](out_t, out_c, a, b, b.t().contiguous(), M=M, N=N, K=K)
    assert layouts == [(True, True), (True, True)], layouts
    assert torch.equal(out_t, out_c)


def test_a_scalar_tensor_indexes_under_numpy_2_4():
    """scalar_index: a scalar tensor's __index__ (a loop bound from a kernel argument) takes its
    one-element array's element; numpy 2.4 refuses int() of such an array, as the array below does.
    Restored with the launch's other swaps. And a kernel looping to an argument runs."""
    import operator

    import numpy as np
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    from lean.kernels import _interp

    class Numpy24(np.ndarray):
        def __int__(self):
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    assert _interp.scalar_index() and interp._patch_lang_tensor.scalar_index
    before = getattr(tl.tensor, "__index__", None)
    scope = interp._LangPatchScope()
    interp._patch_lang_tensor(tl.tensor, scope)
    t = tl.tensor(interp.TensorHandle(np.array([7], dtype=np.int32).view(Numpy24), tl.int32), tl.int32)
    assert operator.index(t) == 7
    scope.restore()
    assert getattr(tl.tensor, "__index__", None) is before

    @triton.jit
    def count(out, n):
        acc = tl.zeros((), tl.int32)
        for _ in range(0, n):
            acc += 1
        tl.store(out, acc)

    out = torch.zeros(1, dtype=torch.int32)
    count[(1,)](out, 5)
    assert out.item() == 5
