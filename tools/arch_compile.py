"""Compile every lean kernel for every GPU target on the CPU, and check its shared memory.

    python tools/arch_compile.py                       # all presets x all targets: a table, exit 1 on a misfit
    python tools/arch_compile.py --targets 86,120 --models qwen3-8b --list

How: the step runs for real on the `meta` device (no memory, no GPU) with Triton's launcher replaced
by a recorder, once per target under lean.kernels.arch.forced(target(cc)): each launcher checks
its arguments and asks its config chooser exactly as on that GPU, and the recorder keeps the
kernel, its arguments and options instead of launching. What runs per preset model (one layer:
every layer launches the same kernels): the eager step over a packed 8192-token batch (documents
of 1 token up to the longest), the same inside gemm.tma_at_every_size (what StepGraph captures:
TMA at every size where the arch takes it; there also under LEAN_PORTABLE=1, the pointer kernels),
a rebuilt-in-backward plan (the deferred dA kernels), LoRA dropout, AdamW, evaluation (loss_eval)
and a short batch, the logits GEMM, the loss and logits with the lm_head streamed from the host
(head_host.py), and generation's cached forward and argmax. Kernels no step launches (the
dropout-mask test kernel, attention's TMA loops forced) are called directly. Then each distinct
(kernel, specialization, options) is compiled by triton.compile for GPUTarget("cuda", cc, 32)
with Triton's own ptxas, and its metadata.shared compared with the arch table's limit.

The same launch recorded for several models or variants compiles once per target (Triton's own
cache key); compiles run on a process pool. Needs Triton's CUDA backend (bundled with the wheel)
but no GPU and no CUDA driver. TRITON_INTERPRET must be 0 (the kernels must be JITFunctions):
this script sets it before importing lean.
"""
import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler.compiler import get_cache_key  # noqa: E402
from triton.compiler.compiler import get_cache_invalidating_env_vars  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: E402

TARGETS = (80, 86, 89, 90, 100, 120, 121)
META = torch.device("meta")


# ---------------------------------------------------------------------------------------- recording

class Recorder:
    """Within: every @triton.jit kernel launch is recorded as (kernel, args, kwargs), not run."""

    def __init__(self):
        self.launches = []

    def __enter__(self):
        self._run = JITFunction.run
        rec = self.launches

        def run(fn, *args, grid, warmup, **kwargs):
            rec.append((fn, args, kwargs))
        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._run


def _meta_batch(docs, max_tokens, **kw):
    import lean
    b = lean.pack(docs, max_tokens, device="cpu", **kw)
    moved = {f: getattr(b, f).to(META) for f in ("ids", "positions", "targets", "cu_seqlens")}
    return dataclasses.replace(b, **moved)


def _doc_lengths(total, rng):
    """1 token, 16, a few exponential ones, then one that fills the batch: the edge cases at once."""
    lens = [1, 16] + [int(x) + 1 for x in rng.exponential(512, 12)]
    while sum(lens) >= total:
        lens.pop()
    lens.append(total - sum(lens))
    return lens


def _gptoss_expert_launches(tokens, dtype, C=2880, F=2880, E=32, K=4, R=16):
    """GPT-OSS's expert MLP kernels on meta tensors (gpt-oss-20b: C = F = 2880, E 32, top-4): the
    clamped GLU both ways, gmm with the expert biases, MXFP4 dequantisation and gmm_mxfp4 in both
    orientations (gate_up forward, dX through the transposed gate_up)."""
    from lean.kernels.grouped_gemm import gmm
    from lean.kernels.moe_glu import moe_glu_bwd, moe_glu_fwd
    from lean.kernels.mxfp4 import gmm_mxfp4, mxfp4_dequant

    P = tokens * K
    t = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device=META)  # noqa: E731
    off, order = t(E + 1, dt=torch.int32), t(P, dt=torch.int32)
    blocks, scales = t(E, 2 * F, C // 32, 16, dt=torch.uint8), t(E, 2 * F, C // 32, dt=torch.uint8)
    moe_glu_fwd(t(P, F), t(P, 2 * F))
    moe_glu_bwd(t(P, 2 * F), t(tokens, K, dt=torch.float32), t(P, F), t(P, 2 * F), t(tokens, K), order, act=t(P, F))
    mxfp4_dequant(t(E, 2 * F, C), blocks, scales)
    lora = (t(P, R), t(E, 2 * F, R), 2.0)
    gmm(t(P, 2 * F), t(tokens, C), t(E, C, 2 * F).transpose(1, 2), off, gather=order, gather_div=K, lora=lora,
        bias=t(E, 2 * F))
    gmm_mxfp4(t(P, 2 * F), t(tokens, C), blocks, scales, off, gather=order, gather_div=K, lora=lora,
              bias=t(E, 2 * F, dt=torch.float32))
    gmm_mxfp4(t(P, C), t(P, 2 * F), blocks, scales, off, transpose=True, lora=(t(P, R), t(E, C, R), 2.0))


def _gguf_quant_launches(R=14336, C=4096):
    """The GGUF export's quantisers (kernels/gguf_quant.py) on an 8B's ffn_gate (R x C): Q8_0, Q4_K
    and Q6_K from bf16 rows (a checkpoint's dtype) and from fp32 (a merge kept in fp32)."""
    from lean.kernels.gguf_quant import QTYPES, quantize_rows, row_bytes

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(R, C, dtype=dtype, device=META)
        for qtype in QTYPES:
            quantize_rows(torch.empty(R, row_bytes(C, qtype), dtype=torch.uint8, device=META), x, qtype)


def _nf4_launches(cfg, dtype, batch, tokens):
    """An NF4 copy of a dense preset (kernels/nf4.py): quantise and dequantise a projection, then the
    step with nf4.FUSED forced each way (the pointer kernels' NF4 decode; the scratch copy)."""
    import lean
    import lean.kernels.nf4 as NF
    from lean.models.weights import empty_model

    model = empty_model(dataclasses.replace(cfg, weight_quant="nf4"), dtype, META)
    q = model.layers[0].q
    NF.nf4_quantize(q, torch.empty(q.shape, dtype=dtype, device=META))
    NF.nf4_dequant(torch.empty(q.shape, dtype=dtype, device=META), q)
    lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", seed=0)
    for fused in (True, False):
        NF.FUSED = fused
        try:
            lean.forward_backward(model, lora, batch)
        finally:
            NF.FUSED = None


def model_launches(name, hf_config, dtype=torch.bfloat16, tokens=8192):
    """Run the step's variants for one preset on meta tensors, recording every launch."""
    import lean
    from lean.kernels.arch import arch, portable
    from lean.kernels.argmax import argmax_fwd
    from lean.kernels.attention import attention_bwd, attention_fwd
    from lean.kernels.gemm import matmul, tma_at_every_size
    from lean.kernels.kv_attention import kv_attention_fwd
    from lean.kernels.lora_dropout import lora_dropout_mask
    from lean.kernels.rmsnorm import rmsnorm_bwd
    from lean.models.config import config_from_hf
    from lean.models.dense import Ctx
    from lean.models.weights import empty_model
    from lean.runtime.generate import _forward_cached
    from lean.runtime.head_host import head_to_host
    from lean.runtime.plan import KEEP, RECOMPUTE, make_plan

    cfg = config_from_hf({**hf_config, "num_hidden_layers": 2})
    model = empty_model(cfg, dtype, META)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab, n).tolist() for n in _doc_lengths(tokens, rng)]
    big = _meta_batch(docs, tokens)
    graph_batch = _meta_batch(docs, tokens, pad_to=tokens, max_docs=64)
    small = _meta_batch([rng.integers(0, cfg.vocab, n).tolist() for n in (37, 1, 122)], 160)
    moe = bool(cfg.moe_layers)
    with Recorder() as rec:
        for dropout in (0.0, 0.1):  # LoRA dropout is for the projections only (never the experts)
            targets = "q,k,v,o" if moe and dropout else "all"
            lora = lean.LoRA.init(model, r=16, alpha=32, targets=targets, dropout=dropout, seed=0)
            opt = lean.AdamW(lora, lr=1e-4, max_grad_norm=1.0)
            lean.forward_backward(model, lora, big)
            lean.forward_backward(model, lora, small)
            opt.step()
        lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", seed=0)
        with tma_at_every_size():  # the captured step's kernels
            lean.forward_backward(model, lora, graph_batch)
            if arch().tma:  # and its pointer kernels, as LEAN_PORTABLE=1 runs them on such a GPU
                with portable():
                    lean.forward_backward(model, lora, graph_batch)
        plan = make_plan(cfg, tokens, (RECOMPUTE, KEEP), lora_rank=16)
        lean.forward_backward(model, lora, big, plan=plan)
        lean.loss_eval(model, lora, big)
        lean.forward(model, lora, small)
        # the lm_head streamed from the host (plan.head_host): the loss and the logits by vocabulary chunks
        streamed = empty_model(cfg, dtype, META)
        head_to_host(streamed)
        lean.forward_backward(streamed, lora, big)
        lean.loss_eval(streamed, lora, big)
        lean.forward(streamed, lora, small)
        if moe:  # the load-balancing loss (off in the preset): router probability sums and moe_aux
            aux = empty_model(config_from_hf({**hf_config, "num_hidden_layers": 2, "output_router_logits": True}),
                              dtype, META)
            lean.forward_backward(aux, lean.LoRA.init(aux, r=16, alpha=32, seed=0), big)
        # generation: a 12-token prompt, then one token at position 12
        ctx = Ctx(cu_seqlens=None, max_seqlen=0, cos=None, sin=None, eps=cfg.rms_eps, attn_scale=0.125,
                  lora_scale=lora.scale, dropout=0.0, seed=0)
        L = 64
        cache = [(torch.empty(L, cfg.n_kv_heads, cfg.head_dim, dtype=dtype, device=META),) * 2 for _ in model.layers]
        cos = torch.empty(L, cfg.head_dim // 2, dtype=torch.float32, device=META)
        for T, P in ((12, 0), (1, 12)):
            ids = torch.empty(T, dtype=torch.int32, device=META)
            logits = _forward_cached(model, lora, ids, P, cache, cos, cos, ctx)
        argmax_fwd(torch.empty(1, dtype=torch.int64, device=META), logits)
        if moe:  # GPT-OSS's expert kernels (no preset model launches them yet), at gpt-oss-20b's shapes
            _gptoss_expert_launches(tokens, dtype)
        else:  # QLoRA: the model in NF4, quantised at load, its step through the fused decode and the scratch copy
            _nf4_launches(cfg, dtype, big, tokens)
        _gguf_quant_launches()  # the GGUF export's (no step launches them)
        # kernels no step launches: the dropout mask (tests), RMSNorm's weight gradient (the norms are
        # frozen under LoRA) and attention's TMA loops forced on
        lora_dropout_mask(torch.empty(tokens, cfg.hidden, dtype=dtype, device=META), 0, 0.1)
        x = torch.empty(tokens, cfg.hidden, dtype=dtype, device=META)
        rmsnorm_bwd(torch.empty_like(x), torch.empty(cfg.hidden, dtype=torch.float32, device=META), x, x, model.norm,
                    torch.empty(tokens, dtype=torch.float32, device=META))
        # gemm.matmul's options no step passes (merge.py's, a kernel experimenter's): bias, alpha and
        # accumulate on x W^T and dy W, eager and at every size (the TMA loops where the arch has them)
        w = torch.empty(cfg.hidden, cfg.hidden, dtype=dtype, device=META)
        for every_size in (False, True):
            with tma_at_every_size() if every_size else contextlib.nullcontext():
                for b in (w.t(), w):
                    matmul(torch.empty_like(x), x, b, bias=w[0], accumulate=True, alpha=0.5)
        # attention at head dim 256 (the table's third row; no preset has it), and its TMA loops
        # forced on where the arch takes them (the captured step takes them at D = 64 / 128 only)
        for H, KVH, D, tma in ((cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, True), (8, 2, 256, False)):
            if tma and not (arch().tma and D == triton.next_power_of_2(D)):
                continue
            t = lambda h: torch.empty(tokens, h, D, dtype=dtype, device=META)  # noqa: E731
            lse = torch.empty(H, tokens, dtype=torch.float32, device=META)
            q, k, v, o = t(H), t(KVH), t(KVH), t(H)
            attention_fwd(o, lse, q, k, v, big.cu_seqlens, big.max_seqlen, 0.1, tma=tma)
            attention_bwd(t(H), t(KVH), t(KVH), torch.empty_like(lse), t(H), q, k, v, o, lse, big.cu_seqlens,
                          big.max_seqlen, 0.1, tma=tma)
        # GPT-OSS's options (sink logits, window 128) until a model passes them: its heads (64/8, D 64),
        # the pointer loops and the TMA loops where the arch takes them, and the cached path
        H, KVH, D = 64, 8, 64
        sinks = torch.empty(H, dtype=dtype, device=META)
        t = lambda h: torch.empty(tokens, h, D, dtype=dtype, device=META)  # noqa: E731
        lse = torch.empty(H, tokens, dtype=torch.float32, device=META)
        q, k, v, o = t(H), t(KVH), t(KVH), t(H)
        for tma in (False, True) if arch().tma else (False,):
            attention_fwd(o, lse, q, k, v, big.cu_seqlens, big.max_seqlen, 0.1, sinks=sinks, window=128, tma=tma)
            attention_bwd(t(H), t(KVH), t(KVH), torch.empty_like(lse), t(H), q, k, v, o, lse, big.cu_seqlens,
                          big.max_seqlen, 0.1, sinks=sinks, window=128, tma=tma)
        for T, P in ((12, 0), (1, 12)):
            kc = torch.empty(64, KVH, D, dtype=dtype, device=META)
            qc = torch.empty(T, H, D, dtype=dtype, device=META)
            kv_attention_fwd(torch.empty_like(qc), qc, kc, kc, P, 0.125, sinks=sinks, window=128)
    return rec.launches


# ---------------------------------------------------------------------------------------- compiling

MEMO = os.path.join(ROOT, "tests", "arch_fit.json")
_BACKENDS = {}


def _backend(cc):
    if cc not in _BACKENDS:
        target = GPUTarget("cuda", cc, 32)
        _BACKENDS[cc] = (target, make_backend(target))
    return _BACKENDS[cc]


_CACHES = {}


def _caches(fn, cc):
    """fn's argument binder for cc's backend and its two launch caches, made once, as JITFunction
    keeps them per device (building the binder execs generated source: most of the recording's
    time when redone for every launch)."""
    if (fn, cc) not in _CACHES:
        _CACHES[fn, cc] = (create_function_from_signature(fn.signature, fn.params, _backend(cc)[1]), {}, {})
    return _CACHES[fn, cc]


def specialize(fn, args, kwargs, cc):
    """(compile key, job) of a launch as Triton would compile it for cc. The key is Triton's own
    cache key (triton.compile's: the kernel's and its callees' source, the specialization, the
    options, Triton's and ptxas' versions), so a memo entry is reused exactly when Triton would
    reuse its compiled binary."""
    target, backend = _backend(cc)
    kwargs = dict(kwargs, debug=False, instrumentation_mode="")
    binder, key_cache, launches = _caches(fn, cc)
    bound, spec, opts = binder(*args, **kwargs)
    # JITFunction.run's in-process key: a launch with the same one runs the kernel it compiled
    launch = compute_cache_key(key_cache, spec, opts)
    if launch not in launches:
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
        src = ASTSource(fn, signature, constexprs, attrs)
        key = get_cache_key(src, backend, backend.parse_options(options.__dict__), get_cache_invalidating_env_vars())
        job = (fn.fn.__module__, fn.fn.__name__, cc, signature, constexprs, attrs, options.__dict__)
        launches[launch] = (hashlib.sha256(key.encode()).hexdigest(), job)
    return launches[launch]


def config_text(fn, constexprs, options):
    """The launch's tile constants and options, for the report."""
    names = [p.name for p in fn.params]
    consts = ", ".join(f"{names[path[0]]}={v}" for path, v in constexprs.items() if names[path[0]].isupper())
    return f"{consts}, num_warps={options['num_warps']}, num_stages={options['num_stages']}"


def _compile_job(job):
    """In a worker: compile one launch for its target; (shared bytes, seconds, error)."""
    module, name, cc, signature, constexprs, attrs, options = job
    import importlib
    fn = getattr(importlib.import_module(module), name)
    target, _ = _backend(cc)
    t0 = time.time()
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
        return k.metadata.shared, time.time() - t0, None
    except Exception as e:  # a compile error is a finding, reported with the launch
        lines = str(e).strip().splitlines() or [""]
        said = [x for x in lines[1:] if ("error" in x.lower() or "fatal" in x.lower())  # ptxas's own words,
                and "Repro command" not in x and "failed with error code" not in x]  # not Triton's header
        return None, time.time() - t0, f"{type(e).__name__}: {' / '.join(said[:2] or lines[-1:])[:300]}"


@dataclasses.dataclass
class Result:
    kernel: str
    cc: int
    config: str
    shared: int          # bytes, -1 when the compile failed
    limit: int           # the arch table's shared memory per block
    how: str             # "compiled", "memo" or "memo, recompiled" (the spot check)
    error: str
    models: list

    @property
    def ok(self):
        return self.error is None and 0 <= self.shared <= self.limit


def check(models, targets, workers=2, memo=None, spot=0, seed=None, log=print):
    """Record every launch of every model on every target, then the shared memory of each distinct
    one: from `memo` (key -> [kernel, cc, shared]) where it has the key, else compiled; `spot` memo
    hits drawn at random (seed printed) are compiled anyway and must agree. Returns [Result]."""
    from lean.kernels import arch as A
    from lean.models.presets import PRESETS

    memo = memo or {}
    jobs, seen = {}, {}
    t0 = time.time()
    for cc in targets:
        a = A.target(cc // 10, cc % 10)
        with A.forced(a):
            for m in models:
                for fn, args, kwargs in model_launches(m, PRESETS[m]):
                    key, job = specialize(fn, args, kwargs, cc)
                    if key not in jobs:
                        jobs[key] = job
                        seen[key] = (fn.fn.__name__, cc, config_text(fn, job[4], job[6]), a.smem, [])
                    if m not in seen[key][4]:
                        seen[key][4].append(m)
    hits = [k for k in jobs if k in memo]
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    checked = set(rng.choice(hits, size=min(spot, len(hits)), replace=False).tolist()) if hits and spot else set()
    todo = [k for k in jobs if k not in memo or k in checked]
    log(f"# recorded {len(jobs)} distinct launches over {len(targets)} targets in {time.time() - t0:.1f} s; "
        f"compiling {len(todo)} ({len(jobs) - len(hits)} not in the memo, {len(checked)} memo entries "
        f"spot-checked, seed {seed})")
    with cf.ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        outs = dict(zip(todo, pool.map(_compile_job, [jobs[k] for k in todo])))
    results = []
    for k in jobs:
        name, cc, cfg, limit, ms = seen[k]
        if k in outs:
            shared, _, err = outs[k]
            how = "compiled"
            if k in checked:
                how = "memo, recompiled"
                if err is None and shared != memo[k][2]:
                    err = f"the memo says {memo[k][2]} B, the compiler {shared} B: rerun tools/arch_compile.py --update"
        else:
            shared, err, how = memo[k][2], None, "memo"
        results.append(Result(name, cc, cfg, -1 if shared is None else shared, limit, how, err, ms))
    return results, {k: [seen[k][0], seen[k][1], r.shared] for k, r in zip(jobs, results) if r.error is None}


def write_memo(entries):
    """The memo as JSON, one entry a line (diffs stay readable)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items())]
    with open(MEMO, "w") as f:
        f.write('{"about": "shared memory per block (bytes) of each launch tools/arch_compile.py records, keyed by '
                "Triton's own compile cache key (kernel source, specialization, options, Triton and ptxas versions); "
                'written by tools/arch_compile.py --update, read by tests/test_arch.py",\n')
        f.write(f' "triton": {json.dumps(triton.__version__)},\n "shared": {{\n' + ",\n".join(lines) + "\n }\n}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities, e.g. 86,120")
    p.add_argument("--models", default="all", help="preset names (lean/models/presets.py), comma-separated")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--no-memo", action="store_true", help="compile every launch (ignore " + os.path.relpath(MEMO, ROOT) + ")")
    p.add_argument("--update", action="store_true", help="rewrite the memo with this run's results")
    p.add_argument("--spot", type=int, default=0, help="memo entries to recompile and compare, drawn at random")
    p.add_argument("--seed", type=int, help="the spot check's draw")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--list", action="store_true", help="print every launch, not only misfits and the summary")
    args = p.parse_args(argv)
    from lean.models.presets import PRESETS

    models = list(PRESETS) if args.models == "all" else args.models.split(",")
    targets = [int(t.replace("sm_", "")) for t in args.targets.split(",")]
    memo = {}
    if not args.no_memo and os.path.exists(MEMO):
        with open(MEMO) as f:
            memo = json.load(f)["shared"]
    t0 = time.time()
    results, fresh = check(models, targets, args.workers, memo, args.spot, args.seed)
    bad = [r for r in results if not r.ok]
    for r in sorted(results, key=lambda r: (r.kernel, r.cc, -r.shared)) if args.list else []:
        print(f"{'ok  ' if r.ok else 'FAIL'} sm_{r.cc:<4} {r.kernel:34s} {r.shared:>7} / {r.limit:<7} {r.config}")
    print(f"\n{'target':8} {'launches':>8} {'max shared':>11} {'limit':>8}  kernel at the max")
    for cc in targets:
        rs = [r for r in results if r.cc == cc]
        top = max(rs, key=lambda r: r.shared)
        print(f"sm_{cc:<5} {len(rs):>8} {top.shared:>11,} {top.limit:>8,}  {top.kernel} ({top.config})")
    for r in bad:
        why = r.error or f"needs {r.shared:,} B of shared memory, the arch allows {r.limit:,}"
        print(f"MISFIT sm_{r.cc} {r.kernel} [{r.config}] ({', '.join(sorted(r.models))}): {why}")
    n_compiled = sum(r.how != "memo" for r in results)
    print(f"# {len(results)} launches, {n_compiled} compiled, {len(bad)} misfits, {time.time() - t0:.0f} s")
    if args.update:  # a run over every model and target replaces the memo; a narrower one adds to it
        whole = set(models) == set(PRESETS) and set(targets) == set(TARGETS)
        entries = fresh if whole else {**memo, **fresh}
        write_memo(entries)
        print(f"# memo: {len(entries)} entries written to {os.path.relpath(MEMO, ROOT)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) | {"ok": r.ok} for r in results], f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
