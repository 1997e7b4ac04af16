"""Greedy generation with a KV cache, through lean's kernels: lean-train's before/after samples.

    ids = generate(model, lora, prompt_ids, max_new_tokens=32, stop_ids={eos})

Shape legend: T tokens fed this call (the prompt, then 1 per new token), L cache rows
(prompt + max_new_tokens), C hidden, H/KVH heads, D head dim, F MLP hidden, V vocab.

One call of `_forward_cached` runs the T new tokens through every layer: the layer is the
training forward (lean/models/dense.py) with three changes, all for the cache: k and v are
projected straight into the cache rows P..P+T-1 (P tokens already cached), RoPE uses the cached
table rows of those positions, and attention reads the whole cache up to P+T
(lean/kernels/kv_attention.py). No dropout; only the last token's hidden state goes through the
final norm and the lm_head; the argmax is a kernel too. The host reads one int per new token
(to stop at an end token): that read is the loop's only sync.

Tested: tests/test_generate.py (the tokens equal transformers' greedy `generate` of the PEFT model,
and every step's logits equal lean.forward over the whole sequence without a cache).
"""
import math

import numpy as np
import torch

from ..kernels.argmax import argmax_fwd
from ..kernels.embedding import embedding_fwd
from ..kernels.kv_attention import kv_attention_fwd
from ..kernels.rmsnorm import rmsnorm_fwd
from ..kernels.rope import rope_fwd, rope_inv_freq, rope_table
from ..kernels.swiglu import swiglu_fwd
from ..models.dense import Ctx, _attn_options, proj_fwd
from ..models.moe import moe_forward
from .head_host import lm_head_logits
from .step import check_compute_dtype, check_devices


def _rope_rows(model, n_rows):
    """cos, sin (L, D/2) fp32 for positions 0..L-1: built once per generation."""
    cfg, dev = model.config, model.device
    inv_freq, attn_scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or None)
    positions = torch.from_numpy(np.arange(n_rows, dtype=np.int32)).to(dev)  # (L,)
    cos = torch.empty(n_rows, cfg.head_dim // 2, dtype=torch.float32, device=dev)
    sin = torch.empty_like(cos)
    rope_table(cos, sin, positions, torch.from_numpy(inv_freq).to(dev), attn_scaling)
    return cos, sin


def _layer_cached(s, d, w, ads, ctx, li, cfg, kc, vc, P, cos, sin):
    """One decoder layer over T new tokens with the cache (kc, vc: (L, KVH, D)); returns (mid, m)."""
    T, C, H, KVH, D = s.shape[0], cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    new = lambda *shape, dt=s.dtype: torch.empty(*shape, dtype=dt, device=s.device)  # noqa: E731
    n1, rstd = new(T, C), new(T, dt=torch.float32)
    x = s if d is None else new(T, C)
    rmsnorm_fwd(n1, rstd, s, w.in_norm, ctx.eps, **({} if d is None else dict(residual=d, h=x)))
    q = new(T, H * D)
    k = kc[P:P + T].view(T, KVH * D)  # the new keys and values land in the cache
    v = vc[P:P + T].view(T, KVH * D)
    unused = {}
    proj_fwd(q, unused, n1, w.q, w.q_bias, ads.get("q"), "q", ctx, li)
    if cfg.qk_norm:
        q_pre, k_pre = q, new(T, KVH * D)
        q = new(T, H * D)
        proj_fwd(k_pre, unused, n1, w.k, w.k_bias, ads.get("k"), "k", ctx, li)
        rmsnorm_fwd(q.view(T * H, D), new(T * H, dt=torch.float32), q_pre.view(T * H, D), w.q_norm, ctx.eps)
        rmsnorm_fwd(k.view(T * KVH, D), new(T * KVH, dt=torch.float32), k_pre.view(T * KVH, D), w.k_norm,
                    ctx.eps)
    else:
        proj_fwd(k, unused, n1, w.k, w.k_bias, ads.get("k"), "k", ctx, li)
    proj_fwd(v, unused, n1, w.v, w.v_bias, ads.get("v"), "v", ctx, li)
    q3 = q.view(T, H, D)
    rope_fwd(q3, k.view(T, KVH, D), cos[P:P + T], sin[P:P + T])
    o = new(T, H * D)
    kv_attention_fwd(o.view(T, H, D), q3, kc, vc, P, ctx.attn_scale, **_attn_options(w, cfg, li))
    a = new(T, C)
    proj_fwd(a, unused, o, w.o, w.o_bias, ads.get("o"), "o", ctx, li)
    mid, n2 = new(T, C), new(T, C)
    rmsnorm_fwd(n2, rstd, x, w.post_norm, ctx.eps, residual=a, h=mid)
    m = new(T, C)
    if w.moe:  # the Mixture-of-Experts block, as in training (ctx.moe None: no step counts)
        moe_forward(m, n2, w, ads, ctx, cfg)
        return mid, m
    gate, up, act = new(T, cfg.intermediate), new(T, cfg.intermediate), new(T, cfg.intermediate)
    proj_fwd(gate, unused, n2, w.gate, None, ads.get("gate"), "gate", ctx, li)
    proj_fwd(up, unused, n2, w.up, None, ads.get("up"), "up", ctx, li)
    swiglu_fwd(act, gate, up)
    proj_fwd(m, unused, act, w.down, None, ads.get("down"), "down", ctx, li)
    return mid, m


def _forward_cached(model, lora, ids, P, cache, cos, sin, ctx):
    """Logits (1, V) of the last of the T tokens `ids` (device int32), appended at position P."""
    cfg = model.config
    T = ids.shape[0]
    if lora is not None and lora.ring is not None:
        lora.ring.join()  # host state: an optimizer step's update may still be writing lowp
    s = torch.empty(T, cfg.hidden, dtype=model.dtype, device=model.device)  # (T, C)
    embedding_fwd(s, ids, model.embed)
    d = None
    for li, w in enumerate(model.layers):
        ads = lora.layers[li] if lora is not None else {}
        s, d = _layer_cached(s, d, w, ads, ctx, li, cfg, cache[li][0], cache[li][1], P, cos, sin)
    last_s, last_d = s[T - 1:], d[T - 1:]
    x, nf = torch.empty_like(last_s), torch.empty_like(last_s)  # (1, C)
    rmsnorm_fwd(nf, torch.empty(1, dtype=torch.float32, device=s.device), last_s, model.norm, cfg.rms_eps,
                residual=last_d, h=x)
    logits = torch.empty(1, cfg.vocab, dtype=model.dtype, device=s.device)  # (1, V)
    lm_head_logits(logits, nf, model)  # streamed in chunks when the lm_head is on the host
    return logits


def generate(model, lora, prompt_ids, max_new_tokens=32, stop_ids=(), on_logits=None):
    """Greedy continuation of prompt_ids (a list of ints): the new token ids (stop token included
    when one is produced). lora may be None (the base model). on_logits(step, logits (1, V)) is
    called for every step (tests compare them with a cache-free forward)."""
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty (give at least one token, e.g. the BOS token)")
    check_compute_dtype(model)
    check_devices(model)
    cfg, dev = model.config, model.device
    bad = [i for i in prompt_ids if not 0 <= int(i) < cfg.vocab]
    if bad:
        raise ValueError(f"generate: prompt ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab}): "
                         "the tokenizer is not this model's")
    if max_new_tokens < 1:
        return []
    L = len(prompt_ids) + max_new_tokens
    cache = [(torch.empty(L, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev),
              torch.empty(L, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev))
             for _ in model.layers]  # (L, KVH, D) keys and values per layer
    cos, sin = _rope_rows(model, L)
    ctx = Ctx(cu_seqlens=None, max_seqlen=0, cos=None, sin=None, eps=cfg.rms_eps,
              attn_scale=1.0 / math.sqrt(cfg.head_dim), lora_scale=lora.scale if lora is not None else 0.0,
              dropout=0.0, seed=0)
    ids = torch.from_numpy(np.asarray(prompt_ids, dtype=np.int32)).to(dev)  # (T,)
    idx = torch.empty(1, dtype=torch.int64, device=dev)
    stop, out, P = set(stop_ids), [], 0
    for step in range(max_new_tokens):
        logits = _forward_cached(model, lora, ids, P, cache, cos, sin, ctx)
        if on_logits is not None:
            on_logits(step, logits)
        argmax_fwd(idx, logits)
        P += ids.shape[0]
        tok = int(idx.item())  # sync: the host decides whether to stop
        out.append(tok)
        if tok in stop:
            break
        ids = torch.from_numpy(np.asarray([tok], dtype=np.int32)).to(dev)
    return out
