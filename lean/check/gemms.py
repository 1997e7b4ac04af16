"""lean-check's kernel checks, part two: the GEMMs (frozen projections, the fused LoRA projections,
the fused lm_head + cross-entropy) and AdamW, against plain torch by the tolerance rule.

Shape legend: N tokens, C hidden, Oq = H*D, Okv = KVH*D, F MLP hidden, V vocab, R LoRA rank,
K / O a projection's in / out features, P LoRA parameters.

The GEMM choosers read the arch table and the problem size; an eager step and a captured one
(lean.StepGraph, inside gemm.tma_at_every_size) choose differently on a GPU that takes the Hopper
path, so there each GEMM check runs twice, the second tagged [graph]. The LoRA projections run in
the step's groups (lean/models/dense.py): q, k, v share their input (one xa pre-pass where the
Hopper path takes it, dx accumulated, dA deferred and summed in one pass), o reads its kept input,
gate and up share theirs, down alone.
"""
import contextlib

import torch

from ..kernels import adamw, gemm, linear_ce, lora_linear, lora_linear_pre
from ..kernels.arch import arch
from ..kernels.gemm_splitk import splitk_count
from ..reference.adamw import AdamWRef
from ..reference.linear_ce import dh_atol, linear_ce_chunked_ref, linear_ce_ref, loss_atol
from ..reference.lora_linear import lora_linear_grads_ref, lora_linear_ref, matmul_ref
from ..reference.rule import close_rule, exact_rule
from .kernels import poison


def gemm_paths():
    """(tag, context) of each way the step picks its GEMM kernels on this GPU."""
    paths = [("", contextlib.nullcontext)]
    if arch().tma:
        paths.append((" [graph]", gemm.tma_at_every_size))
    return paths


def lm_head_rows(case):
    """The rows of one chunk of the fused loss as the step runs them: the activation plan's rule for
    the model's all-keep step with LoRA on every target (runtime/plan.decide_loss_rows: more rows where the
    peak is elsewhere), else linear_ce_fwd_bwd's default (its dh GEMM is the split-K shape)."""
    from ..kernels.linear_ce import _default_chunk_rows
    from ..runtime.lora import TARGETS
    from ..runtime.plan import decide_loss_rows

    c, elsize = case.cfg, torch.empty((), dtype=case.dtype).element_size()
    rows = decide_loss_rows(c, case.n, elsize, case.r, TARGETS) if case.on_gpu else None
    return min(rows, case.n) if rows else _default_chunk_rows(case.n, c.vocab, c.hidden, elsize, not case.on_gpu)


def check_gemm(case, report):
    """matmul as the frozen projections and the loss call it: y = x W^T and dx = dy W at the MLP's
    gate shape, and the loss's dh chunk dlogits @ W over K = V (an under-filled output, where
    split-K runs on a GPU)."""
    c = case.cfg
    N, C, F, V = case.n, c.hidden, c.intermediate, c.vocab
    rows = lm_head_rows(case)
    w, head = case.randn(F, C, scale=C ** -0.5), case.randn(V, C, scale=C ** -0.5)  # (F, C), (V, C)
    cases = [("x@W^T", f"M{N} K{C} N{F}", case.randn(N, C), w.t()),
             ("dy@W", f"M{N} K{F} N{C}", case.randn(N, F), w),
             ("dh chunk", f"M{rows} K{V} N{C}", case.randn(rows, V, scale=V ** -0.5), head)]
    for tag, path in gemm_paths():
        with path():
            for name, shape, a, b in cases:
                out = torch.empty(a.shape[0], b.shape[1], device=case.device, dtype=case.dtype)
                poison(out)
                gemm.matmul(out, a, b)
                ref, low = matmul_ref(case.up(a), case.up(b)), case.lowp(matmul_ref, a, b)
                if name == "dh chunk":
                    split = splitk_count(*out.shape, V)
                    shape += f" split-K {split}" if split > 1 else " no split"
                report.check(f"gemm {name}{tag}", shape, [close_rule(out, ref, low, name="c")])


def projection_groups(cfg):
    """(group, K, [(target, O, has_bias)], input kept) in dense.py's order."""
    C, F = cfg.hidden, cfg.intermediate
    qkv = [("q", cfg.q_dim, cfg.qkv_bias), ("k", cfg.kv_dim, cfg.qkv_bias), ("v", cfg.kv_dim, cfg.qkv_bias)]
    return [("q,k,v", C, qkv, False), ("o", cfg.q_dim, [("o", C, cfg.o_bias)], True),
            ("gate,up", C, [("gate", F, False), ("up", F, False)], False), ("down", F, [("down", C, False)], False)]


def check_lora_linear(case, report):
    """Every projection's fused LoRA forward and backward (lora_linear.py, lora_linear_pre.py)."""
    for tag, path in gemm_paths():
        with path():
            for group, K, targets, kept in projection_groups(case.cfg):
                _lora_group(case, report, tag, group, K, targets, kept)


def _lora_group(case, report, tag, group, K, targets, kept):
    N, R, scale = case.n, case.r, 2.0
    x = case.randn(N, K)  # (N, K) the group's shared input
    p = {}  # target -> (w (O, K), a (R, K), b (O, R), bias (O,) or None, dy (N, O))
    for t, O, has_bias in targets:
        p[t] = (case.randn(O, K, scale=K ** -0.5), case.randn(R, K, scale=K ** -0.5),
                case.randn(O, R, scale=R ** -0.5), case.randn(O) if has_bias else None, case.randn(N, O))
    y = {t: torch.empty(N, p[t][0].shape[0], device=case.device, dtype=case.dtype) for t in p}
    xa = {t: torch.empty(N, R, device=case.device, dtype=case.dtype) for t in p}
    poison(*y.values(), *xa.values())
    shared = [t for t in p if lora_linear.fwd_prepass(x, p[t][0], p[t][1])]
    if len(shared) > 1:  # dense.proj_xa_shared: one read of x for the group's xa
        lora_linear_pre.lora_xa_shared([xa[t] for t in shared], x, [p[t][1] for t in shared])
    for t, (w, a, b, bias, _) in p.items():
        lora_linear.lora_linear_fwd(y[t], xa[t], x, w, a, b, scale, bias=bias, xa_ready=len(shared) > 1 and t in shared)

    dx = torch.empty_like(x)  # (N, K), accumulated over the group
    poison(dx)
    da = {t: torch.zeros(R, K, device=case.device) for t in p}  # fp32, +=
    db = {t: torch.zeros(p[t][0].shape[0], R, device=case.device) for t in p}
    dyb = {t: torch.empty(N, lora_linear.dyb_width(R), device=case.device, dtype=case.dtype) for t in p}
    for i, (t, (w, a, b, _, dy)) in enumerate(p.items()):
        lora_linear.lora_linear_bwd(dx, da[t], db[t], dy, x if kept else None, xa[t], w, a, b, scale,
                                    accumulate_dx=i > 0, dyb=None if kept else dyb[t])
    if not kept:  # dense.proj_bwd_da: the deferred dA once the input is back, one pass for the group
        first, *more = p
        lora_linear.lora_linear_bwd_da(da[first], dyb[first], x, scale, more=[(da[t], dyb[t]) for t in more])

    fwd, bwd, dx_ref, dx_low = [], [], 0, 0
    for t, (w, a, b, bias, dy) in p.items():
        hi = [case.up(u) for u in (x, w, a, b)]
        y_ref, xa_ref = lora_linear_ref(*hi, scale, bias=case.up(bias))
        y_low, xa_low = case.lowp(lora_linear_ref, x, w, a, b, scale, bias=bias) or (None, None)
        dxt, da_ref, db_ref = lora_linear_grads_ref(case.up(dy), *hi, scale)
        lows = case.lowp(lora_linear_grads_ref, dy, x, w, a, b, scale) or (None, None, None)
        dx_ref, dx_low = dx_ref + dxt, (dx_low + lows[0].float()) if lows[0] is not None else None
        fwd += [close_rule(y[t], y_ref, y_low, name=f"y {t}"), close_rule(xa[t], xa_ref, xa_low, name=f"xa {t}")]
        # da/db are fp32 sums of model-dtype products: judged at the model dtype, as tests/test_lora_linear.py
        bwd += [close_rule(da[t].to(case.dtype), da_ref, lows[1], name=f"da {t}"),
                close_rule(db[t].to(case.dtype), db_ref, lows[2], name=f"db {t}")]
    bwd.append(close_rule(dx, dx_ref, None if dx_low is None else dx_low.to(case.dtype), name="dx"))
    shape = f"N{N} K{K} O{','.join(str(p[t][0].shape[0]) for t in p)} R{R}"
    report.check(f"lora_linear fwd {group}{tag}", shape, fwd)
    report.check(f"lora_linear bwd {group}{tag}", shape + ("" if kept else " dA deferred"), bwd)


def check_linear_ce(case, report):
    """The fused lm_head + cross-entropy + dh over the model's vocabulary, ~10% of targets ignored."""
    N, C, V = case.n, case.cfg.hidden, case.cfg.vocab
    h, w = case.randn(N, C), case.randn(V, C, scale=2.0 / C ** 0.5)  # logits of std ~2
    targets = case.randint(V, N)
    targets[case.randint(10, N) == 0] = -100
    count = int((targets != -100).sum())  # host sync: set-up of a check
    kw = dict(grad_scale=1.0 / max(count, 1))
    for tag, path in gemm_paths():
        with path():
            loss, dh = torch.empty(2, device=case.device), torch.empty_like(h)  # [sum, count], (N, C)
            poison(loss, dh)
            linear_ce.linear_ce_fwd_bwd(loss, dh, h, w, targets, **kw)
            if case.dtype == torch.float32:  # autograd through the N x V logits, in fp64
                ref_loss, ref_count, ref_dh = linear_ce_ref(case.up(h), case.up(w), targets, **kw)
                verdicts = [close_rule(loss[:1], ref_loss.reshape(1), name="loss"), close_rule(dh, ref_dh, name="dh")]
            else:  # chunk by chunk: fp32 closed form, and HF's low-precision recipe as torch's own
                ref_loss, ref_count, ref_dh = linear_ce_chunked_ref(h, w, targets, **kw)
                low_loss, _, low_dh = linear_ce_chunked_ref(h, w, targets, upcast=False, **kw)
                verdicts = [close_rule(loss[:1], ref_loss.reshape(1), low_loss.reshape(1), name="loss", by_lowp=True,
                                       atol=loss_atol(case.dtype, ref_loss)),
                            close_rule(dh, ref_dh, low_dh, atol=dh_atol(case.dtype, ref_dh), name="dh")]
            verdicts.append(exact_rule(loss[1:], ref_count.reshape(1).float(), name="count"))
            report.check(f"linear_ce{tag}", f"N{N} C{C} V{V} {N - count} ignored", verdicts)


def lora_numel(cfg, r, layers):
    """P: the LoRA parameters of `layers` layers' seven projections at rank r."""
    C, F, Oq, Okv = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim
    return layers * r * ((Oq + C) * 2 + (Okv + C) * 2 + (F + C) * 3)


def check_adamw(case, report, steps=3):
    """AdamW with clipping over the step's LoRA parameters, `steps` steps against torch.optim.AdamW
    + clip_grad_norm_ (the clip active on every step), as tests/test_adamw.py judges it."""
    P, eps32 = lora_numel(case.cfg, case.r, case.layers), torch.finfo(torch.float32).eps
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    params0 = case.randn(P, scale=0.02, dtype=torch.float32)  # (P,) fp32 master weights
    grads = [case.randn(P, scale=1e-3, dtype=torch.float32) for _ in range(steps)]
    clip = 0.3 * min(torch.linalg.vector_norm(g.double()).item() for g in grads)
    lrs = [1e-3 * (i + 1) for i in range(steps)]
    ref = AdamWRef(params0, max_grad_norm=clip, **hp)
    params, m, v = params0.clone(), torch.zeros_like(params0), torch.zeros_like(params0)
    grad_norm, hyper = torch.empty(1, device=case.device), torch.empty(2, device=case.device)  # (1,), [lr, t]
    lowp = None if case.dtype == torch.float32 else torch.empty(P, device=case.device, dtype=case.dtype)
    verdicts, term_scale = [], 0.0
    for t, (lr, g) in enumerate(zip(lrs, grads), start=1):
        hyper.copy_(torch.tensor([lr, t], dtype=torch.float32))
        adamw.adamw_step(params, m, v, grad_norm, g, hyper, max_grad_norm=clip, params_lowp=lowp, **hp)
        ref_norm = ref.step(g, lr)
        term_scale = max(term_scale, ref.p.grad.abs().max().item())  # m's rounding scales with its terms
        bound = 2 * t * eps32 * (params0.abs().max().item() + sum(lrs[:t]))  # one rounding of p per step each
        verdicts += [close_rule(grad_norm, ref_norm, name=f"grad_norm t{t}"),
                     close_rule(m, ref.m, atol=1e-5 * term_scale, name=f"m t{t}"), close_rule(v, ref.v, name=f"v t{t}"),
                     close_rule(params, ref.p, atol=bound, name=f"params t{t}"),
                     close_rule(params - params0, ref.p - params0, atol=bound, name=f"update t{t}")]
        if lowp is not None:
            verdicts.append(exact_rule(lowp, params.to(case.dtype), name=f"params_lowp t{t}"))
    report.check(f"adamw x{steps}", f"P{P} fp32, clipped", verdicts)
