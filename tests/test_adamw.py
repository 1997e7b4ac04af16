"""lean/kernels/adamw.py against torch.optim.AdamW (+ clip_grad_norm_), 5 steps per case."""
import pytest
import torch

from lean.kernels.adamw import adamw_step
from lean.reference.adamw import AdamWRef
from tests.util import DEVICE, LOWP, ON_GPU, assert_close_rule, fresh_generator, poison, randn

BETAS = dict(beta1=0.9, beta2=0.999, eps=1e-8)
EPS32 = torch.finfo(torch.float32).eps


def _grads_and_clip(P, gdtype, clip, steps, g):
    """Fresh grads for every step and a max_grad_norm that clips on every step ("active"), on
    none ("inactive", above every norm) or None (clipping off)."""
    grads = [randn(P, g=g, dtype=gdtype) for _ in range(steps)]  # (P,) each
    norms = [torch.linalg.vector_norm(x.double()).item() for x in grads]
    max_grad_norm = {"off": None, "active": 0.3 * min(norms), "inactive": 2.0 * max(norms)}[clip]
    return grads, max_grad_norm


def _check_steps(P, gdtype, weight_decay, clip, lrs, g, lowp=True, params_scale=1.0, betas=BETAS):
    params0 = randn(P, g=g, scale=params_scale)  # (P,) fp32 master weights
    grads, max_grad_norm = _grads_and_clip(P, gdtype, clip, len(lrs), g)
    hp = dict(betas, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    ref = AdamWRef(params0, **hp)

    params = params0.clone()
    m = torch.zeros(P, device=DEVICE)  # (P,)
    v = torch.zeros(P, device=DEVICE)  # (P,)
    grad_norm = torch.empty(1, device=DEVICE)  # (1,)
    params_lowp = torch.empty(P, dtype=LOWP, device=DEVICE) if lowp else None  # (P,)
    hyper = torch.empty(2, device=DEVICE)  # (2,) [lr, t], rewritten in place like a graph replay
    term_scale = 0.0  # max |clipped grad| so far
    for t, (lr, grad) in enumerate(zip(lrs, grads), start=1):
        hyper.copy_(torch.tensor([lr, t], dtype=torch.float32))
        poison(grad_norm, params_lowp)
        adamw_step(params, m, v, grad_norm, grad, hyper, **hp, params_lowp=params_lowp)
        ref_norm = ref.step(grad, lr)

        assert_close_rule(grad_norm, ref_norm, name=f"grad_norm t={t}")
        # m sums signed terms (1 - b1) b1^(t-i) g_i that can cancel (P = 1, clipped: -0.73 + 0.81
        # + 0.90 - 1.00), so its rounding scales with the terms it summed, max|g_i|, not with |m|.
        term_scale = max(term_scale, ref.p.grad.abs().max().item())
        assert_close_rule(m, ref.m, atol=1e-5 * term_scale, name=f"m t={t}")
        assert_close_rule(v, ref.v, name=f"v t={t}")
        # Each side rounds p once per step (<= 1 ulp of max|p| each), which bounds the difference
        # of the two paths over t steps: params that pass near zero (P = 1, small p0) end far
        # smaller than that, so the bound scales with what p held, not with |p_t|.
        scale = params0.abs().max().item() + sum(lrs[:t])
        assert_close_rule(params, ref.p, atol=2 * t * EPS32 * scale, name=f"params t={t}")
        # The update itself, much smaller than params, under the same bound.
        assert_close_rule(params - params0, ref.p - params0, atol=2 * t * EPS32 * scale,
                          name=f"update t={t}")
        if lowp:
            assert torch.equal(params_lowp, params.to(LOWP)), f"params_lowp != params cast, t={t}"


SIZES = [1, 37, 1024, 10007, pytest.param(2**24 + 4099, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("P", SIZES)
@pytest.mark.parametrize("gdtype", [torch.float32, LOWP], ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("clip", ["off", "active", "inactive"])
def test_adamw_matches_torch(P, gdtype, weight_decay, clip):
    g = fresh_generator()
    _check_steps(P, gdtype, weight_decay, clip, [1e-2] * 5, g)


@pytest.mark.parametrize("P", [10007, pytest.param(2**24 + 4099, marks=pytest.mark.gpu)])
def test_adamw_lr_schedule_through_hyper(P):
    """New [lr, t] written into the same hyper tensor take effect on the next call; lr = 0 leaves
    params alone while the moments still move. No params_lowp: the plain path."""
    g = fresh_generator()
    _check_steps(P, LOWP, 0.1, "active", [1e-2, 3e-3, 0.0, 2e-2, 5e-4], g, lowp=False)


@pytest.mark.parametrize("beta2", [0.999, 0.99999])
def test_adamw_bias_correction_precision(beta2):
    """Params start at 0, so they ARE the update and the fp32 rule applies to it alone: a bias
    correction 1 - b2^t computed naively in fp32 (1e-4 off for b2 = 0.99999) fails here."""
    g = fresh_generator()
    betas = dict(beta1=0.95, beta2=beta2, eps=1e-8)
    _check_steps(37, torch.float32, 0.0, "off", [1e-2] * 5, g, params_scale=0.0, betas=betas)


@pytest.mark.parametrize("P", [10007, pytest.param(2**24 + 4099, marks=pytest.mark.gpu)])
def test_adamw_deterministic(P):
    """Two runs on the same inputs agree bit for bit, with and without params_lowp."""
    g = fresh_generator()
    params0 = randn(P, g=g)
    grads, max_grad_norm = _grads_and_clip(P, LOWP, "active", 3, g)
    runs = []
    for lowp in (True, False):
        params, m, v = params0.clone(), torch.zeros(P, device=DEVICE), torch.zeros(P, device=DEVICE)
        grad_norm, hyper = torch.empty(1, device=DEVICE), torch.empty(2, device=DEVICE)
        params_lowp = torch.empty(P, dtype=LOWP, device=DEVICE) if lowp else None
        for t, grad in enumerate(grads, start=1):
            hyper.copy_(torch.tensor([1e-2, t], dtype=torch.float32))
            adamw_step(params, m, v, grad_norm, grad, hyper, **BETAS, weight_decay=0.1,
                       max_grad_norm=max_grad_norm, params_lowp=params_lowp)
        runs.append((params, m, v, grad_norm))
    for name, a, b in zip(("params", "m", "v", "grad_norm"), *runs):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def _valid_args(P=37):
    f32 = dict(dtype=torch.float32, device=DEVICE)
    return dict(params=torch.zeros(P, **f32), m=torch.zeros(P, **f32), v=torch.zeros(P, **f32),
                grad_norm=torch.zeros(1, **f32), grads=torch.zeros(P, dtype=LOWP, device=DEVICE),
                hyper=torch.tensor([1e-3, 1.0], **f32))


OTHER_DEVICE = "cpu" if ON_GPU else "meta"  # on the GPU: hyper left on the host
BAD = [
    ("params", lambda a: a["params"].half(), TypeError, "params: expected dtype torch.float32"),
    ("params", lambda a: a["params"].reshape(1, -1), ValueError, "params: expected shape"),
    ("m", lambda a: a["m"][:-1], ValueError, r"m: expected shape \(37\)"),
    ("v", lambda a: a["v"].double(), TypeError, "v: expected dtype"),
    ("grad_norm", lambda a: torch.zeros(2, device=DEVICE), ValueError, "grad_norm: expected shape"),
    ("grads", lambda a: a["grads"].int(), TypeError, "grads: expected dtype"),
    ("grads", lambda a: torch.zeros(74, device=DEVICE)[::2], ValueError, "grads: expected a con"),
    ("hyper", lambda a: a["hyper"].to(OTHER_DEVICE), ValueError, "hyper: expected device"),
    ("hyper", lambda a: a["hyper"].double(), TypeError, "hyper: expected dtype torch.float32"),
    ("hyper", lambda a: torch.zeros(3, device=DEVICE), ValueError, r"hyper: expected shape \(2\)"),
    ("params_lowp", lambda a: torch.zeros(37, dtype=torch.float64, device=DEVICE), TypeError, "params_lowp: expect"),
    ("m", lambda a: a["params"], ValueError, "distinct buffers"),
]


@pytest.mark.parametrize("name,make,exc,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_adamw_rejects_bad_tensors(name, make, exc, match):
    args = _valid_args()
    args[name] = make(args)
    with pytest.raises(exc, match=match):
        adamw_step(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta1=1.0), "beta1"), (dict(beta2=-0.1), "beta2"), (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(max_grad_norm=0.0), "max_grad_norm"),
])
def test_adamw_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adamw_step(**_valid_args(), **kwargs)


@pytest.mark.parametrize("P,match", [(0, "at least one element"), (2**31 - 2**16, "too large")])
def test_adamw_rejects_bad_sizes(P, match):
    # meta tensors: the size check runs before anything touches memory.
    args = {k: torch.empty(P if t.shape[0] == 37 else t.shape[0], dtype=t.dtype, device="meta")
            for k, t in _valid_args().items()}
    with pytest.raises(ValueError, match=match):
        adamw_step(**args)
