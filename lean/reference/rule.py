"""The project's tolerance rule, as functions that return a verdict (tests assert it, lean-check
prints it).

    v = close_rule(out, ref, lowp)        # Verdict(ok, err, bound, text)
    assert v.ok, v.text

out:  the kernel's result (any float dtype).
ref:  the reference in float64 (or float32 for a 16-bit result): high precision.
lowp: torch's own computation at out's low precision (bf16/fp16), required when out is 16-bit.

close_rule, by out's dtype:
  float32/float64 out:  max|out - ref| <= rtol32 * max|ref| + atol
  bf16/fp16 out:        max|out - ref| <= 2 * max|lowp - ref| + atol
  by_lowp=True takes the second bound for any dtype: an fp32 result computed from 16-bit inputs
  (a loss summed from bf16 logits) carries torch-sized error, not fp32-sized.
l2_rule (a whole step against HF + PEFT in bf16, where single elements of a gradient summed over
  thousands of tokens are too noisy to bound one by one):
  |out - ref|_2 / |ref|_2 <= 2 * |lowp - ref|_2 / |ref|_2 + atol
exact_rule: every element equal (copies and index picks: embedding, argmax).
NaN or inf never passes; shapes must match. Everything is compared in float64 on the CPU (one
host copy of each tensor: a test and check utility, never in the step).

LEAN_RULE_LOG=path appends one line per verdict (err / bound, the test, the text) to path: how
close each randomly drawn test sits to its bound (tools/rule_margins.py ranks them).
"""
import os
from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    ok: bool
    err: float     # the measured error (max abs, relative L2, or the count of differing elements)
    bound: float   # what the rule allows
    text: str      # one line: name, error, bound and how the bound was made


def _logged(v):
    path = os.environ.get("LEAN_RULE_LOG")
    if path:
        ratio = v.err / v.bound if v.bound else (0.0 if v.err == 0 else float("inf"))
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{ratio:.4f}\t{test}\t{v.text}\n")
    return v


def _host(t):
    return t.detach().double().cpu()


def _shape_or_finite(out, ref, name):
    """A failing Verdict when shapes differ or out holds NaN/inf (unwritten elements), else None."""
    if tuple(out.shape) != tuple(ref.shape):
        return Verdict(False, float("inf"), 0.0, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    bad = int((~torch.isfinite(_host(out))).sum()) if out.is_floating_point() else 0
    if bad:
        return Verdict(False, float("inf"), 0.0, f"{name}: {bad} non-finite elements (unwritten?)")
    return None


def close_rule(out, ref, lowp=None, *, atol=0.0, rtol32=1e-5, name="out", by_lowp=None, lowp_ref=None):
    """The max-error rule (see the module docstring). by_lowp: None decides by out's dtype.
    lowp_ref: what torch's own error is measured against, where out's reference is not torch's
    (default ref)."""
    early = _shape_or_finite(out, ref, name)
    if early:
        return early
    o, r = _host(out), _host(ref)
    err = (o - r).abs().max().item() if o.numel() else 0.0
    scale = r.abs().max().item() if r.numel() else 0.0
    if by_lowp is None:
        by_lowp = out.dtype not in (torch.float32, torch.float64)
    if by_lowp:
        if lowp is None:
            raise ValueError(f"{name}: a {out.dtype} result needs torch's own low-precision result (lowp)")
        lr = r if lowp_ref is None else _host(lowp_ref)
        lerr = (_host(lowp).reshape(lr.shape) - lr).abs().max().item() if lr.numel() else 0.0
        bound = 2.0 * lerr + atol
        rule = f"2 * torch {lowp.dtype} error ({lerr:.3e}) + atol {atol:.1e}"
    else:
        bound = rtol32 * scale + atol
        rule = f"{rtol32:g} * max|ref| + atol {atol:.1e}"
    ok = err <= bound
    return _logged(Verdict(ok, err, bound, f"{name}: max error {err:.3e} {'<=' if ok else '>'} {bound:.3e} = "
                                           f"{rule} (max|ref| = {scale:.3e})"))


def l2_rule(out, ref, lowp, *, atol=1e-3, name="out"):
    """The relative-L2 rule (see the module docstring)."""
    early = _shape_or_finite(out, ref, name)
    if early:
        return early
    o, r, low = _host(out), _host(ref), _host(lowp).reshape(ref.shape)
    norm = r.norm().item() or 1.0
    err, lerr = (o - r).norm().item() / norm, (low - r).norm().item() / norm
    bound = 2.0 * lerr + atol
    ok = err <= bound
    return _logged(Verdict(ok, err, bound, f"{name}: relative L2 error {err:.3e} {'<=' if ok else '>'} "
                                           f"{bound:.3e} = 2 * torch's low-precision error ({lerr:.3e}) + "
                                           f"atol {atol:.1e}"))


def exact_rule(out, ref, name="out"):
    """Every element equal (NaN only where the reference has NaN). err = the count that differ."""
    if tuple(out.shape) != tuple(ref.shape):
        return Verdict(False, float("inf"), 0.0, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.detach().cpu(), ref.detach().cpu()
    same = o == r
    if o.is_floating_point():
        same |= torch.isnan(o) & torch.isnan(r)
    bad = int((~same).sum())
    where = f" (first at {(~same).nonzero()[0].tolist()})" if bad else ""
    return Verdict(bad == 0, float(bad), 0.0, f"{name}: {bad} of {o.numel()} elements differ{where}")
