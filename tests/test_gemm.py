"""lean/kernels/gemm.py: matmul against torch on odd sizes and strided (transposed) views; its split-K
path (lean/kernels/gemm_splitk.py) called directly and as matmul chooses it."""
import dataclasses

import pytest
import torch

import lean.kernels.arch as A
import lean.kernels.gemm as G
import lean.kernels.gemm_splitk as S
from lean.kernels.gemm import matmul
from lean.reference.lora_linear import matmul_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, hopper_path, poison, randn

DTYPES = [torch.float32, LOWP]


def _operand(rows, cols, transposed, g, dtype, align=1):
    """A (rows, cols) operand, either contiguous or a transposed view of a (cols, rows) tensor.
    align > 1: the underlying tensor's rows are padded to a multiple of align elements (a view of
    the same shape with TMA-describable 16-byte row strides, whatever the sizes)."""
    r, c = (cols, rows) if transposed else (rows, cols)
    t = randn(r, -(-c // align) * align, g=g, dtype=dtype)[:, :c]
    return t.t() if transposed else t


def _launch_matmul(c, a, b, bias, accumulate, alpha):
    matmul(c, a, b, bias=bias, accumulate=accumulate, alpha=alpha)


def _run_and_compare(M, N, K, dtype, ta, tb, *, with_bias, accumulate, alpha, g, atol_lowp=0.0,
                     launch=_launch_matmul, align=1):
    """launch(c, a, b, bias, accumulate, alpha) on fresh inputs against matmul_ref; returns c and
    the inputs (a, b, bias, c0)."""
    a = _operand(M, K, ta, g, dtype, align)
    b = _operand(K, N, tb, g, dtype, align)
    bias = randn(N, g=g, dtype=dtype) if with_bias else None
    c0 = randn(M, N, g=g, dtype=dtype)
    c = c0.clone() if accumulate else torch.empty(M, N, device=DEVICE, dtype=dtype)
    if not accumulate:
        poison(c)
    launch(c, a, b, bias, accumulate, alpha)
    up = lambda t: None if t is None else t.double()  # noqa: E731
    ref = matmul_ref(up(a), up(b), bias=up(bias), c0=up(c0) if accumulate else None, alpha=alpha)
    lowp = None
    if dtype != torch.float32:
        lowp = matmul_ref(a, b, bias=bias, c0=c0 if accumulate else None, alpha=alpha)
    assert_close_rule(c, ref, lowp, atol=atol_lowp if dtype != torch.float32 else 0.0, name="c")
    return c, (a, b, bias, c0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_matmul_layouts(dtype, ta, tb):
    """a @ b for every combination of row-major / transposed views (x W^T, dy W, dy^T x)."""
    g = fresh_generator()
    _run_and_compare(37, 131, 129, dtype, ta, tb, with_bias=False, accumulate=False, alpha=1.0, g=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias,accumulate,alpha", [(True, False, 1.0), (False, True, 0.5),
                                                        (True, True, -1.25)])
def test_matmul_epilogue(dtype, with_bias, accumulate, alpha):
    """bias, accumulate into c and alpha, on sizes that are not block multiples."""
    g = fresh_generator()
    _run_and_compare(67, 257, 37, dtype, False, True, with_bias=with_bias, accumulate=accumulate,
                     alpha=alpha, g=g)


def test_matmul_fp32_output_from_lowp_inputs():
    """Low-precision inputs accumulated into an fp32 c (gradient accumulation): one rounding-free
    fp32 sum, so the tight fp32 rule applies against the products of the same low-precision inputs."""
    g = fresh_generator()
    a = randn(131, 37, g=g, dtype=LOWP).t()      # (37, 131) view, like dy^T
    b = randn(131, 67, g=g, dtype=LOWP)
    c0 = randn(37, 67, g=g)
    c = c0.clone()
    matmul(c, a, b, accumulate=True)
    assert_close_rule(c, a.double() @ b.double() + c0.double(), name="c")


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
def test_matmul_fp32_long_k_in_slices(ta, tb):
    """fp32 (ieee) on _matmul_kernel sums K in slices of IEEE_STEPS K steps, each in a fresh partial:
    K spanning two whole slices and a partial one ending in a masked step, against fp64."""
    g = fresh_generator()
    K = 2 * G.IEEE_STEPS * 32 + 37
    bk = G.gemm_config(33, 65, torch.float32, A.arch(torch.device(DEVICE)), K=K)[2]
    assert 2 * G.IEEE_STEPS * bk < K < 3 * G.IEEE_STEPS * bk and K % bk, bk
    _run_and_compare(33, 65, K, torch.float32, ta, tb, with_bias=False, accumulate=False, alpha=1.0, g=g)


def test_matmul_empty_k_gives_bias():
    g = fresh_generator()
    a = torch.empty(5, 0, device=DEVICE)
    b = torch.empty(0, 7, device=DEVICE)
    bias = randn(7, g=g)
    c = torch.empty(5, 7, device=DEVICE)
    poison(c)
    matmul(c, a, b, bias=bias)
    assert_close_rule(c, bias.double().expand(5, 7), name="c")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 37])
@pytest.mark.parametrize("with_bias,accumulate,alpha", [(False, False, 1.0), (True, True, -0.5)])
def test_matmul_kmajor_persistent(dtype, K, with_bias, accumulate, alpha, monkeypatch):
    """x W^T on _matmul_kmajor_kernel with 3 programs over more tiles (15 in the interpreter, 4 on a
    GPU), rows and columns past the edges wrapped: K a multiple of the K step (no load masks) and not."""
    programs = []
    monkeypatch.setattr(G, "kmajor_programs", lambda tiles, at: programs.append(min(tiles, 3)) or programs[-1])
    g = fresh_generator()
    _run_and_compare(67, 131, K, dtype, False, True, with_bias=with_bias, accumulate=accumulate, alpha=alpha, g=g)
    assert programs == [3], programs


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(8192, 1024, 1024), (4097, 3072, 1024), (8192, 2048, 8192)])
def test_matmul_gpu_sizes(M, N, K):
    """Realistic projection shapes in bf16 on the GPU (x W^T and dy W)."""
    g = fresh_generator()
    _run_and_compare(M, N, K, torch.bfloat16, False, True, with_bias=True, accumulate=False, alpha=1.0, g=g)
    _run_and_compare(M, N, K, torch.bfloat16, False, False, with_bias=False, accumulate=True, alpha=1.0, g=g)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("with_bias,accumulate,alpha", [(False, False, 1.0), (True, True, 0.5)])
def test_matmul_tma_kernel(tb, with_bias, accumulate, alpha, flat, monkeypatch):
    """The Hopper TMA kernel (chosen on an sm_90 GPU for 16-bit row-major a, aligned rows, at least
    a wave of tiles and TMA_MIN_MACS) for x W^T (tb) and dy W: on the CPU through the interpreter with the
    choice forced, on the GPU as chosen. Fails if the TMA kernel did not run. flat: its tile loop
    flattened and c's tiles leaving (and, accumulating, arriving) by TMA (gemm.TMA_FLAT), or not."""
    monkeypatch.setattr(G, "TMA_FLAT", flat)
    monkeypatch.setitem(G._TMA_MIN, "macs", 0)  # these shapes are below the size that picks TMA (tma_ok reads this)
    hopper_path(monkeypatch)
    if DEVICE == "cpu":
        monkeypatch.setattr(G, "tma_ok", lambda *ts, macs: all(t.dtype in (torch.float16, torch.bfloat16) for t in ts))
        one_sm = dataclasses.replace(A.INTERPRETER, sms=1)  # a wave is one tile
        monkeypatch.setattr(G, "arch", lambda device=None: one_sm)
    calls = []
    run = G._matmul_tma
    monkeypatch.setattr(G, "_matmul_tma", lambda *args: calls.append(1) or run(*args))
    M, N, K = (200, 264, 72) if DEVICE == "cpu" else (4100, 8200, 1032)
    _run_and_compare(M, N, K, LOWP, False, tb, with_bias=with_bias, accumulate=accumulate, alpha=alpha,
                     g=fresh_generator())
    assert calls, "the TMA kernel did not run"


# ---- split-K (gemm_splitk.py: _matmul_splitk_kernel + _matmul_splitk_reduce_kernel) ----------------
# Under the interpreter the split-K path is never chosen (it needs a Hopper GPU), so these tests call
# S._matmul_splitk directly with small tiles, or force the choice through matmul.
_SPLITK_TEST_TILES = (32, 32, 32, 4, 1)  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# fp32 checks the kernels' arithmetic tightly on the CPU; on the GPU the path serves 16-bit only.
SPLITK_DTYPES = DTYPES if DEVICE == "cpu" else [LOWP]


# TMA loads: forced under the interpreter, on the GPU where the arch takes them (not LEAN_PORTABLE=1)
SPLITK_LOADS = ["pointers", "tma"] if DEVICE == "cpu" or A.arch().tma else ["pointers"]


@pytest.mark.parametrize("loads", SPLITK_LOADS)
@pytest.mark.parametrize("dtype", SPLITK_DTYPES)
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("split,with_bias,accumulate,alpha", [
    (2, False, False, 1.0),
    (3, True, True, -1.25),   # 10 K blocks dealt 3, 3, 4
    (7, True, False, 0.5),    # uneven slices of 1 and 2 blocks
    (12, False, True, 1.0),   # more slices than K blocks: empty slices write zero partials
])
def test_matmul_splitk_kernel(loads, dtype, tb, split, with_bias, accumulate, alpha):
    """The split-K kernels against the reference, their slices loaded by TMA descriptors or by
    pointers (RTX / A100 cards, LEAN_PORTABLE=1): M, N, K not block multiples (K = 301: 10 blocks
    of 32, the last partial), b row-major (dlogits @ w) or K-major (x W^T), bias, accumulate, alpha."""
    def launch(c, a, b, bias, acc, al):
        S._matmul_splitk(c, a, b, bias, acc, al, split, config=_SPLITK_TEST_TILES, tma=loads == "tma")
    _run_and_compare(37, 45, 301, dtype, False, tb, with_bias=with_bias, accumulate=accumulate, alpha=alpha,
                     g=fresh_generator(), launch=launch, align=8)


def test_matmul_splitk_is_deterministic():
    """Fixed-order fp32 sum of the partials, no atomics: the same inputs give the same bits."""
    g = fresh_generator()
    a = _operand(67, 301, False, g, LOWP, 8)
    b = _operand(301, 45, False, g, LOWP, 8)
    outs = []
    for _ in range(2):
        c = torch.empty(67, 45, device=DEVICE, dtype=LOWP)
        poison(c)
        S._matmul_splitk(c, a, b, None, False, 1.0, 5, config=_SPLITK_TEST_TILES)
        outs.append(c)
    assert torch.equal(outs[0], outs[1])


def _spy(monkeypatch, calls):
    """Record the slice count of every S._matmul_splitk call (still running it; matmul calls it
    through the module, so the patch takes effect)."""
    run = S._matmul_splitk

    def counted(c, a, b, bias, accumulate, alpha, split, config=None, tma=None):
        calls.append((split, S._tma_loads(a, b, *c.shape, a.shape[1]) if tma is None else tma))
        return run(c, a, b, bias, accumulate, alpha, split, config, tma)
    monkeypatch.setattr(S, "_matmul_splitk", counted)


@pytest.mark.parametrize("loads", ["pointers", "tma"])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_takes_splitk(loads, tb, monkeypatch):
    """matmul picks split-K for an under-filled output over a long K, with TMA loads where the
    arch takes them and pointer loads elsewhere: on the CPU with the size conditions (and, for
    "tma", the Hopper ones) forced (interpreter tiles 32 x 32 x 32: 6 tiles, 47 K steps, 2-step
    slices allowed), through the public launcher with bias, accumulate and alpha. Fails if split-K
    did not run, or ran with the other loads."""
    # Patched where _use_splitk / splitk_count look them up at call time: gemm_splitk's own names.
    monkeypatch.setattr(S, "TMA_MIN_MACS", 0)
    monkeypatch.setitem(G._TMA_MIN, "macs", 0)  # tma_ok reads the threshold in force
    if loads == "tma":
        monkeypatch.setattr(S, "tma_ok", lambda *ts, macs: all(t.dtype in (torch.float16, torch.bfloat16) for t in ts))
    else:  # on a Hopper GPU the pointer loads must be forced as well
        monkeypatch.setattr(S, "tma_ok", lambda *ts, macs: False)
    monkeypatch.setattr(S, "_SPLITK_MIN_STEPS", 2)
    calls = []
    _spy(monkeypatch, calls)
    _run_and_compare(67, 45, 1501, LOWP, False, tb, with_bias=True, accumulate=True, alpha=0.75,
                     g=fresh_generator(), align=8)
    assert calls and calls[0][0] > 1, f"split-K not taken: {calls}"
    assert calls[0][1] == (loads == "tma"), f"split-K ran with the wrong loads: {calls}"


@pytest.mark.parametrize("cc,sms", [((9, 0), 132), ((8, 6), 84), ((8, 9), 24), ((12, 0), 188)])
def test_splitk_count(cc, sms, monkeypatch):
    """The slice count (model-free checks of splitk_count's choices) on an H100 and on RTX cards of
    few and many SMs: the lm_head gradient chunks split and fill at least 85% of the waves they
    occupy; full-wave outputs, short K and small problems do not split; every slice keeps
    _SPLITK_MIN_STEPS K steps."""
    monkeypatch.setattr(S, "interpreting", lambda: False)
    at = A.target(*cc, sms=sms)
    BM, BN, BK = S._splitk_config(at, at.tma)[:3]
    for M, N, K in [(768, 1024, 151936), (640, 2048, 128256), (512, 4096, 151936), (512, 2048, 128256),
                    (256, 1024, 151936), (1792, 576, 49152)]:
        s = S.splitk_count(M, N, K, at)
        programs = -(-M // BM) * -(-N // BN) * s
        waves = -(-programs // sms)
        if -(-M // BM) * -(-N // BN) >= sms:  # a wave already (a small GPU): no split
            assert s == 1, (M, N, K, s)
            continue
        # at least 85% of the waves filled, unless the slice cap binds first (a big GPU, a small output)
        assert s > 1 and (programs >= 0.85 * waves * sms or s == S._SPLITK_MAX), (M, N, K, s)
        assert -(-K // BK) // s >= S._SPLITK_MIN_STEPS, (M, N, K, s)
        assert S.splitk_workspace_bytes(M, N, K, 2, at) == s * M * N * 4
        assert S.splitk_workspace_bytes(M, N, K, 4, at) == 0  # fp32 inputs never split
    for M, N, K in [(8192, 1024, 151936), (768, 1024, 1024), (64, 64, 151936)]:
        assert S.splitk_count(M, N, K, at) == 1, (M, N, K)
        assert S.splitk_workspace_bytes(M, N, K, 2, at) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(768, 1024, 151936), (640, 2048, 128256), (512, 4096, 151936)])
def test_matmul_splitk_lm_head_shapes(M, N, K, monkeypatch):
    """The fused linear-CE's dh chunk GEMM (dlogits (rows, V) @ w (V, C)) at Qwen3-0.6B,
    Llama-3.2-1B and Qwen3-8B sizes, bf16 through matmul: split-K runs, meets the rule, and repeats
    bit for bit."""
    calls = []
    _spy(monkeypatch, calls)
    g = fresh_generator()
    c, (a, b, _, _) = _run_and_compare(M, N, K, torch.bfloat16, False, False, with_bias=False,
                                       accumulate=False, alpha=1.0, g=g)
    assert calls and calls[0][0] > 1, f"split-K not taken: {calls}"
    assert calls[0][1] == A.arch().tma, f"split-K loads: {calls} on {A.arch()}"
    again = torch.empty_like(c)
    matmul(again, a, b)
    assert torch.equal(c, again)


def test_matmul_rejects_bad_arguments():
    a = torch.zeros(8, 16, device=DEVICE)
    b = torch.zeros(16, 4, device=DEVICE)
    c = torch.zeros(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"b: expected shape \(16, \*\)"):
        matmul(c, a, torch.zeros(15, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"c: expected shape \(8, 4\)"):
        matmul(torch.zeros(8, 5, device=DEVICE), a, b)
    with pytest.raises(TypeError, match="b: expected dtype torch.float32"):
        matmul(c, a, b.half())
    with pytest.raises(TypeError, match="a: expected dtype"):
        matmul(c, a.to(torch.int32), b)
    with pytest.raises(ValueError, match="c: expected unit stride in the last dimension"):
        matmul(torch.zeros(4, 8, device=DEVICE).t(), a, b)
    with pytest.raises(ValueError, match="a: expected a unit stride in one dimension"):
        matmul(c, torch.zeros(16, 32, device=DEVICE)[::2, ::2], b)
    with pytest.raises(ValueError, match="b: expected device"):
        matmul(c, a, b.to("meta"))
    with pytest.raises(ValueError, match=r"bias: expected shape \(4\)"):
        matmul(c, a, b, bias=torch.zeros(5, device=DEVICE))
