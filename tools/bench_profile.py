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


def family(name):
    """A kernel name's family: lean's Triton kernels by name (without `_kernel`), else `other`."""
    if name.startswith("_") and name.endswith("_kernel"):
        return name[:-len("_kernel")]
    return "other"


def gpu_events(trace):
    """[(family, name, start_us, dur_us)] of every GPU activity in a chrome trace dict."""
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat")
        if cat in GPU_CATS and "dur" in e:
            fam = GPU_CATS[cat] or family(e.get("name", ""))
            out.append((fam, e.get("name", ""), float(e["ts"]), float(e["dur"])))
    return out


def busy_us(events):
    """Length of the union of the activity intervals (us)."""
    total, end = 0.0, float("-inf")
    for _, _, t0, dur in sorted(events, key=lambda e: e[2]):
        t1 = t0 + dur
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def breakdown(events, steps, step_ms):
    """Per-family totals per step, sorted by time, and the busy / idle split."""
    fams = {}
    for fam, name, _, dur in events:
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
    return dict(step_ms=step_ms, kernels_ms=total, busy_ms=busy, idle_ms=step_ms - busy, families=rows,
                n_events=len(events))


def profile_steps(step, steps, trace_path=None):
    """Run step(i) `steps` times under torch.profiler; the GPU events of the trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
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


def measure(step, warmup, steps, trace_path=None):
    """Median step time (CUDA events, after `warmup`), then the profiled breakdown."""
    step_s, _ = bench_step.time_steps(step, warmup, steps, cuda=True)
    events = profile_steps(step, steps, trace_path)
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity: CUPTI is unavailable here, or this torch does "
                           "not report kernels launched from CUDA graphs; run without --graph or check "
                           "torch.profiler on this machine")
    return breakdown(events, steps, step_s * 1e3)


def profile_lean(name, layout, steps=5, graph=False, budget_gib=None, trace_dir=None):
    """{eager: breakdown, [graph: breakdown]} of lean's step for one model and layout."""
    lean, model, lora, opt, docs, batches, _ = bench_step.lean_setup(name, layout)
    plan = bench_step.lean_plan(model, lora, batches[0].n_tokens, budget_gib)

    def eager(i):
        lora.zero_grad()
        loss, n = lean.forward_backward(model, lora, batches[i % 2], plan=plan)
        opt.step()
        return loss / n

    def trace(tag):
        return os.path.join(trace_dir, f"trace_{name}_{layout}_{tag}.json.gz") if trace_dir else None

    out = dict(model=name, layout=layout, steps=steps, plan=bench_step.plan_note(plan),
               eager=measure(eager, bench_step.WARMUP, steps, trace("eager")))
    if graph:
        n_tokens = batches[0].n_tokens
        max_docs = bench_step.MAX_DOCS * -(-(len(docs[0]) + 1) // bench_step.MAX_DOCS)
        g = bench_step.make_step_graph(lean, model, lora, opt, n_tokens, max_docs, plan)
        gb = [g.pack(d) for d in docs]

        def replay(i):
            loss, n = g.step(gb[i % 2])
            return loss / n

        try:
            out["graph"] = measure(replay, bench_step.WARMUP, steps, trace("graph"))
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
    return "\n".join(lines)


def print_profile(p):
    head = f"{p['model']} {p['layout']}" + (f" [{p['plan']}]" if p["plan"] else "")
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
