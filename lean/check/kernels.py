"""lean-check's kernel checks, part one: norms, RoPE, attention, SwiGLU, embedding and the decode
kernels, each against its plain-torch reference (lean/reference) by the tolerance rule.

Shape legend: N tokens, C hidden, H/KVH heads, D head dim, D2 = D/2, F MLP hidden, V vocab,
T new tokens and L cache rows (decode).

Every kernel runs through its public launcher at the model's shapes and with the buffers the step
gives it (the same in-place writes and aliases as lean/models/dense.py), so its config chooser
picks what the step would on this GPU. Launchers are called through their modules
(`rmsnorm.rmsnorm_fwd`), so a kernel swapped in at run time (a test's monkeypatch, an
experimenter's edit) is the one checked. One Report line per kernel call; inputs are fresh draws
from the case's seeded generator.
"""
import torch

from ..kernels import argmax, attention, embedding, kv_attention, qk_norm_rope, rmsnorm, rope, swiglu
from ..reference.attention import attention_sdpa
from ..reference.embedding import embedding_ref
from ..reference.kv_attention import kv_attention_ref, kv_attention_sdpa
from ..reference.qk_norm_rope import qk_norm_rope_ref
from ..reference.rmsnorm import rmsnorm_bwd_ref, rmsnorm_ref
from ..reference.rope import rope_ref, rope_table_ref
from ..reference.rule import close_rule, exact_rule
from ..reference.swiglu import swiglu_bwd_ref, swiglu_ref


def poison(*tensors):
    """NaN in every output before a launch, so an element the kernel never writes fails the rule."""
    for t in tensors:
        t.fill_(float("nan"))


def vjp(fn, dout, *inputs):
    """torch.autograd's gradients of <dout, fn(*inputs)> with respect to inputs (the backward references)."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    return torch.autograd.grad(fn(*xs), xs, dout)


def norm_weight(case, n):
    """A norm weight around 1, like a trained one (a random-init one is all ones)."""
    return (1.0 + 0.5 * case.randn(n, dtype=torch.float32)).to(case.dtype)


def check_rmsnorm(case, report):
    """norm2 of layer_forward (x + a fused, h written) and layer_backward's rmsnorm_bwd (dx over the
    residual gradient, the normed output written again over dy)."""
    N, C, eps = case.n, case.cfg.hidden, case.cfg.rms_eps
    x, res, w = case.randn(N, C), case.randn(N, C), norm_weight(case, C)
    y, h, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(N, device=x.device)  # (N, C), (N, C), (N,)
    poison(y, h, rstd)
    rmsnorm.rmsnorm_fwd(y, rstd, x, w, eps, residual=res, h=h)
    up = case.up
    y_ref = rmsnorm_ref(up(x), up(w), eps, up(res))[0]
    rstd_ref = rmsnorm_ref(up(h), up(w), eps)[2]  # from the rounded h, as the kernel's
    y_low = case.lowp(lambda: rmsnorm_ref(x, w, eps, res)[0])
    report.check("rmsnorm fwd", f"N{N} C{C} +residual", [
        close_rule(y, y_ref, y_low, name="y"), exact_rule(h, x + res, name="h"),
        close_rule(rstd, rstd_ref, name="rstd")])

    dy, dres = case.randn(N, C), case.randn(N, C)
    rstd32 = rmsnorm_ref(x.float(), w.float(), eps)[2]  # (N,) fp32
    g, n = dres.clone(), dy.clone()
    rmsnorm.rmsnorm_bwd(g, None, n, x, w, rstd32, dresidual=g, y=n)  # dx over g, y over dy
    report.check("rmsnorm bwd", f"N{N} C{C} dx+=dres, y over dy", [
        close_rule(g, rmsnorm_bwd_ref(up(dy), up(x), up(w), eps, up(dres))[0],
                   case.lowp(lambda: rmsnorm_bwd_ref(dy, x, w, eps, dres)[0]), name="dx"),
        close_rule(n, rmsnorm_ref(up(x), up(w), eps)[0], case.lowp(lambda: rmsnorm_ref(x, w, eps)[0]), name="y")])


def rope_tables(case):
    """cos, sin (N, D2) fp32 of the batch's positions, by the reference (the kernels' inputs)."""
    cfg = case.cfg
    inv, scale = rope.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or None)
    inv = torch.from_numpy(inv).to(case.device)  # (D2,) fp32
    return (inv, scale), rope_table_ref(case.positions(), inv, scale)


def check_rope(case, report):
    """rope_table at the batch's packed positions, then rope_fwd / rope_bwd in place on q, k."""
    N, H, KVH, D = case.n, case.cfg.n_heads, case.cfg.n_kv_heads, case.cfg.head_dim
    (inv, scale), (cos_ref, sin_ref) = rope_tables(case)
    pos = case.positions()
    cos, sin = torch.empty(N, D // 2, device=case.device), torch.empty(N, D // 2, device=case.device)  # (N, D2)
    poison(cos, sin)
    rope.rope_table(cos, sin, pos, inv, scale)
    report.check("rope table", f"N{N} D{D} positions <= {int(pos.max())}", [
        close_rule(cos, cos_ref, name="cos"), close_rule(sin, sin_ref, name="sin")])

    q0, k0 = case.randn(N, H * D).view(N, H, D), case.randn(N, KVH * D).view(N, KVH, D)
    for direction, launch in (("fwd", rope.rope_fwd), ("bwd", rope.rope_bwd)):
        q, k = q0.clone(), k0.clone()
        launch(q, k, cos_ref, sin_ref)
        verdicts = []
        for name, out, x in (("q", q, q0), ("k", k, k0)):
            if direction == "fwd":
                ref, low = rope_ref(case.up(x), cos_ref, sin_ref), case.lowp(rope_ref, x, cos_ref, sin_ref)
            else:  # x is the incoming gradient
                ref = vjp(lambda t: rope_ref(t, cos_ref, sin_ref), case.up(x), case.up(x))[0]
                low = case.lowp(lambda: vjp(lambda t: rope_ref(t, cos_ref, sin_ref), x, x)[0])
            verdicts.append(close_rule(out, ref, low, name=name))
        report.check(f"rope {direction}", f"N{N} H{H}/{KVH} D{D} in place", verdicts)


def check_qk_norm_rope(case, report):
    """Qwen3's per-head norms and RoPE in one kernel, forward and backward (run at every model's heads)."""
    cfg = case.cfg
    N, H, KVH, D, eps = case.n, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
    _, (cos, sin) = rope_tables(case)
    q_pre, k_pre = case.randn(N, H, D, scale=3.0), case.randn(N, KVH, D, scale=3.0)
    w_q, w_k = norm_weight(case, D), norm_weight(case, D)
    q, k = torch.empty_like(q_pre), torch.empty_like(k_pre)
    rstd_q, rstd_k = torch.empty(N * H, device=case.device), torch.empty(N * KVH, device=case.device)
    poison(q, k, rstd_q, rstd_k)
    qk_norm_rope.qk_norm_rope_fwd(q, k, rstd_q, rstd_k, q_pre, k_pre, w_q, w_k, cos, sin, eps)
    dq, dk = case.randn(N, H, D), case.randn(N, KVH, D)
    dq_pre, dk_pre = torch.empty_like(dq), torch.empty_like(dk)
    poison(dq_pre, dk_pre)
    qk_norm_rope.qk_norm_rope_bwd(dq_pre, dk_pre, dq, dk, q_pre, k_pre, w_q, w_k, rstd_q, rstd_k, cos, sin)

    def ref(x, w, dout, dt):
        """(out, rstd, dx) of rope(rmsnorm_head(x) * w) computed in dt."""
        x = x.detach().to(dt).requires_grad_(True)
        out, r = qk_norm_rope_ref(x, w.to(dt), eps, cos, sin)
        return out.detach(), r.detach(), torch.autograd.grad(out, x, dout.to(dt))[0]

    fwd, bwd = [], []
    for name, x, w, dout, out, rstd, dx in (("q", q_pre, w_q, dq, q, rstd_q, dq_pre),
                                            ("k", k_pre, w_k, dk, k, rstd_k, dk_pre)):
        out_ref, rstd_ref, dx_ref = ref(x, w, dout, case.hi)
        out_low, _, dx_low = case.lowp(ref, x, w, dout, case.dtype) or (None, None, None)
        fwd += [close_rule(out, out_ref, out_low, name=name), close_rule(rstd, rstd_ref, name=f"rstd_{name}")]
        bwd.append(close_rule(dx, dx_ref, dx_low, name=f"d{name}_pre"))
    report.check("qk_norm_rope fwd", f"N{N} H{H}/{KVH} D{D}", fwd)
    report.check("qk_norm_rope bwd", f"N{N} H{H}/{KVH} D{D}", bwd)


def check_attention(case, report):
    """Varlen causal GQA flash attention over the batch's documents, against SDPA run on each
    document alone (the reference at hi precision, torch's own at the model dtype)."""
    cfg = case.cfg
    N, H, KVH, D = case.n, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cu, max_seqlen, scale = case.cu_seqlens(), max(case.lens), D ** -0.5
    q, k, v, do = case.randn(N, H, D), case.randn(N, KVH, D), case.randn(N, KVH, D), case.randn(N, H, D)
    o, lse = torch.empty_like(q), torch.empty(H, N, device=case.device)  # (N, H, D), (H, N) fp32
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(H, N, device=case.device)  # (H, N) fp32 scratch
    poison(o, lse, dq, dk, dv, delta)
    attention.attention_fwd(o, lse, q, k, v, cu, max_seqlen, scale)
    attention.attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max_seqlen, scale)

    def sdpa(dt):
        ins = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        out = attention_sdpa(*ins, cu, scale)
        return [out.detach()] + list(torch.autograd.grad(out, ins, do.to(dt)))

    refs, lows = sdpa(case.hi), case.lowp(sdpa, case.dtype) or [None] * 4
    verdicts = [close_rule(t, r, low, name=name)
                for name, t, r, low in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), refs, lows)]
    shape = f"N{N} H{H}/{KVH} D{D} {len(case.lens)} docs <= {max_seqlen}"
    report.check("attention fwd", shape, verdicts[:1])
    report.check("attention bwd", shape, verdicts[1:])


def check_swiglu(case, report):
    """act = silu(gate) * up; the backward as layer_backward runs it: dgate over gate, dup over up,
    act written again over dact."""
    N, F = case.n, case.cfg.intermediate
    g, u = case.randn(N, F, scale=2.0), case.randn(N, F)
    h = torch.empty_like(g)  # (N, F)
    poison(h)
    swiglu.swiglu_fwd(h, g, u)
    h_ref, h_low = swiglu_ref(case.up(g), case.up(u)), case.lowp(swiglu_ref, g, u)
    report.check("swiglu fwd", f"N{N} F{F}", [close_rule(h, h_ref, h_low, name="h")])

    dh = case.randn(N, F)
    dg, du, act = g.clone(), u.clone(), dh.clone()
    swiglu.swiglu_bwd(dg, du, act, dg, du, h=act)
    dg_ref, du_ref = swiglu_bwd_ref(case.up(dh), case.up(g), case.up(u))
    dg_low, du_low = case.lowp(swiglu_bwd_ref, dh, g, u) or (None, None)
    report.check("swiglu bwd", f"N{N} F{F} in place, act again", [
        close_rule(dg, dg_ref, dg_low, name="dg"), close_rule(du, du_ref, du_low, name="du"),
        close_rule(act, h_ref, h_low, name="act")])

    # without dropout layer_backward runs swiglu_bwd_lora: gate/up dB and down dA from the same pass
    R, s = 16, 2.0
    xg, xu, dyb = case.randn(N, R), case.randn(N, R), case.randn(N, R)  # xa_gate, xa_up, down's dy B
    db_g, db_u, da_d = (torch.zeros(F, R, device=g.device), torch.zeros(F, R, device=g.device),
                        torch.zeros(R, F, device=g.device))  # fp32, += as the step's flat gradients
    dg, du = g.clone(), u.clone()
    swiglu.swiglu_bwd_lora(dg, du, dh, dg, du, scale=s, gate=(db_g, xg), up=(db_u, xu), down=(da_d, dyb))
    up = case.up
    grads = lambda dg_, du_, h_: (s * dg_.t() @ up(xg), s * du_.t() @ up(xu), s * up(dyb).t() @ h_)  # noqa: E731
    refs = grads(dg_ref, du_ref, h_ref)
    lows = grads(up(dg_low), up(du_low), up(h_low)) if dg_low is not None else (None,) * 3
    report.check("swiglu bwd + LoRA grads", f"N{N} F{F} R{R} in place", [
        close_rule(dg, dg_ref, dg_low, name="dg"), close_rule(du, du_ref, du_low, name="du")] + [
        close_rule(got, ref, low, name=name, by_lowp=low is not None) for got, ref, low, name in
        zip((db_g, db_u, da_d), refs, lows, ("db gate", "db up", "da down"))])


def check_embedding(case, report):
    """The token gather: a copy, so exact."""
    N, C, V = case.n, case.cfg.hidden, case.cfg.vocab
    table, ids = case.randn(V, C), case.randint(V, N, dtype=torch.int32)  # (V, C), (N,)
    out = torch.empty(N, C, device=case.device, dtype=case.dtype)
    poison(out)
    embedding.embedding_fwd(out, ids, table)
    report.check("embedding fwd", f"N{N} V{V} C{C}", [exact_rule(out, embedding_ref(ids, table), name="out")])


def check_kv_attention(case, report):
    """Generation's attention over a KV cache: one decoded token after N - 1, and a prefill."""
    cfg = case.cfg
    H, KVH, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for label, T, past in (("decode", 1, case.n - 1), ("prefill", min(case.n, 512), 0)):
        q, kc, vc = case.randn(T, H, D), case.randn(past + T, KVH, D), case.randn(past + T, KVH, D)
        o = torch.empty_like(q)  # (T, H, D)
        poison(o)
        kv_attention.kv_attention_fwd(o, q, kc, vc, past, D ** -0.5)
        low = case.lowp(kv_attention_sdpa, q, kc, vc, past, D ** -0.5)  # atol as tests/test_kv_attention.py
        v = close_rule(o, kv_attention_ref(q, kc, vc, past, D ** -0.5), low, atol=0.0 if low is None else 1e-3,
                       name="o")
        report.check(f"kv_attention {label}", f"T{T} after {past} H{H}/{KVH} D{D}", [v])


def check_argmax(case, report):
    """Greedy decoding's pick over the vocabulary: exact, ties to the lowest index as torch.argmax."""
    V = case.cfg.vocab
    x = case.randn(4, V)
    idx = torch.full((4,), -1, dtype=torch.int64, device=case.device)
    argmax.argmax_fwd(idx, x)
    report.check("argmax", f"M4 V{V}", [exact_rule(idx, torch.argmax(x.float(), dim=1), name="idx")])
