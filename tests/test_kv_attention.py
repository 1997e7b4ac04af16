"""kv_attention_fwd (the decode path's attention over a KV cache, with GPT-OSS's sinks and window)
and argmax_fwd."""
import pytest
import torch

from lean.kernels.argmax import argmax_fwd
from lean.kernels.kv_attention import kv_attention_fwd
from lean.reference.kv_attention import kv_attention_ref, kv_attention_sdpa
from tests.util import DEVICE, LOWP, assert_close_rule, fresh_generator, poison, randn

CASES = [  # (T, n_past, H, KVH, D, L)
    (1, 0, 3, 3, 64, 5),       # the first token alone
    (1, 37, 6, 2, 64, 41),     # decode, G = 3
    (19, 0, 4, 1, 80, 19),     # prefill, D not a power of two, G = 4
    (5, 131, 2, 2, 32, 140),   # several new tokens after a long past
]


@pytest.mark.parametrize("dtype", [torch.float32, LOWP])
@pytest.mark.parametrize("T,P,H,KVH,D,L", CASES)
def test_kv_attention_matches_reference(dtype, T, P, H, KVH, D, L):
    g = fresh_generator()
    q = randn(T, H, D, g=g, dtype=dtype)
    kc = randn(L, KVH, D, g=g, dtype=dtype)
    vc = randn(L, KVH, D, g=g, dtype=dtype)
    scale = D ** -0.5
    o = torch.empty(T, H, D, dtype=dtype, device=DEVICE)
    poison(o)
    kv_attention_fwd(o, q, kc, vc, P, scale)
    ref = kv_attention_ref(q, kc, vc, P, scale)
    lowp = None if dtype == torch.float32 else kv_attention_sdpa(q, kc, vc, P, scale)
    assert_close_rule(o, ref, lowp, atol=1e-3 if dtype != torch.float32 else 0.0, name="o")


@pytest.mark.parametrize("dtype", [torch.float32, LOWP])
@pytest.mark.parametrize("window, sinks", [(0, True), (1, True), (3, False), (16, True)])
@pytest.mark.parametrize("T,P,H,KVH,D,L", CASES)
def test_kv_attention_sinks_window_match_reference(dtype, window, sinks, T, P, H, KVH, D, L):
    # GPT-OSS's options: drawn sink logits (fp32, or the inputs' dtype in 16 bits), the window
    # counted back from each new token's own position (P + t)
    g = fresh_generator()
    q = randn(T, H, D, g=g, dtype=dtype)
    kc = randn(L, KVH, D, g=g, dtype=dtype)
    vc = randn(L, KVH, D, g=g, dtype=dtype)
    s = randn(H, g=g, dtype=dtype, scale=2.0) if sinks else None
    scale = D ** -0.5
    o = torch.empty(T, H, D, dtype=dtype, device=DEVICE)
    poison(o)
    kv_attention_fwd(o, q, kc, vc, P, scale, sinks=s, window=window)
    ref = kv_attention_ref(q, kc, vc, P, scale, sinks=s, window=window)
    lowp = None if dtype == torch.float32 else kv_attention_sdpa(q, kc, vc, P, scale, sinks=s, window=window)
    assert_close_rule(o, ref, lowp, atol=1e-3 if dtype != torch.float32 else 0.0, name="o")


def test_kv_attention_rejects_bad_input():
    q = torch.zeros(1, 4, 64, device=DEVICE)
    kc = torch.zeros(8, 2, 64, device=DEVICE)
    o = torch.empty_like(q)
    with pytest.raises(ValueError, match="grow the cache"):
        kv_attention_fwd(o, q, kc, kc, 8, 0.1)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        kv_attention_fwd(torch.empty(1, 3, 64, device=DEVICE), torch.zeros(1, 3, 64, device=DEVICE), kc, kc, 0, 0.1)
    with pytest.raises(TypeError, match="dtype"):
        kv_attention_fwd(o, q, kc.half(), kc.half(), 0, 0.1)
    with pytest.raises(ValueError, match="shape"):
        kv_attention_fwd(o, q, kc, torch.zeros(8, 2, 32, device=DEVICE), 0, 0.1)
    with pytest.raises(ValueError, match="sinks: expected shape"):
        kv_attention_fwd(o, q, kc, kc, 0, 0.1, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="window"):
        kv_attention_fwd(o, q, kc, kc, 0, 0.1, window=-2)


@pytest.mark.parametrize("dtype", [torch.float32, LOWP])
@pytest.mark.parametrize("M,V", [(1, 49152), (3, 131), (2, 10007)])
def test_argmax_matches_torch(dtype, M, V):
    g = fresh_generator()
    x = randn(M, V, g=g, dtype=dtype)
    x[0, V // 3] = 50.0          # a tie across blocks: the first index wins, as in torch
    x[0, V - 1] = 50.0
    if M > 1:
        x[1, :] = float("-inf")  # an all -inf row: index 0, as torch
    idx = torch.empty(M, dtype=torch.int64, device=DEVICE)
    poison(idx)
    argmax_fwd(idx, x)
    assert torch.equal(idx.cpu(), torch.argmax(x.float(), dim=1).cpu())
