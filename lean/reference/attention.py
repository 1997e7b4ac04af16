"""Plain-torch references for lean/kernels/attention.py (varlen causal GQA attention).

Shapes: q (N, H, D), k, v (N, KVH, D), cu_seqlens (B+1,) int32; kv head of query head h is h // (H // KVH).
GPT-OSS's options (transformers' gpt_oss eager_attention_forward and masking_utils):
    sinks (H,): one logit per head appended to every row's scores (not scaled), dropped after the
        softmax: it enters the denominator only.
    window W > 0: key j is visible from query i iff j <= i and i - j < W (masking_utils'
        sliding_window_overlay: kv_idx > q_idx - W), so each query sees its W most recent keys.
Both functions compute in the dtype they are given (upcast the inputs for a high-precision
reference) and are differentiable, so backward references come from torch.autograd.
"""
import torch
import torch.nn.functional as F


def _lengths(cu_seqlens):
    cu = [int(c) for c in cu_seqlens.tolist()]  # host sync: test-only
    return cu, [b - a for a, b in zip(cu[:-1], cu[1:])]


def attention_ref(q, k, v, cu_seqlens, scale, sinks=None, window=0):
    """Padded reference: every document padded to the longest and run as one (B, H, L, L) batch
    of plain causal attention with a key-padding mask, optionally windowed and with sink logits.
    Returns o (N, H, D) and lse (H, N) (the sinks inside lse)."""
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
    if window:  # padding rows the window leaves without a key keep key 0 (they are dropped below)
        keep = keep & (pos[:, None] - pos[None, :] < window)[None]
        keep = keep | (~keep.any(-1, keepdim=True) & (pos == 0))
    s = s.masked_fill(~keep[:, None], float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(s, dim=-1)                                    # (B, H, L)
    else:  # a column of sink logits: in the denominator, no value row
        sink_col = sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, L, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)     # (B, H, L)
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
