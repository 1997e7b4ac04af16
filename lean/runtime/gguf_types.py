"""Q4_K_M's tensor types: which GGML type each tensor of an exported Q4_K_M file takes.

    types = q4_k_m_types([(name, shape), ...], arch="llama", n_layer=16, n_head=32, n_head_kv=8)

q4_k_m_types gives the per-tensor type llama-quantize's llama_tensor_get_type gives for ftype Q4_K_M
without --imatrix, --pure or overrides (src/llama-quant.cpp of the llama.cpp in llama-cpp-python
0.3.36). It takes every tensor at once because llama.cpp's rule does: attn_v's "more bits" layer is
a counter over the attn_v tensors in llama.cpp's order (by block number, then by name), out of their
total; output.weight's absence makes token_embd "tied" (it then gets output's type); ffn_down's
layer is the block number, out of n_layer. The encoders that write those types: gguf_quants.py.

The rule (no --tensor-type or --output-tensor-type either):
    not quantized (kept as the F16/BF16 export stores them, F32 for these): tensors with fewer than
      2 dimensions (ggml's count: trailing 1s of ne dropped), names not ending in "weight",
      "*_norm.weight", "ffn_gate_inp.weight" (the MoE router), and NOT_QUANTIZED below
    output.weight, and token_embd.weight when there is no output.weight (tied):
      Q8_0 if its rows are not a multiple of 256, else Q6_K
    attn_v (and attn_qkv / attn_kv_b): Q6_K where use_more_bits(i, n), i = the tensor's place among
      them in llama.cpp's order, n = their count; Q5_K instead of Q4_K on a "70B" model; Q8_0
      when n_expert == 8
    attn_k: Q8_0 when n_expert == 8.   attn_output: Q5_K when n_expert == 8.   (attn_qkv's own Q5_K
      branch comes after the attn_v one that catches it, so it never applies.)
    ffn_down*: Q6_K where use_more_bits(layer, n_layer) (layer: the block number when n_expert > 1,
      else the tensor's place among ffn_down tensors)
    everything else quantized: Q4_K
    then the fallback when a row (ne[0]) is not a multiple of the type's block: Q4_K -> Q5_0,
      Q5_K -> Q5_1, Q6_K -> Q8_0; F16 if the fallback's block of 32 does not divide it either.
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division).
  "70B" (llm_type, set when the model loads): llama with 80 layers and n_head != n_head_kv, qwen2
  with 80 layers. Falcon, GLM5-next and MXFP4-MoE branches are not reproduced: lean exports none.
Tested: tests/test_gguf_quants.py (the rules on hand-written model layouts; where llama_cpp imports,
llama_model_quantize's types for small F16 files and the real SmolLM2-135M).
"""
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from .gguf_quants import QK_K


ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
NOT_QUANTIZED = ("ffn_gate_inp.weight", "_norm.weight", "altup", "laurel", "per_layer_model_proj",
                 "ssm_conv1d", "attn_rel_b.weight", "position_embd.weight", "token_types.weight")
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.Q8_0: T.Q8_0}


def _use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _llama_order(name):  # llama_model_loader's weight_name_comparer: block number (-1 outside), name
    parts = name.split(".")
    return (int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1, name)


def _category(name):  # tensor_get_category: first match wins
    if name in ("output.weight", "token_embd.weight"):
        return name.split(".")[0]
    for key in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight",
                "attn_q.weight", "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return "attn_v" if key in ("attn_qkv.weight", "attn_kv_b.weight") else key.split(".")[0]
    return "other"


def q4_k_m_types(tensors, *, arch, n_layer, n_head, n_head_kv, n_expert=0):
    """{gguf name: GGMLQuantizationType} for every tensor of an export, as llama-quantize Q4_K_M.

    tensors: (gguf name, numpy shape) pairs, all of the file's tensors (the rule counts across them);
    shape as numpy holds it, (..., rows, C): ne[0] = C. arch: general.architecture; n_layer:
    block_count; n_head / n_head_kv: attention.head_count(_kv); n_expert: expert_count (0 if dense).
    """
    if arch not in ARCHS:
        raise ValueError(f"q4_k_m_types: architecture {arch!r} is not one lean exports ({', '.join(ARCHS)})")
    tensors = sorted(((n, tuple(int(d) for d in s)) for n, s in tensors), key=lambda t: _llama_order(t[0]))
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(_category(n) == "attn_v" for n in names)
    is_70b = n_layer == 80 and (arch == "qwen2" or (arch == "llama" and n_head != n_head_kv))
    i_attn_v = i_ffn_down = 0
    out = {}
    for name, shape in tensors:
        ne = shape[::-1]
        n_dims = max((i + 1 for i, d in enumerate(ne) if d != 1), default=1)
        if n_dims < 2 or not name.endswith("weight") or any(k in name for k in NOT_QUANTIZED):
            out[name] = T.F32
            continue
        cat, t = _category(name), T.Q4_K
        if cat == "output" or (cat == "token_embd" and tied):
            t = T.Q8_0 if ne[0] % QK_K else T.Q6_K
        elif cat == "attn_v":
            if _use_more_bits(i_attn_v, n_attn_v):
                t = T.Q6_K
            if is_70b and t == T.Q4_K:
                t = T.Q5_K
            if n_expert == 8:
                t = T.Q8_0
            i_attn_v += 1
        elif cat == "attn_k" and n_expert == 8:
            t = T.Q8_0
        elif cat == "attn_output" and n_expert == 8:
            t = T.Q5_K
        elif cat == "ffn_down":
            layer = i_ffn_down
            if n_expert > 1:
                layer = _llama_order(name)[0]
                if not 0 <= layer < n_layer:
                    raise ValueError(f"q4_k_m_types: {name} is not in a block 0..{n_layer - 1}; "
                                     f"name expert tensors blk.N.*")
            if _use_more_bits(layer, n_layer):
                t = T.Q6_K
            i_ffn_down += 1
        if ne[0] % GGML_QUANT_SIZES[t][0]:
            t = _FALLBACK[t]
            if ne[0] % GGML_QUANT_SIZES[t][0]:
                t = T.F16
        out[name] = t
    return out
