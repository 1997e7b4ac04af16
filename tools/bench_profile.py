"""bench profile: where lean's LoRA step spends its GPU time, per kernel family, for one model and layout.

    python tools/bench.py step --profile [--models M,..] [--layouts L,..] [--graph] [--budget G]
    python tools/bench_profile.py MODEL LAYOUT [--graph] [--budget G] [--steps 5] [--json PATH] [--trace DIR]

The step is bench step's lean row (tools/bench_step.py: random-init bf16 model of the named config,
LoRA r=16 on the 7 projections, AdamW with clipping, 8192 tokens in the layout's documents). After
bench_step.WARMUP warm-up steps, `--steps` steps are timed with CUDA events (median: the measured
step), then `--steps` more run under torch.profiler (CPU + CUDA activities). The profiler's
trace gives every GPU activity: kernels, memcpy and memset, with start and duration.

What is printed, per step (totals over the profiled steps / steps):
  family     a lean Triton kernel's name without `_kernel` (`_lora_linear_bwd`, `_attention_bwd_dq`,
             `_matmul` ...); `memcpy` / `memset`; `other` = any other kernel (torch's own: the
             gradient zeroing fill, clone, copies); the JSON lists the `other` names.
  ms/step, % of the measured step, launches/step, us/launch; sorted by time.
  GPU busy   the union of all activity intervals (overlapping kernels counted once);
  idle       measured step - busy: time the GPU waits for the host (launch-bound) or for a sync.
With --graph the same is done for lean+graph (lean.StepGraph replays, bench_step.run_lean_graph's
setup): its idle is what the graph leaves (per-step host work: the descriptor upload, begin_step).

MoE models (qwen3-30b-a3b, gpt-oss-20b[-mxfp4], cut as bench step cuts them): one more line, routing,
the issue's overhead (goal: <= 5% of an MoE layer's forward + backward). Routing = the router GEMM
(models/moe.py's linear_fwd / linear_bwd of the router, gemm.matmul's kernels, family `router_gemm`),
top-k and softmax forward and backward (`_route_fwd`, `_route_bwd`), the aux loss's probability sums
(`_colsum`, `_moe_aux`) and the slot sort by expert: bincount, offsets, scatter (`_group_hist`,
`_group_scan`, `_group_scatter`; moe_group.group_slots). In the eager profile, the profiled steps run
with torch.profiler.record_function ranges around the router's linear calls, moe_forward /
moe_backward / moe_backward_da (the MoE blocks) and the MoE layers' layer_forward / layer_backward
(runtime/step.py's calls, recompute included); a kernel belongs to a range when its launch
(correlation id) falls inside it, so routing is printed as % of the MoE layers' kernel time, % of the
MoE blocks' and % of the step. The graph's replays have no host ranges: there the router GEMM stays in
its GEMM family and routing (without it) is % of the step and % of the step's kernel time less the
embedding, lm_head + loss (`_linear_ce_*`) and optimizer (`_adamw_*`) families; the line says which.

Errors: a profile with no kernel activity (CUPTI unavailable, or a torch that does not report
graph-launched kernels) is reported as such, never as an empty table. Needs CUDA: on a CPU this
tool exits naming bench step --smoke for the harness check.
Caution: the profiler's own overhead stretches the profiled steps' host time; the measured step
(and so the idle figure) comes from the un-profiled timed steps, the kernel times from the profiled
ones (GPU kernel durations are not affected by it).
"""
import argparse
import gzip
import json
import os
import sys
import tempfile

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]
import bench_step  # noqa: E402

GPU_CATS = {"kernel": None, "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # the host side of a launch: its args.correlation names the kernel
# Routing's kernel families (lean/kernels/moe_route.py, moe_group.py), and the router GEMM's (tagged).
ROUTING = ("router_gemm", "_route_fwd", "_route_bwd", "_colsum", "_moe_aux", "_group_hist", "_group_scan",
           "_group_scatter")
OUTSIDE_LAYERS = ("_embedding_fwd", "_linear_ce_fwd_bwd", "_linear_ce_sum", "_adamw_sumsq", "_adamw_norm",
                  "_adamw_update")  # embedding, lm_head + loss, optimizer
RANGE_ROUTER, RANGE_BLOCK, RANGE_LAYER = "bench:router_gemm", "bench:moe_block", "bench:moe_layer"


def family(name):
    """A kernel name's family: lean's Triton kernels by name (without `_kernel`), else `other`."""
    if name.startswith("_") and name.endswith("_kernel"):
        return name[:-len("_kernel")]
    return "other"


def launch_ranges(trace):
    """{correlation id: set of bench: range names} for every launch inside a record_function range
    named bench:* on the same host thread (annotations(): router GEMM, MoE block, MoE layer)."""
    ranges, launches = {}, []
    for e in trace.get("traceEvents", []):
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "user_annotation" and str(e.get("name", "")).startswith("bench:") and "dur" in e:
            ranges.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
        elif cat in LAUNCH_CATS and "correlation" in args:
            launches.append((e.get("tid"), float(e["ts"]), args["correlation"]))
    out = {}
    for tid, ts, corr in launches:
        tags = {name for t0, t1, name in ranges.get(tid, ()) if t0 <= ts <= t1}
        if tags:
            out[corr] = tags
    return out


def gpu_events(trace):
    """[(family, name, start_us, dur_us, tags)] of every GPU activity in a chrome trace dict; tags: the
    bench:* ranges its launch fell in (launch_ranges); a kernel launched in the router's range is
    family router_gemm."""
    tagged = launch_ranges(trace)
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat")
        if cat in GPU_CATS and "dur" in e:
            tags = frozenset(tagged.get((e.get("args") or {}).get("correlation"), ()))
            fam = "router_gemm" if RANGE_ROUTER in tags else GPU_CATS[cat] or family(e.get("name", ""))
            out.append((fam, e.get("name", ""), float(e["ts"]), float(e["dur"]), tags))
    return out


def busy_us(events):
    """Length of the union of the activity intervals (us)."""
    total, end = 0.0, float("-inf")
    for _, _, t0, dur, *_ in sorted(events, key=lambda e: e[2]):
        t1 = t0 + dur
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def routing_summary(events, steps, step_ms):
    """Routing's ms per step and its shares (module docstring): of the MoE layers' and blocks' kernel
    time when the trace has the bench:* ranges, else of the step's kernel time less the embedding,
    lm_head + loss and optimizer families."""
    per = lambda evs: sum(e[3] for e in evs) / steps / 1e3  # noqa: E731 (ms per step)
    routing = [e for e in events if e[0] in ROUTING]
    fams = {}
    for e in routing:
        fams[e[0]] = fams.get(e[0], 0.0) + e[3] / steps / 1e3
    out = dict(ms=per(routing), step_pct=100 * per(routing) / step_ms, families=fams)
    layer = [e for e in events if RANGE_LAYER in e[4]]
    if layer:
        out.update(basis="ranges", layers_ms=per(layer), blocks_ms=per([e for e in events if RANGE_BLOCK in e[4]]))
        out["layers_pct"] = 100 * per([e for e in routing if RANGE_LAYER in e[4]]) / out["layers_ms"]
        out["blocks_pct"] = 100 * per([e for e in routing if RANGE_BLOCK in e[4]]) / max(out["blocks_ms"], 1e-9)
    else:
        rest = per([e for e in events if e[0] not in OUTSIDE_LAYERS])
        out.update(basis="families", layers_ms=rest, layers_pct=100 * out["ms"] / max(rest, 1e-9))
    return out


def breakdown(events, steps, step_ms, moe=False):
    """Per-family totals per step, sorted by time, and the busy / idle split; moe: the routing summary."""
    fams = {}
    for fam, name, _, dur, *_ in events:
        f = fams.setdefault(fam, dict(family=fam, us=0.0, calls=0, names={}))
        f["us"] += dur
        f["calls"] += 1
        f["names"][name] = f["names"].get(name, 0.0) + dur
    rows = []
    for f in sorted(fams.values(), key=lambda f: -f["us"]):
        ms = f["us"] / steps / 1e3
        rows.append(dict(family=f["family"], ms=ms, pct=100 * ms / step_ms, calls=f["calls"] / steps,
                         us_per_call=f["us"] / f["calls"],
                         names=None if f["family"] != "other" else
                         {n: round(us / steps / 1e3, 4) for n, us in sorted(f["names"].items(), key=lambda x: -x[1])[:12]}))
    busy = busy_us(events) / steps / 1e3
    total = sum(r["ms"] for r in rows)
    out = dict(step_ms=step_ms, kernels_ms=total, busy_ms=busy, idle_ms=step_ms - busy, families=rows,
               n_events=len(events))
    if moe:
        out["routing"] = routing_summary(events, steps, step_ms)
    return out


class annotations:
    """Context: record_function ranges around the router's linear calls (models/moe.py), the MoE blocks
    (models/dense.py's moe_forward / moe_backward / moe_backward_da) and the MoE layers (runtime/step.py's
    layer_forward / layer_backward of a layer with cfg.is_moe(li)); the names are put back on exit."""

    def __init__(self):
        from lean.models import dense, moe
        from lean.runtime import step

        self.patches = [(moe, n, RANGE_ROUTER, None) for n in ("linear_fwd", "linear_bwd")] + \
            [(dense, n, RANGE_BLOCK, None) for n in ("moe_forward", "moe_backward", "moe_backward_da")] + \
            [(step, n, RANGE_LAYER, lambda a: len(a) < 7 or a[6].is_moe(a[5]))  # (.., li, cfg, ..)
             for n in ("layer_forward", "layer_backward")]
        self.saved = []

    @staticmethod
    def wrap(fn, range_name, when):
        def wrapped(*a, **k):
            if when is not None and not when(a):
                return fn(*a, **k)
            with torch.profiler.record_function(range_name):
                return fn(*a, **k)
        return wrapped

    def __enter__(self):
        for mod, name, rng, when in self.patches:
            self.saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, self.wrap(getattr(mod, name), rng, when))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self.saved):
            setattr(mod, name, fn)
        self.saved.clear()


def profile_steps(step, steps, trace_path=None, annotate=False):
    """Run step(i) `steps` times under torch.profiler (annotate: inside annotations()); the GPU events
    of the trace."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            (annotations() if annotate else contextlib.nullcontext()):
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            raw = f.read()
    if trace_path:
        with gzip.open(trace_path, "wt") as f:
            f.write(raw)
    return gpu_events(json.loads(raw))


def measure(step, warmup, steps, trace_path=None, moe=False):
    """Median step time (CUDA events, after `warmup`), then the profiled breakdown (moe: with the
    routing summary, the profiled steps annotated)."""
    step_s, _ = bench_step.time_steps(step, warmup, steps, cuda=True)
    events = profile_steps(step, steps, trace_path, annotate=moe)
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity: CUPTI is unavailable here, or this torch does "
                           "not report kernels launched from CUDA graphs; run without --graph or check "
                           "torch.profiler on this machine")
    return breakdown(events, steps, step_s * 1e3, moe)


def profile_lean(name, layout, steps=5, graph=False, budget_gib=None, trace_dir=None):
    """{eager: breakdown, [graph: breakdown]} of lean's step for one model and layout."""
    lean, model, lora, opt, docs, batches, _ = bench_step.lean_setup(name, layout, budget_gib=budget_gib)
    plan = bench_step.lean_plan(model, lora, batches[0].n_tokens, budget_gib)

    def eager(i):
        lora.zero_grad()
        loss, n = lean.forward_backward(model, lora, batches[i % 2], plan=plan)
        opt.step()
        return loss / n

    def trace(tag):
        return os.path.join(trace_dir, f"trace_{name}_{layout}_{tag}.json.gz") if trace_dir else None

    moe = bench_step.is_moe(name)
    out = dict(model=name, layout=layout, steps=steps, plan=bench_step.plan_note(plan),
               layers=bench_step.layers_note(name), eager=measure(eager, bench_step.WARMUP, steps, trace("eager"), moe))
    if graph:
        n_tokens = batches[0].n_tokens
        max_docs = bench_step.MAX_DOCS * -(-(len(docs[0]) + 1) // bench_step.MAX_DOCS)
        g = bench_step.make_step_graph(lean, model, lora, opt, n_tokens, max_docs, plan)
        gb = [g.pack(d) for d in docs]

        def replay(i):
            loss, n = g.step(gb[i % 2])
            return loss / n

        try:
            out["graph"] = measure(replay, bench_step.WARMUP, steps, trace("graph"), moe)
        except RuntimeError as e:  # no graph kernels in the trace: keep the eager breakdown
            out["graph_error"] = str(e)
    return out


def fmt(b, title):
    """One breakdown as a table: families by time, then busy / idle against the measured step."""
    lines = [f"# {title}: measured step {b['step_ms']:.2f} ms (median, CUDA events); "
             f"{8192 / b['step_ms'] * 1e3:,.0f} tok/s at 8192 tokens",
             f"{'family':<26}{'ms/step':>9}{'% step':>8}{'calls/step':>12}{'us/call':>9}"]
    for r in b["families"]:
        lines.append(f"{r['family']:<26}{r['ms']:>9.3f}{r['pct']:>7.1f}%{r['calls']:>12.1f}{r['us_per_call']:>9.1f}")
    lines.append(f"{'sum of GPU activities':<26}{b['kernels_ms']:>9.3f}{100 * b['kernels_ms'] / b['step_ms']:>7.1f}%")
    lines.append(f"{'GPU busy (union)':<26}{b['busy_ms']:>9.3f}{100 * b['busy_ms'] / b['step_ms']:>7.1f}%")
    lines.append(f"{'idle = step - busy':<26}{b['idle_ms']:>9.3f}{100 * b['idle_ms'] / b['step_ms']:>7.1f}%"
                 "   (host-bound / waiting)")
    for r in b["families"]:
        if r["names"]:
            top = ", ".join(f"{n[:60]} {ms:.3f}" for n, ms in list(r["names"].items())[:4])
            lines.append(f"  other = {top} ...")
    if "routing" in b:
        lines.append(fmt_routing(b["routing"]))
    return "\n".join(lines)


def fmt_routing(r):
    """The routing line (module docstring) and its families."""
    if r["basis"] == "ranges":
        share = (f"{r['layers_pct']:.1f}% of the MoE layers' kernel time ({r['layers_ms']:.3f} ms: layer_forward + "
                 f"layer_backward), {r['blocks_pct']:.1f}% of the MoE blocks' ({r['blocks_ms']:.3f} ms: moe_forward + "
                 "moe_backward)")
    else:
        share = (f"{r['layers_pct']:.1f}% of the step's kernel time less embedding, lm_head + loss and optimizer "
                 f"({r['layers_ms']:.3f} ms; no host ranges in this trace: the router GEMM is not separated, "
                 "not counted)")
    fams = ", ".join(f"{f} {ms:.3f}" for f, ms in sorted(r["families"].items(), key=lambda x: -x[1]))
    return (f"routing {r['ms']:.3f} ms/step = {share}, {r['step_pct']:.1f}% of the step (goal <= 5% of an MoE layer)\n"
            f"  routing = {fams or 'no routing kernel in the trace'}")


def print_profile(p):
    head = f"{p['model']} {p['layout']}" + (f", {p['layers']}" if p.get("layers") else "") + \
        (f" [{p['plan']}]" if p["plan"] else "")
    print(fmt(p["eager"], f"lean eager, {head}"))
    if "graph" in p:
        print()
        print(fmt(p["graph"], f"lean+graph, {head}"))
    if "graph_error" in p:
        print(f"# lean+graph, {head}: {p['graph_error']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=list(bench_step.CONFIGS))
    ap.add_argument("layout", choices=list(bench_step.LAYOUTS))
    ap.add_argument("--steps", type=int, default=5, help="timed steps, and profiled steps (default 5)")
    ap.add_argument("--graph", action="store_true", help="also profile lean+graph (lean.StepGraph replays)")
    ap.add_argument("--budget", type=float, help="VRAM budget in GiB for the activation plan")
    ap.add_argument("--json", help="write the breakdowns to this path")
    ap.add_argument("--trace", help="also write the gzipped chrome traces into this folder")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench profile: needs a CUDA GPU (on a CPU, `python tools/bench.py step --smoke` checks "
                         "the step harness)")
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    p = profile_lean(a.model, a.layout, a.steps, a.graph, a.budget, a.trace)
    print_profile(p)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(p, device=torch.cuda.get_device_name(), torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
