"""Triton's CPU interpreter (TRITON_INTERPRET=1) without its per-call re-patching: the same kernels,
the same results, about a sixth less Python; and its tl.dot on C-contiguous tiles.

    patch_device_calls()    # lean/kernels/__init__.py calls all three once when TRITON_INTERPRET=1
    contiguous_dots()
    scalar_index()

Why: the interpreter runs a kernel by swapping triton.language's builtins (tl.load, tl.dot, ...)
for numpy-backed ones, once per launch (GridExecutor.__call__ -> _patch_lang, undone when the launch
ends). It does the same swap again on every call of a @triton.jit device function inside the
kernel (InterpretedFunction.__call__ -> _patch_lang), although the launch's swap is still in
place; tl.sum, tl.zeros and tl.max are such functions, and so are lean's own helpers
(attention's _load_rows, rope's _rope_rotate_heads). The swap walks the modules' members with
inspect.getmembers, ~0.25 ms a call. A SmolLM2-135M forward_backward of 128 tokens makes 33k such
calls: measured on this project's 2-core CPU machine, 88 s -> 76 s (1 core, fp32).

What the patch does: while a launch's swap is in place, a device function's call swaps only the
modules the launch has not swapped (triton.language.core, which tl.zeros' own module reads, on its
first call), and records those swaps in the launch's scope, so that the launch's end undoes
them too; every other device call swaps nothing. Outside a launch nothing changes.
Interrupts: a KeyboardInterrupt raised by a signal handler inside a launch is not safe. Raised in
numpy's conversion of a shape (Python code runs there), numpy turns it into TypeError("expected a
sequence of integers or a single integer, got '(32)'"), which the interpreter raises as an
InterpreterError: a lean-train run on the CPU stopped by SIGTERM exited 1 instead of saving its
checkpoint (seen once in CI, and once in 600 timed interrupts of an attention launch loop). Raised
while the builtins are half swapped, it would leave triton.language swapped. So lean-train's SIGINT
and SIGTERM handlers ask in_launch() and, inside a launch, hold the interrupt (hold_interrupt): the
launch's undo raises it once everything is back.
Caution: it reads two private names of triton 3.6's interpreter (_patch_lang and the scope's
_changes list); with a triton where they differ it leaves the interpreter as it is (the kernels
then run at the old speed). LEAN_INTERP_PATCH=0 turns it off.
Tested: tests/test_interp.py (the same bits with and without it; builtins restored after a
launch; the device calls' swaps skipped).

Dots: the interpreter computes tl.dot as np.matmul of the two tiles as they lie, and a tile may be
a transposed view (tl.trans, .T) or a loaded array. OpenBLAS picks its kernel by the operands'
layout, and on AVX-512 CPUs (its SkylakeX small-matrix kernels) the kernels for the transposed and
plain layouts sum in different orders: two kernels that compute the same products from tiles laid
out differently (NF4 decoded in the loop against the dequantised weight; gmm_mxfp4 against gmm)
gave different fp32 bits there and the same bits on AVX2 CPUs (a CI machine with AVX-512 failed
five such tests). contiguous_dots() hands np.matmul C-contiguous copies of views, so the bits
follow the values alone, on every CPU. Tested: tests/test_interp.py (a dot of a transposed view
and of its contiguous copy, the same bits).

Scalars: the interpreter gives a scalar tensor an __index__ of int(its one-element array), which
numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", after its 1.25
deprecation), so every kernel whose loop bound is a kernel argument failed on the CPU with numpy
>= 2.4 (CI had pinned numpy < 2.4). scalar_index() takes the element instead: the same int with any
numpy (the CPU suite passes with numpy 2.4.6; tools/train_lora.py on the CPU with 2.5.2). Tested:
tests/test_interp.py (a scalar tensor's index from an array that refuses int(), restored after).
"""
import inspect
import os

_STATE = {"scope": None, "modules": frozenset(),  # the launch in progress: its scope, the modules it swapped
          "swapping": False, "pending": False}      # a launch's swap under way; an interrupt held for its end
_GLOBALS = {}                                       # id(fn.__globals__) -> ids of the language modules it sees
_applied = False


def _languages(fn, tl):
    """ids of the triton.language modules a jit function's globals hold (what _patch_lang swaps)."""
    key = id(fn.__globals__)
    got = _GLOBALS.get(key)
    if got is None:
        got = _GLOBALS[key] = frozenset(id(v) for v in fn.__globals__.values()
                                        if inspect.ismodule(v) and v in (tl, tl.core))
    return got


def in_launch() -> bool:
    """True while a kernel runs in the interpreter with triton.language's builtins swapped (from the
    swap's start to its undoing)."""
    return _STATE["scope"] is not None or _STATE["swapping"]


def hold_interrupt():
    """Raise KeyboardInterrupt when the launch in progress has undone its swap, not now (a signal
    handler's call, lean-train's SIGINT / SIGTERM: see the module docstring)."""
    _STATE["pending"] = True


def patch_device_calls() -> bool:
    """Install the patch (module docstring); True when it is in place."""
    global _applied
    if _applied:
        return True
    if os.environ.get("LEAN_INTERP_PATCH", "1") == "0":
        return False
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if original is None or scope_cls is None or not hasattr(scope_cls(), "_changes"):
        return False

    def _patch_lang(fn):
        launch = _STATE["scope"]
        need = _languages(fn, tl)
        if launch is not None:                       # a device function's call inside a launch
            if need <= _STATE["modules"]:
                return scope_cls()                   # all swapped already: nothing to undo
            scope = original(fn)
            launch._changes.extend(scope._changes)   # the launch's end undoes these too
            scope._changes = []
            _STATE["modules"] = _STATE["modules"] | need
            return scope
        _STATE["swapping"] = True                    # a launch: swap, and remember until its end
        try:
            scope = original(fn)
            undo = scope.restore

            def restore():
                undo()
                _STATE["scope"], _STATE["modules"] = None, frozenset()
                if _STATE["pending"]:                # an interrupt held back during the launch: now
                    _STATE["pending"] = False
                    raise KeyboardInterrupt

            scope.restore = restore
            _STATE["scope"], _STATE["modules"] = scope, need
        finally:
            _STATE["swapping"] = False
        return scope

    interp._patch_lang = _patch_lang
    _applied = True
    return True


def contiguous_dots() -> bool:
    """tl.dot under the interpreter on C-contiguous tiles (module docstring, "Dots"); True when in
    place. It reads the interpreter's InterpreterBuilder.create_dot and TensorHandle (triton 3.6);
    where they differ, nothing changes."""
    import numpy as np
    import triton.runtime.interpreter as interp

    builder, handle = getattr(interp, "InterpreterBuilder", None), getattr(interp, "TensorHandle", None)
    original = getattr(builder, "create_dot", None)
    if original is None or handle is None:
        return False
    if getattr(original, "contiguous", False):
        return True

    def create_dot(self, a, b, d, *args, **kwargs):
        a, b = (t if t.data.flags.c_contiguous else handle(np.ascontiguousarray(t.data), t.dtype) for t in (a, b))
        return original(self, a, b, d, *args, **kwargs)

    create_dot.contiguous = True
    builder.create_dot = create_dot
    return True


def scalar_index() -> bool:
    """A scalar tensor's __index__ under the interpreter through its element, not int() of its
    one-element array (module docstring, "Scalars"); True when in place. It wraps triton 3.6's
    _patch_lang_tensor; where that differs, nothing changes."""
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "scalar_index", False):
        return True

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # restored with the launch's other swaps; the element is read from the interpreter's numpy array
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))  # sync: none (numpy, CPU)

    _patch_lang_tensor.scalar_index = True
    interp._patch_lang_tensor = _patch_lang_tensor
    return True
