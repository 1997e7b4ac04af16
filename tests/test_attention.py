"""Varlen causal flash attention (lean/kernels/attention.py) against (a) a padded per-document
reference and (b) torch SDPA run on each document alone, both in fp64 with autograd gradients.

fp32 outputs meet the tight rule against both; fp16 (CPU) / bf16 (GPU) outputs meet the
tolerance rule with SDPA per document in that low dtype as torch's own error; 16-bit dq / dk
against the fp64 gradient at the rounded o the backward is given (see _check_case). lse is fp32 in
every case and meets the tight rule.
"""
import itertools

import pytest
import torch
import triton

import lean.kernels.attention as attention_module
import lean.kernels.attention_config as attention_config
from lean.kernels.attention import attention_bwd, attention_fwd
from lean.reference.attention import attention_ref, attention_sdpa
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

# Triton 3.6's interpreter turns the 1-element program-id arrays behind data-dependent loop
# bounds into ints through a deprecated numpy path (thousands of warnings, harmless below numpy 2.4).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# (lengths, H, KVH, D, input magnitude). Lengths None: drawn per run (see _lengths).
CPU_CASES = {
    "mixed_len0_len1": ([37, 1, 64, 13, 0, 50, 1, 31], 4, 2, 32, 1.0),
    "one_long_large_scores": ([131], 2, 1, 64, 3.0),      # |s| up to ~50: softmax stability
    "30_docs": (("random", 30, 12), 2, 2, 32, 1.0),
    "gqa4_d80_padded": ([67, 45, 3], 4, 1, 80, 1.0),
    "gqa8": ([29, 40], 8, 1, 32, 1.0),
}
GPU_CASES = {
    "100_docs_d64": (("exponential", 100, 40), 8, 8, 64, 1.0),
    "d80_gqa2": ([300, 1, 177, 64, 513], 8, 4, 80, 1.0),
    "d96_gqa4": ([257, 31, 1, 400], 8, 2, 96, 1.0),
    "one_2048_doc_d128": ([2048], 16, 8, 128, 1.0),
    "200_docs_d128_gqa8": (("exponential", 200, 20), 16, 2, 128, 1.0),
    "d256": ([300, 1, 129], 4, 1, 256, 1.0),
}


def _lengths(spec, g):
    if isinstance(spec, list):
        return spec
    kind, count, size = spec
    if kind == "random":                                   # uniform in 1..size
        return torch.randint(1, size + 1, (count,), generator=g, device=g.device).tolist()
    u = torch.rand(count, generator=g, device=g.device)    # exponential with mean `size`, >= 1
    return (-size * torch.log1p(-u)).ceil().clamp(min=1).long().tolist()


def _inputs(lengths, H, KVH, D, dtype, g, mag=1.0, fused=False):
    N = sum(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=DEVICE)
    if fused:   # q, k, v as head slices of one (N, H + 2 KVH, D) projection output
        qkv = randn(N, H + 2 * KVH, D, g=g, dtype=dtype, scale=mag)
        q, k, v = qkv[:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
    else:
        q = randn(N, H, D, g=g, dtype=dtype, scale=mag)
        k = randn(N, KVH, D, g=g, dtype=dtype, scale=mag)
        v = randn(N, KVH, D, g=g, dtype=dtype)
    do = randn(N, H, D, g=g, dtype=dtype)
    return q, k, v, do, cu


def _grads_like(q, k, fused):
    N, H, D = q.shape
    KVH = k.shape[1]
    if fused:   # gradients as slices of one (N, H + 2 KVH, D) buffer, as a fused qkv backward wants
        dqkv = torch.empty(N, H + 2 * KVH, D, dtype=q.dtype, device=q.device)
        return dqkv[:, :H], dqkv[:, H:H + KVH], dqkv[:, H + KVH:]
    return torch.empty_like(q), torch.empty(N, KVH, D, dtype=q.dtype, device=q.device), \
        torch.empty(N, KVH, D, dtype=q.dtype, device=q.device)


def _skip_untuned_tma(D, tma):
    """The CPU cases force the TMA loops at any head dim (the interpreter runs them); a GPU's TMA
    loops take the tuned ones only (attention_config.TMA_TABLES; others raise ValueError, tested
    below): there such a case is skipped, its GPU twins being the *_gpu tests."""
    if tma and DEVICE != "cpu" and triton.next_power_of_2(D) not in attention_config.TMA_TABLES["fwd"]:
        pytest.skip(f"the GPU's TMA loops take D = {sorted(attention_config.TMA_TABLES['fwd'])}, not {D}")


def _run(q, k, v, do, cu, max_seqlen, scale, fused=False, tma=None):
    N, H, D = q.shape
    _skip_untuned_tma(D, tma)
    o = torch.empty(N, H, D, dtype=q.dtype, device=q.device)                  # (N, H, D)
    lse = torch.empty(H, N, dtype=torch.float32, device=q.device)             # (H, N)
    poison(o, lse)
    attention_fwd(o, lse, q, k, v, cu, max_seqlen, scale, tma=tma)
    dq, dk, dv = _grads_like(q, k, fused)
    delta = torch.empty(H, N, dtype=torch.float32, device=q.device)           # (H, N) scratch
    poison(dq, dk, dv, delta)
    attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max_seqlen, scale, tma=tma)
    return o, lse, dq, dk, dv


def _check_case(case, dtype, fused=False, tma=None):
    spec, H, KVH, D, mag = case
    g = fresh_generator()
    lengths = _lengths(spec, g)
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, dtype, g, mag, fused)
    scale = D ** -0.5
    o, lse, dq, dk, dv = _run(q, k, v, do, cu, max(lengths), scale, fused, tma)

    # (a) padded reference and (b) SDPA per document, both in fp64 on the same (upcast) inputs,
    # gradients by autograd; (c) SDPA per document at the kernel's precision: torch's own error
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_ref(q64, k64, v64, cu, scale)
    o_ref.backward(do.double())
    qs, ks, vs = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_sdpa = attention_sdpa(qs, ks, vs, cu, scale)
    o_sdpa.backward(do.double())
    lowp = None
    if dtype != torch.float32:
        qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o_t = attention_sdpa(qt, kt, vt, cu, scale)
        o_t.backward(do)
        lowp = {"o": o_t, "dq": qt.grad, "dk": kt.grad, "dv": vt.grad}

    refs = {"o": (o, o_ref, o_sdpa), "dq": (dq, q64.grad, qs.grad), "dk": (dk, k64.grad, ks.grad),
            "dv": (dv, v64.grad, vs.grad)}
    if lowp is not None:
        # attention_bwd takes the forward's output o as given, rounded to 16 bits, and (as
        # FlashAttention does) computes delta_i = dO_i . o_i from it. dS_ij = P_ij (dP_ij - delta_i),
        # so o's rounding moves dq / dk by exactly -d(sum_i ddelta_i lse_i)/d(q, k), with
        # ddelta_i = dO_i . (o_i - o64_i). o is held to the rule above; dq / dk are held to the fp64
        # gradient at the o they were given. (Seed 980460341, |scores| up to 50: 1.21e-2 of dq's
        # 1.31e-2 error came from o's rounding, against 2 x torch's 4.34e-3 + atol 4.4e-3.)
        ddelta = (do.double() * (o.double() - o_ref.detach())).sum(-1).transpose(0, 1)   # (H, N)
        qg, kg = (t.detach().double().requires_grad_() for t in (q, k))
        _, lse_g = attention_ref(qg, kg, v64.detach(), cu, scale)
        (ddelta * lse_g).sum().backward()
        refs["dq"] = (dq, q64.grad - qg.grad, None, q64.grad)    # torch's error: from the true gradient
        refs["dk"] = (dk, k64.grad - kg.grad, None, k64.grad)
    for name, (out, ref, sdpa, *true) in refs.items():
        torch_lowp = lowp[name] if lowp else None
        # 16-bit: the rule's small atol is the output's own last rounding, at most eps / 2 x max|ref|
        # (seed 57080992: fp16 dq off by 1.801e-3 against 2 x torch's 8.73e-4, at max|ref| 1.8,
        # where that rounding alone may take 8.8e-4)
        atol = 0.0 if lowp is None else torch.finfo(dtype).eps / 2 * ref.abs().max().item()
        assert_close_rule(out, ref, torch_lowp, atol=atol, name=name, lowp_ref=true[0] if true else None)
        if sdpa is not None:
            assert_close_rule(out, sdpa, torch_lowp, atol=atol, name=f"{name} vs sdpa")
    # lse is computed in fp32 from the (rounded) inputs in every dtype: the tight rule applies
    assert_close_rule(lse, lse_ref, name="lse")


@pytest.mark.parametrize("dtype", [torch.float32, LOWP], ids=str)
@pytest.mark.parametrize("case", list(CPU_CASES), ids=str)
def test_attention_matches_references(case, dtype):
    # the pointer loops here (tma=False); the TMA loops below, and on the GPU where they are automatic
    _check_case(CPU_CASES[case], dtype, tma=False)


@pytest.mark.parametrize("case", [c for c, spec in CPU_CASES.items() if spec[3] in (32, 64)], ids=str)
def test_attention_tma_loops_match_references(case):
    # the loops' rows read through TMA descriptors (the interpreter runs them on the CPU)
    _check_case(CPU_CASES[case], LOWP, tma=True)


# dk/dv split over a kv head's query heads (attention_config.DKDV_SPLIT), partials summed after
SPLIT_CASES = {"gqa8_split2": ("gqa8", 2, False), "gqa8_split8_tma": ("gqa8", 8, True),
               "gqa4_d80_split4": ("gqa4_d80_padded", 4, False), "gqa2_len0_len1_split2_tma": ("mixed_len0_len1", 2, True)}


@pytest.mark.parametrize("dtype", [torch.float32, LOWP], ids=str)
@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=str)
def test_attention_dkdv_split_matches_references(case, dtype, monkeypatch):
    base, split, tma = SPLIT_CASES[case]
    spec = CPU_CASES[base]
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(spec[1] // spec[2], spec[3]): split})
    if tma and dtype == torch.float32:
        pytest.skip("the TMA loops take 16-bit inputs")
    _check_case(spec, dtype, fused=tma, tma=tma)


def test_attention_dkdv_split_options_and_scratch(monkeypatch):
    # a window and sinks through the split; the scratch attention_bwd_scratch prices; a split
    # that does not divide G is refused
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(4, 32): 2, (4, 64): 2})
    lengths, H, KVH, D, window, sinks = OPTION_CASES["window3_sinks_gqa4"]
    assert attention_config.dkdv_split(H // KVH, D) == 2 and attention_config.dkdv_split(H // KVH, D, window) == 1
    _check_options_case((lengths, H, KVH, D, 0, sinks), LOWP)                  # split, with sinks
    _check_options_case(OPTION_CASES["window3_sinks_gqa4"], LOWP)              # windowed: not split
    assert attention_config.attention_bwd_scratch(100, 8, 2, 64) == 2 * 2 * 100 * 2 * 64 * 4
    assert attention_config.attention_bwd_scratch(100, 8, 2, 64, window=3) == 0
    assert attention_config.attention_bwd_scratch(100, 8, 4, 64) == 0          # G = 2: no split
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(4, 64): 3})
    with pytest.raises(ValueError, match="must divide the group size 4"):
        attention_config.dkdv_split(4, 64)


def test_attention_dkdv_split_unpacked_heads_bit_equal(monkeypatch):
    # dk / dv whose rows do not pack their heads (stride(1) != D) take the partials' sum through a
    # packed copy: the same bits as packed outputs
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(4, 32): 2})
    g = fresh_generator()
    lengths, H, KVH, D = [37, 1, 50], 8, 2, 32
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g)
    packed = _run(q, k, v, do, cu, max(lengths), D ** -0.5)
    N = q.shape[0]
    o, lse = packed[0], packed[1]
    dq = torch.empty_like(q)
    dk, dv = (torch.empty(N, KVH, 2 * D, dtype=q.dtype, device=q.device)[:, :, :D] for _ in range(2))
    delta = torch.empty(H, N, dtype=torch.float32, device=q.device)
    poison(dq, dk, dv, delta)
    attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max(lengths), D ** -0.5)
    assert dk.stride(1) == 2 * D
    for name, got, want in (("dq", dq, packed[2]), ("dk", dk, packed[3]), ("dv", dv, packed[4])):
        assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4])
def test_attention_dkdv_split_gpu(split, monkeypatch):
    monkeypatch.setattr(attention_config, "DKDV_SPLIT", {(8, 128): split})
    _check_case(GPU_CASES["200_docs_d128_gqa8"], LOWP)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES), ids=str)
def test_attention_matches_references_gpu(case):
    _check_case(GPU_CASES[case], LOWP)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c, spec in GPU_CASES.items() if spec[3] in (64, 128)], ids=str)
def test_attention_tma_loops_match_references_gpu(case):
    # these cases are too small for the automatic choice to pick the TMA loops: forced here
    _check_case(GPU_CASES[case], LOWP, tma=True)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_attention_fused_qkv_views(tma):
    # q/k/v and dq/dk/dv as strided head slices of fused buffers
    _check_case(([45, 1, 70], 4, 2, 32, 1.0), LOWP, fused=True, tma=tma)


@pytest.mark.parametrize("size", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_attention_tma_loops_bit_equal_pointer_loops(size):
    # The TMA loops read rows past a document from the next one (the pointer loops read 0) and
    # mask them out: the same configs must give the same bits. GPU: real configs of both paths
    # differ, so there the outputs of each are compared at the configs of the other's table.
    if size == "cpu":
        cases = [([37, 1, 64, 13, 0, 50, 1, 31], 4, 2, 32), ([19, 3], 8, 1, 64)]
    else:
        cases = [([700, 1, 300, 2000, 5, 129, 64, 65], 32, 8, 128), ([1, 63, 1000, 17, 2048], 32, 8, 64),
                 ([4096, 4096], 16, 8, 128)]
    for lengths, H, KVH, D in cases:
        g = fresh_generator()
        q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g, fused=True)
        ptrs = _run(q, k, v, do, cu, max(lengths), D ** -0.5, fused=True, tma=False)
        with _same_configs(size):
            tma = _run(q, k, v, do, cu, max(lengths), D ** -0.5, fused=True, tma=True)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ptrs, tma):
            assert torch.equal(a, b), f"{name}: the TMA loops differ from the pointer loops ({lengths}, D={D})"


def _same_configs(size):
    """On the GPU: the TMA path at the pointer path's configs (block sizes change the sums' order)."""
    import contextlib
    from unittest import mock

    from lean.kernels import attention_config as AC
    if size == "cpu":
        return contextlib.nullcontext()
    return mock.patch.object(AC, "TMA_TABLES", AC.TABLES)


@pytest.mark.parametrize("size", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_attention_walk_orders_bit_equal(size):
    # The programs' order (documents longest first or in batch order, heads on either grid axis)
    # changes nothing but the launch order: every kernel either way gives the same bits. The
    # CPU batch of 150 documents takes the sorted walk's batch-order fallback (over 128 slots).
    from unittest import mock

    from lean.kernels import attention_config as AC
    if size == "cpu":
        cases = [([37, 1, 64, 13, 0, 50, 1, 31], 4, 2, 32), ([1, 2, 3] * 50, 2, 1, 32)]
    else:
        cases = [([700, 1, 300, 2000, 5, 129, 64, 65], 32, 8, 128), ([1, 63, 1000, 17, 2048], 32, 8, 64)]
    for lengths, H, KVH, D in cases:
        g = fresh_generator()
        q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g)
        runs = []
        for order in (True, False):
            with mock.patch.dict(AC.SORTED, fwd=order, dkdv=order, dq=order):
                runs.append(_run(q, k, v, do, cu, max(lengths), D ** -0.5))
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *runs):
            assert torch.equal(a, b), f"{name}: the sorted walk differs from the batch-order walk ({len(lengths)} docs)"


def test_attention_gpu_config_tables(monkeypatch):
    # The GPU branches of attention_config.config, checked on any machine: every head dim of the
    # pointer and TMA tables gives blocks that nest (config raises otherwise) and comes from its table.
    from lean.kernels import attention_config as AC
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for kernel in ("fwd", "dkdv", "dq"):
        for block_d in (64, 128, 256):
            assert AC.config(kernel, block_d, torch.bfloat16, 8192, 4096) == AC.TABLES[kernel][block_d]
        for block_d in (64, 128):
            assert AC.config(kernel, block_d, torch.bfloat16, 8192, 4096, tma=True) == AC.TMA_TABLES[kernel][block_d]
        assert AC.config(kernel, 64, torch.float32, 8192, 4096) == AC.FP32_CONFIG[kernel]
        with pytest.raises(ValueError, match="tuned for D = \\[64, 128\\] only \\(got D = 32\\)"):
            AC.config(kernel, 32, torch.bfloat16, 8192, 4096, tma=True)
        assert AC.grid(kernel, 8, 100) == ((8, 100) if AC.SORTED[kernel] else (100, 8))


def test_attention_tma_rejects_unfit_heads():
    g = fresh_generator()
    q, k, v, do, cu = _inputs([5, 7], 4, 2, 80, torch.float32, g)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        _run(q, k, v, do, cu, 7, 80 ** -0.5, tma=True)


@pytest.mark.parametrize("size", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_attention_bwd_deterministic(size):
    lengths, H, KVH, D = ([37, 64, 5], 4, 1, 32) if size == "cpu" else ([1500, 3, 900, 1700], 16, 4, 128)
    g = fresh_generator()
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g)
    first = _run(q, k, v, do, cu, max(lengths), D ** -0.5)
    second = _run(q, k, v, do, cu, max(lengths), D ** -0.5)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("size", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_attention_fixed_shape_slots_bit_equal(size):
    # A CUDA graph's batch: the same documents plus empty slots at the end and max_seqlen = N.
    # The work walk (_work_item) must give the very same bits as the tight descriptor.
    lengths, H, KVH, D, slots = ([37, 1, 20, 0, 9], 4, 2, 32, 16) if size == "cpu" else \
        ([700, 1, 300, 2000, 5], 16, 8, 128, 64)
    g = fresh_generator()
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g)
    N = q.shape[0]
    cu_slots = torch.cat([cu, cu[-1:].repeat(slots - len(lengths))])
    tight = _run(q, k, v, do, cu, max(lengths), D ** -0.5)
    fixed = _run(q, k, v, do, cu_slots, N, D ** -0.5)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), tight, fixed):
        assert torch.equal(a, b), f"{name}: {slots} document slots and max_seqlen = N change the result"


# ---- launcher rejections -------------------------------------------------------------------

def _valid_args(N=8, H=4, KVH=2, D=32, dtype=torch.float32, device=DEVICE):
    z = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
    cu = torch.tensor([0, 3, N], dtype=torch.int32, device=device)
    return dict(o=z(N, H, D), lse=z(H, N, dt=torch.float32), q=z(N, H, D), k=z(N, KVH, D),
                v=z(N, KVH, D), cu_seqlens=cu, max_seqlen=5, scale=0.125)


def _fwd(a):
    attention_fwd(a["o"], a["lse"], a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], a["scale"])


def _bwd(a, **over):
    N, H, D = a["q"].shape
    KVH = a["k"].shape[1]
    b = dict(dq=torch.zeros_like(a["q"]), dk=torch.zeros_like(a["k"]), dv=torch.zeros_like(a["v"]),
             delta=torch.zeros(H, N, device=a["q"].device), do=torch.zeros_like(a["q"]))
    b.update(over)
    attention_bwd(b["dq"], b["dk"], b["dv"], b["delta"], b["do"], a["q"], a["k"], a["v"], a["o"],
                  a["lse"], a["cu_seqlens"], a["max_seqlen"], a["scale"])


@pytest.mark.parametrize("field, value, err, match", [
    ("q", torch.zeros(8, 4, 32, dtype=torch.float64), TypeError, "q: expected dtype"),
    ("k", torch.zeros(8, 2, 32, dtype=torch.float16), TypeError, "k: expected dtype"),
    ("k", torch.zeros(8, 2, 16), ValueError, r"k: expected shape \(8, \*, 32\)"),
    ("v", torch.zeros(7, 2, 32), ValueError, r"v: expected shape \(8, 2, 32\)"),
    ("k", torch.zeros(8, 3, 32), ValueError, "multiple of k/v heads"),
    ("o", torch.zeros(8, 4, 32, dtype=torch.float16), TypeError, "o: expected dtype"),
    ("lse", torch.zeros(8, 4), ValueError, r"lse: expected shape \(4, 8\)"),
    ("lse", torch.zeros(4, 8, dtype=torch.float16), TypeError, "lse: expected dtype"),
    ("cu_seqlens", torch.tensor([0, 3, 8]), TypeError, "cu_seqlens: expected dtype torch.int32"),
    ("cu_seqlens", torch.tensor([0], dtype=torch.int32), ValueError, "B\\+1 >= 2"),
    ("q", torch.zeros(32, 4, 8).permute(2, 1, 0), ValueError, "q: expected unit stride"),
    ("k", torch.zeros(8, 2, 32, device="meta"), ValueError, "k: expected device"),
    ("max_seqlen", torch.tensor(5), ValueError, "max_seqlen: expected a host int"),
])
def test_attention_fwd_rejects(field, value, err, match):
    a = _valid_args()
    a[field] = value.to(DEVICE) if isinstance(value, torch.Tensor) and value.device.type != "meta" else value
    with pytest.raises(err, match=match):
        _fwd(a)


def test_attention_rejects_unsupported_head_dim_and_device(monkeypatch):
    a = _valid_args(D=8)
    with pytest.raises(ValueError, match="head dim 8 unsupported"):
        _fwd(a)
    # a CPU tensor outside the interpreter (meta tensors pass: tools/arch_compile.py's compile-only runs)
    monkeypatch.setattr(attention_module, "interpreting", lambda: False)
    a = _valid_args(device="cpu")
    with pytest.raises(ValueError, match="q: expected a cuda device"):
        _fwd(a)


@pytest.mark.parametrize("field, shape, dtype, err, match", [
    ("dq", (8, 2, 32), torch.float32, ValueError, r"dq: expected shape \(8, 4, 32\)"),
    ("dk", (8, 4, 32), torch.float32, ValueError, r"dk: expected shape \(8, 2, 32\)"),
    ("dv", (8, 2, 32), torch.float16, TypeError, "dv: expected dtype"),
    ("delta", (8, 4), torch.float32, ValueError, r"delta: expected shape \(4, 8\)"),
    ("do", (8, 4, 32), torch.bfloat16, TypeError, "do: expected dtype"),
])
def test_attention_bwd_rejects(field, shape, dtype, err, match):
    a = _valid_args()
    with pytest.raises(err, match=match):
        _bwd(a, **{field: torch.zeros(*shape, dtype=dtype, device=DEVICE)})


# ---- GPT-OSS's options: sink logits and a sliding window ------------------------------------
# (lengths, H, KVH, D, window, sinks): documents longer than the window, length-1 documents, GQA.
OPTION_CASES = {
    "sinks": ([37, 1, 64, 13, 0, 50], 4, 2, 32, 0, True),
    "window1_sinks": ([37, 1, 20], 2, 1, 32, 1, True),     # without sinks p = 1 and dq = 0: no test
    "window3_sinks_gqa4": ([37, 1, 64, 5], 4, 1, 32, 3, True),
    "window16_gqa2": ([70, 1, 33, 16, 17], 4, 2, 32, 16, False),
    "window16_sinks_gqa8_d80": ([50, 1, 19], 8, 1, 80, 16, True),
}
GPU_OPTION_CASES = {
    "window128_sinks_d64": ([700, 1, 300, 2000, 5, 129], 16, 4, 64, 128, True),
    "window128_sinks_d128": ([2048, 1, 513], 16, 8, 128, 128, True),
    "window7_d128": ([300, 1, 64], 8, 2, 128, 7, False),
    "sinks_d256": ([300, 1, 129], 4, 1, 256, 0, True),
}


def _check_options_case(case, dtype, tma=False):
    """Kernel vs the padded reference in fp64 (o, lse, dq, dk, dv); in 16 bits torch's own error
    is the same reference run at that precision. The sinks are drawn (N(0, 2^2)) in fp32 for fp32
    inputs, in the inputs' dtype otherwise (the model's own)."""
    lengths, H, KVH, D, window, with_sinks = case
    _skip_untuned_tma(D, tma)
    g = fresh_generator()
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, dtype, g)
    sinks = randn(H, g=g, dtype=dtype, scale=2.0) if with_sinks else None
    scale = D ** -0.5
    N = q.shape[0]
    o = torch.empty(N, H, D, dtype=dtype, device=q.device)                    # (N, H, D)
    lse = torch.empty(H, N, dtype=torch.float32, device=q.device)             # (H, N)
    dq, dk, dv = _grads_like(q, k, False)
    delta = torch.empty(H, N, dtype=torch.float32, device=q.device)           # (H, N) scratch
    poison(o, lse, dq, dk, dv, delta)
    attention_fwd(o, lse, q, k, v, cu, max(lengths), scale, sinks=sinks, window=window, tma=tma)
    attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max(lengths), scale, sinks=sinks, window=window,
                  tma=tma)

    def ref(dt):
        qr, kr, vr = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        o_r, lse_r = attention_ref(qr, kr, vr, cu, scale, sinks=None if sinks is None else sinks.to(dt),
                                   window=window)
        o_r.backward(do.to(dt))
        return {"o": o_r, "lse": lse_r, "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}

    r64 = ref(torch.float64)
    lowp = ref(dtype) if dtype != torch.float32 else None
    for name, out in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close_rule(out, r64[name], lowp[name] if lowp else None, name=name)
    assert_close_rule(lse, r64["lse"], name="lse")


@pytest.mark.parametrize("dtype", [torch.float32, LOWP], ids=str)
@pytest.mark.parametrize("case", list(OPTION_CASES), ids=str)
def test_attention_sinks_window_match_reference(case, dtype):
    _check_options_case(OPTION_CASES[case], dtype)


@pytest.mark.parametrize("case", ["window3_sinks_gqa4", "window16_gqa2"], ids=str)
def test_attention_sinks_window_tma_loops(case):
    _check_options_case(OPTION_CASES[case], LOWP, tma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [None, True], ids=["auto", "tma"])
@pytest.mark.parametrize("case", list(GPU_OPTION_CASES), ids=str)
def test_attention_sinks_window_match_reference_gpu(case, tma):
    if tma and GPU_OPTION_CASES[case][3] not in (64, 128):
        pytest.skip("the TMA loops take D = 64 / 128")
    _check_options_case(GPU_OPTION_CASES[case], LOWP, tma=tma)


def test_attention_sinks_window_tma_loops_bit_equal_pointer_loops():
    # the window's bounds and the sinks are the same code on both paths: the same bits (CPU configs)
    lengths, H, KVH, D = [37, 1, 64, 13, 0, 50], 4, 2, 32
    g = fresh_generator()
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, LOWP, g, fused=True)
    sinks = randn(H, g=g, dtype=torch.float32, scale=2.0)
    ptrs = _run_options(q, k, v, do, cu, max(lengths), D ** -0.5, 5, sinks, tma=False)
    tma = _run_options(q, k, v, do, cu, max(lengths), D ** -0.5, 5, sinks, tma=True)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ptrs, tma):
        assert torch.equal(a, b), f"{name}: the TMA loops differ from the pointer loops (window 5, sinks)"


def test_attention_window_visits_only_tiles_in_the_window():
    # Every tile step (_fwd_step, _dkdv_step, _dq_step) is counted under the interpreter and must
    # equal the number of (query block, key block) tiles holding at least one visible pair, times
    # the heads: a kernel that visited the tiles outside the window and only masked them would
    # count the full causal triangle instead (checked to be larger here).
    from unittest import mock

    from lean.kernels import attention_config as AC
    if not AC.interpreting():
        pytest.skip("counts the interpreter's calls")
    lengths, H, KVH, D = [150, 1, 40, 0, 97], 2, 1, 32
    g = fresh_generator()
    q, k, v, do, cu = _inputs(lengths, H, KVH, D, torch.float32, g)

    def expected(kernel, window):
        q_block, k_block = AC.INTERPRET_CONFIG[kernel][:2]
        n = 0
        for L in lengths:
            i = torch.arange(L)[:, None]
            j = torch.arange(L)[None, :]
            vis = (j <= i) & ((i - j < window) if window else True)          # (L, L)
            for a in range(0, L, q_block):
                for b in range(0, L, k_block):
                    n += bool(vis[a:a + q_block, b:b + k_block].any())
        return n * H

    counts = {}
    for window in (0, 5, 16):
        steps = dict.fromkeys(("_fwd_step", "_dkdv_step", "_dq_step"), 0)

        def counting(name):
            inner = getattr(attention_module, name)

            def step(*args, **kwargs):
                steps[name] += 1
                return inner(*args, **kwargs)
            return step
        with mock.patch.multiple(attention_module, **{name: counting(name) for name in steps}):
            _run_options(q, k, v, do, cu, max(lengths), D ** -0.5, window)
        counts[window] = steps
        for name, kernel in (("_fwd_step", "fwd"), ("_dkdv_step", "dkdv"), ("_dq_step", "dq")):
            assert steps[name] == expected(kernel, window), f"window {window}: {name} visited {steps[name]} tiles"
    for window in (5, 16):
        assert all(counts[window][s] < counts[0][s] for s in counts[0]), counts


def _run_options(q, k, v, do, cu, max_seqlen, scale, window, sinks=None, tma=False):
    N, H, D = q.shape
    _skip_untuned_tma(D, tma)
    o = torch.empty(N, H, D, dtype=q.dtype, device=q.device)                  # (N, H, D)
    lse = torch.empty(H, N, dtype=torch.float32, device=q.device)             # (H, N)
    attention_fwd(o, lse, q, k, v, cu, max_seqlen, scale, sinks=sinks, window=window, tma=tma)
    dq, dk, dv = _grads_like(q, k, False)
    delta = torch.empty(H, N, dtype=torch.float32, device=q.device)           # (H, N) scratch
    attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max_seqlen, scale, sinks=sinks, window=window,
                  tma=tma)
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("field, value, err, match", [
    ("sinks", torch.zeros(3), ValueError, r"sinks: expected shape \(4\)"),
    ("sinks", torch.zeros(4, dtype=torch.float64), TypeError, "sinks: expected dtype"),
    ("window", -1, ValueError, "window: expected a host int >= 0"),
    ("window", 2.0, ValueError, "window: expected a host int >= 0"),
])
def test_attention_options_rejected(field, value, err, match):
    a = _valid_args()
    opts = {field: value.to(DEVICE) if isinstance(value, torch.Tensor) else value}
    with pytest.raises(err, match=match):
        attention_fwd(a["o"], a["lse"], a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], a["scale"], **opts)


@pytest.mark.parametrize("window", [0, 1, 5])
def test_attention_reference_is_hf_gpt_oss(window):
    # The reference's sinks and window are transformers' own: gpt_oss eager_attention_forward with
    # the mask of masking_utils' sliding_window_causal_mask_function, one document, fp64
    import types

    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    H, KVH, D, L = 4, 2, 16, 23
    g = fresh_generator()
    q, k, v = (randn(L, h, D, g=g, dtype=torch.float64).cpu() for h in (H, KVH, KVH))
    sinks = randn(H, g=g, dtype=torch.float64, scale=2.0).cpu()
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (sliding_window_causal_mask_function(window) if window else causal_mask_function)(0, 0, i, j)
    mask = torch.zeros(L, L, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    module = types.SimpleNamespace(num_key_value_groups=H // KVH, sinks=sinks, training=False)
    o_hf, _ = eager_attention_forward(module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask[None, None], 0.25)
    o_ref, _ = attention_ref(q, k, v, torch.tensor([0, L], dtype=torch.int32), 0.25, sinks=sinks, window=window)
    torch.testing.assert_close(o_ref, o_hf[0], rtol=1e-12, atol=1e-12)
