"""lean/kernels/qk_norm_rope.py: bit for bit the two-kernel path it replaces (rmsnorm_fwd on per-head
views then rope_fwd; rope_bwd then rmsnorm_bwd) under the interpreter, and close to lean/reference's
rmsnorm_ref + rope_ref by the tolerance rule (CPU and H100)."""
import pytest
import torch

from lean.kernels.qk_norm_rope import qk_norm_rope_bwd, qk_norm_rope_fwd
from lean.kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from lean.kernels.rope import rope_bwd, rope_fwd, rope_inv_freq, rope_table
from lean.reference.qk_norm_rope import qk_norm_rope_ref
from tests.util import DEVICE, LOWP, ON_GPU, assert_close_rule, fresh_generator, poison, randn

EPS = 1e-6
THETA = 1e6            # Qwen3's rope_theta, default rope
MAX_POS = 131000 if ON_GPU else 8000   # as tests/test_rope.py: CPU keeps angles where torch's cos/sin are exact
DTYPES = [torch.float32, LOWP]
# (N, H, KVH, D): bit equality is a CPU (interpreter) check: on the H100 the compiler contracts
# some products into FMAs differently in the fused kernel (measured: 63-68 of 16.8M bf16 elements
# one ulp apart; fp32 8% of elements 1-2 ulp), so the GPU cases are test_close_to_reference's,
# at Qwen3-0.6B (16/8 heads) and Qwen3-8B (32/8) step sizes.
SHAPES = [(1, 4, 2, 16), (7, 3, 1, 64), (37, 4, 2, 128), (37, 3, 1, 80)]


def _table(N, D, g):
    """cos, sin (N, D/2) fp32 from rope_table at packed positions: documents restart at 0 (sin = +0
    exactly there), the last one continues deep into a long document (large angles)."""
    pos = torch.arange(N, device=DEVICE, dtype=torch.int32)
    starts = torch.randint(0, 2, (N,), generator=g, device=DEVICE).bool()  # a new document here
    starts[0] = True
    doc = torch.cumsum(starts.int(), 0) - 1
    pos = pos - torch.nonzero(starts).flatten().int()[doc]
    pos[N // 2:] += MAX_POS - N   # the second half: deep positions
    inv_freq, scale = rope_inv_freq(D, THETA)
    cos, sin = torch.empty(N, D // 2, device=DEVICE), torch.empty(N, D // 2, device=DEVICE)  # (N, D/2)
    rope_table(cos, sin, pos.int().contiguous(), torch.from_numpy(inv_freq).to(DEVICE), scale)
    return cos, sin


def _inputs(N, H, KVH, D, dtype, g):
    """q_pre (N, H, D), k_pre (N, KVH, D), w_q, w_k (D,), one in eight elements of q_pre/k_pre -0.0
    (the sign of a zero must come out as the two-kernel path's, too)."""
    def act(*shape):
        x = randn(*shape, g=g, dtype=dtype, scale=3.0)
        zero = torch.rand(*shape, generator=g, device=DEVICE) < 0.125
        return x.masked_fill(zero, -0.0)
    w = lambda: (1.0 + 0.5 * randn(D, g=g)).to(dtype)   # noqa: E731  around 1, like trained norm weights
    return act(N, H, D), act(N, KVH, D), w(), w()


def _same_bits(out, ref, name):
    """Bitwise equality (torch.equal would take -0.0 for +0.0)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape, out.dtype, ref.dtype)
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[out.dtype]
    a, b = out.contiguous().view(as_int), ref.contiguous().view(as_int)
    n = int((a != b).sum())
    assert n == 0, f"{name}: {n} of {a.numel()} elements differ from the two-kernel path (max |diff| " \
                   f"{(out.double() - ref.double()).abs().max().item():.3e})"


def _as_two_kernels(out, ref, name):
    """The fused kernel against the two-kernel path: the same bits under the interpreter; on a GPU
    within 4 ulps (elementwise, plus 4 ulps of the largest |ref|), as qk_norm_rope.py's docstring
    says the compiler contracts some products differently there (1-2 ulp measured)."""
    if DEVICE == "cpu":
        return _same_bits(out, ref, name)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape, out.dtype, ref.dtype)
    eps = torch.finfo(out.dtype).eps
    o, r = out.double(), ref.double()
    bound = 4 * eps * (torch.maximum(o.abs(), r.abs()) + r.abs().max())
    n = int(((o - r).abs() > bound).sum())
    assert n == 0, f"{name}: {n} of {o.numel()} elements more than 4 ulps from the two-kernel path"


def _two_kernel_fwd(q_pre, k_pre, w_q, w_k, cos, sin):
    """dense.py's unfused path: per-head rmsnorm_fwd on (N*H, D) views, then rope_fwd in place."""
    N, H, D = q_pre.shape
    KVH = k_pre.shape[1]
    q, k = torch.empty_like(q_pre), torch.empty_like(k_pre)   # (N, H, D), (N, KVH, D)
    rstd_q, rstd_k = torch.empty(N * H, device=DEVICE), torch.empty(N * KVH, device=DEVICE)
    rmsnorm_fwd(q.view(N * H, D), rstd_q, q_pre.reshape(N * H, D), w_q, EPS)
    rmsnorm_fwd(k.view(N * KVH, D), rstd_k, k_pre.reshape(N * KVH, D), w_k, EPS)
    rope_fwd(q, k, cos, sin)
    return q, k, rstd_q, rstd_k


def _two_kernel_bwd(dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin):
    N, H, D = q_pre.shape
    KVH = k_pre.shape[1]
    dq, dk = dq.clone(), dk.clone()
    rope_bwd(dq, dk, cos, sin)
    dq_pre, dk_pre = torch.empty_like(dq), torch.empty_like(dk)
    rmsnorm_bwd(dq_pre.view(N * H, D), None, dq.view(N * H, D), q_pre.reshape(N * H, D), w_q, rstd_q)
    rmsnorm_bwd(dk_pre.view(N * KVH, D), None, dk.view(N * KVH, D), k_pre.reshape(N * KVH, D), w_k, rstd_k)
    return dq_pre, dk_pre


def _fused_fwd(q_pre, k_pre, w_q, w_k, cos, sin):
    N, H, D = q_pre.shape
    KVH = k_pre.shape[1]
    q, k = torch.empty_like(q_pre), torch.empty_like(k_pre)   # (N, H, D), (N, KVH, D)
    rstd_q, rstd_k = torch.empty(N * H, device=DEVICE), torch.empty(N * KVH, device=DEVICE)
    poison(q, k, rstd_q, rstd_k)
    qk_norm_rope_fwd(q, k, rstd_q, rstd_k, q_pre, k_pre, w_q, w_k, cos, sin, EPS)
    return q, k, rstd_q, rstd_k


@pytest.mark.parametrize("N,H,KVH,D", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_as_two_kernels(dtype, N, H, KVH, D):
    """Forward (q, k, rstd_q, rstd_k) and backward (dq_pre, dk_pre) against the unfused kernels: the
    same bits under the interpreter, within 4 ulps on a GPU (_as_two_kernels)."""
    g = fresh_generator()
    q_pre, k_pre, w_q, w_k = _inputs(N, H, KVH, D, dtype, g)
    cos, sin = _table(N, D, g)
    ours = _fused_fwd(q_pre, k_pre, w_q, w_k, cos, sin)
    theirs = _two_kernel_fwd(q_pre, k_pre, w_q, w_k, cos, sin)
    for name, a, b in zip(("q", "k", "rstd_q", "rstd_k"), ours, theirs):
        _as_two_kernels(a, b, name)

    rstd_q, rstd_k = ours[2], ours[3]
    dq, dk = randn(N, H, D, g=g, dtype=dtype), randn(N, KVH, D, g=g, dtype=dtype)
    dq[: N // 2 + 1, :, ::3] = -0.0   # zeros where sin = +0 (position 0) and elsewhere
    dq0, dk0 = dq.clone(), dk.clone()
    dq_pre, dk_pre = torch.empty_like(dq), torch.empty_like(dk)
    poison(dq_pre, dk_pre)
    qk_norm_rope_bwd(dq_pre, dk_pre, dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin)
    ref_q, ref_k = _two_kernel_bwd(dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin)
    _as_two_kernels(dq_pre, ref_q, "dq_pre")
    _as_two_kernels(dk_pre, ref_k, "dk_pre")
    _same_bits(dq, dq0, "dq (must stay unmodified)")
    _same_bits(dk, dk0, "dk (must stay unmodified)")


@pytest.mark.parametrize("N,H,KVH,D", [(7, 3, 1, 64), pytest.param(1031, 16, 8, 128, marks=pytest.mark.gpu),
                                        pytest.param(8192, 16, 8, 128, marks=pytest.mark.gpu),
                                        pytest.param(4097, 32, 8, 128, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_reference(dtype, N, H, KVH, D):
    """Against plain torch (rmsnorm_ref then rope_ref; backward by autograd through them) by the
    tolerance rule: fp64 reference, torch's own low-precision result for the bound."""
    g = fresh_generator()
    q_pre, k_pre, w_q, w_k = _inputs(N, H, KVH, D, dtype, g)
    cos, sin = _table(N, D, g)
    q, k, rstd_q, rstd_k = _fused_fwd(q_pre, k_pre, w_q, w_k, cos, sin)
    dq, dk = randn(N, H, D, g=g, dtype=dtype), randn(N, KVH, D, g=g, dtype=dtype)
    dq_pre, dk_pre = torch.empty_like(dq), torch.empty_like(dk)
    poison(dq_pre, dk_pre)
    qk_norm_rope_bwd(dq_pre, dk_pre, dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin)

    def ref(x, w, dout, dt):
        """(out, rstd, dx) of rope(rmsnorm_head(x) * w) computed in dt."""
        x = x.to(dt).requires_grad_(True)
        out, rstd = qk_norm_rope_ref(x, w.to(dt), EPS, cos, sin)
        out.backward(dout.to(dt))
        return out.detach(), rstd.detach(), x.grad

    low = dtype != torch.float32
    for name, x, w, dout, out, rstd, dx in (("q", q_pre, w_q, dq, q, rstd_q, dq_pre),
                                            ("k", k_pre, w_k, dk, k, rstd_k, dk_pre)):
        out_ref, rstd_ref, dx_ref = ref(x, w, dout, torch.float64)
        out_low, _, dx_low = ref(x, w, dout, dtype) if low else (None, None, None)
        # the small atol: one unit of the 16-bit result's last place at max|ref|. Both lean and torch
        # round the normed value before RoPE; over the 448 elements of the CPU case torch's own max
        # error can land at half an ulp while lean's lands at one, so 2x torch alone is a coin toss there.
        ulp = lambda r: torch.finfo(dtype).eps * r.abs().max().item() if low else 0.0   # noqa: E731
        assert_close_rule(out, out_ref, out_low, atol=ulp(out_ref), name=name)
        assert_close_rule(rstd, rstd_ref, name=f"rstd_{name}")
        assert_close_rule(dx, dx_ref, dx_low, atol=ulp(dx_ref), name=f"d{name}_pre")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(dtype):
    """q_pre/k_pre sliced from a fused (N, (H+2KVH)*D) qkv buffer, outputs and gradients with token
    strides that are not H*D: the two-kernel path's values (_as_two_kernels), nothing written outside
    the views."""
    g = fresh_generator()
    N, H, KVH, D = 13, 4, 2, 32
    qkv = randn(N, (H + 2 * KVH) * D, g=g, dtype=dtype, scale=3.0)   # (N, (H+2KVH)*D)
    q_pre, k_pre = qkv[:, : H * D].view(N, H, D), qkv[:, H * D: (H + KVH) * D].view(N, KVH, D)
    w_q, w_k = (1.0 + 0.5 * randn(D, g=g)).to(dtype), (1.0 + 0.5 * randn(D, g=g)).to(dtype)
    cos, sin = _table(N, D, g)
    out_buf = torch.empty(N, (H + KVH + 1) * D, device=DEVICE, dtype=dtype)   # (N, (H+KVH+1)*D)
    poison(out_buf)
    q, k = out_buf[:, : H * D].view(N, H, D), out_buf[:, (H + 1) * D:].view(N, KVH, D)
    rstd_q, rstd_k = torch.empty(N * H, device=DEVICE), torch.empty(N * KVH, device=DEVICE)
    qkv0 = qkv.clone()
    qk_norm_rope_fwd(q, k, rstd_q, rstd_k, q_pre, k_pre, w_q, w_k, cos, sin, EPS)
    ref = _two_kernel_fwd(q_pre.contiguous(), k_pre.contiguous(), w_q, w_k, cos, sin)
    for name, a, b in zip(("q", "k", "rstd_q", "rstd_k"), (q, k, rstd_q, rstd_k), ref):
        _as_two_kernels(a, b, name)
    assert torch.isnan(out_buf[:, H * D: (H + 1) * D]).all(), "wrote outside q and k"
    _same_bits(qkv, qkv0, "qkv (an input)")

    dqkv = randn(N, (H + 2 * KVH) * D, g=g, dtype=dtype)                 # (N, (H+2KVH)*D)
    dq, dk = dqkv[:, : H * D].view(N, H, D), dqkv[:, H * D: (H + KVH) * D].view(N, KVH, D)
    grad_buf = torch.empty(N, (H + KVH + 1) * D, device=DEVICE, dtype=dtype)
    poison(grad_buf)
    dq_pre, dk_pre = grad_buf[:, KVH * D: (H + KVH) * D].view(N, H, D), grad_buf[:, : KVH * D].view(N, KVH, D)
    qk_norm_rope_bwd(dq_pre, dk_pre, dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin)
    ref_q, ref_k = _two_kernel_bwd(dq.contiguous(), dk.contiguous(), q_pre.contiguous(), k_pre.contiguous(),
                                   w_q, w_k, rstd_q, rstd_k, cos, sin)
    _as_two_kernels(dq_pre, ref_q, "dq_pre")
    _as_two_kernels(dk_pre, ref_k, "dk_pre")
    assert torch.isnan(grad_buf[:, (H + KVH) * D:]).all(), "wrote outside dq_pre and dk_pre"


# ----------------------------------------------------------------------------- rejection

def _fwd_args(N=5, H=4, KVH=2, D=16, dtype=torch.float32):
    z = lambda *s, dt=dtype, dev=DEVICE: torch.zeros(*s, device=dev, dtype=dt)  # noqa: E731
    return dict(q=z(N, H, D), k=z(N, KVH, D), rstd_q=z(N * H, dt=torch.float32), rstd_k=z(N * KVH, dt=torch.float32),
                q_pre=z(N, H, D), k_pre=z(N, KVH, D), w_q=z(D), w_k=z(D),
                cos=z(N, D // 2, dt=torch.float32), sin=z(N, D // 2, dt=torch.float32), eps=EPS)


def _bad(**over):
    a = _fwd_args()
    a.update(over)
    return a


_dev = dict(device=DEVICE)
BAD = [
    (_bad(q_pre=torch.zeros(5, 64, **_dev)), ValueError, r"q_pre: expected shape \(\*, \*, \*\)"),
    (_bad(k_pre=torch.zeros(5, 2, 18, **_dev)), ValueError, r"k_pre: expected shape \(5, \*, 16\)"),
    (_bad(q=torch.zeros(5, 3, 16, **_dev)), ValueError, r"q: expected shape \(5, 4, 16\)"),
    (_bad(k=torch.zeros(6, 2, 16, **_dev)), ValueError, r"k: expected shape \(5, 2, 16\)"),
    (_bad(k_pre=torch.zeros(5, 0, 16, **_dev), k=torch.zeros(5, 0, 16, **_dev)), ValueError, "at least one head"),
    (_fwd_args(D=15) | dict(cos=torch.zeros(5, 7, **_dev), sin=torch.zeros(5, 7, **_dev)), ValueError,
     "head dim must be even"),
    (_fwd_args(D=514) | dict(cos=torch.zeros(5, 257, **_dev), sin=torch.zeros(5, 257, **_dev)), ValueError,
     r"in \[2, 512\]"),
    (_bad(rstd_q=torch.zeros(19, **_dev)), ValueError, r"rstd_q: expected shape \(20\)"),
    (_bad(cos=torch.zeros(5, 16, **_dev)), ValueError, r"cos: expected shape \(5, 8\)"),
    (_bad(w_k=torch.zeros(8, **_dev)), ValueError, r"w_k: expected shape \(16\)"),
    (_fwd_args(dtype=torch.int32), TypeError, "q_pre: expected dtype"),
    (_bad(k=torch.zeros(5, 2, 16, device=DEVICE, dtype=torch.float16)), TypeError, "k: expected dtype torch.float32"),
    (_bad(w_q=torch.zeros(16, device=DEVICE, dtype=torch.float16)), TypeError, "w_q: expected dtype torch.float32"),
    (_bad(rstd_k=torch.zeros(10, device=DEVICE, dtype=torch.float16)), TypeError,
     "rstd_k: expected dtype torch.float32"),
    (_bad(sin=torch.zeros(5, 8, device=DEVICE, dtype=torch.float16)), TypeError, "sin: expected dtype torch.float32"),
    (_bad(q_pre=torch.zeros(5, 16, 4, **_dev).transpose(1, 2)), ValueError, "q_pre: expected unit stride"),
    (_bad(q=torch.zeros(4, 5, 16, **_dev).transpose(0, 1)), ValueError, r"q: expected heads packed \(head stride 16\)"),
    (_bad(cos=torch.zeros(8, 5, **_dev).t()), ValueError, "cos: expected a contiguous"),
    (_bad(k_pre=torch.zeros(5, 2, 16, device="meta")), ValueError, "k_pre: expected device"),
    (_bad(rstd_q=torch.zeros(20, device="meta")), ValueError, "rstd_q: expected device"),
    (_bad(eps=torch.tensor(EPS)), TypeError, "eps must be a Python number"),
]


@pytest.mark.parametrize("args,exc,match", BAD)
def test_fwd_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        qk_norm_rope_fwd(**args)


@pytest.mark.parametrize("args,exc,match", [a for a in BAD if "eps" not in a[2]])
def test_bwd_rejects(args, exc, match):
    """The same checks on the backward, its outputs dq_pre, dk_pre in q, k's place."""
    a = dict(args)
    dq, dk = torch.zeros(5, 4, 16, device=DEVICE), torch.zeros(5, 2, 16, device=DEVICE)
    for short, long in (("q: ", "dq_pre: "), ("k: ", "dk_pre: ")):
        match = long + match[len(short):] if match.startswith(short) else match
    with pytest.raises(exc, match=match):
        qk_norm_rope_bwd(a["q"], a["k"], dq, dk, a["q_pre"], a["k_pre"], a["w_q"], a["w_k"],
                         a["rstd_q"], a["rstd_k"], a["cos"], a["sin"])


def test_bwd_rejects_bad_incoming_gradient():
    a = _fwd_args()
    common = (a["q_pre"], a["k_pre"], a["w_q"], a["w_k"], a["rstd_q"], a["rstd_k"], a["cos"], a["sin"])
    with pytest.raises(ValueError, match=r"dk: expected shape \(5, 2, 16\)"):
        qk_norm_rope_bwd(a["q"], a["k"], torch.zeros(5, 4, 16, device=DEVICE), torch.zeros(5, 4, 16, device=DEVICE),
                         *common)
    with pytest.raises(TypeError, match="dq: expected dtype torch.float32"):
        qk_norm_rope_bwd(a["q"], a["k"], torch.zeros(5, 4, 16, device=DEVICE, dtype=torch.float16),
                         torch.zeros(5, 2, 16, device=DEVICE), *common)
    with pytest.raises(ValueError, match="dq: expected device"):
        qk_norm_rope_bwd(a["q"], a["k"], torch.zeros(5, 4, 16, device="meta"), torch.zeros(5, 2, 16, device=DEVICE),
                         *common)
