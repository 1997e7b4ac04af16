"""Wall time of lean under the Triton CPU interpreter (TRITON_INTERPRET=1), SmolLM2-135M, fp32.

    python tools/interp_profile.py [--model DIR] [--only fb,eval,decode] [--tokens 512]

Prints three timings and, for each, the time per Triton kernel (launches, programs, seconds):
  (1) lean.forward_backward on a packed batch of ~512 tokens of ~60-token documents, r=8 LoRA on
      all 7 projections, dropout 0;
  (2) lean.loss_eval on the same batch;
  (3) the single-token (M=1) calls of one decode step: the 7 LoRA projections of each of the 30
      layers, rmsnorm, rope, swiglu, and the lm_head matmul (1 x 576 @ 576 x 49152); not kv_attention.
(1) and (2) are timed on their first run (the interpreter compiles nothing; a warm-up would double
minutes of waiting), (3) on its second. Totals are wall and process CPU seconds; the per-kernel
rows are process CPU seconds, steadier than wall time on a shared machine.
"""
import argparse
import collections
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import lean  # noqa: E402
from lean.kernels import (attention, embedding, gemm, linear_ce, lora_linear, rmsnorm, rope,  # noqa: E402
                          swiglu)

STATS = collections.defaultdict(lambda: [0, 0, 0.0])  # kernel name -> [launches, programs, seconds]


class _Timed:
    """Stands in for a module's @triton.jit kernel: times each launch and counts its programs."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            t = time.process_time()
            out = launch(*args, **kwargs)
            s = STATS[self.name]
            s[0] += 1
            s[1] += int(torch.tensor(g).prod())
            s[2] += time.process_time() - t
            return out
        return run


def _instrument():
    for mod in (attention, embedding, gemm, linear_ce, lora_linear, rmsnorm, rope, swiglu):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") and name.endswith("_kernel") and isinstance(obj, triton.runtime.jit.KernelInterface):
                setattr(mod, name, _Timed(name, obj))


def _report(title, times):
    wall, cpu = times
    print(f"\n{title}: {wall:.2f} s wall, {cpu:.2f} s CPU (per kernel: CPU seconds)", flush=True)
    for name, (n, progs, t) in sorted(STATS.items(), key=lambda kv: -kv[1][2]):
        print(f"  {name:34s} {n:5d} launches {progs:7d} programs {t:8.2f} s  {100 * t / cpu:5.1f}%")
    STATS.clear()


def _timed(fn, warm=False):
    if warm:
        fn()
    STATS.clear()
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.expanduser("~/.cache/lean-tests/smollm2-135m-instruct"))
    p.add_argument("--only", default="fb,eval,decode")
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    _instrument()
    model = lean.load_model(args.model, dtype=torch.float32, device="cpu")
    lora = lean.LoRA.init(model, r=8, alpha=16, targets="all", dropout=0.0, seed=0)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    docs, total = [], 0
    while True:  # ~60-token documents (53..67), packed up to the token budget
        n = int(torch.randint(53, 68, (1,), generator=g))
        if total + n > args.tokens:
            break
        docs.append(torch.randint(1, cfg.vocab, (n,), generator=g).tolist())
        total += n
    batch = lean.pack(docs, max_tokens=args.tokens, device="cpu")
    print(f"batch: {len(docs)} documents, {total} tokens; torch threads {torch.get_num_threads()}")
    only = args.only.split(",")

    if "fb" in only:
        def fb():
            lora.zero_grad()
            lean.forward_backward(model, lora, batch)
        _report("(1) forward_backward", _timed(fb))
    if "eval" in only:
        _report("(2) loss_eval", _timed(lambda: lean.loss_eval(model, lora, batch)))
    if "decode" in only:
        C, H, KVH, D = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = torch.randn(1, C)                                                   # (1, C)
        y = torch.empty(1, max(C, cfg.intermediate))                                     # (1, max(C, F))
        xa = torch.empty(1, lora.r)                                             # (1, R)
        act = torch.randn(1, cfg.intermediate)                                           # (1, F)
        q, k = torch.randn(1, H, D), torch.randn(1, KVH, D)
        cos, sin = torch.randn(1, D // 2), torch.randn(1, D // 2)
        n, rstd = torch.empty(1, C), torch.empty(1)
        logits = torch.empty(1, cfg.vocab)                                      # (1, V)
        h, gate, up = torch.empty(1, cfg.intermediate), torch.randn(1, cfg.intermediate), torch.randn(1, cfg.intermediate)

        def decode():
            for li, w in enumerate(model.layers):
                ads = lora.layers[li]
                rmsnorm.rmsnorm_fwd(n, rstd, x, w.in_norm, cfg.rms_eps)
                for t in ("q", "k", "v", "o", "gate", "up", "down"):
                    wt, ad = getattr(w, t), ads[t]
                    inp = act if t == "down" else x
                    lora_linear.lora_linear_fwd(y[:, :wt.shape[0]], xa, inp, wt, ad.a_lowp, ad.b_lowp,
                                                lora.scale)
                rope.rope_fwd(q, k, cos, sin)
                rmsnorm.rmsnorm_fwd(n, rstd, x, w.post_norm, cfg.rms_eps)
                swiglu.swiglu_fwd(h, gate, up)
            gemm.matmul(logits, x, model.lm_head.t())
        _report("(3) decode step, M=1 (per layer: 2 rmsnorm, 7 LoRA projections, rope, swiglu; lm_head)",
                _timed(decode, warm=True))


if __name__ == "__main__":
    main()
