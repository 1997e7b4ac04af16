"""fp64 reference for lean/kernels/kv_attention.py: causal attention of new tokens over a cache."""
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
