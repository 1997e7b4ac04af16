"""Shared test helpers: device and dtype choice, fresh seeds, poisoning, the tolerance rule asserted."""
import os
import random

import torch

from lean.reference.rule import close_rule

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter multiplies bf16 bit patterns in tl.dot (triton issue 11584): CPU tests use
# float32 (tight) and float16 (the tolerance rule); the GPU checks bf16 by the tolerance rule.
LOWP = torch.bfloat16 if ON_GPU else torch.float16


def hopper_path(monkeypatch):
    """For a test of the Hopper path's own kernels on a GPU: take the path even under LEAN_PORTABLE=1
    (the portable run of the suite still tests them), or skip on a GPU without TMA. On the CPU
    nothing: such tests force the choice themselves."""
    if not ON_GPU:
        return
    import lean.kernels.arch as A
    real = A.target(*torch.cuda.get_device_capability())
    if not real.tma:
        import pytest
        pytest.skip(f"{real.name} takes the portable path: no TMA kernels to test")
    monkeypatch.setitem(A._FORCED, "portable", False)
    monkeypatch.setitem(A._FORCED, "emulate", None)
    monkeypatch.delenv("LEAN_ARCH", raising=False)


def fresh_generator(device=DEVICE):
    """A generator seeded from the OS: every run draws new inputs. The seed is printed so a
    failure (pytest shows captured output) can be replayed with LEAN_TEST_SEED."""
    seed = int(os.environ.get("LEAN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}")
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def fresh_seed():
    """An int seed for a test's draws, from fresh_generator (printed; LEAN_TEST_SEED replays it)."""
    return int(torch.randint(0, 2**30, (1,), generator=fresh_generator("cpu")))


def randn(*shape, g, dtype=torch.float32, device=DEVICE, scale=1.0):
    return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


def poison(*tensors):
    """Fill outputs with NaN (floats) or a sentinel (ints) so an element never written fails."""
    for t in tensors:
        if t is None:
            continue
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-12345)


def assert_close_rule(out, ref, lowp=None, *, atol=0.0, rtol32=1e-5, name="out", lowp_ref=None):
    """The project's tolerance rule (lean/reference/rule.py's close_rule, by out's dtype), asserted."""
    v = close_rule(out, ref, lowp, atol=atol, rtol32=rtol32, name=name, lowp_ref=lowp_ref)
    assert v.ok, v.text



def check_step_loss(loss, tokens, ref_tokens, lowp_tokens):
    """Asserts lean.reference.hf_peft.step_loss_verdicts (the summed loss against the step's own
    token losses, and those within the rule per token); returns the per-token verdict."""
    from lean.reference.hf_peft import step_loss_verdicts

    verdicts = step_loss_verdicts(loss, tokens, ref_tokens, lowp_tokens)
    for v in verdicts:
        assert v.ok, v.text
    return verdicts[-1]
