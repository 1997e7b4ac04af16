"""lean/kernels/lora_linear_pre.py: the rank-R pre-pass (lora_xa, lora_dyb) and the pre-pass TMA
kernels (_fwd_tma_pre, _bwd_tma_pre) against plain torch. TMA descriptor loads run under the
interpreter too, so on the CPU the launchers are called directly (lora_linear picks its TMA
kernels only on a Hopper GPU); the interpreter's persistent grid is 3 programs, so each walks
several tiles as on the GPU."""
import pytest
import torch

from lean.kernels import lora_linear_pre as LP
from lean.kernels.lora_linear_pre import _bwd_tma_pre, _fwd_tma_pre, lora_dyb, lora_xa, lora_xa_shared
from lean.reference.lora_linear import lora_linear_grads_ref, lora_linear_ref, matmul_ref
from tests.test_lora_linear import _problem
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]


def _padded(a, b):
    """The zero-padded copies lora_linear_bwd hands kernel 1: a (RP, K), b (O, RP), RP >= 16."""
    R = a.shape[0]
    RP = max(16, 1 << (R - 1).bit_length())
    a_pad = torch.zeros(RP, a.shape[1], device=a.device, dtype=a.dtype)   # (RP, K)
    b_pad = torch.zeros(b.shape[0], RP, device=b.device, dtype=b.dtype)   # (O, RP)
    a_pad[:R].copy_(a)
    b_pad[:, :R].copy_(b)
    return a_pad, b_pad


def _up(t):
    return None if t is None else t.double()


def _check_all(checks):
    """Judge every output before failing, so one report names all the bad ones."""
    errors = []
    for name, out, ref, low in checks:
        try:
            assert_close_rule(out, ref, None if out.dtype == torch.float32 else low, name=name)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,R", [(37, 96, 8), (131, 160, 16), (67, 257, 5)])
def test_lora_xa_dyb(N, K, R, dtype):
    """xa = x A^T and dyb = dy B (here K plays O), rank unpadded (R = 5, 8: masked) and 16."""
    g = fresh_generator()
    x = randn(N, K, g=g, dtype=dtype)
    a = randn(R, K, g=g, dtype=dtype, scale=K ** -0.5)
    b = randn(K, R, g=g, dtype=dtype, scale=R ** -0.5)
    xa = torch.empty(N, R, device=DEVICE, dtype=dtype)                   # (N, R)
    dyb = torch.empty(N, R, device=DEVICE, dtype=dtype)                  # (N, R)
    poison(xa, dyb)
    lora_xa(xa, x, a)
    lora_dyb(dyb, x, b)
    _check_all([("xa", xa, matmul_ref(_up(x), _up(a).t()), matmul_ref(x, a.t())),
                ("dyb", dyb, matmul_ref(_up(x), _up(b)), matmul_ref(x, b))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,R,n", [(37, 96, 8, 2), (131, 160, 16, 3), (67, 257, 5, 3),
                                     pytest.param(8192, 4096, 16, 3, marks=pytest.mark.gpu)])
def test_lora_xa_shared_equals_one_at_a_time(N, K, R, n, dtype):
    """q/k/v (gate/up) share their input: lora_xa_shared's xa from one read of x are the bits
    lora_xa gives each alone."""
    g = fresh_generator()
    x = randn(N, K, g=g, dtype=dtype)
    as_ = [randn(R, K, g=g, dtype=dtype, scale=K ** -0.5) for _ in range(n)]
    shared = [torch.empty(N, R, device=DEVICE, dtype=dtype) for _ in range(n)]      # (N, R) each
    alone = [torch.empty(N, R, device=DEVICE, dtype=dtype) for _ in range(n)]
    poison(*shared, *alone)
    lora_xa_shared(shared, x, as_)
    for i, (xa, a) in enumerate(zip(alone, as_)):
        lora_xa(xa, x, a)
        assert torch.equal(shared[i], xa), f"xa[{i}] differs by {(shared[i] - xa).abs().max().item():.3e}"
    with pytest.raises(ValueError, match="1 to 3"):
        lora_xa_shared([shared[0]] * 4, x, [as_[0]] * 4)
    with pytest.raises(ValueError, match=r"a\[1\]: expected shape"):
        lora_xa_shared(shared[:2], x, [as_[0], as_[1][:, :-1]])


CASES = [  # (N, K, O, R, bias): odd N and O, K with 16-byte rows (TMA); rank 8 padded to 16 for dyb
    (37, 96, 272, 8, True),
    (131, 160, 80, 16, False),
]


def _fwd_checks(N, K, O, R, with_bias, dtype, g, **variant):
    x, w, a, b, bias, _ = _problem(N, K, O, R, dtype, g, with_bias)
    scale = 2.0 if R == 8 else 0.75
    y = torch.empty(N, O, device=DEVICE, dtype=dtype)                    # (N, O)
    xa = torch.empty(N, R, device=DEVICE, dtype=dtype)                   # (N, R)
    poison(y, xa)
    _fwd_tma_pre(y, xa, x, w, a, b, scale, bias, max(16, 1 << (R - 1).bit_length()), **variant)
    y_ref, xa_ref = lora_linear_ref(_up(x), _up(w), _up(a), _up(b), scale, bias=_up(bias))
    y_low, xa_low = lora_linear_ref(x, w, a, b, scale, bias=bias)
    return [("y", y, y_ref, y_low), ("xa", xa, xa_ref, xa_low)]


def _bwd_checks(N, K, O, R, accumulate, dtype, g, **variant):
    x, w, a, b, _, dy = _problem(N, K, O, R, dtype, g, False)
    scale = 2.0 if R == 8 else 0.75
    a_pad, b_pad = _padded(a, b)
    prev = randn(N, K, g=g, dtype=dtype)
    dx = prev.clone() if accumulate else torch.empty(N, K, device=DEVICE, dtype=dtype)   # (N, K)
    dyb = torch.empty(N, a_pad.shape[0], device=DEVICE, dtype=dtype)                     # (N, RP)
    poison(dyb, None if accumulate else dx)
    _bwd_tma_pre(dx, dyb, dy, w, a_pad, b_pad, scale, accumulate, **variant)
    dx_ref = lora_linear_grads_ref(_up(dy), _up(x), _up(w), _up(a), _up(b), scale)[0]
    dx_low = lora_linear_grads_ref(dy, x, w, a, b, scale)[0]
    if accumulate:
        dx_ref, dx_low = dx_ref + _up(prev), dx_low + prev
    return [("dx", dx, dx_ref, dx_low), ("dyb", dyb, matmul_ref(_up(dy), _up(b_pad)), matmul_ref(dy, b_pad))]


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,O,R,with_bias", CASES)
def test_fwd_tma_pre(N, K, O, R, with_bias, dtype, first, monkeypatch):
    """y = x W^T + bias + scale * xa B^T and xa = x A^T, against torch; first: the rank-R term
    before the main loop and TMA stores (LORA_FIRST, 16-bit y), or after it with pointer stores."""
    monkeypatch.setattr(LP, "LORA_FIRST", first)
    _check_all(_fwd_checks(N, K, O, R, with_bias, dtype, fresh_generator()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("N,K,O,R,_", CASES)
def test_bwd_tma_pre(N, K, O, R, _, accumulate, dtype):
    """dx (=, or += onto earlier values) = dy W + scale * dyb A and dyb = dy B (padded), against torch."""
    _check_all(_bwd_checks(N, K, O, R, accumulate, dtype, fresh_generator()))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,O,R,with_bias,accumulate", [(8192, 2048, 8192, 16, False, False),
                                                          (4097, 1024, 3072, 8, True, True)])
def test_tma_pre_gpu_sizes(N, K, O, R, with_bias, accumulate):
    """Llama-3.2-1B gate/up, and an odd-N rank-8 shape (xa's masked 16-byte rows) in bf16 on the
    H100."""
    g = fresh_generator()
    checks = _fwd_checks(N, K, O, R, with_bias, torch.bfloat16, g)
    checks += _bwd_checks(N, K, O, R, accumulate, torch.bfloat16, g)
    _check_all(checks)


def test_lora_xa_dyb_reject_bad_arguments():
    N, K, R = 8, 16, 4
    z = lambda *s, dt=torch.float32: torch.zeros(*s, device=DEVICE, dtype=dt)  # noqa: E731
    x, a, b, xa = z(N, K), z(R, K), z(K, R), z(N, R)
    with pytest.raises(ValueError, match=r"xa: expected shape \(8, 4\)"):
        lora_xa(z(N, R + 1), x, a)
    with pytest.raises(ValueError, match=r"a: expected shape \(\*, 16\)"):
        lora_xa(xa, x, z(R, K + 1))
    with pytest.raises(TypeError, match="a: expected dtype torch.float32"):
        lora_xa(xa, x, a.half())
    with pytest.raises(TypeError, match="dyb: expected dtype torch.float32"):
        lora_dyb(xa.half(), x, b)
    with pytest.raises(ValueError, match="x: expected unit stride in the last dimension"):
        lora_xa(xa, z(K, N).t(), a)
    with pytest.raises(ValueError, match="xa: expected a contiguous tensor"):
        lora_xa(z(R, N).t(), x, a)
    with pytest.raises(ValueError, match="b: expected a contiguous tensor"):
        lora_dyb(xa, x, z(R, K).t())
    with pytest.raises(ValueError, match=r"b: expected shape \(16, \*\)"):
        lora_dyb(xa, x, z(K + 1, R))
    with pytest.raises(ValueError, match="a: expected device"):
        lora_xa(xa, x, a.to("meta"))
    with pytest.raises(ValueError, match="dyb: expected device"):
        lora_dyb(xa.to("meta"), x, b)
    with pytest.raises(ValueError, match="rank R=129 outside"):
        lora_xa(z(N, 129), x, z(129, K))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        lora_xa(xa, x.tolist(), a)


def test_fuse_probe_forms_agree():
    """tools/fuse_probe.py (the stacked q/k/v and gate/up numbers in BENCHMARKS.md) times two forms of
    the same math with lean's launchers: one projection a weight, and one over the stacked weights
    whose LoRA has rank 3R (2R) with a block-diagonal B. Its check must hold with the launchers as
    they are: outputs, dx and the LoRA gradients within the fp32 rule."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import fuse_probe
    for widths in ((48, 16, 16), (40, 40)):
        assert fuse_probe.group(37, 32, widths, 4, torch.float32, DEVICE)[-1]() < 1e-5, widths
