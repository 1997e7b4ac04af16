"""One table of GGUF names per architecture, read by the GGUF reader (gguf.py: a .gguf -> an HF
folder) and the writer (gguf_export.py: a run -> a .gguf): a name is written down once, here.

Shape legend: C hidden, D head dim, H / KVH heads, F MLP hidden, E experts, Fe one expert's width.

Names come from the `gguf` package (gguf-py, llama.cpp's own Python side): the architecture names
(MODEL_ARCH_NAMES), the tensor names (TENSOR_NAMES[MODEL_TENSOR.X], "blk.{bid}.attn_q") and the
metadata keys (Keys.LLM / Attention / Rope, "{arch}.context_length"). This file says which of them
each lean architecture uses and how an HF tensor becomes a GGUF one:

  TENSORS   HF name (after "model.layers.{i}." for a layer) -> Part(s): the GGUF tensor, and the
            rows of the HF tensor it takes, in (out, in) orientation:
              rope "q" / "k"   llama only: llama.cpp's RoPE reads each head's D rows interleaved,
                               GGUF row (h, j, half) = HF row (h, half, j), j < D/2 (permute_rows;
                               unpermute_rows undoes it). Qwen and GPT-OSS rotate in HF's order.
              rows "half0/1"   Qwen3-MoE's fused gate_up (E, 2Fe, C): gate = rows [:Fe], up [Fe:]
              rows "even/odd"  GPT-OSS's interleaved gate_up: gate = rows 0, 2, ..., up = 1, 3, ...
            transposed: GPT-OSS stores its experts (E, in, out); GGUF wants (E, out, in)
  HPARAMS   GGUF metadata key <-> config.json field <-> ModelConfig attribute
  PRE       tokenizer.ggml.pre <-> the tokenizer.json pre-tokenizer that splits text the same way
            (llama.cpp's llama-vocab.cpp implements each name; the tokenizer.json shapes are the
            ones the HF releases ship)

Reading covers the dense architectures (READABLE); writing every lean architecture (WRITABLE).
Tested: tests/test_gguf.py (reading), tests/test_gguf_export.py (writing; every table entry
through a round trip per architecture), tests/test_gguf_llama_cpp.py (llama.cpp reads them).
"""
from typing import NamedTuple

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, Keys

# lean architecture -> llama.cpp's
ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3,
         "qwen3_moe": MODEL_ARCH.QWEN3MOE, "gpt_oss": MODEL_ARCH.GPT_OSS}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
READABLE = ("llama", "qwen2", "qwen3")
WRITABLE = tuple(ARCHS)


def gguf_arch(arch: str) -> str:
    """llama.cpp's architecture name ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")."""
    return MODEL_ARCH_NAMES[ARCHS[arch]]


def lean_arch(name: str):
    """The lean architecture of llama.cpp's name, or None."""
    return next((a for a in ARCHS if gguf_arch(a) == name), None)


class Part(NamedTuple):
    tensor: MODEL_TENSOR   # which GGUF tensor
    kind: str = "weight"   # "weight" | "bias": the name's suffix
    rope: str = ""         # "q" | "k": rows permuted for llama.cpp's RoPE (llama only)
    rows: str = ""         # "" all | "half0" | "half1" | "even" | "odd" (see the module docstring)


T = MODEL_TENSOR
TOP = {"model.embed_tokens.weight": Part(T.TOKEN_EMBD), "model.norm.weight": Part(T.OUTPUT_NORM),
       "lm_head.weight": Part(T.OUTPUT)}
LAYER = {
    "input_layernorm.weight": Part(T.ATTN_NORM),
    "post_attention_layernorm.weight": Part(T.FFN_NORM),
    "self_attn.q_proj.weight": Part(T.ATTN_Q, rope="q"),
    "self_attn.k_proj.weight": Part(T.ATTN_K, rope="k"),
    "self_attn.v_proj.weight": Part(T.ATTN_V),
    "self_attn.o_proj.weight": Part(T.ATTN_OUT),
    "self_attn.q_proj.bias": Part(T.ATTN_Q, "bias", rope="q"),
    "self_attn.k_proj.bias": Part(T.ATTN_K, "bias", rope="k"),
    "self_attn.v_proj.bias": Part(T.ATTN_V, "bias"),
    "self_attn.o_proj.bias": Part(T.ATTN_OUT, "bias"),
    "self_attn.q_norm.weight": Part(T.ATTN_Q_NORM),
    "self_attn.k_norm.weight": Part(T.ATTN_K_NORM),
    "mlp.gate_proj.weight": Part(T.FFN_GATE),
    "mlp.up_proj.weight": Part(T.FFN_UP),
    "mlp.down_proj.weight": Part(T.FFN_DOWN),
}
# Mixture-of-Experts layers: HF name -> (parts, HF stores the experts (E, in, out))
QWEN3_MOE = {
    "mlp.gate.weight": ((Part(T.FFN_GATE_INP),), False),
    "mlp.experts.gate_up_proj": ((Part(T.FFN_GATE_EXP, rows="half0"), Part(T.FFN_UP_EXP, rows="half1")), False),
    "mlp.experts.down_proj": ((Part(T.FFN_DOWN_EXP),), False),
}
GPT_OSS = {
    "post_attention_layernorm.weight": ((Part(T.ATTN_POST_NORM),), False),
    "self_attn.sinks": ((Part(T.ATTN_SINKS),), False),
    "mlp.router.weight": ((Part(T.FFN_GATE_INP),), False),
    "mlp.router.bias": ((Part(T.FFN_GATE_INP, "bias"),), False),
    "mlp.experts.gate_up_proj": ((Part(T.FFN_GATE_EXP, rows="even"), Part(T.FFN_UP_EXP, rows="odd")), True),
    "mlp.experts.gate_up_proj_bias": ((Part(T.FFN_GATE_EXP, "bias", rows="even"),
                                       Part(T.FFN_UP_EXP, "bias", rows="odd")), False),
    "mlp.experts.down_proj": ((Part(T.FFN_DOWN_EXP),), True),
    "mlp.experts.down_proj_bias": ((Part(T.FFN_DOWN_EXP, "bias"),), False),
}
ROPE_FREQS = f"{TENSOR_NAMES[T.ROPE_FREQS]}.weight"  # llama3 RoPE scaling as per-dimension divisors


def tensor_parts(arch: str, hf_name: str):
    """(parts, transposed) for an HF tensor name of `arch`, or None when the table has no entry."""
    if hf_name in TOP:
        return (TOP[hf_name],), False
    pre, dot, rest = hf_name.partition(".layers.")
    if not dot or pre != "model":
        return None
    layer, _, suffix = rest.partition(".")
    moe = QWEN3_MOE if arch == "qwen3_moe" else GPT_OSS if arch == "gpt_oss" else {}
    if suffix in moe:
        return moe[suffix]
    if suffix in LAYER and ARCHS[arch] in MODEL_TENSORS and LAYER[suffix].tensor in MODEL_TENSORS[ARCHS[arch]]:
        part = LAYER[suffix]
        return (part._replace(rope=part.rope if arch == "llama" else ""),), False
    return None


def gguf_name(part: Part, layer=None) -> str:
    """The GGUF tensor name of `part` in layer `layer` ("blk.3.attn_q.weight")."""
    return f"{TENSOR_NAMES[part.tensor].format(bid=layer)}.{part.kind}"


def hf_name_of(arch: str, name: str):
    """(HF name, Part) for a GGUF tensor name of a dense architecture (READABLE), or None."""
    for hf, part in TOP.items():
        if gguf_name(part) == name:
            return hf, part
    head, _, rest = name.partition(".")
    layer, _, _ = rest.partition(".")
    if head != "blk" or not layer.isdigit():
        return None
    for suffix in LAYER:
        found = tensor_parts(arch, f"model.layers.{layer}.{suffix}")
        if found and gguf_name(found[0][0], int(layer)) == name:
            return f"model.layers.{layer}.{suffix}", found[0][0]
    return None


# ----------------------------------------------------------------------------- Q/K rows for RoPE

def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rows (H, 2, D/2, ...) -> llama.cpp's (H, D/2, 2, ...): each head's two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """permute_rows undone: GGUF rows (H, D/2, 2, ...) -> HF's (H, 2, D/2, ...)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def row_index(part: Part, n_rows: int, n_heads: int) -> np.ndarray:
    """HF row of each GGUF row of `part` (whose HF tensor has n_rows rows in (out, in) orientation)."""
    idx = np.arange(n_rows)
    if part.rope:
        idx = permute_rows(idx, n_heads)
    if part.rows == "half0":
        return idx[:n_rows // 2]
    if part.rows == "half1":
        return idx[n_rows // 2:]
    if part.rows in ("even", "odd"):
        return idx[part.rows == "odd"::2]
    return idx


# ----------------------------------------------------------------------------- metadata

class Hparam(NamedTuple):
    key: str      # Keys template ("{arch}.context_length")
    hf: str       # config.json field
    attr: str     # ModelConfig attribute
    kind: type    # int | float


HPARAMS = (
    Hparam(Keys.LLM.CONTEXT_LENGTH, "max_position_embeddings", "max_position", int),
    Hparam(Keys.LLM.EMBEDDING_LENGTH, "hidden_size", "hidden", int),
    Hparam(Keys.LLM.BLOCK_COUNT, "num_hidden_layers", "n_layers", int),
    Hparam(Keys.LLM.FEED_FORWARD_LENGTH, "intermediate_size", "intermediate", int),
    Hparam(Keys.LLM.VOCAB_SIZE, "vocab_size", "vocab", int),
    Hparam(Keys.Attention.HEAD_COUNT, "num_attention_heads", "n_heads", int),
    Hparam(Keys.Attention.HEAD_COUNT_KV, "num_key_value_heads", "n_kv_heads", int),
    Hparam(Keys.Attention.KEY_LENGTH, "head_dim", "head_dim", int),
    Hparam(Keys.Attention.VALUE_LENGTH, "head_dim", "head_dim", int),
    Hparam(Keys.Rope.DIMENSION_COUNT, "head_dim", "head_dim", int),
    Hparam(Keys.Attention.LAYERNORM_RMS_EPS, "rms_norm_eps", "rms_eps", float),
    Hparam(Keys.Rope.FREQ_BASE, "rope_theta", "rope_theta", float),
)
MOE_HPARAMS = (  # Mixture-of-Experts models only
    Hparam(Keys.LLM.EXPERT_COUNT, "num_experts", "n_experts", int),
    Hparam(Keys.LLM.EXPERT_USED_COUNT, "num_experts_per_tok", "top_k", int),
    Hparam(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size", "moe_intermediate", int),
)
SLIDING_WINDOW = Keys.Attention.SLIDING_WINDOW  # GPT-OSS: the window of its sliding layers
# RoPE scaling: config.json rope_scaling field -> key (type "linear" or "yarn"; llama3 is ROPE_FREQS)
ROPE_SCALING_TYPE = Keys.Rope.SCALING_TYPE
ROPE_SCALING = {"factor": Keys.Rope.SCALING_FACTOR,
                "original_max_position_embeddings": Keys.Rope.SCALING_ORIG_CTX_LEN,
                "beta_fast": Keys.Rope.SCALING_YARN_BETA_FAST, "beta_slow": Keys.Rope.SCALING_YARN_BETA_SLOW,
                "attention_factor": Keys.Rope.SCALING_YARN_ATTN_FACTOR}


def key(template: str, arch: str) -> str:
    """A metadata key of `arch` ("{arch}.context_length" -> "qwen3.context_length")."""
    return template.format(arch=gguf_arch(arch))


# ----------------------------------------------------------------------------- pre-tokenizers

def _split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_NFC = {"type": "NFC"}
# tokenizer.ggml.pre -> (tokenizer.json normalizer, pre_tokenizer); the first name of a shape is
# the one written. The normalizer is what the HF release ships (llama.cpp applies none: Qwen's NFC
# changes only text not already in NFC).
PRE = {
    "gpt2": (None, _byte_level(True)),
    "smollm": (None, {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                            _byte_level(True)]}),
    "llama-bpe": (None, {"type": "Sequence", "pretokenizers": [_split(_LLAMA3), _byte_level(False)]}),
    "qwen2": (_NFC, {"type": "Sequence", "pretokenizers": [_split(_QWEN2), _byte_level(False)]}),
    "gpt-4o": (None, {"type": "Sequence", "pretokenizers": [_split(_O200K), _byte_level(False)]}),
}
PRE_ALIASES = {"default": "gpt2", None: "gpt2", "starcoder": "smollm", "refact": "smollm", "codeshell": "smollm",
               "llama3": "llama-bpe", "llama-v3": "llama-bpe"}


def pre_shape(pre: dict):
    """What decides how a tokenizer.json pre_tokenizer splits text (trim_offsets and the like
    only move offsets): a tuple to compare."""
    if not pre:
        return ()
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    shape = []
    for s in steps:
        pattern = s.get("pattern") or {}
        shape.append((s.get("type"), pattern.get("Regex", pattern.get("String")), str(s.get("behavior", "")).lower(),
                      s.get("individual_digits"), s.get("use_regex"), s.get("add_prefix_space"),
                      s.get("invert")))
    return tuple(shape)


def pre_name(pre_tokenizer: dict):
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer, or None when llama.cpp has no such split."""
    shape = pre_shape(pre_tokenizer)
    return next((name for name, (_, p) in PRE.items() if pre_shape(p) == shape), None)
