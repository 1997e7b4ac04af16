"""References for lean/kernels/kv_attention.py: causal attention of new tokens over a cache.

Shapes: T new tokens, L cache rows, H/KVH heads, D head dim; token t sees cache rows 0..n_past+t.
kv_attention_ref is the fp64 reference, kv_attention_sdpa torch's own result in q's dtype. Both take
GPT-OSS's options as lean/reference/attention.py states them: sinks (H,) in the denominator only,
window W > 0: token t sees cache rows j with n_past + t - W < j <= n_past + t.
"""
import torch


def _keep(T, S, n_past, window, device):
    q_pos = (n_past + torch.arange(T, device=device))[:, None]
    j = torch.arange(S, device=device)[None, :]
    keep = j <= q_pos                                                       # (T, S)
    return keep & (q_pos - j < window) if window else keep


def kv_attention_ref(q, k_cache, v_cache, n_past, scale, sinks=None, window=0):
    """q (T, H, D); caches (L, KVH, D); token t sees cache rows 0..n_past+t (the last `window` of
    them with a window). Returns (T, H, D) fp64."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    S = n_past + T
    k = k_cache[:S].double().repeat_interleave(G, dim=1)  # (S, H, D)
    v = v_cache[:S].double().repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    s = s.masked_fill(~_keep(T, S, n_past, window, s.device)[None], float("-inf"))
    if sinks is not None:  # a sink column in the softmax, dropped after it
        s = torch.cat([s, sinks.double().view(H, 1, 1).expand(H, T, 1)], dim=-1)
        return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1)[..., :S], v)
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)


def kv_attention_sdpa(q, k_cache, v_cache, n_past, scale, sinks=None, window=0):
    """torch's own attention in q's dtype (SDPA with an explicit causal-offset mask; with sinks,
    the eager softmax with a sink column as HF computes it). (T, H, D)."""
    T, H, D = q.shape
    G = H // k_cache.shape[1]
    S = n_past + T
    k = k_cache[:S].repeat_interleave(G, dim=1).transpose(0, 1)  # (H, S, D)
    v = v_cache[:S].repeat_interleave(G, dim=1).transpose(0, 1)
    keep = _keep(T, S, n_past, window, q.device)
    if sinks is not None:
        s = (q.transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~keep[None], float("-inf"))  # (H, T, S)
        s = torch.cat([s, sinks.to(s.dtype).view(H, 1, 1).expand(H, T, 1)], dim=-1)
        p = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)[..., :S]
        return (p @ v).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=keep, scale=scale)
    return o.transpose(0, 1)
