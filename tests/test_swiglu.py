"""lean/kernels/swiglu.py against lean/reference/swiglu.py."""
import pytest
import torch

from lean.kernels.swiglu import swiglu_bwd, swiglu_fwd
from lean.reference.swiglu import swiglu_bwd_ref, swiglu_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]
SHAPES = [(1, 37), (7, 131), (129, 1000),
          pytest.param(2053, 14336, marks=pytest.mark.gpu), pytest.param(4096, 8192, marks=pytest.mark.gpu)]


def _gate_up(N, F, g, dtype):
    """g and u as the two halves of one (N, 2F) gate-up buffer (row stride 2F), with a few
    saturating gate values (|g| = 80: sigmoid underflows / reaches 1)."""
    gu = randn(N, 2 * F, g=g, dtype=dtype, scale=2.0)            # (N, 2F)
    gu[0, 0], gu[-1, F - 1] = -80.0, 80.0
    return gu, gu[:, :F], gu[:, F:]


@pytest.mark.parametrize("strided_h", [False, True])
@pytest.mark.parametrize("N,F", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd(dtype, N, F, strided_h):
    gen = fresh_generator()
    _, g, u = _gate_up(N, F, gen, dtype)
    h_base = torch.empty(N, F + 3 if strided_h else F, device=DEVICE, dtype=dtype)
    poison(h_base)
    h = h_base[:, :F]                                             # (N, F), maybe row-strided
    swiglu_fwd(h, g, u)
    assert_close_rule(h, swiglu_ref(g.double(), u.double()), swiglu_ref(g, u), name="h")
    if strided_h:
        assert torch.isnan(h_base[:, F:]).all(), "wrote outside the view"


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("N,F", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd(dtype, N, F, inplace):
    """Separate dg/du, or dg written over g and du over u (the halves of the gate-up buffer)."""
    gen = fresh_generator()
    gu, g, u = _gate_up(N, F, gen, dtype)
    dh = randn(N, F, g=gen, dtype=dtype)
    dg_ref, du_ref = swiglu_bwd_ref(dh.double(), g.double(), u.double())
    dg_low, du_low = swiglu_bwd_ref(dh, g, u)
    if inplace:
        dg, du = g, u
    else:
        dg, du = torch.empty_like(g), torch.empty_like(u)
        poison(dg, du)
    swiglu_bwd(dg, du, dh, g, u)
    assert_close_rule(dg, dg_ref, dg_low, name="dg")
    assert_close_rule(du, du_ref, du_low, name="du")


def test_rejects_bad_arguments():
    g = torch.randn(7, 37, device=DEVICE)
    u, h = torch.randn_like(g), torch.empty_like(g)
    with pytest.raises(ValueError, match=r"h: expected shape \(7, 37\)"):
        swiglu_fwd(torch.empty(7, 38, device=DEVICE), g, u)
    with pytest.raises(TypeError, match="u: expected dtype torch.float32"):
        swiglu_fwd(h, g, u.half())
    with pytest.raises(TypeError, match="g: expected dtype"):
        swiglu_fwd(h, g.long(), u)
    with pytest.raises(ValueError, match="u: expected unit stride in the last dimension"):
        swiglu_fwd(h, g, torch.randn(37, 7, device=DEVICE).t())
    with pytest.raises(ValueError, match="h: expected device"):
        swiglu_fwd(torch.empty(7, 37, device="meta"), g, u)
    with pytest.raises(ValueError, match=r"dh: expected shape \(7, 37\)"):
        swiglu_bwd(torch.empty_like(g), torch.empty_like(g), torch.randn(37, 7, device=DEVICE), g, u)
    with pytest.raises(TypeError, match="du: expected dtype torch.float32"):
        swiglu_bwd(torch.empty_like(g), torch.empty_like(g).half(), torch.randn_like(g), g, u)
    with pytest.raises(ValueError, match="dg: expected device"):
        swiglu_bwd(torch.empty(7, 37, device="meta"), torch.empty_like(g), torch.randn_like(g), g, u)


@pytest.mark.parametrize("over_dh", [False, True])
@pytest.mark.parametrize("N,F", [(7, 131), pytest.param(4096, 8192, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_rewrites_h_bitwise(dtype, N, F, over_dh):
    """h= gives back the forward's h bit for bit (the layer drops it after the down projection),
    over dh or into its own buffer, and dg, du are the bits of the plain backward."""
    gen = fresh_generator()
    gu, g, u = _gate_up(N, F, gen, dtype)
    h_fwd = torch.empty(N, F, device=DEVICE, dtype=dtype)
    swiglu_fwd(h_fwd, g, u)
    dh = randn(N, F, g=gen, dtype=dtype)
    dg0, du0 = torch.empty_like(g), torch.empty_like(u)
    swiglu_bwd(dg0, du0, dh, g, u)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    h = dh.clone() if over_dh else torch.empty_like(dh)
    grad = h if over_dh else dh
    poison(dg, du, None if over_dh else h)
    swiglu_bwd(dg, du, grad, g, u, h=h)
    assert torch.equal(h, h_fwd), f"rebuilt h differs from the forward's in {(h != h_fwd).sum().item()} elements"
    assert torch.equal(dg, dg0) and torch.equal(du, du0), "h= changed the gradients"
