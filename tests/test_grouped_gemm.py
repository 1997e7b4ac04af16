"""lean/kernels/grouped_gemm.py (gmm) and gmm_wgrad.py against lean/reference/grouped_gemm.py: odd sizes,
empty experts, gathers, transposed weights, LoRA, accumulation; outputs carved out of poisoned
buffers so that a write outside the rows (or experts) a program owns fails."""
import pytest
import torch

import lean.kernels.arch as A
import lean.kernels.gemm as G
import lean.kernels.gmm_wgrad as GW
import lean.kernels.grouped_gemm as GG
from lean.kernels.gmm_wgrad import gmm_wgrad
from lean.kernels.grouped_gemm import gmm
from lean.reference.grouped_gemm import gmm_ref, gmm_wgrad_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]


def _counts(P, E, layout, g):
    """Rows per expert (sum P): "random" (some experts empty by chance), "one" (all rows on one
    middle expert), "ends" (first and last expert empty), "middle" (one middle expert empty)."""
    if layout == "one":
        c = [0] * E
        c[E // 2] = P
        return c
    open_ = list(range(E))
    if layout == "ends" and E > 2:
        open_ = open_[1:-1]
    if layout == "middle" and E > 2:
        open_.remove(E // 2)
    pick = torch.randint(len(open_), (P,), generator=g, device=DEVICE).cpu()
    c = [0] * E
    for i in pick.tolist():
        c[open_[i]] += 1
    return c


def _offsets(counts):
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    return torch.tensor(off, dtype=torch.int32, device=DEVICE)


def _guarded(rows, cols, dtype, *, pad=(2, 3, 1, 2)):
    """A (rows, cols) view with a unit last stride inside a NaN buffer with pad rows above/below and
    pad columns left/right; returns (view, base, inside mask)."""
    top, bottom, left, right = pad
    base = torch.empty(top + rows + bottom, left + cols + right, device=DEVICE, dtype=dtype)
    poison(base)
    inside = torch.zeros(base.shape, dtype=torch.bool)
    inside[top:top + rows, left:left + cols] = True
    return base[top:top + rows, left:left + cols], base, inside


def _weight(E, O, Kd, transposed, g, dtype, aligned=False):
    """(E, O, Kd), contiguous or the transpose of an (E, Kd, O) weight; aligned: rows padded to 16
    bytes (a TMA-describable stride at odd sizes), the padding never read as weight."""
    inner = O if transposed else Kd
    full = _aligned(inner) if aligned else inner
    t = randn(E, Kd if transposed else O, full, g=g, dtype=dtype)[:, :, :inner]
    return t.transpose(1, 2) if transposed else t


def _aligned(n):
    return -(-n // 8) * 8


def _gather(P, div, g):
    """(X, gather): gather[p] in [0, X * div), the slot order when P = X * div."""
    if div is None:
        return P, None
    X = -(-P // div)
    if X * div == P:
        return X, torch.randperm(P, generator=g, device=DEVICE).to(torch.int32)
    return X, torch.randint(X * div, (P,), generator=g, device=DEVICE, dtype=torch.int32)


# (P, E, layout, O, Kd, gather_div or None, transposed w, LoRA rank or 0, accumulate)
GMM_CASES = [
    (1, 1, "random", 37, 19, None, False, 0, False),
    (1, 3, "ends", 5, 67, 2, True, 3, True),               # O = R: the LoRA xa shape
    (7, 3, "ends", 19, 100, 1, True, 1, True),
    (37, 8, "random", 67, 45, 4, False, 16, False),
    (37, 8, "one", 93, 33, 2, True, 0, True),               # 2 of the bound's 8 M-tiles are real
    (37, 3, "middle", 45, 17, None, True, 5, True),
    (37, 8, "ends", 33, 93, 2, False, 7, False),
    (36, 8, "random", 16, 64, 4, True, 16, True),           # block multiples, a permutation gather
]


def _run_gmm(case, dtype, g, bias_dtype=None, aligned=False):
    P, E, layout, O, Kd, div, wt, R, acc = case
    counts = _counts(P, E, layout, g)
    offsets = _offsets(counts)
    X, gather = _gather(P, div, g)
    x = randn(X, _aligned(Kd) if aligned else Kd, g=g, dtype=dtype)[:, :Kd]
    w = _weight(E, O, Kd, wt, g, dtype, aligned)
    lora = None
    if R:
        xa = randn(P, R, g=g, dtype=dtype, scale=0.5)
        b = _weight(E, O, R, not wt, g, dtype)
        lora = (xa, b, 0.75)
    bias = None if bias_dtype is None else randn(E, O + 3, g=g, dtype=bias_dtype, scale=4.0)[:, 2:O + 2]  # row stride > O
    y, base, inside = _guarded(P, O, dtype)
    y0 = randn(P, O, g=g, dtype=dtype)
    if acc:
        y.copy_(y0)
    gmm(y, x, w, offsets, gather=gather, gather_div=div or 1, lora=lora, bias=bias, accumulate=acc)
    up = None if lora is None else (lora[0].double(), lora[1].double(), lora[2])
    ref = gmm_ref(x.double(), w.double(), offsets, gather=gather, gather_div=div or 1, lora=up,
                  bias=None if bias is None else bias.double(), y0=y0.double() if acc else None)
    lowp = None
    if dtype != torch.float32:
        lowp = gmm_ref(x, w, offsets, gather=gather, gather_div=div or 1, lora=lora, bias=bias, y0=y0 if acc else None)
    assert_close_rule(y, ref, lowp, name=f"y (rows per expert {counts})")
    assert torch.isnan(base.cpu()[~inside]).all(), "gmm wrote outside y"


def _force_loads(monkeypatch, loads):
    """Make gmm take the pointer loop or (on the CPU, any size, dtype and stride; on a GPU, where
    the arch has TMA) the descriptor loads; returns the list of W_DESC modes its launches pass."""
    modes = []
    run = GG._loads
    if loads == "tma":
        if DEVICE == "cpu":
            monkeypatch.setattr(GG, "tma_ok", lambda *ts, macs: True)
        else:
            monkeypatch.setitem(G._TMA_MIN, "macs", 0)  # tma_ok reads the threshold in force
    else:
        monkeypatch.setattr(GG, "tma_ok", lambda *ts, macs: False)

    def counted(*args):
        out = run(*args)
        modes.append(out[0])
        return out
    monkeypatch.setattr(GG, "_loads", counted)
    return modes


LOADS = ["pointers", "tma"] if DEVICE == "cpu" or A.arch().tma else ["pointers"]


@pytest.mark.parametrize("loads", LOADS)
@pytest.mark.parametrize("case", GMM_CASES, ids=[f"P{c[0]}-E{c[1]}-{c[2]}" for c in GMM_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gmm(dtype, case, loads, monkeypatch):
    """y against the per-expert reference; with accumulate, a row written twice (by a program past
    the last tile, or by another expert's program) counts twice and fails. Both main loops: the
    pointer one and the descriptor loads (w, and x where not gathered), whose tiles run past the
    expert's rows and columns into its neighbours' and past Kd (edges the store and zeros mask)."""
    modes = _force_loads(monkeypatch, loads)
    _run_gmm(case, dtype, fresh_generator(), aligned=loads == "tma")
    tma = loads == "tma" and (DEVICE == "cpu" or dtype != torch.float32)  # gemm.tma_ok: 16-bit on a GPU
    assert modes == [(2 if case[6] else 1) if tma else 0], f"gmm's loads: {modes}"


# (case, bias dtype or None = the model dtype): GPT-OSS's gate_up (gather, transposed w, LoRA) and down
BIAS_CASES = [
    ((37, 8, "ends", 33, 93, 2, True, 7, False), None),         # gate_up: w = gate_up_proj.transpose(1, 2)
    ((37, 8, "random", 67, 45, None, True, 0, False), torch.float32),   # down, an fp32 bias
    ((7, 3, "ends", 19, 100, 1, False, 1, True), torch.float32),         # with accumulate
    ((1, 1, "random", 37, 19, None, False, 0, False), None),
]


@pytest.mark.parametrize("case,bias_dtype", BIAS_CASES, ids=[f"P{c[0]}-E{c[1]}-{'fp32' if b else 'model'}" for c, b in BIAS_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gmm_bias(dtype, case, bias_dtype):
    """y = x w[e]^T (+ LoRA) + bias[e] (+ y): each row gets its own expert's bias, in the model
    dtype or fp32; empty experts' bias rows are never read into another's rows."""
    _run_gmm(case, dtype, fresh_generator(), bias_dtype or dtype)


def test_gmm_programs_past_the_last_tile_write_nothing(monkeypatch):
    """The grid's bound exceeds the real M-tiles (all rows on one expert: 2 real tiles of 8);
    programs past them must exit: with the bound's tiles doubled the result is the same bits."""
    g = fresh_generator()
    offsets = _offsets([0, 0, 37, 0, 0, 0, 0, 0])
    x, w = randn(37, 45, g=g), randn(8, 33, 45, g=g)
    y0 = randn(37, 33, g=g)
    ys = []
    launch = GG._gmm_kernel
    for extra in (0, 8):

        class Wide:  # the same kernel on a grid with `extra` more M-tiles of programs
            def __getitem__(self, grid):
                return lambda *args, **kw: launch[(grid[0] + extra * -(-33 // kw["BLOCK_N"]),)](
                    *args[:12], args[12] + extra, *args[13:], **kw)       # args[12]: tiles_m
        monkeypatch.setattr(GG, "_gmm_kernel", Wide())
        y = y0.clone()
        gmm(y, x, w, offsets, accumulate=True)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])
    assert_close_rule(ys[0], gmm_ref(x.double(), w.double(), offsets, y0=y0.double()), name="y")


def test_gmm_short_tail_tiles_cover_exactly_the_short_tails(monkeypatch):
    """An expert's last M-tile of at most TAIL_M rows runs as the short tile, every other tile as a
    full one. Made visible by handing the short tile an x of twice the values (pointer loads, where
    its x source is x itself in real use): exactly the rows of the short tails come out doubled.
    With BLOCK_M = B and TAIL_M = T (interpreter 16 and 8; fp32 on a GPU 64 and 32), experts of
    T - 3 rows (short), B - 3 (a full tile), B + 3 (full, then short), 0, B, T (short: at most
    TAIL_M) and T + 1 (full)."""
    g = fresh_generator()
    O, Kd = 21, 37
    BM = GG._config(16, O, Kd, torch.float32, torch.device(DEVICE))[0]
    TM = GG.tail_rows(BM)
    assert 8 <= TM < BM, f"the short tail tile is off for BLOCK_M {BM}: TAIL_M {TM}"
    counts = [TM - 3, BM - 3, BM + 3, 0, BM, TM, TM + 1]
    shorts = [(0, TM - 3), (0, 0), (BM, 3), (0, 0), (0, 0), (0, TM), (0, 0)]  # (first row, rows) in each expert
    offsets = _offsets(counts)
    P = sum(counts)
    x, w = randn(P, Kd, g=g), randn(len(counts), O, Kd, g=g)
    assert GG._config(-(-P // len(counts)), O, Kd, x.dtype, x.device)[0] == BM
    run = GG._loads
    monkeypatch.setattr(GG, "_loads", lambda *a: run(*a)[:3] + (2 * x,))
    monkeypatch.setattr(GG, "tma_ok", lambda *ts, macs: False)
    y = torch.empty(P, O, device=DEVICE)
    gmm(y, x, w, offsets)
    ref = gmm_ref(x.double(), w.double(), offsets)
    short = torch.zeros(P, dtype=torch.bool)
    for start, (first, rows) in zip(offsets.tolist(), shorts):
        short[start + first:start + first + rows] = True
    scale = torch.where(short, 2.0, 1.0).double().to(ref.device)[:, None]
    assert_close_rule(y, ref * scale, name="y")


@pytest.mark.parametrize("cc", [(9, 0), (8, 0), (8, 6), (12, 0)])
def test_gmm_narrow_outputs_take_four_warps(cc, monkeypatch):
    """The rank-R calls (O <= 64: xa = x A^T, g B, dh B) take 4 warps on every tier, BLOCK_N narrowed
    to O; the wide calls keep the tier's own warps; LEAN_GMM_NARROW=0's setting gives the narrow
    calls the tier's warps back."""
    monkeypatch.setattr(GG, "interpreting", lambda: False)
    with A.forced(A.target(*cc)):
        dev = torch.device(DEVICE)
        wide = GG._config(512, 1536, 2048, torch.bfloat16, dev)
        for O, bn in ((16, 16), (32, 32), (64, 64)):
            bm, got_bn, bk, warps, stages = GG._config(512, O, 768, torch.bfloat16, dev)
            assert (bm, got_bn, bk, warps, stages) == (wide[0], bn, wide[2], 4, wide[4])
        assert GG._config(512, 128, 768, torch.bfloat16, dev)[3] == wide[3] == 8
        monkeypatch.setattr(GG, "NARROW_WARPS", 0)
        assert GG._config(512, 16, 768, torch.bfloat16, dev)[3] == wide[3]


# every gather_a / gather_b / scale combination; (M, Kd) alternate between (R, wide) and (wide, R)
WGRAD_CASES = [(ga, gb, sc) for ga in (False, True) for gb in (False, True) for sc in (False, True)]


@pytest.mark.parametrize("ga,gb,scaled", WGRAD_CASES, ids=[f"ga{int(a)}-gb{int(b)}-s{int(s)}" for a, b, s in WGRAD_CASES])
@pytest.mark.parametrize("dtype,split", [(d, 1) for d in DTYPES] + [(d, 3) for d in DTYPES], ids=str)
def test_gmm_wgrad(dtype, split, ga, gb, scaled, monkeypatch):
    """dw += alpha * sum (s a)^T b per expert, as views into one flat fp32 buffer with guards: the
    guards and the empty experts keep their bits. Tight even for fp16 inputs: the reference
    multiplies the same 16-bit values (and s_p * a rounded as the kernel rounds it) in fp64.
    split 3: each expert's rows in three runs of whole steps (some empty), partials summed after."""
    monkeypatch.setattr(GW, "WGRAD_SPLIT", split)
    g = fresh_generator()
    P, E, div = 37 if split == 1 else 157, 8, 4 if ga else 2  # split: ~26 rows an expert, 2 of 3 runs used
    M, Kd = ((5, 67) if (ga + gb + scaled) % 2 else (93, 16))
    assert GW.wgrad_split(M, Kd) == split
    counts = _counts(P, E, "ends", g)
    offsets = _offsets(counts)
    X = -(-P // div)
    gather = torch.randperm(X * div, generator=g, device=DEVICE)[:P].to(torch.int32)
    a = randn(X if ga else P, M, g=g, dtype=dtype)
    b = randn(X if gb else P, Kd, g=g, dtype=dtype).t().contiguous().t()   # a column-major b
    scale = None
    if scaled:
        scale = (randn(2 * P, g=g, dtype=dtype).abs(), torch.randperm(2 * P, generator=g, device=DEVICE)[:P].to(torch.int32))
    flat = randn(E * M * Kd + 11, g=g)
    before = flat.clone()
    dw = flat[5:5 + E * M * Kd].view(E, M, Kd)
    kw = dict(gather_a=gather if ga else None, gather_b=gather if gb else None, gather_div=div, scale=scale, alpha=-0.5)
    gmm_wgrad(dw, a, b, offsets, **kw)
    ref = before[5:5 + E * M * Kd].view(E, M, Kd).double() + gmm_wgrad_ref(a, b, offsets, **kw)
    assert_close_rule(dw, ref, name=f"dw (rows per expert {counts})")
    assert torch.equal(flat[:5], before[:5]) and torch.equal(flat[-6:], before[-6:]), "wrote outside dw"
    for e in (0, E - 1):
        assert torch.equal(dw[e], before[5:5 + E * M * Kd].view(E, M, Kd)[e]), f"empty expert {e} changed"


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("P,E,layout", [(1, 1, "random"), (37, 3, "one"), (7, 8, "random")])
def test_gmm_wgrad_edges(P, E, layout, split, monkeypatch):
    """One row, all rows on one expert, more experts than rows; bit-identical on a second run."""
    monkeypatch.setattr(GW, "WGRAD_SPLIT", split)
    g = fresh_generator()
    offsets = _offsets(_counts(P, E, layout, g))
    a, b = randn(P, 16, g=g, dtype=LOWP), randn(P, 45, g=g, dtype=LOWP)
    dws = []
    for _ in range(2):
        dw = torch.zeros(E, 16, 45, device=DEVICE)
        gmm_wgrad(dw, a, b, offsets)
        dws.append(dw)
    assert_close_rule(dws[0], gmm_wgrad_ref(a, b, offsets), name="dw")
    assert torch.equal(dws[0], dws[1])


def test_rejects_bad_arguments():
    x, w = torch.randn(7, 16, device=DEVICE), torch.randn(3, 5, 16, device=DEVICE)
    off = torch.tensor([0, 2, 2, 7], dtype=torch.int32, device=DEVICE)
    y = torch.empty(7, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"y: expected shape \(\*, 5\)"):
        gmm(torch.empty(7, 6, device=DEVICE), x, w, off)
    with pytest.raises(TypeError, match="offsets: expected dtype torch.int32"):
        gmm(y, x, w, off.long())
    with pytest.raises(ValueError, match=r"offsets: expected shape \(4\)"):
        gmm(y, x, w, off[:3])
    with pytest.raises(ValueError, match="x: expected 7 rows"):
        gmm(y, x[:6], w, off)
    with pytest.raises(ValueError, match="w: expected a unit stride"):
        gmm(y, x, torch.randn(3, 10, 32, device=DEVICE)[:, ::2, ::2], off)
    with pytest.raises(ValueError, match=r"gather: expected shape \(7\)"):
        gmm(y, x, w, off, gather=torch.zeros(6, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"lora b: expected shape \(3, 5, 4\)"):
        gmm(y, x, w, off, lora=(torch.randn(7, 4, device=DEVICE), torch.randn(3, 5, 3, device=DEVICE), 1.0))
    with pytest.raises(ValueError, match=r"bias: expected shape \(3, 5\)"):
        gmm(y, x, w, off, bias=torch.randn(3, 6, device=DEVICE))
    with pytest.raises(TypeError, match="bias: expected dtype"):
        gmm(y, x, w, off, bias=torch.randn(3, 5, device=DEVICE).double())
    with pytest.raises(TypeError, match="dw: expected dtype torch.float32"):
        gmm_wgrad(torch.zeros(3, 16, 5, device=DEVICE).half(), x, y, off)
    with pytest.raises(ValueError, match="row counts disagree"):
        gmm_wgrad(torch.zeros(3, 16, 5, device=DEVICE), x, y[:6], off)
    with pytest.raises(ValueError, match="dw: expected a contiguous"):
        gmm_wgrad(torch.zeros(3, 5, 16, device=DEVICE).transpose(1, 2), x, y, off)


# ---- GPU: bf16 at Qwen3-30B-A3B sizes (N 8192 tokens, K 8: P 65536, E 128, C 2048, F 768, R 16) -----------

def _skewed_offsets(P, E, g):
    """Expert loads from a skewed draw (a few hot experts), expert 0 empty."""
    w = torch.rand(E, generator=g, device=DEVICE) ** 4
    w[0] = 0
    pick = torch.multinomial(w, P, replacement=True, generator=g)
    counts = torch.bincount(pick, minlength=E)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.big_gpu
def test_gmm_gpu_qwen3_moe():
    g = fresh_generator()
    N, K, E, C, F, R, s = 8192, 8, 128, 2048, 768, 16, 2.0
    P = N * K
    offsets = _skewed_offsets(P, E, g)
    order = torch.randperm(P, generator=g, device=DEVICE).to(torch.int32)
    bf = torch.bfloat16
    n2 = randn(N, C, g=g, dtype=bf)
    wgu, a_, b_ = randn(E, 2 * F, C, g=g, dtype=bf, scale=0.02), randn(E, R, C, g=g, dtype=bf, scale=0.02), randn(E, 2 * F, R, g=g, dtype=bf)
    xa = torch.empty(P, R, device=DEVICE, dtype=bf)
    h = torch.empty(P, 2 * F, device=DEVICE, dtype=bf)
    poison(xa, h)
    gmm(xa, n2, a_, offsets, gather=order, gather_div=K)
    gmm(h, n2, wgu, offsets, gather=order, gather_div=K, lora=(xa, b_, s))
    f = lambda t: t.float()  # noqa: E731
    xa_ref = gmm_ref(f(n2), f(a_), offsets, gather=order, gather_div=K)
    assert_close_rule(xa, xa_ref, gmm_ref(n2, a_, offsets, gather=order, gather_div=K), name="xa")
    ref = gmm_ref(f(n2), f(wgu), offsets, gather=order, gather_div=K, lora=(f(xa), f(b_), s))
    assert_close_rule(h, ref, gmm_ref(n2, wgu, offsets, gather=order, gather_div=K, lora=(xa, b_, s)), name="h")
    # dX = dh Wgu (+ LoRA), the transposed weight view; dA wgrad with the gathered n2
    dh = randn(P, 2 * F, g=g, dtype=bf)
    dhb = randn(P, R, g=g, dtype=bf)
    dx = torch.empty(P, C, device=DEVICE, dtype=bf)
    gmm(dx, dh, wgu.transpose(1, 2), offsets, lora=(dhb, a_.transpose(1, 2), s))
    ref = gmm_ref(f(dh), f(wgu).transpose(1, 2), offsets, lora=(f(dhb), f(a_).transpose(1, 2), s))
    assert_close_rule(dx, ref, gmm_ref(dh, wgu.transpose(1, 2), offsets, lora=(dhb, a_.transpose(1, 2), s)), name="dx")
    da = torch.zeros(E, R, C, device=DEVICE)
    gmm_wgrad(da, dhb, n2, offsets, gather_b=order, gather_div=K, alpha=s)
    ref = gmm_wgrad_ref(dhb, n2, offsets, gather_b=order, gather_div=K, alpha=s, dtype=torch.float32)
    assert_close_rule(da, ref, rtol32=1e-4, name="dA")
    db = torch.zeros(E, 2 * F, R, device=DEVICE)
    wts = randn(P, g=g, dtype=bf).abs()
    gmm_wgrad(db, dh, xa, offsets, scale=(wts, order), alpha=s)
    ref = gmm_wgrad_ref(dh, xa, offsets, scale=(wts, order), alpha=s, dtype=torch.float32)
    assert_close_rule(db, ref, rtol32=1e-4, name="dB")


@pytest.mark.parametrize("loads", LOADS)
def test_gmm_flat_probe_forms_agree(loads, monkeypatch):
    """tools/gmm_flat_probe.py (BENCHMARKS.md's persistent and flattened gmm rows) times gmm's math on
    a persistent grid, flattened or not; its forms must give gmm's y (fp32 as the interpreter runs
    it, every flag, empty experts, both weight layouts, pointer or descriptor loads)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import gmm_flat_probe
    _force_loads(monkeypatch, loads)
    assert gmm_flat_probe.check(DEVICE, torch.float32) <= 1e-6
