"""lean/kernels/rmsnorm.py against lean/reference/rmsnorm.py and HF's RMSNorm modules."""
import pytest
import torch

from lean.kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from lean.reference.rmsnorm import rmsnorm_bwd_ref, rmsnorm_ref
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

EPS = 1e-6
DTYPES = [torch.float32, LOWP]
SHAPES = [(1, 37), (7, 131), (129, 1000),
          pytest.param(4099, 4096, marks=pytest.mark.gpu), pytest.param(1031, 5120, marks=pytest.mark.gpu)]


def _weight(C, g, dtype):
    return (1.0 + 0.5 * randn(C, g=g)).to(dtype)   # around 1, like trained norm weights


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd(dtype, N, C, residual):
    g = fresh_generator()
    x, w = randn(N, C, g=g, dtype=dtype, scale=3.0), _weight(C, g, dtype)
    res = randn(N, C, g=g, dtype=dtype) if residual else None
    y, h = torch.empty_like(x), (torch.empty_like(x) if residual else None)
    rstd = torch.empty(N, device=DEVICE)
    poison(y, h, rstd)
    rmsnorm_fwd(y, rstd, x, w, EPS, residual=res, h=h)

    up = lambda t: None if t is None else t.double()
    y_ref, h_ref, rstd_ref = rmsnorm_ref(up(x), up(w), EPS, up(res))
    y_low, h_low, _ = rmsnorm_ref(x, w, EPS, res)
    if residual:   # h = x + residual rounded to the activation dtype, exactly as torch adds
        assert torch.equal(h, h_low), f"h differs from torch's x + residual in {int((h != h_low).sum())} elements"
    # rstd depends on the rounded h: its reference is computed from that h.
    _, _, rstd_ref_h = rmsnorm_ref(up(h if residual else x), up(w), EPS)
    assert_close_rule(rstd, rstd_ref_h, name="rstd")
    assert_close_rule(y, y_ref, y_low, name="y")


@pytest.mark.parametrize("dres", ["none", "separate", "inplace"])
@pytest.mark.parametrize("with_dw", [False, True])
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd(dtype, N, C, with_dw, dres):
    g = fresh_generator()
    x, w = randn(N, C, g=g, dtype=dtype, scale=3.0), _weight(C, g, dtype)
    dy = randn(N, C, g=g, dtype=dtype)
    dresidual = None if dres == "none" else randn(N, C, g=g, dtype=dtype)
    _, _, rstd = rmsnorm_ref(x.float(), w.float(), EPS)
    dx_ref, dw_ref = rmsnorm_bwd_ref(dy.double(), x.double(), w.double(), EPS,
                                     None if dresidual is None else dresidual.double())
    dx_low, _ = rmsnorm_bwd_ref(dy, x, w, EPS, dresidual)

    dx = dresidual if dres == "inplace" else torch.empty_like(x)
    dw = torch.empty(C, device=DEVICE) if with_dw else None
    poison(dw, None if dres == "inplace" else dx)
    rmsnorm_bwd(dx, dw, dy, x, w, rstd, dresidual=dresidual)
    assert_close_rule(dx, dx_ref, dx_low, name="dx")
    if with_dw:
        assert_close_rule(dw, dw_ref, name="dw")   # fp32 out: the tight rule


@pytest.mark.parametrize("N,H,D", [(7, 5, 64), pytest.param(1031, 32, 128, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_strided_view(dtype, N, H, D):
    """Per-head norm on (N*H, D) views whose rows are strided (D + 5 apart), in and out."""
    g = fresh_generator()
    base = randn(N * H, D + 5, g=g, dtype=dtype)
    x = base[:, 3:3 + D]                          # (N*H, D), row stride D + 5, offset 3
    w = _weight(D, g, dtype)
    y_base = torch.empty(N * H, D + 5, device=DEVICE, dtype=dtype)
    poison(y_base)
    y = y_base[:, 2:2 + D]
    rstd = torch.empty(N * H, device=DEVICE)
    poison(rstd)
    rmsnorm_fwd(y, rstd, x, w, EPS)
    y_ref, _, rstd_ref = rmsnorm_ref(x.double(), w.double(), EPS)
    assert_close_rule(y, y_ref, rmsnorm_ref(x, w, EPS)[0], name="y")
    assert_close_rule(rstd, rstd_ref, name="rstd")
    assert torch.isnan(y_base[:, :2]).all() and torch.isnan(y_base[:, 2 + D:]).all(), "wrote outside the view"

    dy_base = randn(N * H, D + 5, g=g, dtype=dtype)
    dy = dy_base[:, 1:1 + D]
    dx_base = torch.empty(N * H, 2 * D, device=DEVICE, dtype=dtype)
    dx = dx_base[:, :D]
    dw = torch.empty(D, device=DEVICE)
    poison(dx_base, dw)
    rmsnorm_bwd(dx, dw, dy, x, w, rstd)
    dx_ref, dw_ref = rmsnorm_bwd_ref(dy.double(), x.double(), w.double(), EPS)
    assert_close_rule(dx, dx_ref, rmsnorm_bwd_ref(dy, x, w, EPS)[0], name="dx")
    assert_close_rule(dw, dw_ref, name="dw")
    assert torch.isnan(dx_base[:, D:]).all(), "wrote outside the view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_h_over_residual(dtype):
    """The residual stream updated in place: h is the residual tensor itself."""
    g = fresh_generator()
    N, C = 37, 131
    x, res, w = randn(N, C, g=g, dtype=dtype), randn(N, C, g=g, dtype=dtype), _weight(C, g, dtype)
    y_low, h_low, _ = rmsnorm_ref(x, w, EPS, res)
    y_ref, _, _ = rmsnorm_ref(x.double(), w.double(), EPS, res.double())
    y, rstd = torch.empty_like(x), torch.empty(N, device=DEVICE)
    poison(y, rstd)
    rmsnorm_fwd(y, rstd, x, w, EPS, residual=res, h=res)
    assert torch.equal(res, h_low)
    assert_close_rule(y, y_ref, y_low, name="y")


@pytest.mark.parametrize("cls", ["llama", "qwen3"])
@pytest.mark.parametrize("N,C", [(129, 1000), pytest.param(4099, 4096, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_parity(dtype, N, C, cls):
    """Same weights, same input: HF's module and rmsnorm_fwd agree, and in low precision agree
    to the bit on all but a rare element (the cast order, not only the tolerance)."""
    if cls == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as Norm
    g = fresh_generator()
    x, w = randn(N, C, g=g, dtype=dtype, scale=3.0), _weight(C, g, dtype)
    hf = Norm(C, eps=EPS).to(DEVICE)
    hf32 = Norm(C, eps=EPS).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(w.float())
        hf32.weight.copy_(w.float())
        hf.to(dtype)
        out_hf, out_hf32 = hf(x), hf32(x.float())
    y, rstd = torch.empty_like(x), torch.empty(N, device=DEVICE)
    poison(y, rstd)
    rmsnorm_fwd(y, rstd, x, w, EPS)
    assert_close_rule(y, out_hf32, out_hf, name=f"y vs HF {cls}")
    if dtype != torch.float32:
        # Casting before the weight (HF) vs after it differs on ~25% of elements; sum order and
        # rsqrt's last bit may flip a rare element by one ulp.
        differ = (y != out_hf).float().mean().item()
        assert differ <= 0.01, f"{differ:.2%} of elements differ from HF's bits (> 1%): cast order?"


def test_rejects_bad_arguments():
    x = torch.randn(7, 37, device=DEVICE)
    w = torch.randn(37, device=DEVICE)
    y, rstd = torch.empty_like(x), torch.empty(7, device=DEVICE)
    with pytest.raises(ValueError, match=r"y: expected shape \(7, 37\)"):
        rmsnorm_fwd(torch.empty(7, 36, device=DEVICE), rstd, x, w, EPS)
    with pytest.raises(TypeError, match="w: expected dtype torch.float32"):
        rmsnorm_fwd(y, rstd, x, w.half(), EPS)
    with pytest.raises(TypeError, match="rstd: expected dtype torch.float32"):
        rmsnorm_fwd(y, rstd.half(), x, w, EPS)
    with pytest.raises(TypeError, match="x: expected dtype"):
        rmsnorm_fwd(y, rstd, x.double(), w, EPS)
    with pytest.raises(ValueError, match="x: expected unit stride in the last dimension"):
        rmsnorm_fwd(y, rstd, torch.randn(37, 7, device=DEVICE).t(), w, EPS)
    with pytest.raises(ValueError, match="y: expected device"):
        rmsnorm_fwd(torch.empty(7, 37, device="meta"), rstd, x, w, EPS)
    with pytest.raises(TypeError, match="eps must be a Python number"):
        rmsnorm_fwd(y, rstd, x, w, torch.tensor(EPS))
    with pytest.raises(ValueError, match="residual and h go together"):
        rmsnorm_fwd(y, rstd, x, w, EPS, residual=x)
    with pytest.raises(ValueError, match="h: expected shape"):
        rmsnorm_fwd(y, rstd, x, w, EPS, residual=x, h=torch.empty(7, 38, device=DEVICE))
    with pytest.raises(ValueError, match="C = 65537 outside the supported range"):
        big = torch.empty(1, 65537, device=DEVICE)
        rmsnorm_fwd(big, rstd[:1], big, torch.empty(65537, device=DEVICE), EPS)

    dx, dy = torch.empty_like(x), torch.randn_like(x)
    with pytest.raises(TypeError, match="dw: expected dtype torch.float32"):
        rmsnorm_bwd(dx, torch.empty(37, device=DEVICE, dtype=torch.float16), dy, x, w, rstd)
    with pytest.raises(ValueError, match=r"dw: expected shape \(37\)"):
        rmsnorm_bwd(dx, torch.empty(36, device=DEVICE), dy, x, w, rstd)
    with pytest.raises(ValueError, match=r"dresidual: expected shape \(7, 37\)"):
        rmsnorm_bwd(dx, None, dy, x, w, rstd, dresidual=torch.empty(7, 3, device=DEVICE))
    with pytest.raises(ValueError, match="dy: expected unit stride"):
        rmsnorm_bwd(dx, None, torch.randn(37, 7, device=DEVICE).t(), x, w, rstd)
    with pytest.raises(ValueError, match="rstd: expected device"):
        rmsnorm_bwd(dx, None, dy, x, w, torch.empty(7, device="meta"))


@pytest.mark.parametrize("N,C", [(7, 131), (129, 1000), pytest.param(4099, 4096, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_rewrites_y_bitwise(dtype, N, C):
    """y= over dy (as dense.py's backward uses it, residual fused and dx over dresidual) gives back
    the forward's y bit for bit, and dx is the bits of the plain backward."""
    g = fresh_generator()
    s, d, w = randn(N, C, g=g, dtype=dtype, scale=3.0), randn(N, C, g=g, dtype=dtype), _weight(C, g, dtype)
    y_fwd, h, rstd = torch.empty_like(s), torch.empty_like(s), torch.empty(N, device=DEVICE)
    rmsnorm_fwd(y_fwd, rstd, s, w, EPS, residual=d, h=h)
    dy, dres = randn(N, C, g=g, dtype=dtype), randn(N, C, g=g, dtype=dtype)
    dx0 = dres.clone()
    rmsnorm_bwd(dx0, None, dy.clone(), h, w, rstd, dresidual=dx0)
    dx, y = dres.clone(), dy.clone()
    rmsnorm_bwd(dx, None, y, h, w, rstd, dresidual=dx, y=y)
    assert torch.equal(y, y_fwd), f"rebuilt y differs from the forward's in {(y != y_fwd).sum().item()} elements"
    assert torch.equal(dx, dx0), "y= changed dx"
