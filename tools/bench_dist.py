"""bench step --nproc N: lean's data-parallel step on N GPUs beside its one-GPU row, and HF+PEFT
(DDP through `accelerate launch`) beside its own, all from one commit in one run.

    python tools/bench.py step --nproc 2 --models llama-3.2-1b,qwen3-8b --graph
    python tools/bench.py step --nproc 4 --models qwen3-8b --shard-weights     # + the sharded row
    python tools/bench.py step --nproc 2,4 --models llama-3.2-1b --graph      # x2 and x4 rows, one x1 row
    tools/gpu_check.sh dist-bench 2 --models llama-3.2-1b                    # the same, in one device call

Weak scaling (BENCHMARKS.md's goal: >= 0.92 of N x the one-GPU tokens/s): every rank steps its own
8192 tokens (the layout's document lengths, token ids drawn per rank) through the whole optimizer
step, so a step trains N x 8192 tokens. The one-GPU rows are bench_step's own (tools/bench_step.py,
one process each, measured in this run); the N-GPU rows run here as one process per GPU:
  lean xN          torchrun; lean.forward_backward with the gradient's bucketed all-reduce under the
                   backward (lean.runtime.grad_reduce.GradReducer), the loss normalised by every rank's
                   targets, lean.AdamW
  lean+graph xN    (--graph, after the eager row) the step with its all-reduce captured in one
                   StepGraph (the row says if the capture fell back to eager)
  lean xN sharded  (--shard-weights) the same with every layer's frozen weights sharded over the
                   ranks and all-gathered one layer ahead, the lm_head sharded and all-gathered
                   chunk by chunk in the loss, the embedding table in pinned host memory
                   (lean.runtime.shard); goal: >= 0.85 of the unsharded row's tokens/s, and a
                   per-GPU peak under a quarter of the weights plus the one-layer working set on 4
                   GPUs (the row prints both numbers)
  HF+PEFT xN       `accelerate launch --multi_gpu` (torch DDP under accelerate), the peer's usual
                   multi-GPU path; skipped with a note when accelerate is not installed
  Unsloth xN       (--peers with unsloth) Unsloth's documented multi-GPU mode: its model on each
                   rank's GPU (device_map) under `accelerate launch` (DDP); the row fails with the
                   peer's own message if Unsloth does not run so there
Timing: as bench_step (median of --steps CUDA-event-timed steps after 3 warm-ups); each rank times
its own steps and the row takes the slowest rank's median (the step is synchronous across ranks
through its all-reduce). Peak: the largest torch.cuda.max_memory_allocated over the ranks, from
a reset after the setup and before the step's capture (weights, LoRA and optimizer state stay
counted, and so does a captured step's memory pool; a sharded model is sharded before the reset).
Efficiency = tokens/s of the N-GPU row / (N x the one-GPU row's).
Every rank prints its progress on stderr ("[rank 0  12.3 s] step captured"): a row killed at its
--timeout keeps the tail, and a row whose ranks printed their numbers and then hung on the way out
keeps the numbers, the hang noted. `--smoke` runs the lean rows on the CPU with gloo (2 processes,
tiny configs) to test the harness.
"""
import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(TOOLS))
import bench_step  # noqa: E402
from lean.runtime.dist import MULTICAST_OFF  # noqa: E402 - NVLink multicast off, as lean-train sets it


# =============================================================================================
# one rank of lean's row (under torchrun)
# =============================================================================================
def _say(d, t0, what):
    """A progress line on stderr (every rank): a row killed at its timeout keeps the tail, which then
    says where each rank stood."""
    print(f"[rank {d.rank} {time.perf_counter() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)


def lean_rank(args):
    from types import SimpleNamespace

    import torch.distributed as dist

    from lean.runtime.dist import start
    from lean.runtime.grad_reduce import GradReducer
    from lean.runtime.shard import shard_model

    t0 = time.perf_counter()
    d = start(SimpleNamespace(device="cpu" if args.smoke else None, dist_timeout=600, shard_weights=args.shard))
    _say(d, t0, f"process group up ({d.world} ranks, {d.device})")
    lean, model = bench_step.random_model(args.model, d.device, torch.float32 if args.smoke else torch.bfloat16,
                                          args.smoke)  # the same seed on every rank: the same weights
    if args.shard:
        model = shard_model(model, d, d.device)
    cuda = d.device.startswith("cuda")
    _say(d, t0, "model built" + " and sharded" * args.shard)
    total = bench_step.SMOKE_TOKENS if args.smoke else bench_step.TOKENS
    lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", dropout=0.0, seed=0)
    opt = lean.AdamW(lora, lr=1e-4, max_grad_norm=1.0)
    reducer = GradReducer(lora, d)
    rng = np.random.default_rng(1 + d.rank)  # this rank's own token ids, the layout's lengths
    docs = [[rng.integers(0, model.config.vocab, n).tolist() for n in bench_step.doc_lengths(args.layout, total)]
            for _ in range(2)]
    note, graph = [], None
    if cuda:  # the peak counts from here: the setup's weights, LoRA and optimizer state stay in it, and a
        torch.cuda.synchronize()  # sync: setup done   # captured step's pool (allocated while capturing) too
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if args.graph and cuda:
        try:
            graph = lean.StepGraph(model, lora, opt, budget=total, max_docs=bench_step.MAX_DOCS, reducer=reducer)
        except Exception as e:  # noqa: BLE001 - the row says so and runs eagerly
            note.append(f"graph capture failed on rank {d.rank} ({type(e).__name__}: {str(e)[:120]}): eager")
        failed = d.exchange([graph is None])[0]
        graph = graph if not failed else None
        _say(d, t0, "step captured" if graph is not None else "capture failed: eager")
    if graph is not None:
        fixed = [graph.pack(x) for x in docs]
        n = d.world * fixed[0].n_targets  # every rank's batch has the same targets (the same lengths)

        def step(i):  # this rank's mean loss
            return graph.step(fixed[i % 2], n_targets=n)[0] / fixed[i % 2].n_targets
    else:
        batches = [lean.pack(x, max_tokens=total, device=d.device) for x in docs]
        n = d.world * batches[0].n_targets

        def step(i):
            lora.zero_grad()
            reducer.begin()
            loss, _ = lean.forward_backward(model, lora, batches[i % 2], grad_scale=1.0 / n, reducer=reducer)
            reducer.finish()
            opt.step()
            return loss / batches[i % 2].n_targets  # this rank's mean loss
    _say(d, t0, "timing")
    t, loss = bench_step.time_steps(step, bench_step.WARMUP if not args.smoke else 1, args.steps, cuda)
    _say(d, t0, f"timed: median {t * 1e3:.1f} ms")
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    stats = torch.tensor([t, float(peak)], dtype=torch.float64, device=d.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    t, peak = stats.tolist()  # sync: the row's numbers
    if d.main:
        weights = sum(x.numel() * x.element_size() for layer in model.layers for x in (layer.buf, layer.qbuf))
        tables = list({id(x): x for x in (model.embed, model.lm_head) if x.device.type == "cuda"}.values())
        shard = getattr(model.cache.get("head"), "shard", None)  # the sharded lm_head's part (shard.ShardHead)
        tables = sum(x.numel() * x.element_size() for x in tables + ([shard] if shard is not None else []))
        row = dict(framework="lean", nproc=d.world, model=args.model, layout=args.layout, sharded=args.shard,
                   graph=graph is not None, ms=t * 1e3, tokens_per_s=d.world * total / t, peak_gib=peak / 2**30,
                   layer_gib_per_rank=weights / 2**30, tables_gib_per_rank=tables / 2**30, loss=loss,
                   note="; ".join(note))
        print("ROW " + json.dumps(row), flush=True)
    d.close()
    _say(d, t0, "process group closed")


# =============================================================================================
# one rank of HF+PEFT's row (under accelerate launch)
# =============================================================================================
def _unsloth_model(name, local_rank):
    """Unsloth's LoRA model of the bench config on this rank's GPU (its DDP guide: device_map)."""
    import bench_peers

    bench_peers.preload_cudart()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    from unsloth import FastLanguageModel  # before transformers and peft: it patches them

    model, _ = FastLanguageModel.from_pretrained(bench_peers.ensure_folder(name, False), max_seq_length=bench_step.TOKENS,
                                                 dtype=torch.bfloat16, device_map={"": local_rank})
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=bench_peers.TARGETS,
                                             bias="none", use_gradient_checkpointing=False, random_state=0)
    FastLanguageModel.for_training(model, use_gradient_checkpointing=False)
    return model


def hf_rank(args):
    """One rank of HF+PEFT's (or, role unsloth-rank, Unsloth's) row under accelerate launch."""
    from accelerate import Accelerator

    import bench_peers

    acc = Accelerator()
    device = acc.device
    if args.role == "unsloth-rank":
        model = _unsloth_model(args.model, acc.local_process_index)
    else:
        model = bench_peers.peft_wrap(bench_peers.build_hf(args.model, False, device, torch.bfloat16),
                                      bench_step.is_moe(args.model))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    batches = [bench_peers.hf_inputs(args.layout, model.module.config.vocab_size if hasattr(model, "module")
                                     else model.config.vocab_size, bench_step.TOKENS, device, seed=s + 100 * acc.process_index)[0]
               for s in range(2)]

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = model(**batches[i % 2], use_cache=False).loss
        acc.backward(loss)
        acc.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()

    torch.cuda.synchronize()  # sync: setup done
    torch.cuda.reset_peak_memory_stats()
    t, loss = bench_step.time_steps(step, bench_step.WARMUP, args.steps, True)
    import torch.distributed as dist

    stats = torch.tensor([t, float(torch.cuda.max_memory_allocated())], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank's median, the largest peak
    t, peak = stats.tolist()
    if acc.is_main_process:
        row = dict(framework="unsloth" if args.role == "unsloth-rank" else "hf", nproc=acc.num_processes,
                   model=args.model, layout=args.layout, sharded=False, graph=False, ms=t * 1e3,
                   tokens_per_s=acc.num_processes * bench_step.TOKENS / t, peak_gib=peak / 2**30, loss=loss,
                   note="accelerate launch (DDP)")
        print("ROW " + json.dumps(row), flush=True)


# =============================================================================================
# the parent: one-GPU rows (bench_step's), then the N-GPU rows
# =============================================================================================
def _launch(cmd, timeout, env):
    """Run one multi-process row; its ROW line, or an error row with the output's tail."""
    # its own session: a timeout kills the launcher's ranks too (left running, they held 10 GiB of
    # GPU 0 into the next row on the H100 x2), and what they printed so far names where they stood
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=os.path.dirname(TOOLS), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        tail = " | ".join(((err or "") + (out or "")).strip().splitlines()[-6:])
        rows = [json.loads(x[4:]) for x in (out or "").splitlines() if x.startswith("ROW ")]
        if rows:  # measured and printed, then stuck on the way out (the numbers stand; the hang is noted)
            return dict(rows[-1], status="ok", note=(rows[-1].get("note", "") + f"; ranks killed at {timeout} s "
                                                     f"after the row: {tail}").lstrip("; "))
        return dict(status="failed", note=f"killed at {timeout} s: {tail}")
    rows = [json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW ")]
    if p.returncode != 0 or not rows:
        return dict(status="failed", note=f"exit {p.returncode}: " + " | ".join((err or out).strip().splitlines()[-4:]))
    return dict(rows[-1], status="ok")


def _one_gpu(framework, model, layout, steps, smoke, graph, timeout):
    """bench_step's one-process rows of a framework (lean: eager, and lean+graph with --graph)."""
    raw = bench_step.run_child(framework, model, layout, steps, bench_step.WARMUP, smoke, graph, timeout)
    named = [(raw, framework)] if "status" in raw else (
        bench_step.split_lean_row(raw) if framework == "lean" else [(raw, framework)])
    return [dict(r, framework=name, nproc=1, model=model, layout=layout, status=r.get("status", "ok"),
                 tokens_per_s=r["tokens"] / (r["ms"] / 1e3) if "ms" in r else None) for r, name in named]


def _named(row, sharded=False):
    """A lean N-GPU row named as its one-GPU counterpart (lean, lean+graph), plus " sharded"."""
    name = "lean+graph" if row.get("graph") else "lean"
    return dict(row, framework=name + " sharded" * sharded)


def nproc_rows(model, layout, nprocs, steps, graph, shard, peers, smoke, timeout):
    """The one-GPU rows and, for each N of nprocs, the N-GPU rows of one model and layout: lean eager,
    lean+graph (--graph), lean sharded (--shard-weights: graph if --graph, else eager)."""
    env = dict(os.environ, **MULTICAST_OFF)
    rows = _one_gpu("lean", model, layout, steps, smoke, graph, timeout)
    for n in nprocs:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                    str(29500 + (os.getpid() + n) % 1000), os.path.join(TOOLS, "bench_dist.py"), "lean-rank",
                    "--model", model, "--layout", layout, "--steps", str(steps)] + ["--smoke"] * smoke
        for g in [False] + [True] * graph:  # eager first: its row stands should the captured one fail
            rows.append(_named(dict(_launch(torchrun + ["--graph"] * g, timeout, env), nproc=n, model=model,
                                    layout=layout, graph=g)))
        if shard:
            rows.append(_named(dict(_launch(torchrun + ["--shard"] + ["--graph"] * graph, timeout, env), nproc=n,
                                    model=model, layout=layout, graph=graph), sharded=True))
    for peer in [p for p in ("hf", "unsloth") if p in peers and not smoke]:
        rows += _one_gpu(peer, model, layout, steps, smoke, False, timeout)
        missing = [m for m in ("accelerate", "peft" if peer == "hf" else "unsloth") if importlib.util.find_spec(m) is None]
        for n in nprocs:
            if missing:
                rows.append(dict(status="skipped", framework=peer, nproc=n, model=model, layout=layout,
                                 note=f"{', '.join(missing)} not installed (tools/fetch_wheels.sh: .whl/a, .whl/b): skipped"))
                continue
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
                   "--main_process_port", str(29500 + (os.getpid() + n + 7) % 1000), "--mixed_precision", "no",
                   os.path.join(TOOLS, "bench_dist.py"), f"{peer}-rank", "--model", model, "--layout", layout,
                   "--steps", str(steps)]
            rows.append(dict(_launch(cmd, timeout, env), framework=peer, nproc=n, model=model, layout=layout))
    return rows


def table(rows):
    """The rows with their scaling efficiency against the same framework's one-GPU row."""
    one = {(r["framework"], r["model"], r["layout"]): r.get("tokens_per_s") for r in rows if r.get("nproc") == 1}
    unsharded = {(r["framework"], r["model"], r["layout"], r.get("nproc")): r.get("tokens_per_s") for r in rows
                 if r.get("nproc", 1) > 1}
    out = [f"{'model':14} {'layout':7} {'framework':24} {'GPUs':>4} {'tok/s':>10} {'efficiency':>10} {'peak GiB':>9}  note"]
    for r in rows:
        plain = r["framework"].split(" sharded")[0]
        base = one.get((plain, r["model"], r["layout"]))
        tps = r.get("tokens_per_s")
        eff = f"{tps / (r['nproc'] * base):.3f}" if tps and base and r["nproc"] > 1 else ""
        note = r.get("note", "")
        ref = unsharded.get((plain, r["model"], r["layout"], r.get("nproc")))
        if " sharded" in r["framework"] and tps and ref:
            note = (f"{tps / ref:.3f} of unsharded; layers {r.get('layer_gib_per_rank', 0):.2f} GiB, "
                    f"tables {r.get('tables_gib_per_rank', 0):.2f} GiB a rank; "
                    f"{note}").rstrip("; ")
        shown = f"{tps:,.0f}" if tps else r.get("status", "")
        out.append(f"{r['model']:14} {r['layout']:7} {r['framework']:24} {r['nproc']:>4} {shown:>10} {eff:>10} "
                   f"{r.get('peak_gib', 0) or 0:>9.2f}  {note}")
    return "\n".join(out)


def main(models, layouts, nproc, steps, graph=False, shard=False, peers=("hf",), smoke=False, json_path=None,
         timeout=600):
    """nproc: one GPU count or several (2,4: one run, the one-GPU rows measured once)."""
    nprocs = [nproc] if isinstance(nproc, int) else list(nproc)
    if not smoke and torch.cuda.device_count() < max(nprocs):
        raise SystemExit(f"bench step --nproc {max(nprocs)}: this machine has {torch.cuda.device_count()} GPU(s)")
    rows = []
    for m in models:
        for layout in layouts:
            for r in nproc_rows(m, layout, nprocs, steps, graph, shard, peers, smoke, timeout):
                print("row " + json.dumps(r), flush=True)
                rows.append(r)
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(rows=rows, nproc=nproc, smoke=smoke), f, indent=1)


def _child():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["lean-rank", "hf-rank", "unsloth-rank"])
    p.add_argument("--model", required=True)
    p.add_argument("--layout", default="packed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--graph", action="store_true")
    p.add_argument("--shard", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    (lean_rank if args.role == "lean-rank" else hf_rank)(args)


if __name__ == "__main__":
    _child()
