"""lean/kernels/lora_linear.py: fused LoRA projection forward/backward against plain torch."""
import pytest
import torch

import lean.kernels.gemm as G
import lean.kernels.lora_linear as L
from lean.kernels.lora_dropout import lora_dropout_mask
from lean.kernels.lora_linear import (dyb_width, linear_bwd, linear_fwd, lora_linear_bwd, lora_linear_bwd_da,
                                      lora_linear_fwd)
from lean.reference.lora_linear import lora_linear_grads_ref, lora_linear_ref, matmul_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, hopper_path, poison, randn

DTYPES = [torch.float32, LOWP]


def _problem(N, K, O, R, dtype, g, with_bias):
    """Inputs scaled like a trained layer: unit activations, weights ~ 1/sqrt(fan_in)."""
    x = randn(N, K, g=g, dtype=dtype)
    w = randn(O, K, g=g, dtype=dtype, scale=K ** -0.5)
    a = randn(R, K, g=g, dtype=dtype, scale=K ** -0.5)
    b = randn(O, R, g=g, dtype=dtype, scale=R ** -0.5)
    bias = randn(O, g=g, dtype=dtype) if with_bias else None
    dy = randn(N, O, g=g, dtype=dtype)
    return x, w, a, b, bias, dy


def _mask(N, K, seed, p, dtype=torch.float64):
    """The kernels' 0/1 keep mask, written in float32 (NaN-poisoned first), returned in dtype."""
    m = torch.empty(N, K, device=DEVICE, dtype=torch.float32)
    poison(m)
    lora_dropout_mask(m, seed, p)
    return m.to(dtype)


def _run(x, w, a, b, bias, dy, scale, p, seed, da0, db0, with_dx=True):
    """Forward then backward through the kernels; da, db start from da0, db0 (the += rule)."""
    N, K, O, R = x.shape[0], x.shape[1], w.shape[0], a.shape[0]
    y = torch.empty(N, O, device=DEVICE, dtype=x.dtype)      # (N, O)
    xa = torch.empty(N, R, device=DEVICE, dtype=x.dtype)     # (N, R)
    dx = torch.empty(N, K, device=DEVICE, dtype=x.dtype) if with_dx else None
    poison(y, xa, dx)
    lora_linear_fwd(y, xa, x, w, a, b, scale, bias=bias, dropout=p, seed=seed)
    da, db = da0.clone(), db0.clone()
    lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, scale, dropout=p, seed=seed)
    return y, xa, dx, da, db


CASES = [  # (N, K, O, R, bias): odd sizes, no block multiples; rank 8 is padded to 16 inside
    (37, 129, 257, 8, True),
    (131, 257, 37, 16, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("N,K,O,R,with_bias", CASES)
def test_lora_linear_fwd_bwd(N, K, O, R, with_bias, p, dtype):
    """y, xa, dx, da, db against torch (autograd for the gradients), the same dropout mask."""
    g = fresh_generator()
    x, w, a, b, bias, dy = _problem(N, K, O, R, dtype, g, with_bias)
    scale, seed = 2.0 if R == 8 else 0.75, 1234
    da0, db0 = randn(R, K, g=g), randn(O, R, g=g)           # fp32 gradients from earlier micro-batches
    y, xa, dx, da, db = _run(x, w, a, b, bias, dy, scale, p, seed, da0, db0)

    mask = _mask(N, K, seed, p, torch.float64) if p > 0 else None
    up = lambda t: None if t is None else t.double()  # noqa: E731
    y_ref, xa_ref = lora_linear_ref(up(x), up(w), up(a), up(b), scale, bias=up(bias), mask=mask, p=p)
    dx_ref, da_ref, db_ref = lora_linear_grads_ref(up(dy), up(x), up(w), up(a), up(b), scale, mask=mask, p=p)
    if dtype == torch.float32:
        checks = [("y", y, y_ref, None), ("xa", xa, xa_ref, None), ("dx", dx, dx_ref, None),
                  ("da", da - da0, da_ref, None), ("db", db - db0, db_ref, None)]
    else:
        mlow = None if mask is None else mask.to(dtype)
        y_low, xa_low = lora_linear_ref(x, w, a, b, scale, bias=bias, mask=mlow, p=p)
        dx_low, da_low, db_low = lora_linear_grads_ref(dy, x, w, a, b, scale, mask=mlow, p=p)
        # da/db are fp32 accumulators fed by low-precision products, so they are judged at the
        # input precision: rounded to it, against torch's own low-precision gradients.
        checks = [("y", y, y_ref, y_low), ("xa", xa, xa_ref, xa_low), ("dx", dx, dx_ref, dx_low),
                  ("da", (da - da0).to(dtype), da_ref, da_low), ("db", (db - db0).to(dtype), db_ref, db_low)]
    _check_all(checks)


def _check_all(checks):
    """Judge every output before failing, so one failure report names all the bad outputs."""
    errors = []
    for name, out, ref, low in checks:
        try:
            assert_close_rule(out, ref, low, name=name)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_lora_linear_accumulates_and_is_deterministic(p):
    """da/db +=: two backward calls from zero give exactly twice one call; every output is
    bit-identical from run to run (fixed-order reductions, mask regenerated from the seed);
    dx=None gives the same da/db."""
    g = fresh_generator()
    N, K, O, R = 291, 131, 37, 16      # more row blocks than GROUP_M under the interpreter's 32
    x, w, a, b, bias, dy = _problem(N, K, O, R, torch.float32, g, True)
    zR, zO = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    first = _run(x, w, a, b, bias, dy, 0.5, p, 7, zR, zO)
    second = _run(x, w, a, b, bias, dy, 0.5, p, 7, zR, zO)
    for name, u, v in zip(["y", "xa", "dx", "da", "db"], first, second):
        assert torch.equal(u, v), f"{name} differs between two identical runs"
    y, xa, dx, da, db = first[0], first[1], first[2], first[3].clone(), first[4].clone()
    lora_linear_bwd(None, da, db, dy, x, xa, w, a, b, 0.5, dropout=p, seed=7)   # second micro-batch
    assert torch.equal(da, 2 * first[3]) and torch.equal(db, 2 * first[4]), "da/db do not accumulate"


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_input_gradients_accumulate(p):
    """accumulate_dx / accumulate: dx += for projections that share an input (q, k, v; gate, up)."""
    g = fresh_generator()
    N, K, O, R = 67, 131, 37, 16
    x, w, a, b, bias, dy = _problem(N, K, O, R, torch.float32, g, False)
    prev = randn(N, K, g=g)
    da, db = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    y, xa = torch.empty(N, O, device=DEVICE), torch.empty(N, R, device=DEVICE)
    lora_linear_fwd(y, xa, x, w, a, b, 0.5, dropout=p, seed=5)
    fresh = torch.empty(N, K, device=DEVICE)
    poison(fresh)
    lora_linear_bwd(fresh, da, db, dy, x, xa, w, a, b, 0.5, dropout=p, seed=5)
    acc = prev.clone()
    lora_linear_bwd(acc, da, db, dy, x, xa, w, a, b, 0.5, dropout=p, seed=5, accumulate_dx=True)
    assert_close_rule(acc, prev.double() + fresh.double(), name="dx accumulated")
    plain = prev.clone()
    linear_bwd(plain, dy, w, accumulate=True)
    assert_close_rule(plain, prev.double() + matmul_ref(dy.double(), w.double()), name="linear dx accumulated")


def test_lora_dropout_mask_statistics_and_seeds():
    """The mask is reproducible for a seed, differs for another, keeps about 1 - p, and p=0 keeps all."""
    N, K, p = 257, 129, 0.1
    m1, m2, m3 = _mask(N, K, 11, p, torch.float32), _mask(N, K, 11, p, torch.float32), _mask(N, K, 12, p, torch.float32)
    assert torch.equal(m1, m2)
    assert not torch.equal(m1, m3)
    assert set(m1.unique().tolist()) <= {0.0, 1.0}
    # 33153 Bernoulli(0.9) draws: std of the mean 0.0016; 0.01 is six standard deviations.
    assert abs(m1.mean().item() - (1 - p)) < 0.01, m1.mean().item()
    assert abs(m3.mean().item() - (1 - p)) < 0.01, m3.mean().item()
    assert torch.equal(_mask(N, K, 11, 0.0), torch.ones(N, K, device=DEVICE, dtype=torch.float64))
    m8 = torch.full((N, K), 7, device=DEVICE, dtype=torch.uint8)
    lora_dropout_mask(m8, 11, p)
    assert torch.equal(m8, m1.to(torch.uint8))


def test_lora_linear_fwd_dropout_seeds():
    """The forward's dropout is reproducible for a seed and changes with it (y and xa)."""
    g = fresh_generator()
    x, w, a, b, _, _ = _problem(37, 129, 67, 16, torch.float32, g, False)
    outs = []
    for seed in (3, 3, 4):
        y, xa = torch.empty(37, 67, device=DEVICE), torch.empty(37, 16, device=DEVICE)
        poison(y, xa)
        lora_linear_fwd(y, xa, x, w, a, b, 1.0, dropout=0.1, seed=seed)
        outs.append((y, xa))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][1], outs[2][1]) and not torch.equal(outs[0][0], outs[2][0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_fwd_bwd(dtype):
    """Frozen projections: y = x W^T + bias, dx = dy W."""
    g = fresh_generator()
    x, w, _, _, bias, dy = _problem(37, 129, 67, 8, dtype, g, True)
    y, dx = torch.empty(37, 67, device=DEVICE, dtype=dtype), torch.empty(37, 129, device=DEVICE, dtype=dtype)
    poison(y, dx)
    linear_fwd(y, x, w, bias=bias)
    linear_bwd(dx, dy, w)
    up = lambda t: t.double()  # noqa: E731
    low = dtype != torch.float32
    assert_close_rule(y, matmul_ref(up(x), up(w).t(), bias=up(bias)),
                      matmul_ref(x, w.t(), bias=bias) if low else None, name="y")
    assert_close_rule(dx, matmul_ref(up(dy), up(w)), matmul_ref(dy, w) if low else None, name="dx")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,O,R,with_bias,p", [(8191, 1024, 3072, 16, False, 0.0),
                                                 (4097, 2048, 512, 64, True, 0.1)])
def test_lora_linear_gpu_sizes(N, K, O, R, with_bias, p):
    """Realistic projection shapes in bf16 on the GPU."""
    g = fresh_generator()
    x, w, a, b, bias, dy = _problem(N, K, O, R, torch.bfloat16, g, with_bias)
    zR, zO = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    y, xa, dx, da, db = _run(x, w, a, b, bias, dy, 2.0, p, 99, zR, zO)
    mask = _mask(N, K, 99, p, torch.float64) if p > 0 else None
    up = lambda t: None if t is None else t.double()  # noqa: E731
    y_ref, xa_ref = lora_linear_ref(up(x), up(w), up(a), up(b), 2.0, bias=up(bias), mask=mask, p=p)
    grads_ref = lora_linear_grads_ref(up(dy), up(x), up(w), up(a), up(b), 2.0, mask=mask, p=p)
    mlow = None if mask is None else mask.to(torch.bfloat16)
    y_low, xa_low = lora_linear_ref(x, w, a, b, 2.0, bias=bias, mask=mlow, p=p)
    grads_low = lora_linear_grads_ref(dy, x, w, a, b, 2.0, mask=mlow, p=p)
    outs = [y, xa, dx, da.bfloat16(), db.bfloat16()]
    _check_all(list(zip(["y", "xa", "dx", "da", "db"], outs, [y_ref, xa_ref, *grads_ref],
                        [y_low, xa_low, *grads_low])))


def _spy(monkeypatch, module, name, calls):
    """Count calls of module.name (still calling it)."""
    fn = getattr(module, name)

    def counted(*args, **kw):
        calls.append(name)
        return fn(*args, **kw)
    monkeypatch.setattr(module, name, counted)


def _check_dx_accumulated(N, K, O, R):
    """lora_linear_bwd with accumulate_dx (dx += onto an earlier projection's dx) against the rule:
    fp64 prev + the exact dx, with torch's own low-precision dx added to prev as the error scale
    (lean rounds prev + dx once; prev + lean's own dx would round twice)."""
    g = fresh_generator()
    x, w, a, b, bias, dy = _problem(N, K, O, R, LOWP, g, False)
    xa = (x.float() @ a.float().t()).to(LOWP)
    da, db = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    acc = randn(N, K, g=g, dtype=LOWP)                     # dx from an earlier projection
    prev = acc.clone()
    lora_linear_bwd(acc, da, db, dy, x, xa, w, a, b, 0.5, accumulate_dx=True)
    up = lambda t: t.double()  # noqa: E731
    dx_ref = lora_linear_grads_ref(up(dy), up(x), up(w), up(a), up(b), 0.5)[0]
    dx_low = lora_linear_grads_ref(dy, x, w, a, b, 0.5)[0]
    assert_close_rule(acc, prev.double() + dx_ref, (prev.float() + dx_low.float()).to(LOWP), name="dx accumulated")


@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("N,K,O,R,with_bias", [(200, 64, 272, 8, True), (67, 136, 40, 16, False)])
def test_lora_linear_prepass_kernels(path, N, K, O, R, with_bias, monkeypatch):
    """The kernels with the rank-R product from a pre-pass (16-bit, p = 0, big enough problems; here
    the work threshold is lowered), forward and backward kernel 1, dx accumulation included, against
    torch. "tma": the Hopper path's (an sm_90 GPU with 16-byte aligned rows; on the CPU through the
    interpreter with the choice forced). "pointer": the pointer path's, where TMA is not taken
    (_lora_linear_fwd_pre_kernel, a persistent grid walking several tiles, K a multiple of the K step
    and not; _lora_linear_bwd_pre_kernel): on the CPU as the interpreter picks them, on a GPU with the
    portable path forced. Fails if either kernel of the path did not run."""
    import lean.kernels.arch as A
    monkeypatch.setitem(G._TMA_MIN, "macs", 0)  # tma_ok and the pointer path read the threshold in force
    if path == "tma":
        hopper_path(monkeypatch)
        if DEVICE == "cpu":
            monkeypatch.setattr(L, "tma_ok", lambda *ts, macs: all(t.dtype in (torch.float16, torch.bfloat16) for t in ts))
    elif DEVICE != "cpu":
        monkeypatch.setitem(A._FORCED, "portable", True)
    names = ["_fwd_tma_pre", "_bwd_tma_pre"] if path == "tma" else ["_fwd_ptr_pre", "_bwd_ptr_pre"]
    calls = []
    for name in names:
        _spy(monkeypatch, L, name, calls)
    test_lora_linear_fwd_bwd(N, K, O, R, with_bias, 0.0, LOWP)
    assert calls == names, f"{path} pre-pass kernels not used: {calls}"
    _check_dx_accumulated(N, K, O, R)
    assert calls[-1] == names[1], calls
    if path == "pointer":  # fwd_prepass (dense.py's cue to share xa) agrees; fp32 keeps the fused kernel
        t = lambda *shape, dtype=LOWP: torch.empty(*shape, device=DEVICE, dtype=dtype)  # noqa: E731
        assert L.fwd_prepass(t(N, K), t(O, K), t(R, K))
        assert not L.fwd_prepass(t(N, K, dtype=torch.float32), t(O, K, dtype=torch.float32),
                                 t(R, K, dtype=torch.float32))


def test_lora_linear_rejects_bad_arguments():
    N, K, O, R = 8, 16, 12, 4
    x, w = torch.zeros(N, K, device=DEVICE), torch.zeros(O, K, device=DEVICE)
    a, b = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    y, xa = torch.zeros(N, O, device=DEVICE), torch.zeros(N, R, device=DEVICE)
    dy, dx = torch.zeros(N, O, device=DEVICE), torch.zeros(N, K, device=DEVICE)
    da, db = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
    with pytest.raises(ValueError, match=r"b: expected shape \(12, 4\)"):
        lora_linear_fwd(y, xa, x, w, a, torch.zeros(O, R + 1, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"y: expected shape \(8, 12\)"):
        lora_linear_fwd(torch.zeros(N, O + 1, device=DEVICE), xa, x, w, a, b, 1.0)
    with pytest.raises(TypeError, match="a: expected dtype torch.float32"):
        lora_linear_fwd(y, xa, x, w, a.half(), b, 1.0)
    with pytest.raises(TypeError, match="da: expected dtype torch.float32"):
        lora_linear_bwd(dx, da.half(), db, dy, x, xa, w, a, b, 1.0)
    with pytest.raises(ValueError, match="x: expected unit stride in the last dimension"):
        lora_linear_fwd(y, xa, torch.zeros(K, N, device=DEVICE).t(), w, a, b, 1.0)
    with pytest.raises(ValueError, match="w: expected a contiguous tensor"):
        lora_linear_fwd(y, xa, x, torch.zeros(K, O, device=DEVICE).t(), a, b, 1.0)
    with pytest.raises(ValueError, match="dy: expected device"):
        lora_linear_bwd(dx, da, db, dy.to("meta"), x, xa, w, a, b, 1.0)
    with pytest.raises(ValueError, match="rank R=256 outside"):
        big = torch.zeros(256, K, device=DEVICE)
        lora_linear_fwd(y, torch.zeros(N, 256, device=DEVICE), x, w, big, torch.zeros(O, 256, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="dropout: expected a probability"):
        lora_linear_fwd(y, xa, x, w, a, b, 1.0, dropout=1.0)
    with pytest.raises(ValueError, match="seed: expected an int"):
        lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, 1.0, seed=-1)
    with pytest.raises(ValueError, match=r"w: expected shape \(\*, 16\)"):
        linear_fwd(y, x, torch.zeros(O, K + 1, device=DEVICE))
    with pytest.raises(ValueError, match=r"dx: expected shape \(8, 16\)"):
        linear_bwd(torch.zeros(N, K + 1, device=DEVICE), dy, w)


@pytest.mark.parametrize("R,n", [(16, 3), (8, 2), pytest.param(16, 3, marks=pytest.mark.gpu, id="gpu-real")])
def test_shared_deferred_da_equals_one_at_a_time(R, n, request):
    """q/k/v (gate/up) share their input: lora_linear_bwd_da with more=... sums every da from one
    read of x, each the bits it gets alone (dropout 0; with dropout their masks differ: refused)."""
    g = fresh_generator()
    gpu = "gpu-real" in request.node.name
    N, K = (8192, 4096) if gpu else (67, 131)
    dt = torch.bfloat16 if gpu else torch.float32
    x = randn(N, K, g=g, dtype=dt)
    dybs = [randn(N, dyb_width(R), g=g, dtype=dt) for _ in range(n)]   # (N, RP) each; padded columns used as is
    shared = [randn(R, K, g=g) for _ in range(n)]                         # da accumulate: start non-zero
    alone = [d.clone() for d in shared]
    lora_linear_bwd_da(shared[0], dybs[0], x, 0.5, more=list(zip(shared[1:], dybs[1:])))
    for i, (da, dyb) in enumerate(zip(alone, dybs)):
        lora_linear_bwd_da(da, dyb, x, 0.5)
        assert torch.equal(shared[i], da), f"da[{i}] differs by {(shared[i] - da).abs().max().item():.3e}"
    with pytest.raises(ValueError, match="only without dropout"):
        lora_linear_bwd_da(shared[0], dybs[0], x, 0.5, dropout=0.1, more=[(shared[1], dybs[1])])
    with pytest.raises(ValueError, match=r"dyb\[1\]: expected shape"):
        lora_linear_bwd_da(shared[0], dybs[0], x, 0.5, more=[(shared[1], dybs[1][:-1])])


@pytest.mark.parametrize("p,R", [(0.0, 16), (0.1, 8), pytest.param(0.0, 16, marks=pytest.mark.gpu, id="gpu-real")])
def test_deferred_da_equals_the_whole_backward(p, R, request):
    """x=None + lora_linear_bwd_da (dense.py's backward: the layer did not keep x) gives dx, da, db
    bit for bit equal to one whole lora_linear_bwd call."""
    g = fresh_generator()
    gpu = "gpu-real" in request.node.name
    N, K, O = (8192, 2048, 8192) if gpu else (67, 131, 37)
    dt = torch.bfloat16 if gpu else torch.float32
    x, w, a, b, bias, dy = _problem(N, K, O, R, dt, g, False)
    y, xa = torch.empty(N, O, device=DEVICE, dtype=dt), torch.empty(N, R, device=DEVICE, dtype=dt)
    lora_linear_fwd(y, xa, x, w, a, b, 0.5, dropout=p, seed=5)
    outs = []
    for deferred in (False, True):
        da, db = torch.zeros(R, K, device=DEVICE), torch.zeros(O, R, device=DEVICE)
        dx = torch.empty(N, K, device=DEVICE, dtype=dt)
        poison(dx)
        if deferred:
            dyb = torch.empty(N, dyb_width(R), device=DEVICE, dtype=dt)
            lora_linear_bwd(dx, da, db, dy, None, xa, w, a, b, 0.5, dropout=p, seed=5, dyb=dyb)
            assert torch.equal(da, torch.zeros_like(da)), "da moved before lora_linear_bwd_da"
            lora_linear_bwd_da(da, dyb, x, 0.5, dropout=p, seed=5)
        else:
            lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, 0.5, dropout=p, seed=5)
        outs.append((dx, da, db))
    for name, u, v in zip(["dx", "da", "db"], *outs):
        assert torch.equal(u, v), f"{name}: deferred differs from the whole backward by {(u - v).abs().max().item():.3e}"
    with pytest.raises(TypeError, match="dyb: expected a torch.Tensor"):
        lora_linear_bwd(dx, da, db, dy, None, xa, w, a, b, 0.5, dropout=p, seed=5)
