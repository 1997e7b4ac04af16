"""The planner: which activation plan a step runs under a VRAM budget, and the plan printed.

Shape legend and the modes: lean/runtime/plan.py (the table of what a layer saves, the walk that
sizes a plan, plan_cost that prices it).

The planner (plan_step) prices every plan that orders its layers offload_up, offload, recompute,
keep (the backward reaches the offloaded layers last, and the reload of the highest one hides
under the backward of the layer above it) with the rates of this machine (Rates, measured by
offload.measure_rates): a rebuild costs its GEMM FLOPs; a copy costs nothing while it hides under
the compute it overlaps (a layer's forward for the offload, its backward for the reload) and the
difference when it does not. Each is priced twice for an untied model: with the embedding table
on the GPU and in pinned host memory (its gather, N rows over the link, added). It returns the
cheapest plan that fits the budget (ties: less pinned host memory), and all keep when that fits.

Errors: PlanError when no plan fits the budget (it names the smallest peak and the fixes).
Tested: tests/test_offload.py (on real layer shapes no cheaper ordered plan fits, every candidate
walked; pinned host memory held to its limit; Llama-3.2-3B fits 8 GiB) and tests/test_train.py
(lean-train --vram-budget prints the plan and keeps the losses).
"""
import os
from dataclasses import replace

from ..models.weights import embed_to_host
from .head_host import head_to_host
from .lora import TARGETS
from .plan import (
    AUTO, DEFAULT_RATES, GiB, KEEP, MODES, MOE_PLAN, OFFLOAD, OFFLOAD_UP, PLAN, RECOMPUTE, SLACK, Memory, PlanError,
    decide_loss_rows, embed_gather_cost, gather_cost, head_host_cost, layer_bytes, layer_modes, make_plan, mode_bytes,
    mode_policy, plan_cost, row_bytes,
)
from .plan_bytes import head_host_bytes


def ordered_modes(L, n_up, n_offload, n_recompute):
    """The planner's layer order: offload_up, offload, recompute, then keep."""
    n_keep = L - n_up - n_offload - n_recompute
    return (OFFLOAD_UP,) * n_up + (OFFLOAD,) * n_offload + (RECOMPUTE,) * n_recompute + (KEEP,) * n_keep


def candidates(L):
    """Every (n_up, n_offload, n_recompute) of L layers."""
    return [(u, o, r) for u in range(L + 1) for o in range(L + 1 - u) for r in range(L + 1 - u - o)]


def plan_step(cfg, n_tokens, lora_r, budget_bytes, weights_bytes, *, lora_targets=TARGETS, act_bytes=2,
              optimizer=True, rates=None, host_budget_bytes=None, embed_bytes=0, lora_dropout=0.0, head_bytes=0,
              head_on_host=False, world=1, loss_rows=AUTO, host_state=False):
    """The cheapest plan (plan_cost under `rates`, default DEFAULT_RATES) whose predicted peak fits
    budget_bytes and whose pinned host bytes fit host_budget_bytes (None: no limit); all keep when
    budget_bytes is None or it fits. embed_bytes: an untied embedding table (part of weights_bytes)
    that may move to pinned host memory (plan.embed_host; its gather priced by embed_gather_cost);
    0: it stays. head_bytes: likewise the lm_head (a tied table: the one table), streamed through
    the loss from the host (plan.head_host; its copies priced by head_host_cost like every other
    copy). head_on_host: the head is there already (every plan streams it). world > 1: the layers'
    weights are sharded over that many ranks (weights_bytes counts this rank's parts; the gather
    buffers and gathers are priced: plan.gather_cost). Raises PlanError when even offloading every
    layer's input and recomputing the rest does not fit. loss_rows: the lm_head + loss's chunk rows
    every candidate is walked with (make_plan's; AUTO: decided here once, for all of them). host_state:
    the LoRA state in pinned host memory (runtime/host_state.py), counted so by every candidate."""
    L, rates = cfg.n_layers, rates or DEFAULT_RATES
    if loss_rows is AUTO:  # the all-keep step's decision, the same for every candidate (head on the host: unused)
        loss_rows = decide_loss_rows(cfg, n_tokens, act_bytes, lora_r, tuple(lora_targets) if lora_r else (),
                                     lora_dropout, head_on_host)
    kw = dict(lora_rank=lora_r, lora_targets=lora_targets, act_bytes=act_bytes, optimizer=optimizer,
              budget_bytes=budget_bytes, rates=rates, lora_dropout=lora_dropout, world=world, loss_rows=loss_rows,
              host_state=host_state)
    on_gpu = lambda eh, hh: dict(  # noqa: E731
        weights_bytes=weights_bytes - (embed_bytes if eh else 0) - (head_bytes if hh and not head_on_host else 0),
        embed_host=eh, head_host=hh)
    fits = lambda plan: plan.memory.peak + SLACK <= budget_bytes  # noqa: E731
    keep = make_plan(cfg, n_tokens, (KEEP,) * L, **kw, **on_gpu(False, head_on_host))
    if budget_bytes is None or fits(keep):
        return keep
    # Price every ordered plan, with the embedding table on the GPU or not (arithmetic, no walk),
    # then walk them cheapest first until one fits. A plan can never peak below its persistent
    # bytes plus what its finished layers hold: those that cannot fit by that bound are dropped unwalked.
    # Per layer (dense and MoE layers differ). An MoE layer has no up to offload: its offload_up is
    # offload (layer_modes), so candidates that differ only there are one plan, priced once.
    targets = tuple(lora_targets) if lora_r else ()
    by_kind = {}
    for li in range(L):
        by_kind.setdefault(cfg.is_moe(li), (mode_bytes(cfg, n_tokens, act_bytes, KEEP, lora_r, targets, li),
                                            mode_bytes(cfg, n_tokens, act_bytes, OFFLOAD, lora_r, targets, li)))
    hold = [by_kind[cfg.is_moe(li)][0] for li in range(L)]
    host = [by_kind[cfg.is_moe(li)][1] for li in range(L)]
    dense = mode_bytes(cfg, n_tokens, act_bytes, OFFLOAD)
    xb, upb = dense[OFFLOAD], dense[OFFLOAD_UP] - dense[OFFLOAD]  # one (N, C) and one (N, F) reload buffer
    plans = list(dict.fromkeys(layer_modes(cfg, ordered_modes(L, *c)) for c in candidates(L)))
    priced = []
    heads = (True,) if head_on_host else (False, True) if head_bytes else (False,)
    for eh, hh in [(eh, hh) for eh in ((False, True) if embed_bytes else (False,)) for hh in heads]:
        moved = (embed_bytes if eh else 0) + (head_bytes if hh and not head_on_host else 0)
        buffers = head_host_bytes(cfg, act_bytes) if hh and not head_on_host else 0  # the head's chunks
        fixed = keep.memory.peak - keep.memory.activations - moved + buffers
        extra = embed_gather_cost(cfg, n_tokens, act_bytes, rates) if eh or (hh and cfg.tie_embeddings) else 0.0
        extra += head_host_cost(cfg, n_tokens, act_bytes, rates, world) if hh else 0.0
        for modes in plans:
            host_bytes = sum(h[m] for h, m in zip(host, modes)) + moved
            if host_budget_bytes is not None and host_bytes > host_budget_bytes:
                continue
            offloads, ups = any(m in (OFFLOAD, OFFLOAD_UP) for m in modes), OFFLOAD_UP in modes
            bound = fixed + sum(h[m] for h, m in zip(hold, modes)) + 2 * (xb * offloads + upb * ups)
            if bound + SLACK > budget_bytes:
                continue
            cost = plan_cost(cfg, modes, n_tokens, act_bytes, rates) + gather_cost(cfg, modes, n_tokens, act_bytes, rates, world)
            priced.append((cost + extra, host_bytes, eh, hh, modes))
    for _, _, eh, hh, modes in sorted(priced):
        plan = make_plan(cfg, n_tokens, modes, **kw, **on_gpu(eh, hh))
        if fits(plan):
            return plan
    least = make_plan(cfg, n_tokens, (OFFLOAD,) * L, **kw,
                      **on_gpu(bool(embed_bytes), bool(head_bytes) or head_on_host))
    host_note = "" if host_budget_bytes is None else (
        f" (pinned host memory allowed: {host_budget_bytes / GiB:.2f} GiB; offloading every input takes "
        f"{least.host_bytes / GiB:.2f})")
    raise PlanError(
        f"VRAM budget {budget_bytes / GiB:.2f} GiB is too small for {n_tokens}-token steps: even with every "
        f"layer's input offloaded the step needs {least.memory.peak / GiB:.2f} GiB ({_parts(least.memory)}; "
        f"peak at {least.peak_at}){host_note}. Raise the budget, pack fewer tokens per step (max_tokens), or "
        f"use a smaller LoRA rank or fewer targets")


def host_memory_bytes():
    """Physical host memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def host_share():
    """This process's share of the host's memory: all of it, or 1/LOCAL_WORLD_SIZE of it for each
    of the ranks torchrun starts on this machine (each pins its own offload slots)."""
    return host_memory_bytes() // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def early_plan(model, r, targets, dropout, n_tokens, budget_gib, lora_state="device"):
    """plan_for before the LoRA state exists (its rank, targets and dropout are all a plan reads): a plan
    that moves the embedding table to the host moves it now, so that the adapter's buffers and AdamW's
    moments are never allocated beside it (Qwen3-8B in NF4 at a 6 GiB budget would peak there).
    lora_state: "device", "host" (runtime/host_state.py) or "auto": the device where a plan fits the
    budget so, else the host (PlanError, the device's, when neither fits). Returns whether the LoRA
    state goes to the host (LoRA.init's host_state)."""
    from types import SimpleNamespace

    from .lora import _normalise_targets
    from .plan_bytes import lora_numels

    targets = _normalise_targets(targets)
    spec = lambda host: SimpleNamespace(r=r, targets=targets, dropout=dropout, host_state=host,  # noqa: E731
                                        numel=sum(lora_numels(model.config, r, targets)))
    plan = lambda host: plan_for(model, spec(host), n_tokens, budget_bytes=int(budget_gib * 2**30))  # noqa: E731
    try:
        plan(lora_state == "host")
        return lora_state == "host"
    except PlanError as first:
        if lora_state != "auto":
            raise
        try:
            plan(True)
        except PlanError:
            raise first from None  # nor with it there: the error of the plan as asked
        return True


def _pow2(n):
    """n rounded up to a power of two (torch's pinned-memory allocator takes blocks of these)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def plan_for(model, lora, n_tokens, budget_bytes=None, optimizer=True, rates=None):
    """plan_step for a loaded model and its LoRA (what --vram-budget needs): the weights are counted
    from the model's tensors on the GPU; pinned host memory is held to half of this process's share
    of the machine's memory (host_share: the ranks on this machine split it; model.cache["host"]
    when the ranks agreed on one, runtime/parallel.py);
    rates price the candidates (None: measured here by offload.measure_rates when a budget is given
    on a GPU, or the weights are sharded (every rank measures together), a setup-time sync, once per
    model and n_tokens: early_plan's measurement serves the plan after it; DEFAULT_RATES on a CPU).
    When the plan says so, this moves the untied embedding table to pinned host memory
    (models/weights.embed_to_host), and the lm_head (head_host.head_to_host, a tied table with it),
    for good. A sharded model (runtime/shard.py) is planned with its gathers: its layers count this
    rank's parts."""
    on_gpu = model.device.type == "cuda"
    world = model.shard.world if getattr(model, "shard", None) is not None else 1
    if rates is None and (budget_bytes is not None or world > 1) and on_gpu:
        from .offload import measure_rates
        if ("rates", n_tokens) not in model.cache:
            model.cache["rates", n_tokens] = measure_rates(model, n_tokens)
        rates = model.cache["rates", n_tokens]
    staged = model.cache.get("staged", False) and on_gpu  # tables loaded to the host for this plan to place
    seen, weights = set(), 0
    for t in [model.embed, model.lm_head, model.norm] + [b for layer in model.layers for b in (layer.buf, layer.qbuf)]:
        if t.data_ptr() not in seen and (t.device.type == model.device.type or staged and t is not model.norm):
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    shard = getattr(model.cache.get("head"), "shard", None)  # a sharded lm_head's part (shard.ShardHead)
    if shard is not None:
        weights += shard.numel() * shard.element_size()
    untied = model.embed is not model.lm_head
    table = model.embed.numel() * model.embed.element_size()
    head = model.lm_head.numel() * model.lm_head.element_size()
    moved = on_gpu and untied and model.embed.device.type == "cpu" and not staged  # by an earlier plan_for
    head_moved = "head" in model.cache  # likewise (head_host.head_to_host; a tied table with it)
    movable = on_gpu and untied and not moved and budget_bytes is not None
    head_movable = on_gpu and not head_moved and budget_bytes is not None
    r, targets, dropout = (lora.r, lora.targets, lora.dropout) if lora is not None else (0, (), 0.0)
    host_state = bool(getattr(lora, "host_state", False))
    host = model.cache.get("host", host_share())
    on_host = (table if moved else 0) + (head if head_moved and model.lm_head.device.type == "cpu" else 0) + (
        4 * _pow2(4 * lora.numel) if host_state else 0)  # the LoRA state's params, grads, m, v (pinned: rounded up)
    plan = plan_step(model.config, n_tokens, r, budget_bytes, weights, lora_targets=targets,
                     act_bytes=model.dtype.itemsize, optimizer=optimizer, rates=rates,
                     host_budget_bytes=host // 2 - on_host if host else None,
                     embed_bytes=table if movable else 0, head_bytes=head if head_movable else 0,
                     head_on_host=head_moved, lora_dropout=dropout, world=world,
                     loss_rows=model.cache.get("loss_rows", AUTO), host_state=host_state)
    model.cache.pop("staged", None)  # placed below: a plan that raised (PlanError) left them for the next try
    model.cache.setdefault("loss_rows", plan.loss_rows)  # every later step of this model runs them (step.loss_rows)
    if moved:
        plan = replace(plan, embed_host=True,
                       cost=plan.cost + embed_gather_cost(model.config, n_tokens, model.dtype.itemsize, plan.rates))
    elif plan.embed_host and untied:
        embed_to_host(model)  # a staged table stays where it is
    if plan.head_host and not head_moved:
        head_to_host(model)
    if staged:  # the tables this plan keeps on the GPU go there now
        if not plan.head_host:
            tied = not untied
            model.lm_head = model.lm_head.to(model.device)  # sync: set-up, once, before the first step
            if tied:
                model.embed = model.lm_head
        if untied and not plan.embed_host:
            model.embed = model.embed.to(model.device)
    return plan


def _gib(b):
    return f"{b / GiB:.2f} GiB"


def _parts(mem):
    return ", ".join(f"{name} {_gib(b)}" for name, b in zip(Memory._fields, mem) if b or name != "gather")


def _spans(modes):
    """[(first, last, mode)] runs of equal modes."""
    runs = []
    for li, m in enumerate(modes):
        if runs and runs[-1][2] == m:
            runs[-1][1] = li
        else:
            runs.append([li, li, m])
    return runs


def format_plan(plan):
    """The plan as a printable table: layer modes, every saved row with its bytes and policy per
    mode in use, and the predicted peak by part."""
    cfg, N, nt = plan.cfg, plan.n_tokens, len(plan.lora_targets)
    used = [m for m in MODES if m in plan.modes]
    budget = f"; budget {_gib(plan.budget_bytes)}" if plan.budget_bytes is not None else "; no budget"
    out = [f"activation plan: {cfg.arch}, {cfg.n_layers} layers, N={N} tokens, {plan.act_bytes}-byte activations, "
           f"LoRA r={plan.lora_rank} on {nt} projections{budget}"]
    for first, last, m in _spans(plan.modes):
        out.append(f"  {f'layers {first}-{last}' if last > first else f'layer {first}'}: {m}")
    out.append("| tensor | shape | dtype | MiB/layer | " + " | ".join(used) + " |")
    out.append("|---" * (4 + len(used)) + "|")
    layers = {cfg.is_moe(li): li for li in reversed(range(cfg.n_layers))}  # a layer of each kind
    ts = plan.lora_targets
    rows = [(r, r.name, max(row_bytes(r, cfg, N, plan.act_bytes, plan.lora_rank, ts, li) for li in layers.values()))
            for r in PLAN if r.name != "moe"]
    if True in layers:  # an MoE layer's block: its rows follow the moe row's policy
        rows += [(r, "moe." + r.name, row_bytes(r, cfg, N, plan.act_bytes, plan.lora_rank, ts, layers[True]))
                 for r in MOE_PLAN]
    for r, name, b in rows:
        if b == 0:
            continue
        pol = [mode_policy(m, name.split(".")[0]) for m in used]
        out.append(f"| {name} | ({r.shape.replace('R*', 'R')}) | {r.dtype} | {b / 2**20:.2f} | "
                   + " | ".join(pol) + " |")
    full = " / ".join(f"{layer_bytes(cfg, N, plan.act_bytes, plan.lora_rank, ts, li) / 2**20:.1f} MiB"
                      + (f" ({'MoE' if moe else 'dense'})" if len(layers) > 1 or moe else "")
                      for moe, li in sorted(layers.items()))
    if plan.embed_host:
        table = cfg.vocab * cfg.hidden * plan.act_bytes
        out.append(f"embedding table: pinned host memory ({_gib(table)} off the GPU; the gather reads the batch's "
                   f"rows over the link, {N * cfg.hidden * plan.act_bytes / 2**20:.0f} MiB a step)")
    if plan.head_host:
        from .head_host import chunk_rows
        head = cfg.vocab * cfg.hidden * plan.act_bytes
        Vc = chunk_rows(cfg.vocab, cfg.hidden, plan.act_bytes, plan.world)
        moved = (2 * -(-cfg.vocab // Vc) - 2) * Vc * cfg.hidden * plan.act_bytes / 2**30
        if plan.world > 1:  # shard.ShardHead
            out.append(f"lm_head: sharded over the {plan.world} ranks ({_gib(head / plan.world)} here); the loss "
                       f"all-gathers it into two {Vc}-row chunk buffers, {moved:.2f} GiB of chunks a step")
        else:
            out.append(f"lm_head: pinned host memory ({_gib(head)} off the GPU; the loss streams it through two "
                       f"{Vc}-row chunk buffers, {moved:.2f} GiB over the link a step)")
    out.append(f"saved per kept layer {full}; kept on the GPU after the forward "
               f"{_gib(plan.kept_bytes)}; pinned host {_gib(plan.host_bytes)}")
    if plan.world > 1:
        out.append(f"sharded weights over {plan.world} ranks: this rank holds 1/{plan.world} of every layer; two "
                   f"rotating full layers of each kind take {_gib(plan.memory.gather)}; each layer is all-gathered "
                   f"one layer ahead, forward and backward, at {plan.rates.link / 1e9:.0f} GB/s"
                   f"{' (assumed)' if plan.rates.link == DEFAULT_RATES.link else ''}")
    out.append(f"predicted peak {_gib(plan.memory.peak)} = {_parts(plan.memory)}; at {plan.peak_at}")
    if plan.cost:
        r = plan.rates
        out.append(f"predicted cost over keeping everything: {plan.cost * 1e3:.1f} ms a step (rebuild GEMMs, "
                   f"copies{' and gathers' if plan.world > 1 else ''} not hidden), priced at D2H {r.d2h / 1e9:.1f} GB/s, H2D {r.h2d / 1e9:.1f} GB/s, "
                   f"GEMM {r.flops / 1e12:.0f} TFLOP/s{' (defaults)' if r == DEFAULT_RATES else ''}")
    return "\n".join(out)
