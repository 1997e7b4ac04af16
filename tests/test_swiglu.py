"""lean/kernels/swiglu.py against lean/reference/swiglu.py."""
import pytest
import torch

import lean.kernels.swiglu as SW
from lean.kernels.gemm import interpret_big, interpreting
from lean.kernels.lora_grad import _block_r, _lora_grad
from lean.kernels.swiglu import swiglu_bwd, swiglu_bwd_lora, swiglu_fwd
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


@pytest.mark.parametrize("launch", ["grad", "tiles"])
@pytest.mark.parametrize("N,F,R,parts", [
    (1, 37, 16, "all"), (97, 131, 8, "all"), (300, 200, 16, "gate"), (97, 131, 16, "up,down"), (300, 200, 8, "down"), (97, 131, 8, "none"),
    pytest.param(8192, 8192, 16, "all", marks=pytest.mark.gpu), pytest.param(8192, 8192, 8, "up,down", marks=pytest.mark.gpu),
    pytest.param(4099, 3072, 16, "all", marks=pytest.mark.gpu), pytest.param(4099, 3072, 8, "gate", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_lora_equals_separate_passes(dtype, N, F, R, parts, launch, monkeypatch):
    """swiglu_bwd_lora's dg, du and LoRA gradients against swiglu_bwd (h written) followed by
    lora_grad's passes over dg, du and h (what lora_linear_bwd and lora_linear_bwd_da run):
    db_gate += s dg^T xa_gate, db_up += s du^T xa_up, da_down += s dyb^T h; accumulated onto
    nonzero gradients; dg, du written over g, u as the layer does. On lora_grad's tiles ("grad")
    the gradients are its bits; on other tiles (the module's GPU launch; on the CPU 16 x 16) the
    same products summed in another order: fp32-close."""
    if launch == "tiles":
        monkeypatch.setattr(SW, "_LORA_LAUNCH", (16, 16, 4, 1, 2) if DEVICE == "cpu" else SW._LORA_LAUNCH or (128, 32, 4, 3, 2))
    elif SW._LORA_LAUNCH is not None:
        monkeypatch.setattr(SW, "_LORA_LAUNCH", None)
    gen = fresh_generator()
    want = {"all": {"gate", "up", "down"}, "none": set()}.get(parts) or set(parts.split(","))
    gu, g, u = _gate_up(N, F, gen, dtype)
    dh = randn(N, F, g=gen, dtype=dtype)
    RP, s = _block_r(R), 2.0
    xg, xu = randn(N, R, g=gen, dtype=dtype), randn(N, R, g=gen, dtype=dtype)
    dyb = randn(N, RP, g=gen, dtype=dtype)
    dyb[:, R:] = 0  # lora_linear_bwd's padded dy B: zero columns past the rank
    grads0 = {"gate": randn(F, R, g=gen), "up": randn(F, R, g=gen), "down": randn(R, F, g=gen)}  # fp32
    # the separate passes
    dg0, du0, h0 = torch.empty_like(g), torch.empty_like(u), torch.empty_like(g)
    swiglu_bwd(dg0, du0, dh, g, u, h=h0)
    ref = {k: v.clone() for k, v in grads0.items()}
    prec = "ieee" if dtype == torch.float32 else "tf32"
    big = interpreting() and interpret_big(N, F, F)  # the interpreter's model-sized chunking, as the fused pass's
    if "gate" in want:
        _lora_grad(ref["gate"], dg0, xg, s, 0, 0.0, prec, transposed=False, big=big)
    if "up" in want:
        _lora_grad(ref["up"], du0, xu, s, 0, 0.0, prec, transposed=False, big=big)
    if "down" in want:
        _lora_grad(ref["down"], h0, dyb, s, 0, 0.0, prec, transposed=True, big=big)
    # fused, in place over the gate-up buffer
    got = {k: v.clone() for k, v in grads0.items()}
    swiglu_bwd_lora(g, u, dh, g, u, scale=s,
                    gate=(got["gate"], xg) if "gate" in want else None,
                    up=(got["up"], xu) if "up" in want else None,
                    down=(got["down"], dyb) if "down" in want else None)
    assert torch.equal(g, dg0) and torch.equal(u, du0), "dg / du differ from swiglu_bwd's"
    for k in ("gate", "up", "down"):
        diff = (got[k] - ref[k]).abs().max().item()
        if launch == "grad":
            assert torch.equal(got[k], ref[k]), f"{k}: the fused gradient differs from the separate pass by {diff:.3e}"
        else:  # fp32 sums of the same products, N / BLOCK_T terms per partial: a few ulps of the largest
            tol = 1e-5 * max(1.0, (ref[k] - grads0[k]).abs().max().item())
            assert diff <= tol, f"{k}: the fused gradient differs from the separate pass by {diff:.3e} > {tol:.1e}"
        if k not in want:
            assert torch.equal(got[k], grads0[k]), f"{k}: touched without being asked"


def test_bwd_lora_rejects_bad_arguments():
    g = torch.randn(7, 37, device=DEVICE)
    u, dh = torch.randn_like(g), torch.randn_like(g)
    with pytest.raises(ValueError, match=r"gate db: expected shape \(37, 8\)"):
        swiglu_bwd_lora(g, u, dh, g, u, scale=1.0, gate=(torch.zeros(37, 4, device=DEVICE),
                                                          torch.zeros(7, 8, device=DEVICE)),
                        up=(torch.zeros(37, 8, device=DEVICE), torch.zeros(7, 8, device=DEVICE)))
    with pytest.raises(ValueError, match=r"down dyb: expected shape \(7, 16\)"):
        swiglu_bwd_lora(g, u, dh, g, u, scale=1.0, down=(torch.zeros(8, 37, device=DEVICE),
                                                          torch.zeros(7, 8, device=DEVICE)))
    with pytest.raises(TypeError, match="up xa: expected dtype torch.float32"):
        swiglu_bwd_lora(g, u, dh, g, u, scale=1.0, up=(torch.zeros(37, 8, device=DEVICE),
                                                        torch.zeros(7, 8, device=DEVICE).half()))
