"""One row of `bench.py step` in its own process: build, warm up, time, print `ROW {json}`.

    python tools/bench_peers.py FRAMEWORK MODEL LAYOUT [--steps 8] [--warmup 3] [--smoke] [--graph] [--budget GiB]
    python tools/bench_peers.py folder MODEL [--smoke]     # Unsloth's input folder, then exit

FRAMEWORK: lean | lean-attn (lean, LoRA on q,k,v,o only) | hf (HF transformers + PEFT) | hf-default
(the same with transformers' default experts implementation; MoE models) | liger (HF + PEFT +
liger-kernel) | unsloth.
tools/bench_step.py starts one such process per row and reads its last `ROW ` line: keys tokens,
ms (median step), loss (last step's mean), peak_gib (torch.cuda.max_memory_allocated since the
process start, model build included; None on CPU), checkpointing, lora ("all" or "attn": where the
LoRA landed, read from the trainable parameters' names), note; or status "skipped" with a note.
lean only: --graph adds a `graph` sub-row (bench_step.run_lean_graph, its own peak) and --budget GiB
runs lean's step under plan_for's activation plan for that VRAM budget. A failure is an exception:
its traceback on stderr is what the parent shows.

The peers' step (bench_step's docstring gives the common work): HF builds the random-init model
from the config on the GPU (`from_config`, bf16, its own init, sdpa attention; GPT-OSS has no sdpa
in transformers 5.17: flex_attention on the GPU, eager on the CPU; $BENCH_HF_ATTN sets another, and
the note then names it); PEFT wraps it (LoraConfig r=16, alpha=32, dropout=0; PEFT keeps the
adapters in fp32); Liger patches the built model first
(`_apply_liger_kernel_to_instance`: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy).
Dense models: LoRA on the 7 projections (target_modules). MoE models (Qwen3-MoE, GPT-OSS): LoRA on
q,k,v,o (target_modules) and on every expert's fused weights through
target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] (transformers 5.17's
Qwen3MoeExperts and GptOssExperts hold exactly these two 3-D parameters, plus GPT-OSS's biases,
which stay frozen); PEFT wraps each as a ParamWrapper that adds a rank-r A and B per expert and
folds W + s B A into the (E, out, in) stack every forward (one baddbmm), which the experts
implementation then runs. gate_up's rank: PEFT 0.21 gives an explicitly targeted gate_up_proj plain
r (no pattern); only its v4 -> v5 mapping of Qwen3-MoE's gate_proj + up_proj names (the 7 names as
target_modules) fuses them into gate_up_proj with rank_pattern / alpha_pattern 2r / 2 alpha. The row
passes that same pattern (expert_patterns: Qwen3-MoE gate_up rank 32, alpha 64; GPT-OSS, whose names
PEFT does not map, rank 16), which is also lean's LoRA.peft_config: both sides train the same
adapters. Experts implementation (`experts_implementation=` to from_config; transformers 5.17 knows
eager, grouped_mm, batched_mm, deepgemm, sonicmoe, and resolves None to grouped_mm): hf and liger ask
for grouped_mm, hf-default passes none (the note names what it resolved to); the CPU smoke runs them
the same way (torch's grouped_mm runs on the CPU). Liger on Qwen3-MoE swaps the experts' forward for
its fused MoE kernels (LigerExperts, reading the PEFT-parametrised weights), on GPT-OSS it keeps
HF's experts (grouped_mm). gpt-oss-20b-mxfp4: from_config builds bf16 experts (the
quantization_config is dropped: HF fine-tunes GPT-OSS dequantised, Mxfp4Config(dequantize=True));
the note says so. The row's note states the placement, e.g. "LoRA attn + experts (PEFT
target_parameters; gate_up r32, down r16), grouped_mm"; a model whose experts PEFT did not reach
runs attention-only and says so (lora "attn").
Inputs: packed = input_ids (1, N) with position_ids restarting per document (transformers then masks
attention per document; GptOssModel does not pass position_ids to its mask functions, so its packed
rows get the mask mapping transformers' create_causal_mask / create_sliding_window_causal_mask build
from them, made once per batch, outside the timed step) and labels -100 at each document's first
token (no target crosses a document); padded = (4, N/4), labels = input_ids. Unsloth has no
build-from-config API: a child process writes the random model with a tiny tokenizer to
$BENCH_FOLDERS/<model>-L<layers> (default /tmp/bench_step; reused; write_folder says how), and
FastLanguageModel.from_pretrained(load_in_4bit=False, bf16) loads it; get_peft_model gets the 7 names on every model (on an MoE model Unsloth maps them onto
the experts itself, "Unsloth's MoE LoRA": 2026.10.9 passes them as target_modules beside
target_parameters [gate_up_proj, down_proj], so PEFT's Qwen3-MoE mapping doubles gate_up's rank there
too; the row reports where the LoRA landed and each expert parameter's rank); unsloth is imported
before transformers, with HF_HUB_OFFLINE=1, UNSLOTH_DISABLE_STATISTICS=1 and libcudart.so.12
preloaded for xformers ($BENCH_CUDART, or /tmp/site/_cudart/ where tools/gpu_check.sh puts it, or
.whl/a/); packed input also gets packed_seq_lengths. Optimizer: clip_grad_norm_(1.0) +
torch.optim.AdamW(fused=True), lr 1e-4.

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
ATTN_TARGETS = TARGETS[:4]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT target_parameters of an MoE model
GATE_UP_PATTERN = ".*\\.gate_up_proj"  # the key PEFT's Qwen3-MoE mapping writes (lean.runtime.lora's too)
EXPERTS = {"hf": "grouped_mm", "hf-default": None, "liger": "grouped_mm"}  # experts_implementation per framework
HF_ATTN_ENV = "BENCH_HF_ATTN"  # set: the HF rows' attn_implementation (e.g. eager, if flex fails on GPT-OSS)
FOLDERS = os.environ.get("BENCH_FOLDERS", "/tmp/bench_step")  # a full-depth 30B's 61 GB: /dev/shm (disk 64 GiB)
SHARD_BYTES = 4 << 30  # write_folder's safetensors shards
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
def build_hf(name, smoke, device, dtype, experts=None):
    """A random-init transformers model of the bench config, built on `device` (HF's own init).
    experts: experts_implementation for an MoE model (None: transformers' default). An MXFP4 config
    is built with bf16 experts (quantization_config dropped: from_config does not quantize)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = bench_step.model_config(name, smoke)
    cfg.pop("quantization_config", None)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    kw = dict(experts_implementation=experts) if experts and bench_step.is_moe(name) else {}
    attn = os.environ.get(HF_ATTN_ENV) or \
        ("sdpa" if hf_cfg.model_type != "gpt_oss" else "flex_attention" if device == "cuda" else "eager")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn, **kw)
    return model.train()


def expert_patterns(model, r=16, alpha=32):
    """(rank_pattern, alpha_pattern) for the experts' gate_up_proj: what PEFT 0.21 writes when it maps
    Qwen3-MoE's gate_proj + up_proj onto the fused parameter (2r, 2 alpha); none for GPT-OSS (experts
    with biases, gate and up interleaved: PEFT maps no names onto them; lean gives them rank r too)."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    if not experts or getattr(experts[0], "has_bias", False):
        return {}, {}
    return {GATE_UP_PATTERN: 2 * r}, {GATE_UP_PATTERN: 2 * alpha}


def peft_wrap(model, moe=False):
    """PEFT LoRA r=16 alpha=32 dropout 0: the 7 projections; an MoE model's q,k,v,o and experts
    (target_parameters, expert_patterns)."""
    from peft import LoraConfig, get_peft_model

    kw = dict(target_modules=TARGETS)
    if moe:
        rank, alpha = expert_patterns(model)
        kw = dict(target_modules=ATTN_TARGETS, target_parameters=EXPERT_PARAMS, rank_pattern=rank, alpha_pattern=alpha)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                            **kw))


def lora_placement(model, how=""):
    """(lora, words) of a wrapped model from its trainable parameters' names: ("all", "attn + experts
    (how; gate_up r32, down r16)") when LoRA reached an MoE model's experts (the ranks PEFT's wrappers got),
    ("all", "7 projections") on a dense one, ("attn", "attn only") when only q,k,v,o carry it. Raises
    when no LoRA parameter trains."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not any("lora" in n for n in names):
        raise AssertionError("no trainable LoRA parameter in the peer's model")
    if any(".experts." in n for n in names):
        ranks = {}  # PEFT's ParamWrappers: the rank each expert parameter got (gate_up 2r where PEFT doubles it)
        for m in model.modules():
            if isinstance(getattr(m, "parameter_name", None), str) and isinstance(getattr(m, "r", None), dict):
                ranks.setdefault(m.parameter_name.removesuffix("_proj"), set(m.r.values()))
        ranks = ", ".join(f"{k} r{'/'.join(map(str, sorted(v)))}" for k, v in sorted(ranks.items(), reverse=True))
        return "all", f"attn + experts ({'; '.join(filter(None, [how, ranks]))})".replace(" ()", "")
    if any(f".{t}." in n for n in names for t in TARGETS[4:]):
        return "all", "7 projections"
    return "attn", "attn only"


def packed_masks(model, batch):
    """GPT-OSS: batch with attention_mask = {layer type: mask} built by transformers' own mask functions
    from the packed position_ids (GptOssModel does not pass them on; it takes a ready mapping). Other
    models, or no position_ids: batch unchanged."""
    cfg = model.config
    if cfg.model_type != "gpt_oss" or "position_ids" not in batch:
        return batch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    pos = batch["position_ids"]
    embeds = torch.empty(*pos.shape, cfg.hidden_size, dtype=model.dtype, device=pos.device)  # shape, dtype, device
    masks = {"full_attention": create_causal_mask(cfg, embeds, None, None, position_ids=pos),
             "sliding_attention": create_sliding_window_causal_mask(cfg, embeds, None, None, position_ids=pos)}
    return dict(batch, attention_mask=masks)


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
    batch = packed_masks(model, dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"]))
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        alone = model(input_ids=batch["input_ids"][:, -lens[-1]:], use_cache=False).logits[0]
    gap = (packed[-lens[-1]:] - alone).abs().max().item()
    if len(lens) < 2 or gap > 1e-4 * alone.abs().max().item():
        raise AssertionError(f"packed HF row attends across documents (max logit gap {gap:.2e}, {len(lens)} "
                             "documents): this transformers does not split attention at position_ids resets")


def run_hf(name, layout, warmup, steps, smoke, framework="hf"):
    """HF+PEFT (hf, hf-default) or HF+PEFT+Liger (liger): the row dict, or skipped."""
    if importlib.util.find_spec("peft") is None:
        return skipped("peft not installed: skipped")
    if bench_step.quant():
        return skipped("QLoRA rows: this harness runs lean and Unsloth only: skipped")
    liger, moe = framework == "liger", bench_step.is_moe(name)
    device, dtype, cuda = setting(smoke)
    model = build_hf(name, smoke, device, dtype, EXPERTS[framework])
    experts, notes = "", []
    if moe:
        impl = model.config._experts_implementation
        experts = impl if EXPERTS[framework] else f"default experts implementation: {impl}"
        if "quantization_config" in bench_step.CONFIGS[name]:
            notes.append("experts not quantised (HF trains MXFP4 checkpoints dequantised)")
    if os.environ.get(HF_ATTN_ENV):
        notes.append(f"attention {model.config._attn_implementation} (${HF_ATTN_ENV})")
    if liger:
        if importlib.util.find_spec("liger_kernel") is None:
            return skipped("liger_kernel not installed: skipped (smoke: HF model built)")
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        mod = model.model.layers[0].mlp.experts if moe else None
        if moe and mod._get_name().startswith("Liger"):  # Liger bound its own experts forward (Qwen3-MoE)
            experts = f"Liger's experts ({mod._get_name()}), not {experts}"
        if not cuda:
            built = "model built and patched" + (f"; {experts}" if moe else "")
            return skipped(f"liger needs CUDA: skipped (smoke: {built})")
    model = peft_wrap(model, moe)
    scope, where = lora_placement(model, "PEFT target_parameters")
    if moe:
        notes[:0] = [f"LoRA {where}", experts]
    total = bench_step.SMOKE_TOKENS if smoke else bench_step.TOKENS
    vocab = model.config.vocab_size
    if smoke and not liger:
        check_packed_isolation(model, vocab, total)
        notes.append("packed isolation checked")
    batches = [packed_masks(model, hf_inputs(layout, vocab, total, device, seed)[0]) for seed in (1, 2)]
    t, loss = train_steps(model, batches, warmup, steps, cuda)
    return dict(tokens=total, ms=t * 1e3, loss=loss, checkpointing=checkpointing_on(model), lora=scope,
                note=", ".join(notes))


# =============================================================================================
# Unsloth
# =============================================================================================
def write_folder(name, smoke):
    """The random-init model, bf16 (fp32 under smoke), and a tiny tokenizer with its own pad token
    (so Unsloth neither adds one nor resizes the embeddings) in FOLDERS/<name>-L<layers>[-smoke].

    Written tensor by tensor, not through save_pretrained: the model is built on the meta device for
    its names and shapes, each tensor is drawn on the row's device (HF's scheme: normal(0,
    initializer_range) for matrices and expert stacks, norms one, biases zero), copied to the host
    and streamed into ~4 GB safetensors shards under the model's own parameter names, which
    transformers loads as they are. save_pretrained on a full-depth Qwen3-30B-A3B (61 GB) needs the
    whole model twice (its weight conversion back to per-expert names): neither on the GPU nor at a
    usable rate on the host. Here: one tensor on the device, one shard on the host."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    device, dtype, _ = setting(smoke)
    folder = folder_path(name, smoke)
    tmp = folder + ".tmp"
    for old in (folder, tmp):  # a stale folder, or one a killed write left
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(tmp)
    model = build_hf(name, smoke, "meta", dtype)  # an MXFP4 config: bf16 experts
    cfg = model.config
    std = cfg.initializer_range
    skip = {"lm_head.weight"} if cfg.get_text_config().tie_word_embeddings else set()
    g = torch.Generator(device).manual_seed(0)
    shard, index, files, total, held = {}, {}, [], 0, 0

    def flush():
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, os.path.join(tmp, files[-1]), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, files[-1]))
        shard.clear()

    for key, meta in model.state_dict().items():  # persistent tensors only (no RoPE inv_freq)
        if key in skip:
            continue
        x = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if "norm" in key:
            x.fill_(1.0)
        elif x.dim() >= 2 and x.is_floating_point():
            x.normal_(0.0, std, generator=g)
        else:
            x.zero_()
        shard[key] = x.cpu()
        total += x.nbytes
        held += x.nbytes
        if held >= SHARD_BYTES:
            flush()
            held = 0
    if shard:
        flush()
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    cfg.update(dict(pad_token_id=1, bos_token_id=2, eos_token_id=3))
    cfg.save_pretrained(tmp)
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", model_max_length=1 << 20).save_pretrained(tmp)
    os.replace(tmp, folder)  # complete or absent: a killed write is not reused


def folder_path(name, smoke):
    n = bench_step.model_config(name, smoke)["num_hidden_layers"]  # a cut model is its own folder
    return os.path.join(FOLDERS, f"{name}-L{n}" + ("-smoke" if smoke else ""))


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
    qlora = bench_step.quant() == "nf4"  # Unsloth's QLoRA: bitsandbytes NF4 at load
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=total, dtype=torch.bfloat16,
                                                 load_in_4bit=qlora, use_gradient_checkpointing=ckpt)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             bias="none", use_gradient_checkpointing=ckpt, random_state=0)
    FastLanguageModel.for_training(model, use_gradient_checkpointing=ckpt)
    batches = []
    for seed in (1, 2):
        batch, lens = hf_inputs(layout, model.config.vocab_size, total, "cuda", seed)
        if layout == "packed":
            batch["packed_seq_lengths"] = torch.tensor(lens, dtype=torch.int32)  # host tensor, as its collator makes
        batches.append(batch)
    scope, where = lora_placement(model)  # on an MoE model: did Unsloth put LoRA on the experts?
    t, loss = train_steps(model, batches, warmup, steps, cuda=True)
    from unsloth.utils import attention_dispatch

    attn = "xformers" if getattr(attention_dispatch, "HAS_XFORMERS", False) else "no xformers"
    moe = bench_step.is_moe(name)
    lora = f"Unsloth's MoE LoRA: {where}" if moe else ""
    mxfp4 = "quantization_config" in bench_step.CONFIGS[name]
    bf16 = "experts not quantised (the folder holds them dequantised)" * mxfp4
    note = ", ".join(filter(None, ["QLoRA load_in_4bit" * qlora, lora, bf16, attn, note,
                                   "offloaded checkpointing" * checkpointing]))
    return dict(tokens=total, ms=t * 1e3, loss=loss, checkpointing=checkpointing_on(model) or checkpointing,
                lora=scope, note=note)


# =============================================================================================
def run(framework, name, layout, warmup, steps, smoke, graph, budget=None, checkpointing=False):
    if framework in bench_step.LEAN_TARGETS:
        return bench_step.run_lean(name, layout, warmup, steps, graph=graph, smoke=smoke, budget_gib=budget,
                                   targets=bench_step.LEAN_TARGETS[framework])
    if framework in EXPERTS:
        return run_hf(name, layout, warmup, steps, smoke, framework)
    if framework == "unsloth":
        return run_unsloth(name, layout, warmup, steps, smoke, checkpointing)
    raise SystemExit(f"bench_peers: unknown framework {framework!r}: {', '.join(bench_step.FRAMEWORKS)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("framework", help=f"{', '.join(bench_step.FRAMEWORKS)}; or `folder` (write Unsloth's input "
                   "folder)")
    p.add_argument("model", choices=list(bench_step.CONFIGS))
    p.add_argument("layout", nargs="?", default="packed", choices=list(bench_step.LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=bench_step.WARMUP)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, fp32, interpreter")
    p.add_argument("--graph", action="store_true", help="lean, lean-attn: also the whole step from lean.StepGraph")
    p.add_argument("--budget", type=float, help="lean, lean-attn: VRAM budget in GiB for the activation plan")
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
