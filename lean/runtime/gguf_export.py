"""A model folder (+ a LoRA adapter) -> one .gguf file that llama.cpp, Ollama and LM Studio run:
the merged model, or the adapter alone as a GGUF LoRA adapter (llama.cpp --lora, Ollama ADAPTER).

    export_model(model_dir, "run1/model-Q8_0.gguf", "Q8_0", adapter_dir="run1/adapter")
    export_adapter(model_dir, "run1/adapter", "run1/adapter-F16.gguf", "F16")

Shape legend: O / K a weight's output / input dims, E experts, R rank, D head dim.

Streaming and atomic (gguf_write.py): the header first, then each tensor a chunk of rows at a time,
read from the safetensors shards with the LoRA folded in (gguf_source.merged_rows), quantised and
written; peak host memory is a few chunks, whatever the model's size; the file appears under its
final name only once complete and fsynced; a failed export leaves nothing there.

Tensor types (what llama.cpp's convert_hf_to_gguf.py writes for the same --outtype): 1-D tensors,
*_norm.weight, biases and the MoE router (ffn_gate_inp) in F32; every other weight in the type asked
for (F32, F16, BF16, Q8_0; Q8_0 falls back to F16 for a row length that is not a multiple of 32).
Q4_K_M: each tensor's type from gguf_types.q4_k_m_types, llama-quantize's rule for the whole file
(Q4_K, Q6_K for attn_v / ffn_down of its "more bits" layers and for output, the Q5_0 / Q8_0 / F16
fallbacks for rows that are no multiple of 256; written down there from llama-quant.cpp): the types
and bytes llama-quantize gives lean's F32 export. Bytes: gguf_quants.quantize (ggml's, bit for bit).
Tensor order: token_embd, each layer in ascending order, output_norm, output (llama.cpp's loader
sorts by block number itself, and q4_k_m_types counts attn_v in that order).

Merging and quantising: numpy on the host (device None), or on a torch device: lean's matmul
kernel folds the LoRA in (fp32, IEEE products) and, on a CUDA device, kernels/gguf_quant.py writes
the Q8_0 / Q4_K / Q6_K bytes there (the same bytes; gguf_write.py's docstring says which type is
quantised where). lean-export and lean-train --export-gguf use the GPU where there is one. A QLoRA
run (quant "nf4") folds its adapter into the NF4 base it trained on (gguf_source.Nf4Base), as
--merge does.

Metadata (gguf_names' tables): general.{architecture, type, name, file_type, quantization_version},
{arch}.* hparams (context length, sizes, head counts and head_dim, norm eps, rope theta, vocab size;
expert count, used count and width; GPT-OSS's sliding window), RoPE scaling (linear and yarn as keys;
llama3 as the rope_freqs tensor llama.cpp divides its frequencies by: factor 1 below the high
frequency wavelength, `factor` above the low one, 1 / ((1 - s) / factor + s) between, with s the
smoothing of transformers' _compute_llama3_parameters), and the tokenizer (gguf_vocab.py).
A <out stem>.Modelfile for Ollama is written beside (write_modelfile).

The adapter file: general.type "adapter", adapter.type "lora", adapter.lora.alpha = lora_alpha; per
adapted weight "<name>.lora_a" (R, K) and "<name>.lora_b" (O, R) ((E, R, K) / (E, O, R) for experts),
B's rows permuted as the weight's. llama.cpp scales B A by alpha / R with R read from each tensor;
where the adapter's own scale differs (rsLoRA, Qwen3-MoE's gate_up at rank 2R and alpha 2 alpha:
that is alpha / R), B is multiplied by the ratio.

Supported: every architecture lean trains (gguf_names.WRITABLE) in llama.cpp's form: Qwen3-MoE with
every layer MoE and top-k renormalised (llama.cpp's qwen3moe has no dense layers), GPT-OSS with its
alternating sliding layers and GLU constants (llama.cpp's are fixed). Errors are GGUFError naming
the cause and the fix: an unknown type, an architecture or layout llama.cpp cannot run, a missing
tokenizer, no adapter, too little free space.
Tested: tests/test_gguf_export.py (F32 files read by transformers' GGUF loader to the merged model's
logits, Llama / Qwen2 / Qwen3 / Qwen3-MoE; GPT-OSS tensor by tensor against merge.py; BF16, Q8_0 and
Q4_K_M bytes and bounds, and lean's reader to the source's logits; the adapter file applied by hand
gives the merged file; a QLoRA run; every refusal, a full disk; chunked reads), and where llama_cpp
imports tests/test_gguf_llama_cpp.py (llama-quantize's Q4_K_M equal to lean's, llama.cpp's logits and
greedy tokens equal to lean's on every architecture, the adapter through --lora).
"""
import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFType, GGUFValueType, Keys, LlamaFileType
from gguf import GGMLQuantizationType as Q
from gguf import MODEL_TENSOR as T

from .gguf import GGUFError
from .gguf_names import (HPARAMS, MOE_HPARAMS, ROPE_FREQS, ROPE_SCALING, ROPE_SCALING_TYPE, SLIDING_WINDOW,
                         WRITABLE, Part, gguf_arch, gguf_name, key, row_index, tensor_parts)
from .gguf_types import q4_k_m_types
from .gguf_source import Shards
from .gguf_write import Out, write_gguf

# --gguf TYPE -> (general.file_type, the type of the quantised weights; Q4_K_M: per tensor, q4_k_m_types)
TYPES = {"F32": (LlamaFileType.ALL_F32, Q.F32), "F16": (LlamaFileType.MOSTLY_F16, Q.F16),
         "BF16": (LlamaFileType.MOSTLY_BF16, Q.BF16), "Q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
         "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K)}
ADAPTER_TYPES = ("F32", "F16", "BF16", "Q8_0")


def check_type(gguf_type: str, allowed=TYPES) -> str:
    name = str(gguf_type).upper()
    if name not in allowed:
        raise GGUFError(f"--gguf {gguf_type}: not a type lean writes; use one of {', '.join(allowed)}")
    return name


def tensor_type(name: str, part: Part, shape: tuple, qtype: Q) -> Q:
    """The GGUF type of a tensor in a file of `qtype` weights (the module docstring's rule)."""
    if len(shape) == 1 or part.kind == "bias" or name.endswith("_norm.weight") or part.tensor == T.FFN_GATE_INP:
        return Q.F32
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16


def check_exportable(cfg):
    """GGUFError when llama.cpp has no form for this model (see Supported)."""
    if cfg.arch not in WRITABLE:
        raise GGUFError(f"architecture {cfg.arch!r}: the GGUF export writes {', '.join(WRITABLE)}")
    if cfg.arch == "qwen3_moe" and (len(cfg.moe_layers) != cfg.n_layers or not cfg.norm_topk):
        raise GGUFError(f"this Qwen3-MoE has dense layers {sorted(set(range(cfg.n_layers)) - set(cfg.moe_layers))} "
                        f"or norm_topk_prob={cfg.norm_topk}: llama.cpp's qwen3moe runs every layer as MoE with the "
                        "top-k renormalised; export the merged HF folder (--merge) instead")
    if cfg.arch == "gpt_oss":
        pattern = all((w > 0) == (i % 2 == 0) for i, w in enumerate(cfg.windows))
        if not pattern or (cfg.glu_limit, cfg.glu_alpha) != (7.0, 1.702):
            raise GGUFError("this GPT-OSS has another sliding-window pattern or GLU constants than llama.cpp's fixed "
                            "ones (sliding on even layers, swiglu_limit 7.0, swiglu_alpha 1.702): export the merged "
                            "HF folder (--merge) instead")


def _hf_tensors(cfg):
    """(HF name, shape in the checkpoint's bf16 layout) in file order."""
    from ..models.weights import layer_fields

    yield "model.embed_tokens.weight", (cfg.vocab, cfg.hidden)
    for li in range(cfg.n_layers):
        for _, suffix, shape in layer_fields(cfg, li, dequantised=True):
            yield f"model.layers.{li}.{suffix}", shape
    yield "model.norm.weight", (cfg.hidden,)
    if not cfg.tie_embeddings or cfg.arch == "gpt_oss":  # llama.cpp's gpt-oss reads output.weight
        yield "lm_head.weight", (cfg.vocab, cfg.hidden)


def _oriented(shape, part, transposed):
    """(experts, rows, cols) of an HF tensor in (out, in) orientation."""
    if part.kind == "bias" or len(shape) == 1:
        return tuple(shape[:-1]), shape[-1], ()
    if transposed:
        shape = (*shape[:-2], shape[-1], shape[-2])
    return tuple(shape[:-2]), shape[-2], (shape[-1],)


def model_plan(cfg, type_name: str, adapters: dict) -> list:
    """[Out] of the merged model: every GGUF tensor, its type and where its rows come from."""
    check_exportable(cfg)
    qtype = TYPES[type_name][1]
    heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}
    plan = []
    if cfg.arch == "llama" and cfg.rope_scaling.get("rope_type") == "llama3":
        plan.append(Out(ROPE_FREQS, (cfg.head_dim // 2,), Q.F32, data=llama3_rope_factors(cfg)))
    for hf, shape in _hf_tensors(cfg):
        found = tensor_parts(cfg.arch, hf)
        if found is None:
            raise GGUFError(f"{hf}: llama.cpp's {gguf_arch(cfg.arch)} has no such tensor: the GGUF export cannot "
                            "write this model; export the merged HF folder (--merge) instead")
        parts, transposed = found
        layer = int(hf.split(".")[2]) if ".layers." in hf else None
        experts, rows, cols = _oriented(shape, parts[0], transposed)
        src = "model.embed_tokens.weight" if hf == "lm_head.weight" and cfg.tie_embeddings else hf
        for part in parts:
            idx = row_index(part, rows, heads.get(part.rope, 0))
            out_shape = (*experts, len(idx), *cols)
            name = gguf_name(part, layer)
            plan.append(Out(name, out_shape, tensor_type(name, part, out_shape, qtype), src, idx, transposed,
                            adapters.get(hf), experts=experts[0] if experts else 0, vector=not cols,
                            unit=cfg.head_dim if part.rope else 1))
    if type_name == "Q4_K_M":  # llama-quantize's per-tensor rule, over the whole file at once
        types = q4_k_m_types([(o.name, o.shape) for o in plan], arch=gguf_arch(cfg.arch), n_layer=cfg.n_layers,
                             n_head=cfg.n_heads, n_head_kv=cfg.n_kv_heads, n_expert=cfg.n_experts)
        plan = [o._replace(qtype=types[o.name]) for o in plan]
    return plan


def llama3_rope_factors(cfg) -> np.ndarray:
    """(D/2,) fp32: the divisor of each RoPE frequency under llama3 scaling (the module docstring)."""
    s = cfg.rope_scaling
    factor, lo, hi = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - lo) / (hi - lo)
    out = np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def model_metadata(cfg, name: str, file_type) -> dict:
    """{key: (value, GGUFValueType, sub type)}: general.* and the {arch}.* hparams."""
    arch, U32, F32, S = cfg.arch, GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    meta = {Keys.General.TYPE: (GGUFType.MODEL, S, None), Keys.General.NAME: (name, S, None),
            Keys.General.FILE_TYPE: (int(file_type), U32, None),
            Keys.General.QUANTIZATION_VERSION: (GGML_QUANT_VERSION, U32, None)}
    for h in HPARAMS + (MOE_HPARAMS if cfg.n_experts else ()):
        value = getattr(cfg, h.attr)
        if value:  # max_position 0: not in config.json
            meta[key(h.key, arch)] = (h.kind(value), U32 if h.kind is int else F32, None)
    if cfg.windows:
        meta[key(SLIDING_WINDOW, arch)] = (max(cfg.windows), U32, None)
    kind = cfg.rope_scaling.get("rope_type")
    if kind in ("linear", "yarn"):
        meta[key(ROPE_SCALING_TYPE, arch)] = (kind, S, None)
        for field, k in ROPE_SCALING.items():
            if field in cfg.rope_scaling and (kind == "yarn" or field == "factor"):
                v = cfg.rope_scaling[field]
                meta[key(k, arch)] = ((int(v), U32, None) if field.startswith("original") else (float(v), F32, None))
    return meta


# ----------------------------------------------------------------------------- the two exports

def export_model(model_dir, out, gguf_type="Q8_0", adapter_dir=None, *, name=None, device=None,
                 progress=True, modelfile=True, quant=None, quant_dtype=None, quantizer=None) -> Path:
    """Write the model in model_dir (with the adapter in adapter_dir folded in) as a GGUF at out;
    device: None merges with numpy on the host, a torch device with lean's matmul kernel there;
    quantizer: None (Triton's kernels on a CUDA device, numpy otherwise), "numpy" or "triton"
    (write_gguf; "triton" on a CPU device runs them in the interpreter: the tests).
    quant "nf4" (a QLoRA run): the adapter is folded into the NF4 base it trained on (Nf4Base; its
    projections quantised from quant_dtype, the run's dtype: bfloat16 on a GPU, float32 without)."""
    from .gguf_modelfile import write_modelfile
    from .gguf_source import load_adapter
    from .gguf_vocab import vocab_metadata
    from .loader import read_config

    type_name = check_type(gguf_type)
    model_dir, out = Path(model_dir), Path(out)
    cfg = read_config(model_dir)
    adapters = load_adapter(model_dir, adapter_dir, device or "cpu")[0] if adapter_dir is not None else {}
    plan = model_plan(cfg, type_name, adapters)
    vocab = vocab_metadata(model_dir, cfg.vocab)
    meta = {**model_metadata(cfg, name or model_dir.name, TYPES[type_name][0]), **vocab}
    src = Shards(model_dir)
    if any(n.endswith(".quant_state.bitsandbytes__nf4") for n in src.names):
        raise GGUFError(f"{model_dir} is a bitsandbytes 4-bit checkpoint: the GGUF export reads float checkpoints; "
                        "pass --model the float release it was quantised from")
    if quant == "nf4":
        import torch

        from .gguf_source import Nf4Base
        run_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = quant_dtype or ("bfloat16" if str(run_device).startswith("cuda") else "float32")
        src.nf4 = Nf4Base(cfg, getattr(torch, dtype), run_device)
    elif quant is not None:
        raise GGUFError(f"quant={quant!r}: lean's runs quantise their base to 'nf4' only")
    missing = [o.hf for o in plan if o.hf and o.hf not in src and o.hf + "_blocks" not in src
               and ".experts." not in o.hf]
    if missing:
        raise GGUFError(f"{model_dir}: tensor {missing[0]} is not in the safetensors shards: point at the "
                        "model folder the run trained on")
    path = write_gguf(out, cfg.arch, meta, plan, src, device, progress, quantizer)
    if modelfile:
        write_modelfile(path, vocab)
    return path


def adapter_plan(cfg, adapters: dict, alpha: float, qtype: Q) -> list:
    """[Out] of the adapter file: <weight>.lora_a (R, K) and .lora_b (O, R) per adapted weight part."""
    check_exportable(cfg)
    heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}
    plan = []
    for hf, _ in _hf_tensors(cfg):
        if hf not in adapters:
            continue
        parts, _ = tensor_parts(cfg.arch, hf)
        a, b, scale = adapters[hf]
        a, b = a.cpu().numpy(), b.cpu().numpy()  # sync: the adapter's A and B go to the writer on the host
        ratio = np.float32(scale / (alpha / a.shape[-2]))  # llama.cpp scales by alpha / R (R: A's rows)
        layer = int(hf.split(".")[2])
        for part in parts:
            bp = b[..., row_index(part, b.shape[-2], heads.get(part.rope, 0)), :] * ratio
            name = gguf_name(part, layer)
            for suffix, t in ((".lora_a", a), (".lora_b", bp)):
                t = np.ascontiguousarray(t, dtype=np.float32)
                plan.append(Out(name + suffix, t.shape, tensor_type(name, part, t.shape, qtype), data=t))
    return plan


def export_adapter(model_dir, adapter_dir, out, gguf_type="F16", *, name=None, base=None, progress=True,
                   modelfile=True) -> Path:
    """Write the PEFT adapter in adapter_dir (for the model in model_dir) as a GGUF LoRA adapter at out;
    base: the base model's .gguf for the Modelfile's FROM (None: a line to fill in)."""
    from .gguf_modelfile import write_adapter_modelfile
    from .gguf_source import load_adapter
    from .loader import read_config

    type_name = check_type(gguf_type, ADAPTER_TYPES)
    qtype = TYPES[type_name][1]
    model_dir, out = Path(model_dir), Path(out)
    cfg = read_config(model_dir)
    adapters, lora = load_adapter(model_dir, adapter_dir)
    S = GGUFValueType.STRING
    meta = {Keys.General.TYPE: (GGUFType.ADAPTER, S, None), Keys.General.NAME: (name or Path(adapter_dir).name, S, None),
            Keys.Adapter.TYPE: ("lora", S, None), Keys.Adapter.LORA_ALPHA: (lora.alpha, GGUFValueType.FLOAT32, None)}
    path = write_gguf(out, cfg.arch, meta, adapter_plan(cfg, adapters, lora.alpha, qtype), progress=progress)
    if modelfile:
        write_adapter_modelfile(path, base)
    return path
