"""lean/kernels/gemm.py: matmul against torch on odd sizes and strided (transposed) views."""
import pytest
import torch

import lean.kernels.gemm as G
from lean.kernels.gemm import matmul
from tests.reference.lora_linear import matmul_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]


def _operand(rows, cols, transposed, g, dtype):
    """A (rows, cols) operand, either contiguous or a transposed view of a (cols, rows) tensor."""
    if transposed:
        return randn(cols, rows, g=g, dtype=dtype).t()
    return randn(rows, cols, g=g, dtype=dtype)


def _run_and_compare(M, N, K, dtype, ta, tb, *, with_bias, accumulate, alpha, g, atol_lowp=0.0):
    a = _operand(M, K, ta, g, dtype)
    b = _operand(K, N, tb, g, dtype)
    bias = randn(N, g=g, dtype=dtype) if with_bias else None
    c0 = randn(M, N, g=g, dtype=dtype)
    c = c0.clone() if accumulate else torch.empty(M, N, device=DEVICE, dtype=dtype)
    if not accumulate:
        poison(c)
    matmul(c, a, b, bias=bias, accumulate=accumulate, alpha=alpha)
    up = lambda t: None if t is None else t.double()  # noqa: E731
    ref = matmul_ref(up(a), up(b), bias=up(bias), c0=up(c0) if accumulate else None, alpha=alpha)
    lowp = None
    if dtype != torch.float32:
        lowp = matmul_ref(a, b, bias=bias, c0=c0 if accumulate else None, alpha=alpha)
    assert_close_rule(c, ref, lowp, atol=atol_lowp if dtype != torch.float32 else 0.0, name="c")


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


def test_matmul_empty_k_gives_bias():
    g = fresh_generator()
    a = torch.empty(5, 0, device=DEVICE)
    b = torch.empty(0, 7, device=DEVICE)
    bias = randn(7, g=g)
    c = torch.empty(5, 7, device=DEVICE)
    poison(c)
    matmul(c, a, b, bias=bias)
    assert_close_rule(c, bias.double().expand(5, 7), name="c")


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(8192, 1024, 1024), (4097, 3072, 1024), (8192, 2048, 8192)])
def test_matmul_gpu_sizes(M, N, K):
    """Realistic projection shapes in bf16 on the GPU (x W^T and dy W)."""
    g = fresh_generator()
    _run_and_compare(M, N, K, torch.bfloat16, False, True, with_bias=True, accumulate=False, alpha=1.0, g=g)
    _run_and_compare(M, N, K, torch.bfloat16, False, False, with_bias=False, accumulate=True, alpha=1.0, g=g)


@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("with_bias,accumulate,alpha", [(False, False, 1.0), (True, True, 0.5)])
def test_matmul_tma_kernel(tb, with_bias, accumulate, alpha, monkeypatch):
    """The Hopper TMA kernel (chosen on an sm_90 GPU for 16-bit row-major a, aligned rows, at least
    a wave of tiles and TMA_MIN_MACS) for x W^T (tb) and dy W: on the CPU through the interpreter with the
    choice forced, on the GPU as chosen. Fails if the TMA kernel did not run."""
    monkeypatch.setattr(G, "TMA_MIN_MACS", 0)  # these shapes are below the size that picks TMA
    if DEVICE == "cpu":
        monkeypatch.setattr(G, "tma_ok", lambda *ts, macs: all(t.dtype in (torch.float16, torch.bfloat16) for t in ts))
        monkeypatch.setattr(G, "NUM_SMS", 1)
    calls = []
    run = G._matmul_tma
    monkeypatch.setattr(G, "_matmul_tma", lambda *args: calls.append(1) or run(*args))
    M, N, K = (200, 264, 72) if DEVICE == "cpu" else (4100, 8200, 1032)
    _run_and_compare(M, N, K, LOWP, False, tb, with_bias=with_bias, accumulate=accumulate, alpha=alpha,
                     g=fresh_generator())
    assert calls, "the TMA kernel did not run"


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
