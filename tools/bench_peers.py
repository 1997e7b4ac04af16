"""One row of `bench.py step` in its own process: build, warm up, time, print `ROW {json}`.

    python tools/bench_peers.py FRAMEWORK MODEL LAYOUT [--steps 8] [--warmup 3] [--smoke] [--graph] [--budget GiB]
    python tools/bench_peers.py folder MODEL [--smoke]     # Unsloth's input folder, then exit

FRAMEWORK: lean | hf (HF transformers + PEFT) | liger (HF + PEFT + liger-kernel) | unsloth.
tools/bench_step.py starts one such process per row and reads its last `ROW ` line: keys tokens,
ms (median step), loss (last step's mean), peak_gib (torch.cuda.max_memory_allocated since the
process start, model build included; None on CPU), checkpointing, note; or status "skipped"
with a note. lean only: --graph adds a `graph` sub-row (bench_step.run_lean_graph, its own peak)
and --budget GiB runs lean's step under plan_for's activation plan for that VRAM budget. A failure is an exception: its traceback on stderr is what the parent shows.

The peers' step (bench_step's docstring gives the common work): HF builds the random-init model
from the config on the GPU (`from_config`, bf16, its own init, sdpa attention); PEFT wraps it
(LoraConfig r=16, alpha=32, dropout=0, the 7 projections; PEFT keeps the adapters in fp32);
Liger patches the built model first (`_apply_liger_kernel_to_instance`: RoPE, RMSNorm, SwiGLU,
fused linear cross-entropy). Inputs: packed = input_ids (1, N) with position_ids restarting per
document (transformers then masks attention per document) and labels -100 at each document's
first token (no target crosses a document); padded = (4, N/4), labels = input_ids. Unsloth has no
build-from-config API: a child process saves the random model with a tiny tokenizer to
/tmp/bench_step/<model> (reused), and FastLanguageModel.from_pretrained(load_in_4bit=False, bf16)
loads it; unsloth is imported before transformers, with HF_HUB_OFFLINE=1,
UNSLOTH_DISABLE_STATISTICS=1 and libcudart.so.12 preloaded for xformers ($BENCH_CUDART, or
/tmp/site/_cudart/ where tools/gpu_check.sh puts it, or .whl/a/); packed input also gets
packed_seq_lengths. Optimizer: clip_grad_norm_(1.0) + torch.optim.AdamW(fused=True), lr 1e-4.

--smoke (CPU, tiny config of the same architecture, fp32): lean runs through the interpreter;
HF+PEFT runs its steps and checks that the packed row keeps documents apart (the last
document's logits equal those of the document alone); Liger patches the model, then skips
(needs CUDA); Unsloth writes and reloads its folder with transformers, then skips (needs CUDA).
Not installed: "<module> not installed: skipped", after the build check.
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

if "--smoke" in sys.argv:  # before anything imports triton: lean's kernels run in the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]
import bench_step  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FOLDERS = "/tmp/bench_step"
CUDART = ["/tmp/site/_cudart/libcudart.so.12", os.path.join(os.path.dirname(TOOLS), ".whl/a/libcudart.so.12")]


def skipped(note):
    return dict(status="skipped", note=note)


def setting(smoke):
    """(device, dtype, cuda?) of a row."""
    cuda = torch.cuda.is_available() and not smoke
    return ("cuda", torch.bfloat16, True) if cuda else ("cpu", torch.float32, False)


# =============================================================================================
# inputs
# =============================================================================================
def hf_inputs(layout, vocab, total, device, seed):
    """One batch as HF keyword arguments (module docstring: Inputs), plus the document lengths."""
    lens = bench_step.doc_lengths(layout, total)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (total,), generator=g)
    if layout == "padded":
        ids = ids.view(len(lens), -1)
        return dict(input_ids=ids.to(device), labels=ids.clone().to(device)), lens
    pos = torch.cat([torch.arange(n) for n in lens])
    labels = ids.clone()
    labels[np.cumsum([0] + lens[:-1])] = -100  # a document's first token is no target of the previous one
    return dict(input_ids=ids[None].to(device), position_ids=pos[None].to(device), labels=labels[None].to(device)), lens


# =============================================================================================
# HF + PEFT (+ Liger)
# =============================================================================================
def build_hf(name, smoke, device, dtype):
    """A random-init transformers model of the bench config, built on `device` (HF's own init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = bench_step.model_config(name, smoke)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def peft_wrap(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                            bias="none", task_type="CAUSAL_LM"))


def train_steps(model, batches, warmup, steps, cuda):
    """Time clip + fused AdamW steps of `model(**batch).loss` on alternating batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = model(**batches[i % 2], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        return loss.detach()

    return bench_step.time_steps(step, warmup, steps, cuda)


def checkpointing_on(model):
    """Whether any module of the built model would recompute in backward (must be False here)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def check_packed_isolation(model, vocab, total):
    """Smoke: the last packed document's logits equal the document run alone (no cross-document
    attention through position_ids). Raises naming the gap."""
    batch, lens = hf_inputs("packed", vocab, total, "cpu", seed=7)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = model(input_ids=batch["input_ids"][:, -lens[-1]:], use_cache=False).logits[0]
    gap = (packed[-lens[-1]:] - alone).abs().max().item()
    if len(lens) < 2 or gap > 1e-4 * alone.abs().max().item():
        raise AssertionError(f"packed HF row attends across documents (max logit gap {gap:.2e}, {len(lens)} "
                             "documents): this transformers does not split attention at position_ids resets")


def run_hf(name, layout, warmup, steps, smoke, liger=False):
    if importlib.util.find_spec("peft") is None:
        return skipped("peft not installed: skipped")
    device, dtype, cuda = setting(smoke)
    model = build_hf(name, smoke, device, dtype)
    note = ""
    if liger:
        if importlib.util.find_spec("liger_kernel") is None:
            return skipped("liger_kernel not installed: skipped (smoke: HF model built)")
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        if not cuda:
            return skipped("liger needs CUDA: skipped (smoke: model built and patched)")
    model = peft_wrap(model)
    total = bench_step.SMOKE_TOKENS if smoke else bench_step.TOKENS
    vocab = model.config.vocab_size
    if smoke and not liger:
        check_packed_isolation(model, vocab, total)
        note = "packed isolation checked"
    batches = [hf_inputs(layout, vocab, total, device, seed)[0] for seed in (1, 2)]
    t, loss = train_steps(model, batches, warmup, steps, cuda)
    return dict(tokens=total, ms=t * 1e3, loss=loss, checkpointing=checkpointing_on(model), note=note)


# =============================================================================================
# Unsloth
# =============================================================================================
def write_folder(name, smoke):
    """Save the random-init model, bf16 (fp32 under smoke), and a tiny tokenizer with its own pad
    token (so Unsloth neither adds one nor resizes the embeddings) to FOLDERS/<name>[-smoke]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    device, dtype, _ = setting(smoke)
    folder = folder_path(name, smoke)
    for old in (folder, folder + ".tmp"):  # a stale folder, or one a killed write left
        shutil.rmtree(old, ignore_errors=True)
    model = build_hf(name, smoke, device, dtype)
    model.config.update(dict(pad_token_id=1, bos_token_id=2, eos_token_id=3))
    model.save_pretrained(folder + ".tmp")
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", model_max_length=1 << 20).save_pretrained(folder + ".tmp")
    os.replace(folder + ".tmp", folder)  # complete or absent: a killed write is not reused


def folder_path(name, smoke):
    return os.path.join(FOLDERS, name + ("-smoke" if smoke else ""))


def ensure_folder(name, smoke):
    """The model folder, written by a child process (this one must import unsloth before
    transformers). Raises with that process's error tail."""
    folder = folder_path(name, smoke)
    if smoke or not os.path.isdir(folder):  # smoke: always written, so the writing is checked
        os.makedirs(FOLDERS, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "folder", name] + ["--smoke"] * smoke
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.isdir(folder):
            raise RuntimeError(f"writing {folder} failed (exit {p.returncode}):\n" + "\n".join(p.stderr.splitlines()[-12:]))
    return folder


def preload_cudart():
    """Load libcudart.so.12 globally so xformers' extension finds it. Returns a note."""
    import ctypes

    for path in [os.environ.get("BENCH_CUDART", "")] + CUDART:
        if path and os.path.isfile(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return ""
    return "libcudart.so.12 not found: no xformers"


def run_unsloth(name, layout, warmup, steps, smoke, checkpointing=False):
    folder = ensure_folder(name, smoke)
    if smoke:  # the folder is what Unsloth loads: transformers must load it too
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoModelForCausalLM.from_pretrained(folder)
        if AutoTokenizer.from_pretrained(folder).pad_token_id != 1:
            raise AssertionError(f"{folder}: the tokenizer lost its pad token")
    if importlib.util.find_spec("unsloth") is None:
        return skipped("unsloth not installed: skipped" + (" (smoke: model folder written and loaded)" * smoke))
    if smoke or not torch.cuda.is_available():
        return skipped("unsloth needs CUDA: skipped (smoke: model folder written and loaded)")
    note = preload_cudart()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    from unsloth import FastLanguageModel  # before transformers and peft: it patches them

    total = bench_step.TOKENS
    ckpt = "unsloth" if checkpointing else False  # "unsloth": its offloaded gradient checkpointing
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=total, dtype=torch.bfloat16,
                                                 load_in_4bit=False, use_gradient_checkpointing=ckpt)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             bias="none", use_gradient_checkpointing=ckpt, random_state=0)
    FastLanguageModel.for_training(model, use_gradient_checkpointing=ckpt)
    batches = []
    for seed in (1, 2):
        batch, lens = hf_inputs(layout, model.config.vocab_size, total, "cuda", seed)
        if layout == "packed":
            batch["packed_seq_lengths"] = torch.tensor(lens, dtype=torch.int32)  # host tensor, as its collator makes
        batches.append(batch)
    t, loss = train_steps(model, batches, warmup, steps, cuda=True)
    from unsloth.utils import attention_dispatch

    attn = "xformers" if getattr(attention_dispatch, "HAS_XFORMERS", False) else "no xformers"
    note = " ".join(filter(None, [attn, note, "offloaded checkpointing" * checkpointing]))
    return dict(tokens=total, ms=t * 1e3, loss=loss, checkpointing=checkpointing_on(model) or checkpointing, note=note)


# =============================================================================================
def run(framework, name, layout, warmup, steps, smoke, graph, budget=None, checkpointing=False):
    if framework == "lean":
        return bench_step.run_lean(name, layout, warmup, steps, graph=graph, smoke=smoke, budget_gib=budget)
    if framework in ("hf", "liger"):
        return run_hf(name, layout, warmup, steps, smoke, liger=framework == "liger")
    if framework == "unsloth":
        return run_unsloth(name, layout, warmup, steps, smoke, checkpointing)
    raise SystemExit(f"bench_peers: unknown framework {framework!r}: {', '.join(bench_step.FRAMEWORKS)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("framework", help="lean, hf, liger, unsloth; or `folder` (write Unsloth's input folder)")
    p.add_argument("model", choices=list(bench_step.CONFIGS))
    p.add_argument("layout", nargs="?", default="packed", choices=list(bench_step.LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=bench_step.WARMUP)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, fp32, interpreter")
    p.add_argument("--graph", action="store_true", help="lean only: also the whole step from lean.StepGraph")
    p.add_argument("--budget", type=float, help="lean only: VRAM budget in GiB for the activation plan")
    p.add_argument("--checkpointing", action="store_true", help="unsloth only: its offloaded gradient checkpointing")
    a = p.parse_args(argv)
    if a.framework == "folder":
        write_folder(a.model, a.smoke)
        return
    cuda = torch.cuda.is_available() and not a.smoke
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    row = run(a.framework, a.model, a.layout, a.warmup, a.steps, a.smoke, a.graph, a.budget, a.checkpointing)
    if cuda and row.get("status", "ok") == "ok":
        row.setdefault("peak_gib", torch.cuda.max_memory_allocated() / 2**30)  # lean sets its own
    print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
