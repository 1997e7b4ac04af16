"""Plain-torch references for lean/kernels/attention.py (varlen causal GQA attention).

Shapes: q (N, H, D), k, v (N, KVH, D), cu_seqlens (B+1,) int32; kv head of query head h is h // (H // KVH).
Both functions compute in the dtype they are given (upcast the inputs for a high-precision
reference) and are differentiable, so backward references come from torch.autograd.
"""
import torch
import torch.nn.functional as F


def _lengths(cu_seqlens):
    cu = [int(c) for c in cu_seqlens.tolist()]  # host sync: test-only
    return cu, [b - a for a, b in zip(cu[:-1], cu[1:])]


def attention_ref(q, k, v, cu_seqlens, scale):
    """Padded reference: every document padded to the longest and run as one (B, H, L, L) batch
    of plain causal attention with a key-padding mask. Returns o (N, H, D) and lse (H, N)."""
    cu, lens = _lengths(cu_seqlens)
    N, H, D = q.shape
    G = H // k.shape[1]
    B, L = len(lens), max(max(lens), 1)
    pos = torch.arange(L, device=q.device)
    lens_t = torch.tensor(lens, device=q.device)
    valid = pos[None, :] < lens_t[:, None]                                  # (B, L)
    idx = (torch.tensor(cu[:-1], device=q.device)[:, None] + pos[None, :]).clamp(max=max(N - 1, 0))
    qp = q[idx].transpose(1, 2)                                             # (B, H, L, D)
    kp = k[idx].transpose(1, 2).repeat_interleave(G, dim=1)
    vp = v[idx].transpose(1, 2).repeat_interleave(G, dim=1)
    s = scale * qp @ kp.transpose(-1, -2)                                   # (B, H, L, L)
    # causal, and keys inside the document (an empty document keeps key 0 so no row is all -inf)
    keep = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens_t.clamp(min=1)[:, None, None])
    s = s.masked_fill(~keep[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                        # (B, H, L)
    o = torch.exp(s - lse[..., None]) @ vp                                  # (B, H, L, D)
    # valid (b, i) in row-major order are exactly the tokens cu[0]:cu[B] in order
    o = o.transpose(1, 2)[valid]                                            # (N, H, D)
    lse = lse.transpose(1, 2)[valid].t()                                    # (H, N)
    return o, lse


def attention_sdpa(q, k, v, cu_seqlens, scale):
    """torch.nn.functional.scaled_dot_product_attention run on each document alone. o (N, H, D)."""
    cu, lens = _lengths(cu_seqlens)
    outs = []
    for a, n in zip(cu[:-1], lens):
        if n == 0:
            continue
        qd, kd, vd = (t[a:a + n].transpose(0, 1)[None] for t in (q, k, v))    # (1, heads, n, D)
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(od[0].transpose(0, 1))                                   # (n, H, D)
    return torch.cat(outs, dim=0)
