"""lean/kernels/linear_ce.py against plain torch: summed CE, valid count and dh, chunk by chunk."""
import pytest
import torch

import lean.kernels.gemm as G
import lean.kernels.gemm_splitk as S
import lean.kernels.linear_ce as CE
from lean.kernels.linear_ce import linear_ce_fwd_bwd
from lean.reference.linear_ce import dh_atol, linear_ce_chunked_ref, linear_ce_ref, loss_atol
from lean.reference.rule import close_rule
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

gpu = pytest.mark.gpu


def make_inputs(N, V, C, dtype, g, *, ignore_index=-100, ignore_frac=0.2, logit_std=2.0):
    """h ~ N(0, 1), w scaled so the logits have std ~logit_std (real lm_heads give a few units)."""
    h = randn(N, C, g=g, dtype=dtype)  # (N, C)
    w = randn(V, C, g=g, dtype=dtype, scale=logit_std / C**0.5)  # (V, C)
    targets = torch.randint(0, V, (N,), generator=g, device=DEVICE)  # (N,) int64
    drop = torch.rand(N, generator=g, device=DEVICE) < ignore_frac
    targets[drop] = ignore_index
    return h, w, targets


def run(h, w, targets, *, with_dh=True, **kw):
    loss = torch.empty(2, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if with_dh else None
    poison(loss, dh)
    linear_ce_fwd_bwd(loss, dh, h, w, targets, **kw)
    return loss, dh


def assert_rule(out, ref, lowp, *, atol, name):
    """The project's rule where assert_close_rule cannot apply it by dtype: an fp32 result whose
    inputs carry torch-sized error (a loss summed from 16-bit logits, or fp32 on ill-conditioned
    logits). max|out - ref| <= 2 max|lowp - ref| + atol, lowp torch's own result at that precision."""
    v = close_rule(out.reshape(-1), ref.reshape(-1), lowp.reshape(-1), atol=atol, name=name, by_lowp=True)
    assert v.ok, v.text


def assert_loss_rule(out, ref, lowp, *, dtype):
    """A 16-bit run's loss, atol as lean/reference/linear_ce.loss_atol says."""
    assert_rule(out, ref, lowp, atol=loss_atol(dtype, ref), name="loss")


def check_against_reference(loss, dh, h, w, targets, *, grad_scale=1.0, ignore_index=-100):
    kw = dict(grad_scale=grad_scale, ignore_index=ignore_index)
    ref_loss, ref_count, ref_dh = linear_ce_ref(h.double(), w.double(), targets, **kw)
    assert loss[1].item() == ref_count.item(), f"count {loss[1].item()} != {ref_count.item()}"
    if h.dtype == torch.float32:
        assert_close_rule(loss[:1], ref_loss.reshape(1), name="loss")
        if dh is not None:
            # fp32 dh sums V products per element; gemm.dot_tile sums them in slices of IEEE_STEPS K
            # steps. H200, N 3001, V 151,936, C 1024, ten seeds: max 2.5e-6 of max|dh| from fp64
            # (cuBLAS fp32 6.3e-6; one accumulator over V, before the slices, up to 4.3e-5).
            assert_close_rule(dh, ref_dh, name="dh")
        return
    low_loss, _, low_dh = linear_ce_ref(h, w, targets, **kw)
    assert_loss_rule(loss[0], ref_loss, low_loss, dtype=h.dtype)
    if dh is not None:
        assert_close_rule(dh, ref_dh, low_dh, atol=dh_atol(h.dtype, ref_dh), name="dh")


# (N, V, C, chunk_rows, grad_scale, ignore_index): odd sizes; chunk_rows None is the default (64 under
# the interpreter); the others put several chunks and a partial last one inside N. The interpreter
# is slow (~1-4 ms per GEMM tile step), which keeps the CPU sizes modest.
CASES = [
    (1, 97, 64, None, 1.0, -100),
    (37, 2053, 64, 16, 0.37, -100),  # chunks 16, 16, 5; 5 vocab blocks of 512 under the interpreter
    (131, 1000, 64, 48, 2.5, -1),  # chunks 48, 48, 35; another ignore_index
    (300, 97, 80, None, 1 / 300, -100),  # default chunks under the interpreter: 64 x 4 + 44
    pytest.param(4096, 32000, 2048, None, 1 / 4096, -100, marks=gpu),
    pytest.param(3001, 151936, 1024, 1024, 1.0, -100, marks=gpu),
]


@pytest.mark.parametrize("dtype", [torch.float32, LOWP], ids=str)
@pytest.mark.parametrize("N,V,C,chunk_rows,grad_scale,ignore_index", CASES)
def test_linear_ce(N, V, C, chunk_rows, grad_scale, ignore_index, dtype):
    g = fresh_generator()
    frac = 0.2 if N > 1 else 0.0  # a lone token keeps its target
    h, w, targets = make_inputs(N, V, C, dtype, g, ignore_index=ignore_index, ignore_frac=frac)
    if N % 2:
        targets = targets.to(torch.int32)  # both index dtypes
    loss, dh = run(h, w, targets, grad_scale=grad_scale, ignore_index=ignore_index, chunk_rows=chunk_rows)
    check_against_reference(loss, dh, h, w, targets, grad_scale=grad_scale, ignore_index=ignore_index)


def test_linear_ce_large_logits():
    """Logits with std ~100: exp overflows fp32 unless the running max is subtracted. fp32 logits of
    size ~300 carry ~3e-5 absolute error, which the near-one-hot softmax passes on to dh, so the
    bound is torch's own fp32 error (x2) plus the fp32 rule's 1e-5 relative term."""
    g = fresh_generator()
    h, w, targets = make_inputs(37, 1000, 64, torch.float32, g, logit_std=100.0)
    loss, dh = run(h, w, targets, chunk_rows=16)
    ref_loss, ref_count, ref_dh = linear_ce_ref(h.double(), w.double(), targets)
    t32_loss, _, t32_dh = linear_ce_ref(h, w, targets)
    assert loss[1].item() == ref_count.item()
    assert_rule(loss[0], ref_loss, t32_loss, atol=1e-5 * ref_loss.abs().item(), name="loss")
    assert_rule(dh, ref_dh, t32_dh, atol=1e-5 * ref_dh.abs().max().item(), name="dh")


@pytest.mark.parametrize("dtype", [torch.float32, LOWP], ids=str)
def test_linear_ce_loss_only(dtype):
    """dh=None skips the second GEMM; the loss is the same, bit for bit."""
    g = fresh_generator()
    h, w, targets = make_inputs(37, 521, 80, dtype, g)
    loss, _ = run(h, w, targets, with_dh=False, chunk_rows=16)
    check_against_reference(loss, None, h, w, targets)
    loss_with_dh, _ = run(h, w, targets, chunk_rows=16)
    assert torch.equal(loss, loss_with_dh)


@pytest.mark.parametrize("N", [0, 37])
def test_linear_ce_all_ignored(N):
    """No valid target: loss [0, 0] and dh exactly zero (written, not left alone)."""
    g = fresh_generator()
    h, w, targets = make_inputs(N, 97, 64, LOWP, g, ignore_frac=1.0)
    loss, dh = run(h, w, targets, grad_scale=0.5, chunk_rows=16)
    assert loss.tolist() == [0.0, 0.0]
    assert torch.equal(dh, torch.zeros_like(dh))


def _spy_splitk(monkeypatch):
    """A list that records the slice count of every split-K GEMM (gemm_splitk.py) from now on."""
    calls, run = [], S._matmul_splitk

    def counted(c, a, b, bias, accumulate, alpha, split, config=None, tma=None):
        calls.append(split)
        return run(c, a, b, bias, accumulate, alpha, split, config, tma)
    monkeypatch.setattr(S, "_matmul_splitk", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, LOWP] if DEVICE == "cpu" else [LOWP], ids=str)
def test_linear_ce_splitk_dh(dtype, monkeypatch):
    """The dh GEMM through gemm_splitk.py's split-K path (its size conditions forced; on the CPU its Hopper
    conditions too, fp32 included: chunks (16, 64) over V = 1000 are 2 interpreter tiles and 32 K
    steps), against the reference."""
    # Patched where _use_splitk / splitk_count look them up at call time: gemm_splitk's own names.
    monkeypatch.setattr(S, "TMA_MIN_MACS", 0)
    monkeypatch.setitem(G._TMA_MIN, "macs", 0)  # tma_ok reads the threshold in force
    if DEVICE == "cpu":
        monkeypatch.setattr(S, "tma_ok", lambda *ts, macs: True)
    monkeypatch.setattr(S, "_SPLITK_MIN_STEPS", 4)
    calls = _spy_splitk(monkeypatch)
    g = fresh_generator()
    h, w, targets = make_inputs(37, 1000, 64, dtype, g)
    loss, dh = run(h, w, targets, grad_scale=0.37, chunk_rows=16)
    assert calls and min(calls) > 1, f"split-K not taken for dh: {calls}"
    check_against_reference(loss, dh, h, w, targets, grad_scale=0.37)


def test_default_chunk_rows_gpu():
    """The GPU chunk rule: the fewest multiple-of-128 rows whose GEMMs reach _GPU_INTENSITY flop/byte
    (rows * C / (rows + C)), within the scratch budget and N; narrow models take the budget."""
    def intensity(rows, C):
        return rows * C / (rows + C)
    for N, V, C, want in [(8192, 151936, 1024, 768), (8192, 128256, 2048, 640), (8192, 151936, 4096, 512),
                          (300, 128256, 2048, 300), (8192, 49152, 576, 1792)]:
        rows = CE._default_chunk_rows(N, V, C, 2, False)
        assert rows == want, (N, V, C, rows)
        if rows < N:
            assert rows % 128 == 0 and rows * V * 2 <= CE._GPU_CHUNK_BYTES
            assert intensity(rows, C) >= CE._GPU_INTENSITY and intensity(rows - 128, C) < CE._GPU_INTENSITY
    cap = CE._default_chunk_rows(8192, 49152, 256, 2, False)  # C under the target intensity
    assert cap == CE._GPU_CHUNK_BYTES // (49152 * 2) // 128 * 128


@gpu
def test_linear_ce_qwen_vocab(monkeypatch):
    """Qwen-size vocabulary at a 16k-token batch, bf16: default chunks (their dh GEMMs split-K) and one
    16384-row chunk (2.5e9 logits, row * V past 2^31), against a chunked fp32 reference; bitwise
    reproducible."""
    calls = _spy_splitk(monkeypatch)
    N, V, C = 16384, 151936, 1024
    g = fresh_generator()
    h, w, targets = make_inputs(N, V, C, torch.bfloat16, g)
    kw = dict(grad_scale=1 / N)
    ref_loss, ref_count, ref_dh = linear_ce_chunked_ref(h, w, targets, **kw)
    low_loss, _, low_dh = linear_ce_chunked_ref(h, w, targets, upcast=False, **kw)
    atol = dh_atol(torch.bfloat16, ref_dh)
    for chunk_rows in (None, N):
        loss, dh = run(h, w, targets, chunk_rows=chunk_rows, **kw)
        assert loss[1].item() == ref_count.item()
        assert_loss_rule(loss[0], ref_loss, low_loss, dtype=torch.bfloat16)
        assert_close_rule(dh, ref_dh, low_dh, atol=atol, name=f"dh (chunk_rows={chunk_rows})")
        del dh
        torch.cuda.empty_cache()
    assert calls and min(calls) > 1, f"split-K not taken for dh: {calls}"
    loss_a, dh_a = run(h, w, targets, **kw)
    loss_b, dh_b = run(h, w, targets, **kw)
    assert torch.equal(loss_a, loss_b) and torch.equal(dh_a, dh_b)


def test_chunked_reference_matches_autograd():
    """The closed-form chunked reference (used where autograd cannot hold N x V) equals autograd,
    in fp32 and in its 16-bit HF-recipe mode (upcast=False)."""
    g = fresh_generator()
    h, w, targets = make_inputs(37, 1000, 80, torch.float32, g)
    kw = dict(grad_scale=0.37)
    a_loss, a_count, a_dh = linear_ce_ref(h, w, targets, **kw)
    c_loss, c_count, c_dh = linear_ce_chunked_ref(h, w, targets, chunk_rows=16, **kw)
    assert a_count.item() == c_count.item()
    assert_close_rule(c_loss.reshape(1), a_loss.reshape(1), name="loss")
    assert_close_rule(c_dh, a_dh, name="dh")
    h16, w16 = h.to(LOWP), w.to(LOWP)
    ref_loss, _, ref_dh = linear_ce_ref(h16.double(), w16.double(), targets, **kw)
    a_loss, _, a_dh = linear_ce_ref(h16, w16, targets, **kw)
    c_loss, _, c_dh = linear_ce_chunked_ref(h16, w16, targets, chunk_rows=16, upcast=False, **kw)
    assert c_dh.dtype == LOWP
    assert_loss_rule(c_loss, ref_loss, a_loss, dtype=LOWP)
    assert_close_rule(c_dh, ref_dh, a_dh, atol=dh_atol(LOWP, ref_dh))


def _args(N=5, V=11, C=8, dtype=torch.float32):
    g = fresh_generator()
    h, w, targets = make_inputs(N, V, C, dtype, g)
    loss = torch.empty(2, dtype=torch.float32, device=DEVICE)
    return dict(loss=loss, dh=torch.empty_like(h), h=h, w=w, targets=targets)


@pytest.mark.parametrize("change,err,match", [
    (lambda a: a.update(h=a["h"][0]), ValueError, r"h: expected shape \(\*, \*\)"),
    (lambda a: a.update(w=a["w"][:, :7]), ValueError, r"w: expected shape \(\*, 8\)"),
    (lambda a: a.update(targets=a["targets"][:4]), ValueError, r"targets: expected shape \(5\)"),
    (lambda a: a.update(loss=torch.empty(3, device=DEVICE)), ValueError, r"loss: expected shape \(2\)"),
    (lambda a: a.update(dh=a["dh"][:, :7]), ValueError, r"dh: expected shape \(5, 8\)"),
    (lambda a: a.update(h=a["h"].double()), TypeError, "h: expected dtype torch.float32"),
    (lambda a: a.update(w=a["w"].half()), TypeError, "w: expected dtype torch.float32"),
    (lambda a: a.update(dh=a["dh"].half()), TypeError, "dh: expected dtype torch.float32"),
    (lambda a: a.update(targets=a["targets"].float()), TypeError, "targets: expected dtype torch.int32"),
    (lambda a: a.update(loss=a["loss"].double()), TypeError, "loss: expected dtype torch.float32"),
    (lambda a: a.update(h=a["h"].t().contiguous().t()), ValueError, "h: expected unit stride"),
    (lambda a: a.update(w=a["w"].t().contiguous().t()), ValueError, "w: expected unit stride"),
    (lambda a: a.update(targets=a["targets"].repeat(2)[::2]), ValueError, "targets: expected a contiguous"),
    (lambda a: a.update(w=a["w"].to("meta")), ValueError, "w: expected device"),
    (lambda a: a.update(dh=a["dh"].to("meta")), ValueError, "dh: expected device"),
])
def test_linear_ce_rejects(change, err, match):
    a = _args()
    change(a)
    with pytest.raises(err, match=match):
        linear_ce_fwd_bwd(a.pop("loss"), a.pop("dh"), **a)


def test_linear_ce_rejects_chunk_rows():
    a = _args()
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        linear_ce_fwd_bwd(a.pop("loss"), a.pop("dh"), **a, chunk_rows=0)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32), pytest.param(LOWP, marks=pytest.mark.gpu)])
def test_linear_ce_row_walks_agree(dtype):
    """The row kernel's walks (one program per row; persistent programs, pass 2 forward or
    reversed) give the same bits: every element of a row is computed alone, in any order. Each walk
    at the default's tile (BLOCK_V, warps): another tile sums a row's exponentials in another order."""
    gen = fresh_generator()
    N, V, C = 45, 1031, 64
    h, w, targets = make_inputs(N, V, C, dtype, gen)
    bv, warps = CE._row_config(h.device)[:2]
    outs = [run(h, w, targets, grad_scale=0.5, chunk_rows=16, row_config=cfg)
            for cfg in ((bv, warps, None, False), (bv, warps, 3, True), (bv, warps, 2, False), None)]
    for i, (loss, dh) in enumerate(outs[1:], 1):
        assert torch.equal(loss, outs[0][0]) and torch.equal(dh, outs[0][1]), f"walk {i} differs from one row a program"
