"""lean/kernels/moe_route.py and lean/kernels/moe_group.py against lean/reference/moe_route.py,
and the references against transformers' own Qwen3-MoE / GPT-OSS router and aux loss."""
import types

import pytest
import torch

from lean.kernels import moe_group
from lean.kernels.moe_group import group_slots, moe_act_bwd, moe_combine
from lean.kernels.moe_route import moe_aux, route_topk_bwd, route_topk_fwd
from lean.kernels.swiglu import swiglu_fwd
from lean.reference.rule import close_rule
from lean.reference.moe_route import (group_slots_ref, moe_act_bwd_ref, moe_aux_ref, moe_combine_ref,
                                      route_topk_bwd_ref, route_topk_ref)
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]
NS = [1, 33]
EKS = [(4, 1), (4, 4), (8, 2), (12, 4), (12, 12), (128, 4)]
CASES = [(N, E, K) for N in NS for E, K in EKS] + [(33, 128, 128)]   # (N, E, K); K = E = 128 once (slow)
# (norm_topk, softmax_first): Qwen3-MoE with and without renormalisation, GPT-OSS (norm ignored)
MODES = [(True, True), (False, True), (False, False)]


def _logits(N, E, g, dtype, grid=2.0**-10, scale=2.0):
    """Random logits on a grid: values are equal (a tie, broken by expert id) or at least `grid`
    apart, so the kernel's and torch's fp32 softmax (which may differ by an ulp) rank them alike."""
    x = torch.randn(N, E, generator=g, device=DEVICE) * scale
    return (torch.round(x / grid) * grid).to(dtype)


def _route(logits, K, norm, first, dtype=None, prob_sum=None):
    N = logits.shape[0]
    w = torch.empty(N, K, device=DEVICE, dtype=dtype or logits.dtype)
    e = torch.empty(N, K, device=DEVICE, dtype=torch.int32)
    poison(w, e)
    route_topk_fwd(w, e, logits, norm_topk=norm, softmax_first=first, prob_sum=prob_sum)
    return w, e


def _check_route(logits, K, norm, first, prob_sum0=None):
    ps = None if prob_sum0 is None else prob_sum0.clone()
    w, e = _route(logits, K, norm, first, prob_sum=ps)
    w_low, e_ref, _ = route_topk_ref(logits, K, norm_topk=norm, softmax_first=first)
    w64, e64, p64 = route_topk_ref(logits.double(), K, norm_topk=norm, softmax_first=first)
    assert torch.equal(e, e_ref) and torch.equal(e_ref, e64), f"experts differ in {(e != e_ref).sum().item()} slots"
    assert_close_rule(w, w64, w_low, name="weights")
    if ps is not None:
        assert_close_rule(ps, prob_sum0.double() + p64.sum(0), name="prob_sum")
    return w, e


@pytest.mark.parametrize("norm,first", MODES)
@pytest.mark.parametrize("N,E,K", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_fwd(dtype, N, E, K, norm, first):
    """Experts exactly torch's (topk order, ties to the lower id), weights by the rule, prob_sum +=."""
    gen = fresh_generator()
    _check_route(_logits(N, E, gen, dtype), K, norm, first, randn(E, g=gen).abs())


@pytest.mark.parametrize("norm,first", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_fwd_ties_and_extremes(dtype, norm, first):
    """Integer logits (ties everywhere); a row of equal logits; one expert far above the rest in
    every row (it takes every token) and one far below (it gets none)."""
    gen = fresh_generator()
    N, E, K = 33, 12, 4
    x = torch.randint(-2, 3, (N, E), generator=gen, device=DEVICE).to(dtype)
    x[0] = 1.0
    _check_route(x, K, norm, first, torch.zeros(E, device=DEVICE))
    x = _logits(N, E, gen, dtype)
    x[:, 5], x[:, 2] = 30.0, -30.0
    _, e = _check_route(x, K, norm, first)
    assert (e[:, 0] == 5).all() and not (e == 2).any()


def test_prob_sum_deterministic():
    """prob_sum is the same bits on every call (several programs and partials under the interpreter)."""
    gen = fresh_generator()
    x = _logits(33, 128, gen, torch.float32, grid=2.0**-20)
    outs = []
    for _ in range(3):
        ps = torch.full((128,), 0.25, device=DEVICE)
        _route(x, 8, True, True, prob_sum=ps)
        outs.append(ps)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("norm,first", MODES)
@pytest.mark.parametrize("E,K", [(4, 1), (8, 2), (12, 4), (12, 12), (128, 8)])
@pytest.mark.parametrize("N", [1, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_bwd(dtype, N, E, K, norm, first, aux):
    """dlogits against autograd through the reference's weights (renormalisation included) and,
    with aux, the aux gradient on every token's probs."""
    gen = fresh_generator()
    x = _logits(N, E, gen, dtype)
    _, e = _route(x, K, norm, first)
    dw = randn(N, K, g=gen)
    ag = randn(E, g=gen, scale=0.1) if aux else None
    dl = torch.empty(N, E, device=DEVICE, dtype=dtype)
    poison(dl)
    route_topk_bwd(dl, dw, x, e, norm_topk=norm, softmax_first=first, aux_grad=ag)
    ref = route_topk_bwd_ref(dw.double(), x.double(), e, norm_topk=norm, softmax_first=first,
                             aux_grad=None if ag is None else ag.double())
    low = route_topk_bwd_ref(dw, x, e, norm_topk=norm, softmax_first=first, aux_grad=ag)
    assert_close_rule(dl, ref, low, atol=1e-6, name="dlogits")


def _hf_config(E, K, C, norm):
    return types.SimpleNamespace(num_experts_per_tok=K, num_experts=E, num_local_experts=E, norm_topk_prob=norm,
                                 hidden_size=C)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_matches_hf(dtype, norm):
    """The reference is transformers' Qwen3MoeTopKRouter (and GptOssTopKRouter) bit for bit; the
    kernel chooses the same experts and its weights pass the rule."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    gen = fresh_generator()
    N, E, K, C = 33, 128, 8, 64
    hs = randn(N, C, g=gen, dtype=dtype)
    for cls, first in ((Qwen3MoeTopKRouter, True), (GptOssTopKRouter, False)):
        router = cls(_hf_config(E, K, C, norm)).to(DEVICE)
        with torch.no_grad():
            router.weight.copy_(randn(E, C, g=gen, scale=0.3))
            if hasattr(router, "bias"):
                router.bias.copy_(randn(E, g=gen, scale=0.1))
        router = router.to(dtype)
        with torch.no_grad():
            logits, scores, idx = router(hs)
        w_ref, e_ref, probs = route_topk_ref(logits, K, norm_topk=norm, softmax_first=first)
        assert torch.equal(w_ref, scores), cls.__name__
        # torch.topk orders equal values as it likes (fp16 logits tie often): the same experts
        # wherever the K+1 largest scores are distinct, the same score at every slot elsewhere
        score = probs if first else logits.float()
        top = torch.sort(score, dim=1, descending=True).values[:, :K + 1]
        distinct = (top[:, 1:] != top[:, :-1]).all(dim=1)
        assert torch.equal(e_ref.long()[distinct], idx[distinct]), cls.__name__
        assert torch.equal(score.gather(1, e_ref.long()), score.gather(1, idx)), cls.__name__
        _check_route(logits, K, norm, first)


@pytest.mark.parametrize("scale_tensor", [False, True])
def test_aux_matches_hf(scale_tensor):
    """moe_aux over L layers (counts from group_slots, prob_sum from route_topk_fwd) equals HF's
    load_balancing_loss_func, and route_topk_bwd with aux_grad equals autograd of scale * that loss."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    gen = fresh_generator()
    L, N, E, K, scale = 3, 33, 12, 4, 0.37
    xs = [_logits(N, E, gen, torch.float32, grid=2.0**-20) for _ in range(L)]
    counts, prob_sum = torch.zeros(E, device=DEVICE), torch.zeros(E, device=DEVICE)
    experts = []
    for x in xs:
        _, e = _route(x, K, True, True, prob_sum=prob_sum)
        group_slots(*(torch.empty(N * K, dtype=torch.int32, device=DEVICE) for _ in range(2)),
                    torch.empty(E + 1, dtype=torch.int32, device=DEVICE), e, counts=counts)
        experts.append(e)
    aux, aux_grad = torch.empty(1, device=DEVICE), torch.empty(E, device=DEVICE)
    poison(aux, aux_grad)
    moe_aux(aux, aux_grad, counts, prob_sum, L * N,
            torch.tensor([scale], device=DEVICE) if scale_tensor else scale)
    leaves = tuple(x.clone().requires_grad_(True) for x in xs)
    hf = load_balancing_loss_func(leaves, E, K)
    assert_close_rule(aux, hf.detach().reshape(1), name="aux")
    aux_ref, grad_ref = moe_aux_ref(counts.double(), prob_sum.double(), L * N, E, scale)
    assert_close_rule(aux, aux_ref, name="aux vs reference")
    assert_close_rule(aux_grad, grad_ref, name="aux_grad")
    loss, aux_grad2 = torch.tensor([1.5, 7.0], device=DEVICE), torch.empty(E, device=DEVICE)
    moe_aux(aux, aux_grad2, counts, prob_sum, L * N, scale, alpha=2.5, loss=loss)  # the step's use
    assert_close_rule(loss, torch.tensor([1.5, 7.0], dtype=torch.float64) + torch.tensor([2.5, 0.0]) * hf.item(),
                      name="loss += alpha * aux")
    assert_close_rule(aux_grad2, 2.5 * grad_ref, name="aux_grad with alpha")
    grads = torch.autograd.grad(scale * hf, leaves)
    for x, e, gref in zip(xs, experts, grads):
        dl = torch.empty_like(x)
        route_topk_bwd(dl, torch.zeros(N, K, device=DEVICE), x, e, norm_topk=True, aux_grad=aux_grad)
        assert_close_rule(dl, gref, atol=1e-7, name="dlogits of the aux loss")


def _experts(kind, N, E, K, g):
    """(N, K) int32 expert ids: a routing (distinct per row, expert 1 never chosen when K < E), or
    every slot to one expert."""
    if kind == "one":
        return torch.full((N, K), E - 1, dtype=torch.int32, device=DEVICE)
    score = torch.rand(N, E, generator=g, device=DEVICE)
    if K < E:
        score[:, 1] = -1.0
    return torch.sort(score, dim=1, descending=True).indices[:, :K].to(torch.int32).contiguous()


@pytest.mark.parametrize("kind", ["route", "one"])
@pytest.mark.parametrize("E,K", [(4, 1), (4, 4), (12, 4), (128, 4), (128, 128)])
@pytest.mark.parametrize("N", NS)
def test_group_slots(N, E, K, kind):
    """order, slot_pos, offsets exactly the stable sort's; counts += exactly."""
    gen = fresh_generator()
    e = _experts(kind, N, E, K, gen)
    order, slot_pos = (torch.empty(N * K, dtype=torch.int32, device=DEVICE) for _ in range(2))
    offsets = torch.empty(E + 1, dtype=torch.int32, device=DEVICE)
    poison(order, slot_pos, offsets)
    counts = torch.full((E,), 3.0, device=DEVICE)
    group_slots(order, slot_pos, offsets, e, counts=counts)
    o_ref, s_ref, off_ref, c_ref = group_slots_ref(e, E)
    assert torch.equal(offsets, off_ref), (offsets, off_ref)
    assert torch.equal(order, o_ref) and torch.equal(slot_pos, s_ref)
    assert torch.equal(counts, c_ref + 3.0)
    if K < E:
        assert offsets[1] == offsets[2], "expert 1 got slots"


def _combine_inputs(N, K, C, dtype, g):
    E = max(K, 4)
    _, slot_pos, _, _ = group_slots_ref(_experts("route", N, E, K, g), E)
    return randn(N * K, C, g=g, dtype=dtype), slot_pos, randn(N, K, g=g, dtype=dtype).abs()


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("N,K,C", [(1, 1, 37), (7, 2, 300), (33, 4, 37), (33, 8, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine(dtype, N, K, C, weighted, accumulate):
    gen = fresh_generator()
    ys, slot_pos, w = _combine_inputs(N, K, C, dtype, gen)
    w = w if weighted else None
    out0 = randn(N, C, g=gen, dtype=dtype)
    out = out0.clone() if accumulate else torch.empty_like(out0)
    if not accumulate:
        poison(out)
    moe_combine(out, ys, slot_pos, w, accumulate=accumulate)
    acc0 = out0 if accumulate else None
    ref = moe_combine_ref(ys.double(), slot_pos, N, None if w is None else w.double(),
                          None if acc0 is None else acc0.double())
    assert_close_rule(out, ref, moe_combine_ref(ys, slot_pos, N, w, acc0), name="out")


@pytest.mark.parametrize("launch", ["here", "gpu"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("N,K,F", [(1, 1, 37), (7, 2, 131), (33, 4, 64), (7, 2, 2600)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_bwd(dtype, N, K, F, inplace, launch, monkeypatch):
    """dh and dweights against autograd of the reference (w * <G, swiglu(h)>); act is swiglu_fwd's
    bits; dh written over h. F = 2600 takes two column chunks under the interpreter.
    launch "gpu": the GPU's launch configuration (moe_group.act_bwd_config) under the interpreter too."""
    if launch == "gpu":
        monkeypatch.setattr(moe_group, "_interpreting", lambda: False)
    gen = fresh_generator()
    E = max(K, 4)
    order, _, _, _ = group_slots_ref(_experts("route", N, E, K, gen), E)
    P = N * K
    h = randn(P, 2 * F, g=gen, dtype=dtype, scale=2.0)
    h[0, 0] = -80.0
    G = randn(P, F, g=gen, dtype=dtype)
    w = randn(N, K, g=gen, dtype=dtype).abs()
    dh_ref, dw_ref, _ = moe_act_bwd_ref(G.double(), h.double(), w.double(), order)
    dh_low, dw_low, _ = moe_act_bwd_ref(G, h, w, order)
    a_fwd = torch.empty(P, F, device=DEVICE, dtype=dtype)
    swiglu_fwd(a_fwd, h[:, :F], h[:, F:])
    hin = h.clone()
    dh = hin if inplace else torch.empty_like(h)
    dw, act = torch.empty(N, K, device=DEVICE), torch.empty(P, F, device=DEVICE, dtype=dtype)
    poison(dw, act, None if inplace else dh)
    moe_act_bwd(dh, dw, G, hin, w, order, act=act)
    assert torch.equal(act, a_fwd), "act differs from swiglu_fwd's bits"
    assert_close_rule(dh, dh_ref, dh_low, name="dh")
    # dweights are fp32 sums of G times act rounded once to the 16-bit dtype: besides 2x torch's own
    # error (a single short dot, as at N = K = 1, can land near zero by cancellation), allow the
    # rounding of act itself, eps/2 * sum |G act| per row (an exact bound, not a fudge factor)
    _, _, act_ref = moe_act_bwd_ref(G.double(), h.double(), w.double(), order)
    atol = torch.finfo(dtype).eps / 2 * (G.double().abs() * act_ref.abs()).sum(1).max().item() if dtype != torch.float32 else 0.0
    v = close_rule(dw, dw_ref, dw_low, by_lowp=dtype != torch.float32, atol=atol, name="dweights")
    assert v.ok, v.text


def test_rejects_bad_arguments():
    x = torch.randn(7, 12, device=DEVICE)
    w, e = torch.empty(7, 4, device=DEVICE), torch.empty(7, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="experts: expected dtype torch.int32"):
        route_topk_fwd(w, e.long(), x, norm_topk=True)
    with pytest.raises(ValueError, match=r"E = 300 experts"):
        route_topk_fwd(w, e, torch.randn(7, 300, device=DEVICE), norm_topk=True)
    with pytest.raises(ValueError, match=r"K = 13 experts per token"):
        route_topk_fwd(torch.empty(7, 13, device=DEVICE), torch.empty(7, 13, dtype=torch.int32, device=DEVICE), x,
                       norm_topk=True)
    with pytest.raises(ValueError, match=r"prob_sum: expected shape \(12\)"):
        route_topk_fwd(w, e, x, norm_topk=True, prob_sum=torch.zeros(11, device=DEVICE))
    with pytest.raises(TypeError, match="dweights: expected dtype torch.float32"):
        route_topk_bwd(torch.empty_like(x), w.half(), x, e, norm_topk=True)
    order = torch.empty(28, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_pos: expected shape \(28\)"):
        group_slots(order, order[:27], torch.empty(13, dtype=torch.int32, device=DEVICE), e)
    with pytest.raises(ValueError, match="not a multiple of N = 5"):
        moe_combine(torch.empty(5, 8, device=DEVICE), torch.empty(28, 8, device=DEVICE), order)
    with pytest.raises(ValueError, match="h: expected"):
        moe_act_bwd(torch.empty(28, 7, device=DEVICE), w, torch.empty(28, 3, device=DEVICE),
                    torch.empty(28, 7, device=DEVICE), w, order)


# ------------------------------------------------------------------------------ GPU: bf16, big sizes

@pytest.mark.gpu
@pytest.mark.parametrize("norm,first", MODES)
@pytest.mark.parametrize("N,E,K", [(65536, 128, 8), (4099, 256, 8), (4099, 256, 256)])
def test_route_gpu(N, E, K, norm, first):
    gen = fresh_generator()
    x = _logits(N, E, gen, torch.bfloat16)
    _check_route(x, K, norm, first, torch.zeros(E, device=DEVICE))
    ps = [torch.zeros(E, device=DEVICE) for _ in range(2)]
    for p in ps:
        _route(x, K, norm, first, prob_sum=p)
    assert torch.equal(ps[0], ps[1]), "prob_sum is not deterministic"
    _, e = _route(x, K, norm, first)
    dw, ag = randn(N, K, g=gen), randn(E, g=gen, scale=0.1)
    dl = torch.empty_like(x)
    route_topk_bwd(dl, dw, x, e, norm_topk=norm, softmax_first=first, aux_grad=ag)
    ref = route_topk_bwd_ref(dw.double(), x.double(), e, norm_topk=norm, softmax_first=first, aux_grad=ag.double())
    low = route_topk_bwd_ref(dw, x, e, norm_topk=norm, softmax_first=first, aux_grad=ag)
    assert_close_rule(dl, ref, low, atol=1e-6, name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("N,E,K", [(65536, 128, 8), (65536, 256, 8), (4099, 256, 256)])
def test_group_slots_gpu(N, E, K):
    gen = fresh_generator()
    e = _experts("route", N, E, K, gen)
    order, slot_pos = (torch.empty(N * K, dtype=torch.int32, device=DEVICE) for _ in range(2))
    offsets, counts = torch.empty(E + 1, dtype=torch.int32, device=DEVICE), torch.zeros(E, device=DEVICE)
    group_slots(order, slot_pos, offsets, e, counts=counts)
    o_ref, s_ref, off_ref, c_ref = group_slots_ref(e, E)
    assert torch.equal(offsets, off_ref) and torch.equal(order, o_ref) and torch.equal(slot_pos, s_ref)
    assert torch.equal(counts, c_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,C,F", [(8192, 8, 2048, 768), (2053, 4, 2880, 2880)])
def test_combine_act_bwd_gpu(N, K, C, F):
    gen = fresh_generator()
    dtype = torch.bfloat16
    ys, slot_pos, w = _combine_inputs(N, K, C, dtype, gen)
    out0 = randn(N, C, g=gen, dtype=dtype)
    out = out0.clone()
    moe_combine(out, ys, slot_pos, w, accumulate=True)
    assert_close_rule(out, moe_combine_ref(ys.double(), slot_pos, N, w.double(), out0.double()),
                      moe_combine_ref(ys, slot_pos, N, w, out0), name="out")
    order = torch.empty_like(slot_pos)
    order[slot_pos.long()] = torch.arange(N * K, device=DEVICE, dtype=torch.int32)
    h = randn(N * K, 2 * F, g=gen, dtype=dtype, scale=2.0)
    G = randn(N * K, F, g=gen, dtype=dtype)
    dh, dw = torch.empty_like(h), torch.empty(N, K, device=DEVICE)
    moe_act_bwd(dh, dw, G, h, w, order)
    dh_ref, dw_ref, _ = moe_act_bwd_ref(G.double(), h.double(), w.double(), order)
    dh_low, dw_low, _ = moe_act_bwd_ref(G, h, w, order)
    assert_close_rule(dh, dh_ref, dh_low, name="dh")
    v = close_rule(dw, dw_ref, dw_low, by_lowp=True, name="dweights")
    assert v.ok, v.text
