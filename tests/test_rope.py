"""lean/kernels/rope.py against transformers' RoPE (init functions, rotary class, apply_rotary_pos_emb)
and lean/reference/rope.py (backward through autograd)."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lean.kernels.rope import rope_bwd, rope_fwd, rope_inv_freq, rope_table
from lean.reference.rope import rope_ref, rope_table_ref
from tests.util import DEVICE, LOWP, ON_GPU, assert_close_rule, fresh_generator, poison, randn

DTYPES = [torch.float32, LOWP]
# name -> (theta, HF rope dict without theta)
ROPES = {
    "default": (10000.0, {"rope_type": "default"}),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3.1": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3.2": (500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn-qwen": (1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-deepseek": (10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "yarn-untruncated": (150000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3,
                                    "truncate": False}),
    "legacy-linear": (10000.0, {"type": "linear", "factor": 2.0}),   # transformers 4.x rope_scaling
}
# Positions: CPU keeps angles below 1e4 rad, where torch's CPU float32 cos/sin (Sleef) are accurate.
MAX_POS = 131000 if ON_GPU else 8000


def _hf_config(D, theta, scaling, H=4, KVH=2):
    params = {"rope_theta": theta, **scaling}
    if "type" in params:
        params["rope_type"] = params.pop("type")
    return LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=KVH, head_dim=D,
                       max_position_embeddings=4 * 131072, rope_parameters=params)


def _hf_inv_freq(config):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def _packed_positions(n_docs, g, max_len=24):
    """Positions (N,) int32 of a packed batch: restart at 0 per document, with length-1 documents, and
    last a document that continues a long one (starts deep into it) to reach large angles; the last
    token is then not at position 0, where the rotation is the identity and an unwritten token hides."""
    lens = torch.randint(2, max_len, (n_docs,), generator=g, device=DEVICE).tolist()
    lens[0] = lens[2] = 1
    starts = [0] * n_docs
    starts[-1] = MAX_POS - max_len
    pos = [torch.arange(s, s + n, dtype=torch.int32, device=DEVICE) for s, n in zip(starts, lens)]
    return torch.cat(pos)


def _ours(positions, D, theta, scaling):
    inv_np, scale = rope_inv_freq(D, theta, scaling)
    N = positions.shape[0]
    cos = torch.empty(N, D // 2, device=DEVICE)  # (N, D/2)
    sin = torch.empty(N, D // 2, device=DEVICE)  # (N, D/2)
    poison(cos, sin)
    rope_table(cos, sin, positions, torch.from_numpy(inv_np).to(DEVICE), scale)
    return inv_np, scale, cos, sin


# ----------------------------------------------------------------------------- rope_inv_freq

def test_inv_freq_matches_transformers():
    """Same float32 steps as transformers' init functions; only torch's vectorised pow (<= 1 ulp, see
    the kernel docstring) may differ: at most 2 ulp per element, and in few elements (a step done
    differently, e.g. a division for torch's reciprocal-multiply, would move far more)."""
    n_total = n_diff = 0
    for name, (theta, scaling) in ROPES.items():
        for D in (32, 64, 80, 96, 128, 256):
            ref, ref_scale = _hf_inv_freq(_hf_config(D, theta, scaling))
            ours, scale = rope_inv_freq(D, theta, scaling)
            assert ours.dtype == np.float32 and ours.shape == (D // 2,), (ours.dtype, ours.shape)
            assert scale == ref_scale, f"{name} D={D}: attention_scaling {scale} != transformers' {ref_scale}"
            ref = ref.numpy()
            ulps = np.abs(ours.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
            assert ulps.max() <= 2, f"{name} D={D}: inv_freq off by {ulps.max()} ulp at {ulps.argmax()}"
            n_total, n_diff = n_total + ulps.size, n_diff + int((ulps > 0).sum())
    assert n_diff <= 0.03 * n_total, f"{n_diff} of {n_total} inv_freq elements differ from transformers'"


@pytest.mark.parametrize("args,match", [
    ((64, 1e4, {"rope_type": "dynamic", "factor": 2.0}), "supported are default, linear, llama3, yarn"),
    ((64, 1e4, {"rope_type": "longrope"}), "unsupported rope_type 'longrope'"),
    ((63, 1e4, None), "positive even integer"),
    ((64, 1e4, {"rope_type": "linear"}), "needs 'factor'"),
    ((64, 5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     "needs 'original_max_position_embeddings'"),
    ((64, 1e6, {"rope_type": "yarn", "original_max_position_embeddings": 32768}), "needs 'factor'"),
    ((64, 1e4, {"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    ((64, 1e4, {"rope_type": "default", "rope_theta": 5e5}), "rope_theta"),
])
def test_inv_freq_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(*args)


# ----------------------------------------------------------------------------- rope_table

TABLE_CASES = [("default", 32, 5), ("linear", 80, 7), ("llama3.2", 128, 6), ("yarn-qwen", 64, 9),
               ("yarn-deepseek", 80, 4),
               pytest.param("llama3.1", 128, 700, marks=pytest.mark.gpu),
               pytest.param("yarn-qwen", 128, 700, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("rope,D,n_docs", TABLE_CASES)
def test_table_matches_hf_rotary_class(rope, D, n_docs):
    """cos, sin against HF's rotary class on the same positions, fed HF's own inv_freq buffer so the
    angles are the same fp32 products (rope_inv_freq is compared separately above)."""
    g = fresh_generator()
    theta, scaling = ROPES[rope]
    rot = LlamaRotaryEmbedding(_hf_config(D, theta, scaling)).to(DEVICE)
    positions = _packed_positions(n_docs, g)
    N = positions.shape[0]
    hf_cos, hf_sin = rot(torch.zeros(1, device=DEVICE), positions[None].long())  # (1, N, D) fp32
    _, scale = rope_inv_freq(D, theta, scaling)
    assert scale == rot.attention_scaling
    cos, sin = torch.empty(N, D // 2, device=DEVICE), torch.empty(N, D // 2, device=DEVICE)  # (N, D/2)
    poison(cos, sin)
    rope_table(cos, sin, positions, rot.inv_freq.float().contiguous(), scale)
    assert_close_rule(cos, hf_cos[0, :, : D // 2], name="cos")
    assert_close_rule(sin, hf_sin[0, :, : D // 2], name="sin")


# ----------------------------------------------------------------------------- rope_fwd

FWD_CASES = [(rope, D, 6, 2, 5) for rope in ("default", "llama3.2", "yarn-qwen") for D in (32, 64, 80, 128)]
FWD_CASES += [("llama3.1", 64, 5, 5, 4), ("yarn-deepseek", 80, 9, 3, 4)]   # MHA; heads blocked 1 at a time
FWD_CASES += [pytest.param("llama3.1", 128, 32, 8, 700, marks=pytest.mark.gpu),      # Llama 3.1 8B
              pytest.param("llama3.2", 64, 32, 8, 700, marks=pytest.mark.gpu),       # Llama 3.2 1B
              pytest.param("yarn-qwen", 128, 28, 4, 700, marks=pytest.mark.gpu)]     # Qwen2.5 7B + yarn


@pytest.mark.parametrize("rope,D,H,KVH,n_docs", FWD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_matches_hf(dtype, rope, D, H, KVH, n_docs):
    """The whole path (rope_inv_freq -> rope_table -> rope_fwd on q, k sliced from a fused qkv buffer)
    against HF's rotary class + apply_rotary_pos_emb; v must be left untouched."""
    g = fresh_generator()
    theta, scaling = ROPES[rope]
    config = _hf_config(D, theta, scaling, H, KVH)
    positions = _packed_positions(n_docs, g)
    N = positions.shape[0]
    qkv = randn(N, (H + 2 * KVH) * D, g=g, dtype=dtype, scale=2.0)  # (N, (H+2KVH)*D)
    q, k = qkv[:, : H * D].view(N, H, D), qkv[:, H * D: (H + KVH) * D].view(N, KVH, D)
    q0, k0, v0 = q.clone(), k.clone(), qkv[:, (H + KVH) * D:].clone()

    inv_np, _, cos, sin = _ours(positions, D, theta, scaling)
    rope_fwd(q, k, cos, sin)
    assert torch.equal(qkv[:, (H + KVH) * D:], v0), "rope_fwd wrote outside q and k"

    rot = LlamaRotaryEmbedding(config).to(DEVICE)

    def hf(qx, kx):
        c, s = rot(qx, positions[None].long())  # (1, N, D) in qx.dtype
        qe, ke = apply_rotary_pos_emb(qx[None], kx[None], c, s, unsqueeze_dim=2)
        return qe[0], ke[0]

    q_ref, k_ref = hf(q0.float(), k0.float())
    q_low, k_low = hf(q0, k0) if dtype != torch.float32 else (None, None)
    # Where our inv_freq differs from HF's by an ulp (see test_inv_freq_matches_transformers) the angle
    # differs by at most pos * |d inv_freq|, moving an output by at most that times (|x1| + |x2|) * scale.
    d_inv = np.abs(inv_np.astype(np.float64) - rot.inv_freq.cpu().double().numpy()).max()
    x_max = max(q0.abs().max().item(), k0.abs().max().item())
    atol = positions.max().item() * d_inv * 2 * x_max * rot.attention_scaling
    assert_close_rule(q, q_ref, q_low, atol=atol, name="q")
    assert_close_rule(k, k_ref, k_low, atol=atol, name="k")


# ----------------------------------------------------------------------------- rope_bwd

BWD_CASES = [(D, 6, 2, 9) for D in (32, 64, 80, 128)] + [(64, 3, 3, 5)]
BWD_CASES += [pytest.param(128, 32, 8, 700, marks=pytest.mark.gpu),
              pytest.param(80, 32, 32, 300, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("D,H,KVH,n_docs", BWD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_matches_autograd(dtype, D, H, KVH, n_docs):
    """rope_bwd against autograd through the reference forward; dq, dk are strided views whose head
    stride is not D (padding after each head must stay untouched)."""
    g = fresh_generator()
    positions = _packed_positions(n_docs, g)
    N = positions.shape[0]
    theta, scaling = ROPES["yarn-qwen"]   # attention_scaling != 1
    inv_np, scale = rope_inv_freq(D, theta, scaling)
    cos, sin = rope_table_ref(positions, torch.from_numpy(inv_np).to(DEVICE), scale)
    dq_buf = randn(N, H, D + 8, g=g, dtype=dtype)  # (N, H, D+8): head stride D+8
    dk_buf = randn(N, KVH, D + 8, g=g, dtype=dtype)
    dq, dk = dq_buf[..., :D], dk_buf[..., :D]
    dq0, dk0, pad_q, pad_k = dq.clone(), dk.clone(), dq_buf[..., D:].clone(), dk_buf[..., D:].clone()

    def grad(dout, heads, dt):
        x = torch.zeros(N, heads, D, device=DEVICE, dtype=dt, requires_grad=True)
        rope_ref(x, cos, sin).backward(dout.to(dt))
        return x.grad

    rope_bwd(dq, dk, cos, sin)
    assert torch.equal(dq_buf[..., D:], pad_q) and torch.equal(dk_buf[..., D:], pad_k), "wrote into padding"
    low = dtype != torch.float32
    assert_close_rule(dq, grad(dq0.float(), H, torch.float32), grad(dq0, H, dtype) if low else None, name="dq")
    assert_close_rule(dk, grad(dk0.float(), KVH, torch.float32), grad(dk0, KVH, dtype) if low else None, name="dk")


@pytest.mark.parametrize("D", [32, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_undoes_fwd(dtype, D):
    """rope_bwd(rope_fwd(x)) == x * attention_scaling**2 (a rotation and its transpose)."""
    g = fresh_generator()
    H, KVH = 4, 2
    positions = _packed_positions(5, g)
    N = positions.shape[0]
    theta, scaling = ROPES["yarn-deepseek"]
    inv_np, scale, cos, sin = _ours(positions, D, theta, scaling)
    q0, k0 = randn(N, H, D, g=g, dtype=dtype), randn(N, KVH, D, g=g, dtype=dtype)
    q, k = q0.clone(), k0.clone()
    rope_fwd(q, k, cos, sin)
    rope_bwd(q, k, cos, sin)

    def low(x):  # torch's own round trip in the low dtype
        return rope_ref(rope_ref(x, cos, sin), cos, -sin) if dtype != torch.float32 else None

    assert_close_rule(q, q0.float() * scale**2, low(q0), name="q")
    assert_close_rule(k, k0.float() * scale**2, low(k0), name="k")


# ----------------------------------------------------------------------------- rejection

def _args(N=5, H=4, KVH=2, D=16, dtype=torch.float32):
    z = lambda *s, dt=dtype: torch.zeros(*s, device=DEVICE, dtype=dt)
    return dict(q=z(N, H, D), k=z(N, KVH, D), cos=z(N, D // 2, dt=torch.float32), sin=z(N, D // 2, dt=torch.float32))


def _with(**over):
    a = _args()
    a.update(over)
    return a


ROTATE_BAD = [
    (_with(q=torch.zeros(5, 64, device=DEVICE)), ValueError, "q: expected shape"),
    (_with(k=torch.zeros(5, 2, 18, device=DEVICE)), ValueError, "k: expected shape"),
    (_with(k=torch.zeros(6, 2, 16, device=DEVICE)), ValueError, "k: expected shape"),
    (_with(k=torch.zeros(5, 0, 16, device=DEVICE)), ValueError, "at least one head"),
    (_args(D=15) | dict(cos=torch.zeros(5, 7, device=DEVICE), sin=torch.zeros(5, 7, device=DEVICE)),
     ValueError, "head dim must be even"),
    (_with(cos=torch.zeros(5, 16, device=DEVICE)), ValueError, "cos: expected shape"),
    (_with(sin=torch.zeros(4, 8, device=DEVICE)), ValueError, "sin: expected shape"),
    (_args(dtype=torch.int32), TypeError, "q: expected dtype"),
    (_with(k=torch.zeros(5, 2, 16, device=DEVICE, dtype=torch.float16)), TypeError, "k: expected dtype"),
    (_with(cos=torch.zeros(5, 8, device=DEVICE, dtype=torch.float16)), TypeError, "cos: expected dtype"),
    (_with(q=torch.zeros(5, 16, 4, device=DEVICE).transpose(1, 2)), ValueError, "q: expected unit stride"),
    (_with(sin=torch.zeros(8, 5, device=DEVICE).t()), ValueError, "sin: expected a contiguous"),
    (_with(k=torch.zeros(5, 2, 16, device="meta")), ValueError, "k: expected device"),
    (_with(cos=torch.zeros(5, 8, device="meta")), ValueError, "cos: expected device"),
]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("args,exc,match", ROTATE_BAD)
def test_rotate_rejects(args, exc, match, direction):
    a = dict(args)
    if direction == "bwd":   # same checks, the gradients named as such
        a = dict(dq=a.pop("q"), dk=a.pop("k"), **a)
        match = match.replace("q:", "dq:").replace("k:", "dk:")
    with pytest.raises(exc, match=match):
        (rope_fwd if direction == "fwd" else rope_bwd)(*a.values())


def _table_args(**over):
    a = dict(cos=torch.zeros(5, 8, device=DEVICE), sin=torch.zeros(5, 8, device=DEVICE),
             positions=torch.zeros(5, dtype=torch.int32, device=DEVICE), inv_freq=torch.ones(8, device=DEVICE))
    a.update(over)
    return a


@pytest.mark.parametrize("args,exc,match", [
    (_table_args(positions=torch.zeros(5, dtype=torch.int64, device=DEVICE)), TypeError, "positions: expected dtype"),
    (_table_args(positions=torch.zeros(5, 1, dtype=torch.int32, device=DEVICE)), ValueError,
     "positions: expected shape"),
    (_table_args(cos=torch.zeros(5, 9, device=DEVICE)), ValueError, "cos: expected shape"),
    (_table_args(sin=torch.zeros(5, 8, device=DEVICE, dtype=torch.float16)), TypeError, "sin: expected dtype"),
    (_table_args(cos=torch.zeros(8, 5, device=DEVICE).t()), ValueError, "cos: expected a contiguous"),
    (_table_args(inv_freq=torch.ones(8, device="meta")), ValueError, "inv_freq: expected device"),
    (_table_args(inv_freq=torch.ones(300, device=DEVICE), cos=torch.zeros(5, 300, device=DEVICE),
                 sin=torch.zeros(5, 300, device=DEVICE)), ValueError, "1 to 256 frequencies"),
])
def test_table_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        rope_table(*args.values(), 1.0)
