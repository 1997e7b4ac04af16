"""Triton's CPU interpreter (TRITON_INTERPRET=1) without its per-call re-patching: the same kernels,
the same results, about a sixth less Python.

    patch_device_calls()    # lean/kernels/__init__.py calls it once when TRITON_INTERPRET=1

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
Caution: it reads two private names of triton 3.6's interpreter (_patch_lang and the scope's
_changes list); with a triton where they differ it leaves the interpreter as it is (the kernels
then run at the old speed). LEAN_INTERP_PATCH=0 turns it off.
Tested: tests/test_interp.py (the same bits with and without it; builtins restored after a
launch; the device calls' swaps skipped).
"""
import inspect
import os

_STATE = {"scope": None, "modules": frozenset()}   # the launch in progress: its scope, the modules it swapped
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
        scope = original(fn)                         # a launch: swap, and remember until its end
        undo = scope.restore

        def restore():
            _STATE["scope"], _STATE["modules"] = None, frozenset()
            undo()

        scope.restore = restore
        _STATE["scope"], _STATE["modules"] = scope, need
        return scope

    interp._patch_lang = _patch_lang
    _applied = True
    return True
