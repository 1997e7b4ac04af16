"""Benchmarks: lean's kernels against the best torch path on the same inputs, in physical units.

    python tools/bench.py kernels                  # on the H100, bf16: every kernel
    python tools/bench.py kernels --only attention,lora --json out/bench.json
    python tools/bench.py kernels --smoke          # CPU: interpreter, tiny sizes, no timings
    python tools/bench.py kernels --only moe       # the MoE grouped expert GEMMs (Qwen3-30B-A3B shapes)
    python tools/bench.py step                     # one LoRA step: lean and the peers (bench_step.py)
    python tools/bench.py step --smoke             # CPU: the step harness on tiny configs
    python tools/bench.py step --graph [--budget G] --peers ""   # lean and lean+graph only
    python tools/bench.py step --graph --models qwen3-30b-a3b --layouts packed [--layers N]   # MoE, cut to 8
    python tools/bench.py step --graph --models gpt-oss-20b --lean-attn-only   # + lean with q,k,v,o LoRA only
    python tools/bench.py step --graph --portable  # lean's rows on the Hopper and the portable path too
    python tools/bench.py step --profile [--graph]  # lean's GPU time per kernel family (bench_profile.py)

How a number is taken:
  * time = median of triton.testing.do_bench(fn, warmup, rep) (it flushes L2 between calls);
    lean and torch run on the same random inputs (fixed seed, never zeros). The GEMM and LoRA
    linear rows time CUDA-graph replays of both sides (do_bench_cudagraph), as the captured step
    runs them: at the small projections eager timing measured Python launch cost, not the kernel.
  * torch/lean > 1 means lean is faster.
  * floor = max(FLOPs / matmul rate, bytes / copy bandwidth), both measured at the start of the
    run: an 8192^3 bf16 torch matmul on random data, and a 1 GiB device-to-device copy counting
    read + write bytes. %floor = floor / lean time. FLOPs are the useful ones (causal attention
    counts the lower triangle only); bytes are the minimum each op must move.
  * err = max|lean - torch| / max|torch| over the op's outputs: a sanity check that the timed
    call computes the same thing, not the accuracy test (tests/ do that).

Shape legend: N tokens in the packed batch, C hidden, H/KVH heads, D head dim, F MLP hidden,
V vocab, R LoRA rank, K/O a projection's in/out features; MoE rows: E experts, k experts per token,
P = N*k slots sorted by expert, M/K a weight gradient's dims.
"""
import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Model shapes the kernels serve (HF config.json values).
MODELS = {
    #             C     H   KVH  D    F     V
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936),
    "llama3.2-1b": (2048, 32, 8, 64, 8192, 128256),
}
N_TOKENS = 8192  # packed tokens per micro-batch
LORA_R = 16
LORA_SCALE = 2.0  # alpha / R = 32 / 16
ADAMW_P = 20_000_000  # trainable LoRA parameters in the optimizer benchmark
# do_bench budget per measurement (ms). Moderate so the whole GPU check stays under 8 minutes.
WARMUP_MS, REP_MS = 25, 100


@dataclass
class Row:
    kernel: str
    shape: str
    lean_ms: float = None
    rate: float = None  # lean TFLOP/s or GB/s
    unit: str = ""
    baseline: str = ""
    torch_ms: float = None
    ratio: float = None  # torch_ms / lean_ms, > 1 = lean faster
    floor_ms: float = None
    pct_floor: float = None
    err: float = None
    note: str = ""


class Bench:
    """Run-wide state: device, dtype, the measured machine rates, and the rows so far."""

    def __init__(self, smoke):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.dtype = torch.float32 if smoke else torch.bfloat16  # interpreter: bf16 tl.dot is wrong
        self.rows = []
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(1234)
        self.matmul_flops = None  # FLOP/s
        self.copy_bw = None  # B/s

    # -- inputs and timing -------------------------------------------------------------------
    def randn(self, *shape, scale=1.0, dtype=None):
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (t * scale).to(dtype or self.dtype)

    def randint(self, high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=self.gen, device=self.device, dtype=dtype)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn):
        """Median ms of fn; in smoke mode fn runs once and no time is claimed."""
        if self.smoke:
            fn()
            return None
        import triton.testing

        return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    def time_graph(self, fn):
        """Median ms of fn replayed from a CUDA graph (the step's own setting: kernel time without
        Python launch time); in smoke mode as time()."""
        if self.smoke:
            return self.time(fn)
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")

    def measure_machine(self):
        """The two rates the floor is built from, measured here rather than taken from a sheet."""
        n = 256 if self.smoke else 8192
        a, b = self.randn(n, n), self.randn(n, n)
        c = torch.empty(n, n, device=self.device, dtype=self.dtype)
        ms = self.time(lambda: torch.mm(a, b, out=c))
        ms = ms if ms is not None else self._wall_ms(lambda: torch.mm(a, b, out=c))
        self.matmul_flops = 2 * n**3 / (ms * 1e-3)
        elems = (1 << 20) if self.smoke else (1 << 29)  # 1 GiB of bf16
        src = self.randn(elems)
        dst = torch.empty_like(src)
        ms = self.time(lambda: dst.copy_(src))
        ms = ms if ms is not None else self._wall_ms(lambda: dst.copy_(src))
        self.copy_bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
        del a, b, c, src, dst
        tag = " (smoke: CPU wall clock, meaningless)" if self.smoke else ""
        print(f"# matmul {n}^3 {str(self.dtype)[6:]}: {self.matmul_flops / 1e12:.1f} TFLOP/s; "
              f"d2d copy: {self.copy_bw / 1e9:.0f} GB/s (read+write){tag}")

    def _wall_ms(self, fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    # -- rows ----------------------------------------------------------------------------------
    def add(self, kernel, shape, lean_ms, *, flops=0.0, bytes_=0.0, torch_ms=None, baseline="",
            err=None, note=""):
        r = Row(kernel, shape, lean_ms, baseline=baseline, torch_ms=torch_ms, err=err, note=note)
        t_flop, t_byte = flops / self.matmul_flops, bytes_ / self.copy_bw
        r.floor_ms = max(t_flop, t_byte) * 1e3
        r.unit = "TFLOP/s" if t_flop >= t_byte else "GB/s"
        if lean_ms:
            r.rate = (flops / 1e12 if r.unit == "TFLOP/s" else bytes_ / 1e9) / (lean_ms * 1e-3)
            r.pct_floor = 100.0 * r.floor_ms / lean_ms
            if torch_ms:
                r.ratio = torch_ms / lean_ms
        self._keep(r)
        return r

    def skip(self, kernel, why):
        self._keep(Row(kernel, "-", note=why))

    def _keep(self, r):
        """Record a row and print it at once, so a run cut short still leaves its numbers."""
        self.rows.append(r)
        print(f"row {r.kernel} | {r.shape} | lean {fmt(r.lean_ms, '.3f')} ms | {r.baseline or '-'} "
              f"{fmt(r.torch_ms, '.3f')} ms | x{fmt(r.ratio, '.2f')} | {fmt(r.pct_floor, '.0f')}% floor | "
              f"err {fmt(r.err, '.1e')} | {r.note}", flush=True)


def rel_err(pairs):
    """max over (lean, torch) pairs of max|lean - torch| / max|torch|."""
    worst = 0.0
    for out, ref in pairs:
        o, r = out.detach().float(), ref.detach().float()
        scale = r.abs().max().item() or 1.0
        d = (o - r).abs().max().item()
        worst = max(worst, d / scale if math.isfinite(d) else float("inf"))
    return worst


def lean_kernel(name):
    """lean.kernels.<name>. Raises MissingKernel when its file does not exist (yet)."""
    try:
        return importlib.import_module(f"lean.kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"lean.kernels.{name}":
            raise MissingKernel(f"skipped: lean/kernels/{name}.py missing") from None
        raise


class MissingKernel(Exception):
    pass


def reference(name):
    """lean/reference/<name>.py: the plain-torch references the tests and lean-check use."""
    return importlib.import_module(f"lean.reference.{name}")


# =============================================================================================
# attention: varlen causal flash attention vs torch SDPA (flash backend)
# =============================================================================================
def doc_lengths(n, mean, minimum, seed):
    """Document lengths ~ exponential(mean), at least `minimum`, summing to exactly n (seeded)."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < n:
        lens.append(max(minimum, int(rng.exponential(mean))))
    lens[-1] -= sum(lens) - n
    if lens[-1] < minimum and len(lens) > 1:  # too short a tail joins the previous document
        tail = lens.pop()
        lens[-1] += tail
    return lens


def sdpa_context(device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cuda":
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


GQA_NATIVE = [True]  # flips to False if this torch's flash backend rejects enable_gqa


def sdpa(q, k, v, scale):
    """Causal SDPA on (B, H, T, D) / (B, KVH, T, D); GQA through enable_gqa (no K/V copies), or,
    where the flash backend refuses that, K/V repeated per query head (the copy is then timed)."""
    if GQA_NATIVE[0]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        except RuntimeError:
            GQA_NATIVE[0] = False
            print("# sdpa: flash backend refused enable_gqa; repeating K/V per query head")
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def bench_attention(B):
    mod = lean_kernel("attention")
    n = 64 if B.smoke else N_TOKENS
    configs = [(m, (H, KVH, D)) for m, (_C, H, KVH, D, _F, _V) in MODELS.items()]
    if B.smoke:
        configs = [("smoke", (4, 2, 16))]
    cases = [("varlen", doc_lengths(n, 16 if B.smoke else 512, 4 if B.smoke else 16, seed=0)),
             ("dense", [n // 4] * 4)]
    for model, (H, KVH, D) in configs:
        for case, lens in cases:
            _guard(B, f"attention {model} {case}", _attention_case, B, mod, model, H, KVH, D, case, lens)


def _attention_case(B, mod, model, H, KVH, D, case, lens):
    n, dev = sum(lens), B.device
    scale = 1.0 / math.sqrt(D)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
    max_seqlen = max(lens)
    q, k, v = B.randn(n, H, D), B.randn(n, KVH, D), B.randn(n, KVH, D)  # (N, H, D), (N, KVH, D)
    do = B.randn(n, H, D)
    o, lse = torch.empty_like(q), torch.empty(H, n, device=dev, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(H, n, device=dev, dtype=torch.float32)

    def lean_fwd():
        mod.attention_fwd(o, lse, q, k, v, cu, max_seqlen, scale)

    def lean_fwd_bwd():
        mod.attention_fwd(o, lse, q, k, v, cu, max_seqlen, scale)
        mod.attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, max_seqlen, scale)

    # torch path 1: SDPA per document, each document its own (1, H, L, D) leaf tensor (no packing
    # cost charged to torch). Path 2: one padded (B, H, Lmax, D) batch (padding at the end of
    # each document is harmless under the causal mask, but its work is paid).
    bounds = list(zip(np.cumsum([0] + lens[:-1]), np.cumsum(lens)))

    def per_doc(t):
        return [t[s:e].transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for s, e in bounds]

    dq_docs, dk_docs, dv_docs, do_docs = per_doc(q), per_doc(k), per_doc(v), per_doc(do)
    pad = lambda t, heads: _padded(t, bounds, max_seqlen, heads)  # noqa: E731
    qp, kp, vp, dop = pad(q, H), pad(k, KVH), pad(v, KVH), pad(do, H)

    def docs_fwd():
        return [sdpa(a, b, c, scale) for a, b, c in zip(dq_docs, dk_docs, dv_docs)]

    def docs_fwd_bwd():
        outs = docs_fwd()
        return torch.autograd.grad(outs, dq_docs + dk_docs + dv_docs, do_docs)

    def padded_fwd():
        return sdpa(qp, kp, vp, scale)

    def padded_fwd_bwd():
        return torch.autograd.grad(padded_fwd(), (qp, kp, vp), dop)

    flops_fwd = 2.0 * H * D * sum(L * L for L in lens)  # QK^T + PV, causal half: 2 * 2*L*L*D / 2
    qb, kb = q.numel() * q.element_size(), k.numel() * k.element_size()
    bytes_fwd, bytes_fwd_bwd = 2 * qb + 2 * kb, 6 * qb + 6 * kb  # bwd: q,o,do,dq + k,v,dk,dv
    docs = f"{len(lens)} docs max {max_seqlen}" if case == "varlen" else f"{len(lens)}x{max_seqlen}"
    shape = f"{model} H{H}/{KVH} D{D} N{n} {case} {docs}"
    with sdpa_context(B.device):
        # sanity: lean vs per-document SDPA (exactly the same math)
        lean_fwd_bwd()
        B.sync()
        outs = docs_fwd()
        grads = torch.autograd.grad(outs, dq_docs + dk_docs + dv_docs, do_docs)
        nd = len(lens)
        unpack = lambda ts: torch.cat([t[0].transpose(0, 1) for t in ts])  # noqa: E731
        err_f = rel_err([(o, unpack(outs))])
        err_b = rel_err([(o, unpack(outs)), (dq, unpack(grads[:nd])), (dk, unpack(grads[nd:2 * nd])),
                         (dv, unpack(grads[2 * nd:]))])
        del outs, grads
        for direction, lean_fn, paths, flops, nbytes, err in (
            ("fwd", lean_fwd, [("per-doc", docs_fwd), ("padded", padded_fwd)], flops_fwd, bytes_fwd, err_f),
            ("fwd+bwd", lean_fwd_bwd, [("per-doc", docs_fwd_bwd), ("padded", padded_fwd_bwd)],
             3.5 * flops_fwd, bytes_fwd_bwd, err_b),  # bwd = 5 matmuls vs fwd's 2
        ):
            if case == "dense":
                paths = paths[1:]  # equal lengths: the padded batch is the dense (B, H, T, D) call
            lean_ms = B.time(lean_fn)
            timed = [(name, B.time(fn)) for name, fn in paths]
            best = min(timed, key=lambda p: p[1] if p[1] is not None else 0.0)
            note = " ".join(f"{nm} {t:.3f}ms" for nm, t in timed if t is not None and nm != best[0])
            if not GQA_NATIVE[0]:
                note += " K/V repeated"
            B.add(f"attention {direction}", shape, lean_ms, flops=flops, bytes_=nbytes, torch_ms=best[1],
                  baseline=f"SDPA-flash {best[0]}", err=err, note=note)


def _padded(t, bounds, lmax, heads):
    """(N, heads, D) packed -> (B, heads, Lmax, D) zero-padded leaf; padding is never attended by
    real rows under the causal mask (it sits after each document)."""
    out = torch.zeros(len(bounds), heads, lmax, t.shape[-1], device=t.device, dtype=t.dtype)
    for i, (s, e) in enumerate(bounds):
        out[i, :, : e - s] = t[s:e].transpose(0, 1)
    return out.requires_grad_()


# =============================================================================================
# LoRA linear: y = x W^T + s (x A^T) B^T fused, vs cuBLAS base alone and base + LoRA GEMMs + add
# =============================================================================================
def projection_shapes():
    """Distinct (K, O) projection shapes per model, with the projections that share each."""
    out = []
    for model, (C, H, KVH, D, Fh, _V) in MODELS.items():
        shapes = {}
        for name, ko in (("q", (C, H * D)), ("k", (C, KVH * D)), ("v", (C, KVH * D)),
                         ("o", (H * D, C)), ("gate", (C, Fh)), ("up", (C, Fh)), ("down", (Fh, C))):
            shapes.setdefault(ko, []).append(name)
        out += [(f"{model} {','.join(names)}", K, O) for (K, O), names in shapes.items()]
    return out


def bench_lora_linear(B):
    mod = lean_kernel("lora_linear")
    n, R, s = (37 if B.smoke else N_TOKENS), (4 if B.smoke else LORA_R), LORA_SCALE
    shapes = [("smoke", 48, 80)] if B.smoke else projection_shapes()
    for label, K, O in shapes:
        _guard(B, f"lora_linear {label}", _lora_case, B, mod, label, n, K, O, R, s)


def _lora_case(B, mod, label, n, K, O, R, s):
    dev, dt = B.device, B.dtype
    x, w = B.randn(n, K), B.randn(O, K, scale=K**-0.5)  # (N, K), (O, K)
    a, b = B.randn(R, K, scale=K**-0.5), B.randn(O, R, scale=R**-0.5)  # (R, K), (O, R)
    dy = B.randn(n, O)  # (N, O)
    y, xa = torch.empty(n, O, device=dev, dtype=dt), torch.empty(n, R, device=dev, dtype=dt)
    dx = torch.empty(n, K, device=dev, dtype=dt)
    da, db = torch.zeros(R, K, device=dev), torch.zeros(O, R, device=dev)  # fp32, accumulated +=
    ty, txa, tdx, tdxa = torch.empty_like(y), torch.empty_like(xa), torch.empty_like(dx), torch.empty_like(xa)
    tda, tdb = torch.zeros_like(da), torch.zeros_like(db)

    lean_fwd = lambda: mod.lora_linear_fwd(y, xa, x, w, a, b, s)  # noqa: E731
    lean_bwd = lambda: mod.lora_linear_bwd(dx, da, db, dy, x, xa, w, a, b, s)  # noqa: E731

    def base_fwd():
        torch.mm(x, w.t(), out=ty)

    def lora_fwd():
        torch.mm(x, w.t(), out=ty)
        torch.mm(x, a.t(), out=txa)
        ty.addmm_(txa, b.t(), alpha=s)

    def base_bwd():
        torch.mm(dy, w, out=tdx)

    def lora_bwd():  # dxa = dy B; dx = dy W + s dxa A; dB += s dy^T xa; dA += s dxa^T x
        torch.mm(dy, w, out=tdx)
        torch.mm(dy, b, out=tdxa)
        tdx.addmm_(tdxa, a, alpha=s)
        tdb.add_(torch.mm(dy.t(), txa), alpha=s)
        tda.add_(torch.mm(tdxa.t(), x), alpha=s)

    shape = f"{label} N{n} K{K} O{O} R{R}"
    flops_base = 2.0 * n * K * O
    fwd_flops = flops_base + 2.0 * n * R * (K + O)
    bwd_flops = flops_base + 4.0 * n * R * (K + O)
    e = x.element_size()
    fwd_bytes = e * (n * K + O * K + n * O + n * R)
    bwd_bytes = e * (n * O + O * K + n * K + n * K + n * R)
    torch_ms = {f: B.time_graph(f) for f in (base_fwd, lora_fwd, base_bwd, lora_bwd)}
    for suffix, ctx in gemm_paths(B):
        with ctx():
            # sanity: one call each from zeroed accumulators
            da.zero_(), db.zero_(), tda.zero_(), tdb.zero_()
            lean_fwd(), lora_fwd(), lean_bwd(), lora_bwd()
            B.sync()
            err_f = rel_err([(y, ty), (xa, txa)])
            err_b = rel_err([(dx, tdx), (da, tda), (db, tdb)])
            for direction, lean_fn, fl, by, err, base, full in (
                ("fwd", lean_fwd, fwd_flops, fwd_bytes, err_f, base_fwd, lora_fwd),
                ("bwd", lean_bwd, bwd_flops, bwd_bytes, err_b, base_bwd, lora_bwd),
            ):
                lean_ms = B.time_graph(lean_fn)
                B.add(f"lora_linear {direction}{suffix}", shape, lean_ms, flops=fl, bytes_=by, torch_ms=torch_ms[base],
                      baseline="cuBLAS base", err=err)
                B.add(f"lora_linear {direction}{suffix}", shape, lean_ms, flops=fl, bytes_=by, torch_ms=torch_ms[full],
                      baseline="cuBLAS base+LoRA", err=err)


def bench_gemm(B):
    """The plain matmul behind frozen projections: y = x W^T vs cuBLAS (torch.mm), same views."""
    mod = lean_kernel("gemm")
    n = 37 if B.smoke else N_TOKENS
    shapes = [("smoke", 48, 80)] if B.smoke else [("square", n, n)] + projection_shapes()
    for label, K, O in shapes:
        _guard(B, f"gemm {label}", _gemm_case, B, mod, label, n, K, O)


def gemm_paths(B):
    """(suffix, context) per GEMM path this GPU has: the Hopper path as a captured step takes it (TMA
    at every size) where the arch table gives TMA, and the portable path (pointer loads: the code an
    RTX or A100 card runs) everywhere."""
    import contextlib

    from lean.kernels import arch as A
    from lean.kernels.gemm import tma_at_every_size

    paths = [("", tma_at_every_size)] if not B.smoke and A.arch().tma else []
    return paths + [(" portable", A.portable if not B.smoke else contextlib.nullcontext)]


def _gemm_case(B, mod, label, n, K, O):
    """y = x W^T and dx = dy W (the frozen projection's forward and input gradient) on each path."""
    x, w = B.randn(n, K), B.randn(O, K, scale=K**-0.5)  # (N, K), (O, K)
    dy = B.randn(n, O)  # (N, O)
    y, ty = (torch.empty(n, O, device=B.device, dtype=B.dtype) for _ in range(2))  # (N, O)
    dx, tdx = (torch.empty(n, K, device=B.device, dtype=B.dtype) for _ in range(2))  # (N, K)
    for name, out, ref, a, b in (("gemm x@W^T", y, ty, x, w.t()), ("gemm dy@W", dx, tdx, dy, w)):
        torch_fn = lambda: torch.mm(a, b, out=ref)  # noqa: E731
        torch_fn()
        torch_ms = B.time_graph(torch_fn)
        M, N = out.shape
        for suffix, ctx in gemm_paths(B):
            with ctx():
                lean_fn = lambda: mod.matmul(out, a, b)  # noqa: E731
                lean_fn()
                B.sync()
                B.add(name + suffix, f"{label} M{M} K{a.shape[1]} N{N}", B.time_graph(lean_fn), flops=2.0 * M * N * a.shape[1],
                      bytes_=x.element_size() * (M * a.shape[1] + a.shape[1] * N + M * N), torch_ms=torch_ms,
                      baseline="cuBLAS", err=rel_err([(out, ref)]))


# =============================================================================================
# MoE grouped expert GEMM (Qwen3-30B-A3B shapes) vs torch._grouped_mm and a per-expert cuBLAS loop
# =============================================================================================
# Qwen3-30B-A3B (HF config.json): C hidden, F moe_intermediate, E experts, K per token; R LoRA rank.
MOE = dict(N=N_TOKENS, C=2048, F=768, E=128, K=8, R=LORA_R)
MOE_SMOKE = dict(N=24, C=32, F=24, E=6, K=2, R=4)  # multiples of 4: fp32 _grouped_mm's 16-byte strides
# Expert popularity ~ 1 / rank^s over a seeded permutation, the least popular expert getting no token.
# s = 0.5 at 8192 tokens, top-8 of 128: the busiest expert takes 2,749 slots (5.4x the mean 512, a third
# of the tokens), the quietest live one 245; s = 1 would give 6,905 (13x).
MOE_ZIPF = 0.5


def zipf_experts(N, E, K, seed=0, s=MOE_ZIPF):
    """(N, K) distinct expert ids per token, drawn without replacement with probability ~ 1 / rank^s
    (Gumbel top-K over log-popularity), the ranks a seeded permutation of the experts; the last-ranked
    expert has popularity 0, so one expert receives no token (the empty-expert path is timed too)."""
    rng = np.random.default_rng(seed)
    rank = rng.permutation(E)  # rank[e]: 0 = most popular
    with np.errstate(divide="ignore"):
        logp = np.where(rank == E - 1, -np.inf, -s * np.log1p(rank))
    keys = logp[None, :] + rng.gumbel(size=(N, E))
    return np.argpartition(-keys, K - 1, axis=1)[:, :K].astype(np.int32), rng


def bench_moe(B):
    """Every grouped GEMM of one Qwen3-MoE layer's step (models/moe.py), lean's gmm / gmm_wgrad on
    the device offsets of group_slots, against torch on the same rows already gathered (and, for the
    weight gradients, already scaled by the routing weight and the LoRA scale): torch._grouped_mm
    (offs = the int32 cumulative ends, offsets[1:]) and one cuBLAS matmul per expert (host slices
    from offsets read once, before timing; empty experts skipped). All timed as CUDA-graph replays
    (the per-expert loop's 128 launches too). err = lean vs lean/reference/grouped_gemm.py in fp64;
    each torch path's own err is in its note."""
    gg = lean_kernel("grouped_gemm")
    group_slots = lean_kernel("moe_group").group_slots
    m = MOE_SMOKE if B.smoke else MOE
    N, C, F, E, K, R = (m[k] for k in ("N", "C", "F", "E", "K", "R"))
    P, dev, s = N * K, B.device, LORA_SCALE
    ids, rng = zipf_experts(N, E, K)
    experts = torch.tensor(ids, device=dev)  # (N, K) int32
    order, slot_pos = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(2))
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    group_slots(order, slot_pos, offsets, experts)
    off = offsets.tolist()  # host copy for the per-expert loop and the shape label (setup, not timed)
    rows = np.diff(off)
    if off[-1] != P or not np.array_equal(rows, np.bincount(ids.ravel(), minlength=E)):
        raise AssertionError("group_slots: offsets disagree with the routing's bincount")
    w_route = torch.tensor(rng.dirichlet(np.ones(K), N), device=dev, dtype=B.dtype)  # (N, K) routing weights
    print(f"# moe: {'smoke' if B.smoke else 'Qwen3-30B-A3B'} N{N} k{K} E{E} C{C} F{F} R{R}; routing zipf "
          f"s={MOE_ZIPF:g} (seeded): rows per expert max {rows.max()}, mean {P / E:.0f}, min live "
          f"{rows[rows > 0].min()}, {int((rows == 0).sum())} empty", flush=True)
    shape = f"{'smoke' if B.smoke else 'a3b'} P{P} E{E}"
    ctx = dict(B=B, gg=gg, offsets=offsets, off=off, order=order, K=K, s=s, shape=shape)

    n2 = B.randn(N, C)  # (N, C) the MoE block's input (gathered by slot)
    w_gu, w_d = B.randn(E, 2 * F, C, scale=C**-0.5), B.randn(E, C, F, scale=F**-0.5)  # (E, 2F, C), (E, C, F)
    a_gu, b_gu = B.randn(E, 2 * R, C, scale=C**-0.5), B.randn(E, 2 * F, 2 * R, scale=(2 * R) ** -0.5)
    a_d, b_d = B.randn(E, R, F, scale=F**-0.5), B.randn(E, C, R, scale=R**-0.5)
    act, dh = B.randn(P, F), B.randn(P, 2 * F)  # (P, F) down's input, (P, 2F) dL/d[gate | up], sorted rows
    for name, x, w, gather, lora in (
        ("moe gate_up fwd", n2, w_gu, True, None),
        ("moe gate_up fwd +LoRA", n2, w_gu, True, (a_gu, b_gu)),
        ("moe down fwd", act, w_d, False, None),
        ("moe down fwd +LoRA", act, w_d, False, (a_d, b_d)),
        ("moe dX bwd Wgu^T", dh, w_gu.transpose(1, 2), False, None),
        ("moe dX bwd Wgu^T +LoRA", dh, w_gu.transpose(1, 2), False, (b_gu.transpose(1, 2), a_gu.transpose(1, 2))),
    ):
        _guard(B, name, _moe_gmm_case, ctx, name, x, w, gather, lora)
    g = B.randn(N, C)  # (N, C) dL/d(block output)
    xa_gu, dhb = B.randn(P, 2 * R), B.randn(P, 2 * R)  # gate_up's LoRA rows: x A^T and dh B
    xa_d, gb = B.randn(P, R), B.randn(P, R)  # down's: act A^T and g B
    slot = (w_route.view(-1), order)  # routing weight of sorted row p
    for name, a, b, ga, gb_, scale in (  # models/moe.py's four LoRA weight gradients
        ("moe wgrad gate_up dB", dh, xa_gu, False, False, None),
        ("moe wgrad gate_up dA", dhb, n2, False, True, None),
        ("moe wgrad down dB", g, xa_d, True, False, slot),
        ("moe wgrad down dA", gb, act, False, False, slot),
    ):
        _guard(B, name, _moe_wgrad_case, ctx, name, a, b, ga, gb_, scale)


# gpt-oss-20b (HF config.json): 64/8 heads of 64, window 128 on the sliding layers; experts E 32,
# top-4, C = F = 2880 (gate_up interleaved, 2F = 5760).
OSS = dict(N=N_TOKENS, C=2880, F=2880, E=32, K=4, H=64, KVH=8, D=64, W=128)
OSS_SMOKE = dict(N=64, C=64, F=64, E=4, K=2, H=4, KVH=2, D=16, W=8)


def bench_gptoss(B):
    """gpt-oss's two kernel changes, each against lean's own plain path on the same work:
    - attention with sinks and window 128 (a sliding layer) against full causal attention (a full
      layer), fwd and fwd+bwd, on one 8192-token document and on packed documents (mean 512):
      the sliding layer must cost a fraction of a full one (tiles outside the window are skipped);
    - the grouped expert GEMMs with MXFP4 weights (gmm_mxfp4, dequantised in the weight loads)
      against gmm on the same weights dequantised to bf16: gate_up and down forward, and the two
      transposed dX / G GEMMs of the backward. err = MXFP4 output vs the bf16 gmm's."""
    attn = lean_kernel("attention")
    mx = lean_kernel("mxfp4")
    gg = lean_kernel("grouped_gemm")
    group_slots = lean_kernel("moe_group").group_slots
    m = OSS_SMOKE if B.smoke else OSS
    N, C, F, E, K, H, KVH, D, W = (m[k] for k in ("N", "C", "F", "E", "K", "H", "KVH", "D", "W"))
    dev = B.device
    for case, lens in (("1 doc", [N]), ("packed", doc_lengths(N, 16 if B.smoke else 512, 4 if B.smoke else 16, seed=0))):
        _guard(B, f"gptoss attention {case}", _oss_attention_case, B, attn, N, H, KVH, D, W, case, lens)
    ids, _ = zipf_experts(N, E, K)
    experts = torch.tensor(ids, device=dev)
    P = N * K
    order, slot_pos = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(2))
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    group_slots(order, slot_pos, offsets, experts)
    ref = reference("mxfp4")
    # MXFP4 weights (E, out, in), blocks along in; the bf16 weight is their exact dequantisation
    q_gu = ref.mxfp4_quantize_ref(B.randn(E, 2 * F, C, scale=C**-0.5, dtype=torch.float32))
    q_d = ref.mxfp4_quantize_ref(B.randn(E, C, F, scale=F**-0.5, dtype=torch.float32))
    w_gu, w_d = (ref.mxfp4_dequant_ref(*q, B.dtype) for q in (q_gu, q_d))
    n2, act, g, dh = B.randn(N, C), B.randn(P, F), B.randn(N, C), B.randn(P, 2 * F)
    shape = f"{'smoke' if B.smoke else 'gpt-oss-20b'} P{P} E{E}"
    for name, x, q, w, transpose, gather in (
        ("mxfp4 gate_up fwd", n2, q_gu, w_gu, False, True),
        ("mxfp4 down fwd", act, q_d, w_d, False, False),
        ("mxfp4 G bwd Wd^T", g, q_d, w_d, True, True),
        ("mxfp4 dX bwd Wgu^T", dh, q_gu, w_gu, True, False),
    ):
        _guard(B, name, _oss_gmm_case, B, mx, gg, name, shape, x, q, w, transpose, gather, offsets, order, K)


def _oss_attention_case(B, attn, N, H, KVH, D, W, case, lens):
    dev = B.device
    scale = 1.0 / math.sqrt(D)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
    L = max(lens)
    q, k, v, do = B.randn(N, H, D), B.randn(N, KVH, D), B.randn(N, KVH, D), B.randn(N, H, D)
    sinks = B.randn(H, dtype=torch.float32)
    o, lse = torch.empty_like(q), torch.empty(H, N, device=dev, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(H, N, device=dev, dtype=torch.float32)

    def run(bwd, **kw):
        def fn():
            attn.attention_fwd(o, lse, q, k, v, cu, L, scale, **kw)
            if bwd:
                attn.attention_bwd(dq, dk, dv, delta, do, q, k, v, o, lse, cu, L, scale, **kw)
        return fn

    pairs_full = sum(n * (n + 1) / 2 for n in lens)
    pairs_win = sum(sum(min(i + 1, W) for i in range(n)) for n in lens)
    for direction, bwd, mult in (("fwd", False, 1.0), ("fwd+bwd", True, 3.5)):
        full_ms = B.time(run(bwd))
        win_ms = B.time(run(bwd, sinks=sinks, window=W))
        shape = f"H{H}/{KVH} D{D} N{N} {case} max {L}"
        B.add(f"gptoss attention {direction} window {W}+sinks", shape, win_ms, flops=mult * 4.0 * H * D * pairs_win,
              torch_ms=full_ms, baseline="lean full causal",
              note=f"key pairs {pairs_win / pairs_full:.3f} of full causal's")


def _oss_gmm_case(B, mx, gg, name, shape, x, q, w, transpose, gather, offsets, order, K):
    blocks, scales = q
    E, A, Bd = w.shape
    O, Kd = (Bd, A) if transpose else (A, Bd)
    P = order.numel()
    kw = dict(gather=order, gather_div=K) if gather else {}
    y, y_ref = (torch.empty(P, O, device=B.device, dtype=B.dtype) for _ in range(2))

    def mx_fn():
        mx.gmm_mxfp4(y, x, blocks, scales, offsets, transpose=transpose, **kw)

    def bf16_fn():
        gg.gmm(y_ref, x, w.transpose(1, 2) if transpose else w, offsets, **kw)

    wq = torch.empty_like(w)

    def dequant_fn():  # models/moe.py's default (MXFP4_FUSED False): one GEMM's transient bf16 weight
        mx.mxfp4_dequant(wq, blocks, scales)
        gg.gmm(y, x, wq.transpose(1, 2) if transpose else wq, offsets, **kw)

    mx_fn()
    bf16_fn()
    B.sync()
    err = rel_err([(y, y_ref)])
    dequant_fn()
    B.sync()
    err_dq = rel_err([(y, y_ref)])
    mx_ms, dq_ms, bf_ms = B.time_graph(mx_fn), B.time_graph(dequant_fn), B.time_graph(bf16_fn)
    e = x.element_size()
    flops = 2.0 * P * O * Kd
    nbytes = e * (x.shape[0] * Kd + P * O) + E * O * Kd * 17 / 32  # x, y; the MXFP4 weight (4.25 bits)
    label = f"{shape} O{O} K{Kd}" + (" gather" if gather else "") + (" transposed" if transpose else "")
    B.add(name + " (fused)", label, mx_ms, flops=flops, bytes_=nbytes, torch_ms=bf_ms,
          baseline="lean gmm bf16 weight", err=err,
          note=f"weight bytes {E * O * Kd * 17 / 32 / 2**20:.0f} MiB vs {E * O * Kd * e / 2**20:.0f} MiB")
    B.add(name + " (dequant+gmm)", label, dq_ms, flops=flops, bytes_=nbytes + E * O * Kd * 2 * e, torch_ms=bf_ms,
          baseline="lean gmm bf16 weight", err=err_dq, note="mxfp4_dequant into a transient bf16 weight, then gmm")


def _grouped_mm():
    """torch._grouped_mm, or None where this torch has none."""
    return getattr(torch, "_grouped_mm", None)


def _moe_baselines(B, ref, paths):
    """[(baseline, torch_ms or None, note)] for each (name, fn, out) torch path: run once, err
    against ref, then timed as lean is; a path that fails says why in its note."""
    out = []
    for name, fn, result in paths:
        if fn is None:
            out.append((name, None, "not in this torch"))
            continue
        try:
            got = fn()
            B.sync()
            err = rel_err([(result() if got is None else got, ref)])
            out.append((name, B.time_graph(fn), f"its err {err:.1e}"))
        except Exception as e:
            traceback.print_exc()
            out.append((name, None, f"failed: {type(e).__name__}: {str(e)[:80]}"))
    return out


def _moe_gmm_case(c, name, x, w, gather, lora):
    """y (P, O) = x[r(p)] w[e]^T [+ s (x[r(p)] A_e^T) B_e^T]: lean's one gmm (two with LoRA: the
    adapter rows xa first, as models/moe.py) vs torch on the pre-gathered rows."""
    B, gg, offsets, off, order, K, s = (c[k] for k in ("B", "gg", "offsets", "off", "order", "K", "s"))
    ref_mod = reference("grouped_gemm")
    E, O, Kd = w.shape
    P, dev, dt = order.numel(), B.device, B.dtype
    R = lora[0].shape[1] if lora else 0
    kw = dict(gather=order, gather_div=K) if gather else {}
    y, xa = torch.empty(P, O, device=dev, dtype=dt), (torch.empty(P, R, device=dev, dtype=dt) if lora else None)

    def lean_fn():
        if lora:
            gg.gmm(xa, x, lora[0], offsets, **kw)
        gg.gmm(y, x, w, offsets, **kw, lora=(xa, lora[1], s) if lora else None)

    xg = x[order.long() // K].contiguous() if gather else x  # (P, Kd) torch's pre-gathered rows
    ends = offsets[1:]  # (E,) int32 cumulative ends: _grouped_mm's offs
    gm = _grouped_mm()

    def grouped_fn():
        yt = gm(xg, w.transpose(1, 2), offs=ends)  # (P, Kd) @ (E, Kd, O) -> (P, O)
        if lora:
            xat = gm(xg, lora[0].transpose(1, 2), offs=ends)
            yt.add_(gm(xat, lora[1].transpose(1, 2), offs=ends), alpha=s)
        return yt

    ty, txa = torch.empty_like(y), (torch.empty_like(xa) if lora else None)
    bounds = [(e, off[e], off[e + 1]) for e in range(E) if off[e + 1] > off[e]]

    def loop_fn():
        for e, lo, hi in bounds:
            torch.mm(xg[lo:hi], w[e].t(), out=ty[lo:hi])
            if lora:
                torch.mm(xg[lo:hi], lora[0][e].t(), out=txa[lo:hi])
                ty[lo:hi].addmm_(txa[lo:hi], lora[1][e].t(), alpha=s)

    lean_fn()
    B.sync()
    f64 = lambda t: t.to(torch.float64)  # noqa: E731
    xa_ref = ref_mod.gmm_ref(f64(x), f64(lora[0]), offsets, **kw) if lora else None
    y_ref = ref_mod.gmm_ref(f64(x), f64(w), offsets, **kw, lora=(xa_ref, f64(lora[1]), s) if lora else None)
    err = rel_err([(y, y_ref)] + ([(xa, xa_ref)] if lora else []))
    del xa_ref
    flops = 2.0 * P * O * Kd + (2.0 * P * R * (Kd + O) if lora else 0.0)
    e = x.element_size()  # bytes: x's rows once (N unique rows when gathered), every expert's weights, y
    nbytes = e * (x.shape[0] * Kd + E * O * Kd + P * O + (E * R * (Kd + O) + 2 * P * R if lora else 0))
    shape = f"{c['shape']} O{O} K{Kd}" + (" gather" if gather else "")
    lean_ms = B.time_graph(lean_fn)
    for base, torch_ms, note in _moe_baselines(B, y_ref, [("torch._grouped_mm", gm and grouped_fn, None),
                                                            ("cuBLAS per-expert loop", loop_fn, lambda: ty)]):
        B.add(name, shape, lean_ms, flops=flops, bytes_=nbytes, torch_ms=torch_ms, baseline=base, err=err,
              note=f"torch on pre-gathered rows; {note}" if gather else note)


def _moe_wgrad_case(c, name, a, b, gather_a, gather_b, scale):
    """dw (E, M, Kd) fp32 += s * sum over expert e's rows of (w_p a[ra(p)])^T b[rb(p)]: lean's
    gmm_wgrad vs torch on rows gathered and scaled (by w_p and the LoRA scale) before timing,
    writing dw in the inputs' dtype (torch._grouped_mm's 2-D x 2-D form, offs over the reduced rows)."""
    B, gg, offsets, off, order, K, s = (c[k] for k in ("B", "gg", "offsets", "off", "order", "K", "s"))
    ref_mod = reference("grouped_gemm")
    M, Kd, E = a.shape[1], b.shape[1], len(off) - 1
    P, dev, dt = order.numel(), B.device, B.dtype
    src = order.long() // K
    kw = dict(gather_a=order if gather_a else None, gather_b=order if gather_b else None, gather_div=K,
              scale=scale, alpha=s)
    dw = torch.zeros(E, M, Kd, device=dev, dtype=torch.float32)
    gw = lean_kernel("gmm_wgrad")
    lean_fn = lambda: gw.gmm_wgrad(dw, a, b, offsets, **kw)  # noqa: E731
    ag = a[src] if gather_a else a
    if scale is not None:  # w_p a rounded to a's dtype, as the kernel does; s = 2 is exact
        vec, idx = scale
        ag = (ag.float() * vec[idx.long()].float()[:, None]).to(dt)
    ag = (ag * s).contiguous()  # (P, M)
    bg = (b[src] if gather_b else b).contiguous()  # (P, Kd)
    ends = offsets[1:]
    gm = _grouped_mm()
    grouped_fn = lambda: gm(ag.t(), bg, offs=ends)  # noqa: E731  (M, P) @ (P, Kd) per group -> (E, M, Kd)
    tw = torch.zeros(E, M, Kd, device=dev, dtype=dt)
    bounds = [(e, off[e], off[e + 1]) for e in range(E) if off[e + 1] > off[e]]

    def loop_fn():
        for e, lo, hi in bounds:
            torch.mm(ag[lo:hi].t(), bg[lo:hi], out=tw[e])

    lean_fn()
    B.sync()
    ref = ref_mod.gmm_wgrad_ref(a, b, offsets, **kw)  # fp64
    err = rel_err([(dw, ref)])
    rows_a, rows_b = (a.shape[0] if gather_a else P), (b.shape[0] if gather_b else P)  # N unique rows where gathered
    nbytes = a.element_size() * (rows_a * M + rows_b * Kd) + 8 * E * M * Kd  # a, b read once; dw fp32 read + written
    shape = f"{c['shape']} M{M} K{Kd}" + " gather" * (gather_a or gather_b) + " scaled" * (scale is not None)
    lean_ms = B.time_graph(lean_fn)
    for base, torch_ms, note in _moe_baselines(B, ref, [("torch._grouped_mm", gm and grouped_fn, None),
                                                         ("cuBLAS per-expert loop", loop_fn, lambda: tw)]):
        B.add(name, shape, lean_ms, flops=2.0 * P * M * Kd, bytes_=nbytes, torch_ms=torch_ms, baseline=base,
              err=err, note=f"torch: pre-gathered/scaled rows, dw in their dtype (lean: += fp32); {note}")


# =============================================================================================
# memory-bound ops vs torch eager: rmsnorm (+residual), rope, swiglu, embedding
# =============================================================================================
def _bench_eager(B, kernel, lean_fn, torch_fn, nbytes, shape, err, note=""):
    B.add(kernel, shape, B.time(lean_fn), bytes_=nbytes, torch_ms=B.time(torch_fn),
          baseline="eager", err=err, note=note)


def _models(B):
    if B.smoke:
        return [("smoke", (48, 4, 2, 16, 80, 101))], 37
    return list(MODELS.items()), N_TOKENS


def _guard(B, kernel, fn, *args):
    """Run one case; an error becomes a row (and a traceback in the log), never the end of the run."""
    try:
        fn(*args)
    except Exception as e:
        B.skip(kernel, f"error: {type(e).__name__}: {str(e)[:120]}")
        traceback.print_exc()


def bench_rmsnorm(B):
    mod = lean_kernel("rmsnorm")
    models, n = _models(B)
    for model, (C, *_rest) in models:
        _guard(B, f"rmsnorm {model}", _rmsnorm_case, B, mod, model, n, C)


def _rmsnorm_case(B, mod, model, n, C):
    dev, dt, eps = B.device, B.dtype, 1e-6
    x, res, w = B.randn(n, C), B.randn(n, C), B.randn(C, scale=0.1) + 1.0  # (N, C), (N, C), (C,)
    dy, dres = B.randn(n, C), B.randn(n, C)
    y, h = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(n, device=dev, dtype=torch.float32)  # (N,)
    dx = torch.empty_like(x)

    lean_fwd = lambda: mod.rmsnorm_fwd(y, rstd, x, w, eps, residual=res, h=h)  # noqa: E731
    lean_bwd = lambda: mod.rmsnorm_bwd(dx, None, dy, h, w, rstd, dresidual=dres)  # noqa: E731

    ref = reference("rmsnorm")  # lean/reference/rmsnorm.py: HF's eager recipe

    xg, resg = x.clone().requires_grad_(), res.clone().requires_grad_()
    ty, th, _ = ref.rmsnorm_ref(xg, w, eps, residual=resg)
    # gradient of the residual stream: dh = dresidual + the norm's backward of dy
    torch_bwd = lambda: torch.autograd.grad((ty, th), (xg,), (dy, dres), retain_graph=True)  # noqa: E731
    torch_fwd = lambda: _no_grad(lambda: ref.rmsnorm_ref(x, w, eps, residual=res))  # noqa: E731
    lean_fwd(), lean_bwd()
    B.sync()
    err_f = rel_err([(y, ty), (h, th)])
    err_b = rel_err([(dx, torch_bwd()[0])])
    e, shape = x.element_size(), f"{model} N{n} C{C} +residual"
    _bench_eager(B, "rmsnorm fwd", lean_fwd, torch_fwd, e * 4 * n * C + 4 * n, shape, err_f)
    _bench_eager(B, "rmsnorm bwd", lean_bwd, torch_bwd, e * 4 * n * C + 4 * n, shape, err_b,
                 note="dw=None (frozen)")


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def bench_rope(B):
    mod = lean_kernel("rope")
    models, n = _models(B)
    for model, (C, H, KVH, D, *_rest) in models:
        _guard(B, f"rope {model}", _rope_case, B, mod, model, n, H, KVH, D)


def _rope_case(B, mod, model, n, H, KVH, D):
    ref = reference("rope")  # lean/reference/rope.py: HF's recipe, for the sanity check
    dev, dt = B.device, B.dtype
    pos = torch.arange(n, device=dev, dtype=torch.float32) % 2048  # packed positions restart per doc
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = pos[:, None] * inv_freq[None]  # (N, D/2)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()  # (N, D/2) fp32: lean's tables
    q0, k0 = B.randn(n, H, D), B.randn(n, KVH, D)  # (N, H, D), (N, KVH, D)
    q, k = q0.clone(), k0.clone()

    # torch eager as HF runs it per layer: (N, 1, D) tables in the activation dtype, built once per
    # batch, then apply_rotary_pos_emb (out of place); its backward is autograd's.
    cos_hf = torch.cat([cos, cos], -1)[:, None].to(dt)  # (N, 1, D)
    sin_hf = torch.cat([sin, sin], -1)[:, None].to(dt)
    eager = lambda x: x * cos_hf + _rotate_half(x) * sin_hf  # noqa: E731
    torch_fwd = lambda: _no_grad(lambda: (eager(q0), eager(k0)))  # noqa: E731
    qg, kg = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    tq, tk = eager(qg), eager(kg)
    torch_bwd = lambda: torch.autograd.grad((tq, tk), (qg, kg), (q0, k0), retain_graph=True)  # noqa: E731

    # sanity from fresh copies (lean works in place): fwd vs the reference, bwd vs autograd
    mod.rope_fwd(q, k, cos, sin)
    err_f = rel_err([(q, ref.rope_ref(q0, cos, sin)), (k, ref.rope_ref(k0, cos, sin))])
    q.copy_(q0), k.copy_(k0)
    mod.rope_bwd(q, k, cos, sin)  # the incoming gradients are q0, k0
    err_b = rel_err(zip((q, k), torch_bwd()))
    B.sync()
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * 4
    shape = f"{model} N{n} H{H}/{KVH} D{D} in place"
    # in place: repeated calls keep rotating the same buffers (norm-preserving)
    _bench_eager(B, "rope fwd", lambda: mod.rope_fwd(q, k, cos, sin), torch_fwd, nbytes, shape, err_f)
    _bench_eager(B, "rope bwd", lambda: mod.rope_bwd(q, k, cos, sin), torch_bwd, nbytes, shape, err_b)


def bench_swiglu(B):
    mod = lean_kernel("swiglu")
    models, n = _models(B)
    for model, (C, H, KVH, D, Fh, _V) in models:
        _guard(B, f"swiglu {model}", _swiglu_case, B, mod, model, n, Fh)


def _swiglu_case(B, mod, model, n, Fh):
    g, u, dh = B.randn(n, Fh, scale=2.0), B.randn(n, Fh), B.randn(n, Fh)  # (N, F) each
    h, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
    lean_fwd = lambda: mod.swiglu_fwd(h, g, u)  # noqa: E731
    lean_bwd = lambda: mod.swiglu_bwd(dg, du, dh, g, u)  # noqa: E731
    ref = reference("swiglu")  # lean/reference/swiglu.py: F.silu(g) * u, torch eager
    gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
    th = ref.swiglu_ref(gg, ug)
    torch_bwd = lambda: torch.autograd.grad(th, (gg, ug), dh, retain_graph=True)  # noqa: E731
    lean_fwd(), lean_bwd()
    B.sync()
    tdg, tdu = torch_bwd()
    err_f, err_b = rel_err([(h, th)]), rel_err([(dg, tdg), (du, tdu)])
    e, shape = g.element_size(), f"{model} N{n} F{Fh}"
    torch_fwd = lambda: _no_grad(lambda: ref.swiglu_ref(g, u))  # noqa: E731
    _bench_eager(B, "swiglu fwd", lean_fwd, torch_fwd, e * 3 * n * Fh, shape, err_f)
    _bench_eager(B, "swiglu bwd", lean_bwd, torch_bwd, e * 5 * n * Fh, shape, err_b)


def bench_embedding(B):
    mod = lean_kernel("embedding")
    models, n = _models(B)
    for model, (C, H, KVH, D, Fh, V) in models:
        _guard(B, f"embedding {model}", _embedding_case, B, mod, model, n, C, V)


def _embedding_case(B, mod, model, n, C, V):
    table, ids = B.randn(V, C), B.randint(V, n, dtype=torch.int32)  # (V, C), (N,)
    out = torch.empty(n, C, device=B.device, dtype=B.dtype)  # (N, C)
    ids64 = ids.long()
    lean_fn = lambda: mod.embedding_fwd(out, ids, table)  # noqa: E731
    torch_fn = lambda: F.embedding(ids64, table)  # noqa: E731
    lean_fn()
    B.sync()
    err = rel_err([(out, torch_fn())])
    nbytes = 2 * n * C * table.element_size() + 4 * n  # gathered rows in, out, ids
    _bench_eager(B, "embedding fwd", lean_fn, torch_fn, nbytes, f"{model} N{n} V{V} C{C}", err)


# =============================================================================================
# fused linear + cross-entropy vs Liger (time and peak memory)
# =============================================================================================
def bench_linear_ce(B):
    mod = lean_kernel("linear_ce")
    cases = [("smoke", 37, 48, 301)] if B.smoke else [
        (model, N_TOKENS, C, V) for model, (C, _H, _KVH, _D, _F, V) in MODELS.items()]
    for model, n, C, V in cases:
        _guard(B, f"linear_ce {model}", _linear_ce_case, B, mod, model, n, C, V)


def _peak_mib(B, fn):
    """Peak memory allocated while fn runs, above what was allocated before (MiB)."""
    if B.device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _linear_ce_case(B, mod, model, n, C, V):
    dev = B.device
    h, w = B.randn(n, C), B.randn(V, C, scale=C**-0.5)  # (N, C), (V, C) frozen lm_head
    targets = B.randint(V, n)  # (N,) int64
    targets[B.randint(10, n) == 0] = -100  # ~10% ignored (prompt tokens)
    count = int((targets != -100).sum())  # bench setup, not a launcher: host value is fine
    loss = torch.empty(2, device=dev, dtype=torch.float32)  # [sum, count]
    dh = torch.empty_like(h)  # (N, C)

    def lean_fn():  # loss and dh are written with `=`
        mod.linear_ce_fwd_bwd(loss, dh, h, w, targets, grad_scale=1.0 / count, ignore_index=-100)

    lean_fn()  # compile outside the memory measurement
    lean_mem = _peak_mib(B, lean_fn)
    lean_loss, lean_dh = (loss[0] / loss[1]).clone(), dh.clone()
    flops = 4.0 * n * C * V  # logits + dh = dlogits @ W (W frozen: no dW)
    nbytes = h.element_size() * (2 * n * C + V * C)
    shape = f"{model} N{n} C{C} V{V}"
    lean_ms = B.time(lean_fn)
    mem = f"peak +{lean_mem:.0f} MiB" if lean_mem is not None else ""

    def lean_only(why):  # no peer: at least check lean against the chunked fp32 reference
        ref_loss, ref_count, ref_dh = reference("linear_ce").linear_ce_chunked_ref(
            h, w, targets, grad_scale=1.0 / count, ignore_index=-100)
        err = rel_err([(lean_loss.reshape(1), (ref_loss / ref_count).reshape(1)), (lean_dh, ref_dh)])
        B.add("linear_ce fwd+bwd", shape, lean_ms, flops=flops, bytes_=nbytes, err=err,
              note="; ".join(x for x in (mem, why) if x))

    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return lean_only("Liger skipped: liger-kernel not installed")
    try:
        flce = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
        hg = h.clone().requires_grad_()  # w stays frozen: Liger computes no dW, as lean

        def liger_fn():  # Liger does the whole backward inside its forward
            return torch.autograd.grad(flce(w, hg, targets), (hg,))

        liger_fn()
        liger_mem = _peak_mib(B, liger_fn)  # includes its returned dh (N, C); lean's dh is preallocated
        with torch.no_grad():
            liger_loss = flce(w, h, targets)
        err = rel_err([(lean_loss.reshape(1), liger_loss.reshape(1)), (lean_dh, liger_fn()[0])])
        liger_ms = B.time(liger_fn)
    except Exception as e:
        traceback.print_exc()
        return lean_only(f"Liger failed: {type(e).__name__}: {str(e)[:60]}")
    if liger_mem is not None:
        mem = f"peak +{lean_mem:.0f} vs +{liger_mem:.0f} MiB"
    B.add("linear_ce fwd+bwd", shape, lean_ms, flops=flops, bytes_=nbytes, torch_ms=liger_ms,
          baseline="Liger FLCE", err=err, note=mem)


# =============================================================================================
# AdamW over ~20M LoRA parameters vs torch.optim.AdamW(fused=True)
# =============================================================================================
def bench_adamw(B):
    mod = lean_kernel("adamw")
    _guard(B, "adamw", _adamw_case, B, mod)


def _adamw_case(B, mod):
    """One flat fp32 buffer of P LoRA parameters (lean's layout); torch steps the same flat buffer
    as one parameter, which is its fastest path (one multi-tensor launch)."""
    dev, P = B.device, (1000 if B.smoke else ADAMW_P)
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    lr, clip = 1e-4, 1.0
    params, grads = B.randn(P, scale=0.02, dtype=torch.float32), B.randn(P, scale=1e-3, dtype=torch.float32)
    m, v = torch.zeros_like(params), torch.zeros_like(params)  # (P,) fp32 moments
    grad_norm = torch.empty(1, device=dev, dtype=torch.float32)
    hyper = torch.tensor([lr, 1.0], device=dev, dtype=torch.float32)  # [lr, t]
    tp = torch.nn.Parameter(params.clone())
    tp.grad = grads.clone()
    opt = torch.optim.AdamW([tp], lr=lr, betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], fused=True)

    def lean_fn(max_grad_norm):
        mod.adamw_step(params, m, v, grad_norm, grads, hyper, max_grad_norm=max_grad_norm, **hp)

    def torch_clip_step():
        torch.nn.utils.clip_grad_norm_([tp], clip, foreach=True)
        opt.step()

    lean_fn(clip)
    torch_clip_step()  # grads are clipped in place in tp.grad only
    B.sync()
    err = rel_err([(params, tp.detach()), (m, opt.state[tp]["exp_avg"]), (v, opt.state[tp]["exp_avg_sq"])])
    shape = f"P={P / 1e6:g}M fp32 flat"
    # bytes: p, m, v read + written, g read; lean also reads g once more for the norm it always writes
    B.add("adamw step", shape, B.time(lambda: lean_fn(None)), bytes_=32.0 * P, torch_ms=B.time(opt.step),
          baseline="AdamW fused", err=err, note="lean also writes grad_norm")
    B.add("adamw step", shape + " clip", B.time(lambda: lean_fn(clip)), bytes_=32.0 * P,
          torch_ms=B.time(torch_clip_step), baseline="clip+AdamW fused", err=err)


# =============================================================================================
KERNELS = {
    "attention": bench_attention,
    "gemm": bench_gemm,
    "lora_linear": bench_lora_linear,
    "moe_gmm": bench_moe,
    "gptoss": bench_gptoss,
    "rmsnorm": bench_rmsnorm,
    "rope": bench_rope,
    "swiglu": bench_swiglu,
    "embedding": bench_embedding,
    "linear_ce": bench_linear_ce,
    "adamw": bench_adamw,
}


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(rows, smoke):
    cols = [("kernel", lambda r: r.kernel), ("shape", lambda r: r.shape),
            ("lean ms", lambda r: fmt(r.lean_ms, ".3f")),
            ("lean rate", lambda r: f"{r.rate:.1f} {r.unit}" if r.rate is not None else "-"),
            ("torch path", lambda r: r.baseline or "-"), ("torch ms", lambda r: fmt(r.torch_ms, ".3f")),
            ("torch/lean", lambda r: fmt(r.ratio, ".2f")), ("floor ms", lambda r: fmt(r.floor_ms, ".3f")),
            ("%floor", lambda r: fmt(r.pct_floor, ".0f")), ("err", lambda r: fmt(r.err, ".1e")),
            ("note", lambda r: r.note)]
    if smoke:  # no timing claims from the interpreter
        cols = [c for c in cols if c[0] in ("kernel", "shape", "torch path", "err", "note")]
    cells = [[name for name, _ in cols]]
    for i, r in enumerate(rows):
        line = [f(r) for _, f in cols]
        if i and (r.kernel, r.shape) == (rows[i - 1].kernel, rows[i - 1].shape):
            line[0], line[1] = "", '"'  # a second baseline for the same lean measurement
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    banner = "SMOKE (CPU interpreter, tiny sizes): checks the harness runs; no timings.\n" if smoke else ""
    print("\n" + banner)
    for i, line in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path, B, dev):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": dev, "dtype": str(B.dtype), "smoke": B.smoke, "torch": torch.__version__,
                   "matmul_tflops": B.matmul_flops / 1e12, "copy_gbps": B.copy_bw / 1e9,
                   "rows": [asdict(r) for r in B.rows]}, f, indent=1)


def cmd_kernels(args):
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench kernels: no CUDA GPU here; use --smoke for the CPU harness check")
    B = Bench(args.smoke)
    dev = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"# lean kernel bench on {dev}, {B.dtype}; torch {torch.__version__}")
    B.measure_machine()
    only = [s for s in (args.only or "").split(",") if s]
    for name, fn in KERNELS.items():
        if only and not any(s in name for s in only):
            continue
        t0 = time.perf_counter()
        try:
            fn(B)
        except MissingKernel as e:
            B.skip(name, str(e))
        except Exception as e:  # an import error in a kernel file must not stop the others
            B.skip(name, f"error: {type(e).__name__}: {str(e)[:120]}")
            traceback.print_exc()
        if B.device == "cuda":
            torch.cuda.empty_cache()
        print(f"# {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        if args.json:  # after every kernel, so a run cut short keeps what it measured
            write_json(args.json, B, dev)
    print_table(B.rows, args.smoke)


def cmd_profile(models, layouts, args):
    """bench_profile.py for each (model, layout), each in its own process (its own memory and
    caches; --layers N cuts the models as bench step does); --json PATH writes PATH with
    _<model>_<layout> before the extension."""
    import subprocess

    if args.smoke:
        raise SystemExit("bench step --profile needs a CUDA GPU: --smoke checks the step harness only")
    env = dict(os.environ, **({"BENCH_STEP_LAYERS": str(args.layers)} if args.layers else {}))  # bench_step.LAYERS_ENV
    rc = 0
    for m in models:
        for layout in layouts:
            cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_profile.py"),
                   m, layout, "--steps", str(args.steps or 5)] + ["--graph"] * args.graph
            if args.budget is not None:
                cmd += ["--budget", str(args.budget)]
            if args.json:
                stem, ext = os.path.splitext(args.json)
                cmd += ["--json", f"{stem}_{m}_{layout}{ext or '.json'}"]
            print(f"# bench profile {m} {layout}", flush=True)
            rc = subprocess.run(cmd, timeout=args.timeout, env=env).returncode or rc
    if rc:
        raise SystemExit(f"bench step --profile: a profile process failed (exit {rc}; its traceback above)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    k = sub.add_parser("kernels", help="every kernel against its best torch path")
    k.add_argument("--only", help="comma-separated kernel names (substring match): " + ",".join(KERNELS))
    k.add_argument("--json", help="write the rows to this path")
    k.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes, no timings")
    st = sub.add_parser("step", help="one LoRA optimizer step over 8192 tokens: lean and its peers")
    st.add_argument("--models", help="comma-separated, from qwen3-0.6b,llama-3.2-1b,qwen3-8b,qwen3-30b-a3b,"
                    "gpt-oss-20b,gpt-oss-20b-mxfp4 ... (lean/models/presets.py; default qwen3-0.6b,llama-3.2-1b; "
                    "--smoke: qwen3-0.6b)")
    st.add_argument("--layers", type=int, help="cut every model to its first N layers, every framework alike "
                    "(default: all, but the MoE models 8: bench_step.DEFAULT_LAYERS)")
    st.add_argument("--layouts", help="packed,padded (default both; --smoke: packed)")
    st.add_argument("--peers", default="hf,hf-default,liger,unsloth", help="comma-separated peers run beside lean "
                    "(hf-default: HF+PEFT with transformers' default experts implementation, MoE models only)")
    st.add_argument("--lean-attn-only", action="store_true", help="also lean's rows with LoRA on q,k,v,o only "
                    "(lean attn-LoRA; they run by themselves after a peer row that came back attention-only on MoE)")
    st.add_argument("--steps", type=int, help="timed steps after the warm-up (default 8; --smoke: 1)")
    st.add_argument("--timeout", type=int, default=300, help="seconds one row's process may take")
    st.add_argument("--json", help="write the rows to this path")
    st.add_argument("--graph", action="store_true", help="also lean+graph: the whole step replayed from lean.StepGraph")
    st.add_argument("--budget", type=float, help="lean only: VRAM budget (GiB) for the activation plan (plan_for)")
    st.add_argument("--quant", choices=["nf4"], help="QLoRA rows: lean's NF4 base weights, Unsloth's load_in_4bit "
                    "(HF+PEFT rows are skipped)")
    st.add_argument("--tokens", type=int, help="tokens per step (default 8192)")
    st.add_argument("--portable", action="store_true", help="lean's rows also on the portable path (LEAN_PORTABLE=1: "
                    "pointer loads, no TMA, the code an RTX / A100 card runs), in the same run")
    st.add_argument("--profile", action="store_true", help="instead of the table: lean's GPU time per kernel family "
                    "per step, one model/layout per process (tools/bench_profile.py; default layout packed)")
    st.add_argument("--smoke", action="store_true", help="CPU, tiny configs, interpreter, no timing claims")
    st.add_argument("--nproc", type=lambda v: [int(x) for x in v.split(",")], help="N GPUs, or several counts (2,4): "
                    "lean's data-parallel step through torchrun (N x 8192 tokens) beside its one-GPU row, and HF+PEFT "
                    "through accelerate launch beside its own (tools/bench_dist.py)")
    st.add_argument("--no-lean", action="store_true", help="the peers' rows alone (a full-depth pair that outlasts "
                    "one device call: lean's row in the next call)")
    st.add_argument("--shard-weights", action="store_true", help="with --nproc: also lean's row with the layers' "
                    "frozen weights sharded over the GPUs (lean.runtime.shard)")
    args = p.parse_args()
    if args.smoke:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    if args.mode == "step":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        if args.quant:  # read by bench_step (at import) and by every row's process
            os.environ["BENCH_STEP_QUANT"] = args.quant
        if args.tokens:
            os.environ["BENCH_STEP_TOKENS"] = str(args.tokens)
        import bench_step

        split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
        models = split(args.models or ("qwen3-0.6b" if args.smoke else "qwen3-0.6b,llama-3.2-1b"))
        layouts = split(args.layouts or ("packed" if args.smoke else "packed,padded"))
        if args.profile:
            layouts = split(args.layouts or "packed")
            return cmd_profile(models, layouts, args)
        steps = args.steps or (1 if args.smoke else 8)
        if args.nproc:
            import bench_dist

            return bench_dist.main(models, layouts, args.nproc, steps, graph=args.graph, shard=args.shard_weights,
                                   peers=split(args.peers), smoke=args.smoke, json_path=args.json, timeout=args.timeout)
        bench_step.main(models, layouts, split(args.peers), steps, args.json, graph=args.graph,
                        smoke=args.smoke, timeout=args.timeout, budget=args.budget, portable=args.portable,
                        n_layers=args.layers, lean_attn=args.lean_attn_only, lean=not args.no_lean)
        return
    cmd_kernels(args)


if __name__ == "__main__":
    main()
