"""References for lean/kernels/kv_attention.py: causal attention of new tokens over a cache.

Shapes: T new tokens, L cache rows, H/KVH heads, D head dim; token t sees cache rows 0..n_past+t.
kv_attention_ref is the fp64 reference, kv_attention_sdpa torch's own result in q's dtype.
"""
import torch


def kv_attention_ref(q, k_cache, v_cache, n_past, scale):
    """q (T, H, D); caches (L, KVH, D); token t sees cache rows 0..n_past+t. Returns (T, H, D) fp64."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    S = n_past + T
    k = k_cache[:S].double().repeat_interleave(G, dim=1)  # (S, H, D)
    v = v_cache[:S].double().repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    keep = torch.arange(S)[None, :] <= (n_past + torch.arange(T))[:, None]  # (T, S)
    s = s.masked_fill(~keep[None].to(s.device), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)


def kv_attention_sdpa(q, k_cache, v_cache, n_past, scale):
    """torch's own attention in q's dtype (SDPA with an explicit causal-offset mask). (T, H, D)."""
    T, H, D = q.shape
    G = H // k_cache.shape[1]
    S = n_past + T
    k = k_cache[:S].repeat_interleave(G, dim=1).transpose(0, 1)  # (H, S, D)
    v = v_cache[:S].repeat_interleave(G, dim=1).transpose(0, 1)
    keep = torch.arange(S, device=q.device)[None, :] <= (n_past + torch.arange(T, device=q.device))[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=keep, scale=scale)
    return o.transpose(0, 1)
