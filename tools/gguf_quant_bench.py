"""lean's GGUF quantisers against ggml's C on the same rows, and what an 8B Q4_K_M export costs.

    python tools/gguf_quant_bench.py                          # 4096x4096 and 14336x4096; Q4_K Q6_K Q8_0
    python tools/gguf_quant_bench.py --shapes 14336x4096 --types Q4_K --threads 1 2
    python tools/gguf_quant_bench.py --gpu                    # + lean/kernels/gguf_quant.py on the GPU
    python tools/gguf_quant_bench.py --ptx                    # the kernels' PTX / SASS (CPU, no GPU)

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

--gpu: the Triton kernels (quantize_rows) on the same shapes, bf16 and fp32 rows on the GPU: median
time (triton.testing.do_bench, L2 flushed), GB/s read and written, and a device copy's GB/s (read +
write of the bf16 rows) as the floor; the copy of the bytes to pinned host memory; bytes checked
against the numpy on the same widened values.
Then the 8B's Q4_K_M on the GPU from the bf16 rates, next to the time to write its file at the disk
rate measured here (--disk-mib MiB written and fsynced; 0 skips). With --gpu the CPU rows run only
when --cpu is given too.

--ptx: compile the three kernels for --cc (default 90) with enable_fp_fusion off (as launched) and
on, and count the PTX fma and SASS FFMA / FMUL / FADD instructions (no GPU needed; Triton's
bundled ptxas and nvdisasm). Off must show no fma: what is left in the SASS are div.rn expansions.
"""
import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

if "--ptx" in sys.argv:  # compiled kernels (JITFunctions), not the interpreter: set before triton loads
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lean.runtime.gguf_quants import T, quantize, row_bytes  # noqa: E402
from lean.runtime.gguf_types import q4_k_m_types  # noqa: E402

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


def gpu_rows(args):
    """The kernels on the GPU: {type name: (kernel, copy to host) seconds per value} of bf16 rows at the
    last shape."""
    import torch
    from triton.testing import do_bench

    from lean.kernels.gguf_quant import quantize_rows

    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    rate = {}
    for shape in args.shapes:
        R, C = (int(n) for n in shape.split("x"))
        x32 = torch.randn(R, C, generator=g, device="cuda") * 0.02
        xb = x32.to(torch.bfloat16)
        copy = torch.empty_like(xb)
        ms = do_bench(lambda: copy.copy_(xb), return_mode="median")
        print(f"{shape:11s} bf16 copy: {ms:7.3f} ms {2 * xb.nbytes / ms / 1e6:7.1f} GB/s (read + write)", flush=True)
        for name in args.types:
            qtype = T[name]
            for x in (xb, x32):
                dst = torch.empty(R, row_bytes(C, qtype), dtype=torch.uint8, device="cuda")
                ms = do_bench(lambda: quantize_rows(dst, x, qtype), return_mode="median")
                host = torch.empty(dst.shape, dtype=torch.uint8, pin_memory=True)
                d2h = do_bench(lambda: host.copy_(dst), return_mode="median")        # the bytes to the file
                same = np.array_equal(host.numpy(), quantize(x.float().cpu().numpy(), qtype))
                dt = str(x.dtype).replace("torch.", "")
                print(f"{shape:11s} {name:5s} {dt:8s}: {ms:8.3f} ms {x.numel() / ms / 1e6:8.2f} G values/s | "
                      f"in {x.nbytes / ms / 1e6:7.1f} GB/s out {dst.nbytes / ms / 1e6:7.1f} GB/s | to host (pinned) "
                      f"{d2h:7.3f} ms | bytes {'equal' if same else 'DIFFER'} to numpy", flush=True)
                if x is xb:
                    rate[name] = (ms / 1e3 / x.numel(), d2h / 1e3 / x.numel())
    return rate


def disk_rate(mib):
    """GB/s of writing and fsyncing mib MiB to a file in the current directory."""
    import tempfile

    buf = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with tempfile.NamedTemporaryFile(dir=".", prefix="gguf_bench_") as f:
        t = time.perf_counter()
        for _ in range(mib):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
        return mib * (1 << 20) / (time.perf_counter() - t) / 1e9


def ptx_counts(cc):
    """PTX / SASS instruction counts of the three kernels compiled for sm_cc, fusion off and on."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lean.kernels.gguf_quant as G

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    for kernel, n, meta in ((G._q8_0_kernel, "n_blk", ("BLOCKS", 64)), (G._q4_k_kernel, "n_sb", ("SB", 16)),
                            (G._q6_k_kernel, "n_sb", ("SB", 8))):
        sig = {"dst_ptr": "*u8", "x_ptr": "*bf16", n: "i32", meta[0]: "constexpr"}
        for fusion in (False, True):
            t = time.time()
            c = triton.compile(ASTSource(kernel, sig, {(3,): meta[1]}), target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": 4, "enable_fp_fusion": fusion})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(c.asm["cubin"])
                f.flush()
                sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
            n_ptx = {k: len(re.findall(v, c.asm["ptx"])) for k, v in
                     (("fma", r"\bfma\."), ("div.rn", r"div\.rn\.f32"), ("div.full", r"div\.full"),
                      ("sqrt.approx", r"sqrt\.approx"))}
            n_sass = {k: len(re.findall(rf"\b{k}\b", sass)) for k in ("FFMA", "FMUL", "FADD")}
            print(f"{kernel.fn.__name__:13s} sm_{cc} fusion {'on ' if fusion else 'off'}: PTX "
                  + " ".join(f"{k} {v}" for k, v in n_ptx.items()) + " | SASS "
                  + " ".join(f"{k} {v}" for k, v in n_sass.items())
                  + f" | shared {c.metadata.shared} B, compiled in {time.time() - t:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096"])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--no-ggml", action="store_true", help="lean only (llama_cpp not installed)")
    ap.add_argument("--gpu", action="store_true", help="the Triton kernels on the GPU (CPU rows only with --cpu)")
    ap.add_argument("--cpu", action="store_true", help="with --gpu: the CPU rows too")
    ap.add_argument("--disk-mib", type=int, default=2048, help="with --gpu: MiB written to time the disk (0: skip)")
    ap.add_argument("--ptx", action="store_true", help="count the kernels' fma instructions, then exit")
    ap.add_argument("--cc", type=int, default=90, help="with --ptx: the compute capability, e.g. 86")
    args = ap.parse_args()
    if args.ptx:
        return ptx_counts(args.cc)
    rng = np.random.default_rng(0)
    rate = {}  # (type, threads) -> (lean s/value, ggml s/value) at the last shape
    gpu = gpu_rows(args) if args.gpu else {}
    for shape in args.shapes if args.cpu or not args.gpu else ():
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
    if gpu and all(k in gpu for k in count if k != "F32"):
        secs = sum(v * gpu[k][0] for k, v in count.items() if k != "F32")
        d2h = sum(v * gpu[k][1] for k, v in count.items() if k != "F32")
        size = sum(int(np.prod(s[:-1])) * row_bytes(s[-1], types[n]) for n, s in ts)  # tensor data
        line = (f"8B Q4_K_M on the GPU (bf16 rows): {secs:.2f} s of kernels + {d2h:.2f} s of copies to the host "
                f"for a {size / 1e9:.2f} GB file")
        if args.disk_mib:
            disk = disk_rate(args.disk_mib)
            line += f"; writing it here at {disk:.2f} GB/s (fsync'd): {size / 1e9 / disk:.1f} s"
        print(line)
    for th in args.threads:
        if all((k, th) in rate for k in count if k != "F32"):
            lean = sum(v * rate[k, th][0] for k, v in count.items() if k != "F32")
            ggml = sum(v * rate[k, th][1] for k, v in count.items() if k != "F32")
            print(f"8B estimate, {th} threads: lean {lean / 60:.1f} min, ggml quantize {ggml / 60:.1f} min")


if __name__ == "__main__":
    main()
