"""lean/kernels/moe_glu.py (GPT-OSS's clamped SwiGLU, forward and the fused backward with the
routing-weight gradient) against lean/reference/moe_glu.py and its autograd."""
import pytest
import torch

from lean.kernels import moe_group
from lean.kernels.moe_glu import moe_glu_bwd, moe_glu_fwd
from lean.reference.moe_glu import moe_glu_bwd_ref, moe_glu_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]
LIMIT, ALPHA = 7.0, 1.702


def _h(P, F, g, dtype):
    """(P, 2F) interleaved gate / up, scale 5 so that both straddle +-limit, with exact +-limit,
    values just inside and outside, and huge ones planted in gates and ups."""
    h = randn(P, 2 * F, g=g, dtype=torch.float32, scale=5.0)
    flat = h.view(-1)
    special = [LIMIT, -LIMIT, LIMIT, -LIMIT, 6.99, 7.01, -7.01, -6.99, 1e3, -1e3, -80.0, 0.0]
    n = min(flat.numel(), 2 * len(special))
    pos = torch.randperm(flat.numel(), generator=g, device=DEVICE)[:n]
    flat[pos] = torch.tensor((special * 2)[:n], device=DEVICE)
    if P and F:
        h[0, 0], h[0, 1] = LIMIT, -LIMIT        # a gate and an up exactly at the boundary, always
        h[-1, 2 * F - 2], h[-1, 2 * F - 1] = LIMIT, LIMIT
    return h.to(dtype)


@pytest.mark.parametrize("P,F", [(1, 1), (7, 37), (33, 131), (5, 2600)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd(dtype, P, F):
    """act against HF's expression; written into a strided view (row stride > F)."""
    gen = fresh_generator()
    h = _h(P, F, gen, dtype)
    base = torch.empty(P, F + 3, device=DEVICE, dtype=dtype)
    poison(base)
    act = base[:, 1:F + 1]
    moe_glu_fwd(act, h, limit=LIMIT, alpha=ALPHA)
    assert_close_rule(act, moe_glu_ref(h.double(), LIMIT, ALPHA), moe_glu_ref(h, LIMIT, ALPHA), name="act")
    assert torch.isnan(base[:, 0]).all() and torch.isnan(base[:, F + 1:]).all(), "wrote outside act"


@pytest.mark.parametrize("launch", ["here", "gpu"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("N,K,F", [(1, 1, 37), (7, 2, 131), (33, 4, 64), (7, 2, 2600)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd(dtype, N, K, F, inplace, launch, monkeypatch):
    """dh and dweights against autograd of the reference (w * <G, glu(h)>), zero gradient where a
    clamp is active and the unclamped one at exactly +-limit (torch.clamp's rule); act is
    moe_glu_fwd's bits; dh written over h. F = 2600 takes two column chunks in the interpreter.
    launch "gpu": the GPU's launch configuration (moe_group.act_bwd_config) under the interpreter too."""
    if launch == "gpu":
        monkeypatch.setattr(moe_group, "_interpreting", lambda: False)
    gen = fresh_generator()
    P = N * K
    order = torch.randperm(P, generator=gen, device=DEVICE).to(torch.int32)
    h = _h(P, F, gen, dtype)
    G = randn(P, F, g=gen, dtype=dtype)
    w = randn(N, K, g=gen, dtype=dtype).abs()
    dh_ref, dw_ref, _ = moe_glu_bwd_ref(G.double(), h.double(), w.double(), order, LIMIT, ALPHA)
    dh_low, _, _ = moe_glu_bwd_ref(G, h, w, order, LIMIT, ALPHA)
    a_fwd = torch.empty(P, F, device=DEVICE, dtype=dtype)
    moe_glu_fwd(a_fwd, h, limit=LIMIT, alpha=ALPHA)
    hin = h.clone()
    dh = hin if inplace else torch.empty_like(h)
    dw, act = torch.empty(N, K, device=DEVICE), torch.empty(P, F, device=DEVICE, dtype=dtype)
    poison(dw, act, None if inplace else dh)
    moe_glu_bwd(dh, dw, G, hin, w, order, limit=LIMIT, alpha=ALPHA, act=act)
    assert torch.equal(act, a_fwd), "act differs from moe_glu_fwd's bits"
    assert_close_rule(dh, dh_ref, dh_low, name="dh")
    clamped = torch.cat([(h[:, 0::2] > LIMIT)[..., None], (h[:, 1::2].abs() > LIMIT)[..., None]], -1).view(P, 2 * F)
    assert (dh[clamped] == 0).all(), "gradient through an active clamp"
    at = (h.abs() == LIMIT) & ~clamped & (G.repeat_interleave(2, 1) != 0)
    assert (dh[at] != 0).any() or not at.any(), "gradient stopped at exactly +-limit"
    # dweights is <G, act> with act as the forward rounds it (by design, not HF's stepwise act): an
    # fp32 sum of F products, against fp64 on those bits. Its error bound is the fp32 dot product's,
    # (F + 1) u sum|G act| with u = 2^-24 (products exact for 16-bit inputs, rounded once for fp32),
    # not 1e-5 of the result: at F = 37 the terms can cancel to a result far smaller than their sum.
    # fp32 inputs are also compared against autograd, adding what act's own rounding (test_fwd bounds
    # it) carries into the dot: sum |G| |act - act_exact|.
    exact = torch.empty(P, dtype=torch.float64, device=DEVICE)
    exact[order.long()] = (G.double() * a_fwd.double()).sum(1)
    dot_bound = (F + 1) * 2.0 ** -24 * (G.double() * a_fwd.double()).abs().sum(1).max().item()
    assert_close_rule(dw, exact.view(N, K), atol=dot_bound, rtol32=0.0, name="dweights (<G, act>)")
    if dtype == torch.float32:
        act_err = (G.double().abs() * (a_fwd.double() - moe_glu_ref(h.double(), LIMIT, ALPHA)).abs()).sum(1).max().item()
        assert_close_rule(dw, dw_ref, atol=dot_bound + act_err, name="dweights")


def test_rejects_bad_arguments():
    h = torch.randn(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="interleaved"):
        moe_glu_fwd(torch.empty(6, 3, device=DEVICE), torch.randn(6, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"act: expected shape \(6, 4\)"):
        moe_glu_fwd(torch.empty(6, 5, device=DEVICE), h)
    w = torch.rand(3, 2, device=DEVICE)
    order = torch.arange(6, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="dweights: expected dtype torch.float32"):
        moe_glu_bwd(h, w.half(), torch.randn(6, 4, device=DEVICE), h, w, order)
    with pytest.raises(ValueError, match="weights: expected N \\* K = P = 6"):
        moe_glu_bwd(h, torch.empty(2, 2, device=DEVICE), torch.randn(6, 4, device=DEVICE), h, w[:2], order)


@pytest.mark.gpu
def test_fwd_bwd_gpu_gptoss_20b():
    """bf16 at gpt-oss-20b's expert shapes (8192 tokens, top-4, F 2880): act and dh by the rule,
    dweights tight against the fp64 dot of G with the kernel's act."""
    gen = fresh_generator()
    N, K, F, dtype = 8192, 4, 2880, torch.bfloat16
    P = N * K
    order = torch.randperm(P, generator=gen, device=DEVICE).to(torch.int32)
    h, G = _h(P, F, gen, dtype), randn(P, F, g=gen, dtype=dtype)
    w = randn(N, K, g=gen, dtype=dtype).abs()
    act = torch.empty(P, F, device=DEVICE, dtype=dtype)
    moe_glu_fwd(act, h, limit=LIMIT, alpha=ALPHA)
    h64 = h.double()
    assert_close_rule(act, moe_glu_ref(h64, LIMIT, ALPHA), moe_glu_ref(h, LIMIT, ALPHA), name="act")
    dh, dw = torch.empty_like(h), torch.empty(N, K, device=DEVICE)
    moe_glu_bwd(dh, dw, G, h, w, order, limit=LIMIT, alpha=ALPHA)
    dh_ref, _, _ = moe_glu_bwd_ref(G.double(), h64, w.double(), order, LIMIT, ALPHA)
    dh_low, _, _ = moe_glu_bwd_ref(G, h, w, order, LIMIT, ALPHA)
    assert_close_rule(dh, dh_ref, dh_low, name="dh")
    exact = torch.empty(P, dtype=torch.float64, device=DEVICE)
    exact[order.long()] = (G.double() * act.double()).sum(1)
    assert_close_rule(dw, exact.view(N, K), name="dweights (<G, act>)")
