"""lean's GGUF quantisers against ggml's C on the same rows, and what an 8B Q4_K_M export costs.

    python tools/gguf_quant_bench.py                          # 4096x4096 and 14336x4096; Q4_K Q6_K Q8_0
    python tools/gguf_quant_bench.py --shapes 14336x4096 --types Q4_K --threads 1 2

Per (shape, type, threads): lean's quantize and ggml's ggml_quantize_chunk (llama_cpp's
libggml-base, rows split over the threads as llama-quantize splits them), run back to back on the
same N(0, 0.02) float32 rows; wall and CPU seconds, M values/s, and whether the bytes agree. The
machine may be shared: CPU seconds show the work, wall seconds what a user waits, and the two
sides are measured alternately so both see the same load. lean's peak extra host memory of one
call comes from tracemalloc (numpy reports its buffers there).

Then the 8B estimate: Llama-3.1-8B's tensors (32 layers, C 4096, F 14336, 8 KV heads, vocab
128256, untied) typed by q4_k_m_types, values per type times each side's measured seconds per value
at the largest shape. ggml's side is llama-quantize's quantisation alone (its convert_hf_to_gguf
pass, which reads the safetensors and writes the F16 file first, comes on top).
"""
import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lean.runtime.gguf_quants import T, q4_k_m_types, quantize  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_oracle import ggml_quantize  # noqa: E402


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def llama_8b():
    C, F, L, V, kv = 4096, 14336, 32, 128256, 1024
    ts = [("token_embd.weight", (V, C)), ("output.weight", (V, C)), ("output_norm.weight", (C,))]
    for i in range(L):
        b = f"blk.{i}."
        ts += [(b + "attn_q.weight", (C, C)), (b + "attn_k.weight", (kv, C)), (b + "attn_v.weight", (kv, C)),
               (b + "attn_output.weight", (C, C)), (b + "ffn_gate.weight", (F, C)), (b + "ffn_up.weight", (F, C)),
               (b + "ffn_down.weight", (C, F)), (b + "attn_norm.weight", (C,)), (b + "ffn_norm.weight", (C,))]
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096"])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--no-ggml", action="store_true", help="lean only (llama_cpp not installed)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rate = {}  # (type, threads) -> (lean s/value, ggml s/value) at the last shape
    for shape in args.shapes:
        R, C = (int(n) for n in shape.split("x"))
        x = (rng.standard_normal((R, C), dtype=np.float32) * np.float32(0.02))
        for name in args.types:
            qtype = T[name]
            tracemalloc.start()
            quantize(x[: max(1, (1 << 22) // C)], qtype, threads=1)  # the same chunks; 4M values
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            for th in args.threads:
                ours, w, c = timed(lambda: quantize(x, qtype, threads=th))
                line = (f"{shape:11s} {name:5s} threads {th}: lean wall {w:6.2f} s cpu {c:6.2f} s "
                        f"{x.size / w / 1e6:6.1f} M/s wall")
                ggml_w = float("nan")
                if not args.no_ggml:
                    ref, ggml_w, gc = timed(lambda: ggml_quantize(x, qtype, threads=th))
                    line += (f" | ggml wall {ggml_w:6.2f} s cpu {gc:6.2f} s {x.size / ggml_w / 1e6:6.1f} M/s"
                             f" | lean/ggml {w / ggml_w:4.2f}x | bytes {'equal' if np.array_equal(ours, ref) else 'DIFFER'}")
                print(line + f" | lean extra peak (4M values) {peak:.0f} MiB", flush=True)
                rate[name, th] = (w / x.size, ggml_w / x.size)
    ts = llama_8b()
    types = q4_k_m_types(ts, arch="llama", n_layer=32, n_head=32, n_head_kv=8)
    count = {}
    for n, s in ts:
        count[types[n].name] = count.get(types[n].name, 0) + int(np.prod(s))
    print("Llama-3.1-8B Q4_K_M values per type:", {k: f"{v / 1e9:.3f}G" for k, v in count.items()})
    for th in args.threads:
        if all((k, th) in rate for k in count if k != "F32"):
            lean = sum(v * rate[k, th][0] for k, v in count.items() if k != "F32")
            ggml = sum(v * rate[k, th][1] for k, v in count.items() if k != "F32")
            print(f"8B estimate, {th} threads: lean {lean / 60:.1f} min, ggml quantize {ggml / 60:.1f} min")


if __name__ == "__main__":
    main()
