"""GGUF file -> Hugging Face model folder, so that `lean.load_model(folder)` can train a .gguf model.

    folder = ensure_hf_folder("SmolLM2-135M-Instruct.Q4_1.gguf")   # converts once, then reuses
    model = lean.load_model(folder, dtype=torch.bfloat16)

What is written into the folder:
  config.json            LlamaForCausalLM: sizes, rms_norm_eps, rope_theta, max_position_embeddings
                         (context_length), vocab_size, tie_word_embeddings (true when the file has no
                         output.weight), rope_scaling (linear only), bos/eos/pad token ids
  model.safetensors      every tensor dequantised (gguf.quants.dequantize: F32, F16, BF16, Q4_0,
                         Q4_1, Q8_0, the K-quants, ...) to `dtype`, under HF names (GGUF_NAMES),
                         written one tensor at a time (peak memory: one tensor, not the model)
  tokenizer.json         the `tokenizers` byte-level BPE built from tokenizer.ggml.* metadata
  tokenizer_config.json  chat_template (tokenizer.chat_template; named ones as a list),
                         bos/eos/pad/unk tokens as strings, add_bos_token / add_eos_token
  lean_gguf_source.json  the source's absolute path, size, mtime and the dtype: a folder whose
                         record matches is complete and is not converted again

Math:
  llama.cpp stores the rows of attn_q and attn_k permuted for its RoPE kernel: per head, the D rows
  (two halves of the rotary dims) are interleaved, GGUF row (i, j, half) = HF row (i, half, j) for
  head i, j < D/2. Undone here by reading the rows as (H, D/2, 2, C) and writing them as
  (H, 2, D/2, C), with H = num_key_value_heads for attn_k. Same direction as transformers'
  modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights.

Supported: general.architecture "llama" (Llama 2/3 shaped dense decoders, SmolLM) with
  tokenizer.ggml.model "gpt2" (byte-level BPE) and tokenizer.ggml.pre
    "smollm" (and starcoder / refact / codeshell): split off every \\p{N} character, then ByteLevel's
              GPT-2 regex, without prefix space (llama.cpp's llama-vocab.cpp does the same)
    "default" / "gpt2" / absent: ByteLevel's GPT-2 regex, no prefix space
    "llama-bpe" / "llama3" / "llama-v3": the Llama 3 split regex, then ByteLevel without regex
  token_type 3 (control) tokens become special added tokens, token_type 4 (user-defined) plain
  added tokens; the decoder is ByteLevel; BOS/EOS are added when add_bos_token / add_eos_token say so.

Errors are GGUFError (a ValueError) naming the file and the fix: not a GGUF file, a truncated file,
an architecture other than llama, a tokenizer or pre-tokenizer not listed above, rope scaling other
than linear (llama3 scaling stored as a rope_freqs tensor included), mixture-of-experts llama files,
any llama.* metadata key or tensor this converter does not know (never silently ignored).

Cautions:
  - transformers' own GGUF tokenizer (5.x) ignores the "smollm" pre-tokenizer and uses plain
    ByteLevel; lean follows llama.cpp instead. On SmolLM2's vocabulary (no merges with digits) the
    two differ only where a run of whitespace ends in a number character ("x\\n\\n3": ours "ĊĊ","3",
    transformers' "Ċ","Ċ","3"; likewise before "½").
  - Dequantised weights are the quantised model, not the original float release.
  - tokenizer.ggml.add_space_prefix is ignored for byte-level BPE (transformers ignores it too).
  - The files are replaced one by one (temp name, then os.replace); the record is written last and
    removed first, so a conversion cut short is redone on the next call.
Tested: tests/test_gguf.py (every tensor and the tokenizer against transformers on the real SmolLM2
GGUF; Q/K permutation, untied heads and the errors on small synthetic GGUF files).
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
RECORD_NAME = "lean_gguf_source.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", RECORD_NAME)
CONVERTER_VERSION = 1  # bump when the output changes, so old conversions are redone

# GGUF tensor name -> HF name. Per-layer names hang off blk.N. / model.layers.N.
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_TO_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.* metadata keys read here (after the "llama." prefix). Any other llama.* key is refused.
LLAMA_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "expert_count", "expert_used_count",
}

_DTYPES = {  # name -> (torch dtype, safetensors dtype code)
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}



class GGUFError(ValueError):
    pass


# ----------------------------------------------------------------------------- public functions

def convert_gguf(gguf_path, out_dir, dtype="float32") -> Path:
    """Write an HF model folder for `gguf_path` into `out_dir` (created) and return it.

    `dtype`: "float32", "bfloat16" or "float16" (or the torch dtype) for model.safetensors. Returns
    at once when out_dir already holds a complete conversion of the same file (path, size, mtime)
    in the same dtype. Raises GGUFError (see the module docstring)."""
    src = _source_path(gguf_path)
    dtype_name = _dtype_name(dtype)
    out = Path(os.path.expanduser(str(out_dir)))
    record = _source_record(src, dtype_name)
    if _is_complete(out, record):
        return out
    _check_out_dir(out)

    # Read and check everything before the first byte is written.
    reader = _open(src)
    meta = _metadata(reader)
    _check_architecture(meta, src)
    config = _hf_config(meta, reader, src)
    plan = _tensor_plan(reader, config, src)
    from . import gguf_tokenizer  # imported here: it imports GGUFError from this module

    tokenizer_json = gguf_tokenizer.tokenizer_json(meta, src)
    tokenizer_config = gguf_tokenizer.tokenizer_config(meta, config)
    config["dtype"] = dtype_name

    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD_NAME).unlink(missing_ok=True)  # the folder is incomplete from here on
    _atomic_write(out / "model.safetensors", lambda f: _write_safetensors(f, plan, dtype_name))
    _atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    _atomic_write_text(out / "tokenizer.json", tokenizer_json)
    _atomic_write_text(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    _atomic_write_text(out / RECORD_NAME, json.dumps(record, indent=2) + "\n")
    return out


def default_cache_dir(gguf_path, dtype="float32") -> Path:
    """$XDG_CACHE_HOME (or ~/.cache)/lean/gguf/<stem>-<12 hex of sha256(absolute path, dtype)>."""
    src = Path(os.path.expanduser(str(gguf_path))).resolve()
    key = hashlib.sha256(f"{src}\0{_dtype_name(dtype)}".encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lean" / "gguf" / f"{src.stem}-{key}"


def ensure_hf_folder(gguf_path, dtype="float32") -> Path:
    """Convert `gguf_path` once into default_cache_dir(gguf_path, dtype) and return that folder."""
    return convert_gguf(gguf_path, default_cache_dir(gguf_path, dtype), dtype)


# ----------------------------------------------------------------------------- source and output

def _source_path(gguf_path) -> Path:
    src = Path(os.path.expanduser(str(gguf_path))).resolve()
    if not src.exists():
        raise GGUFError(f"GGUF file {src} does not exist: check the path")
    if not src.is_file():
        raise GGUFError(f"{src} is not a file: pass the .gguf file itself")
    return src


def _dtype_name(dtype) -> str:
    for name, (torch_dtype, _) in _DTYPES.items():
        if dtype == name or dtype == torch_dtype:
            return name
    raise GGUFError(f"dtype {dtype!r} is not supported for the converted weights: use one of "
                    f"{', '.join(_DTYPES)}")


def _source_record(src: Path, dtype_name: str) -> dict:
    st = src.stat()
    return {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype_name,
            "converter_version": CONVERTER_VERSION}


def _is_complete(out: Path, record: dict) -> bool:
    try:
        old = json.loads((out / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return False
    return old == record and all((out / name).is_file() for name in FILES)


def _check_out_dir(out: Path):
    """Refuse to write into a folder that holds files of something else (e.g. a real HF model)."""
    if out.exists() and not out.is_dir():
        raise GGUFError(f"output {out} exists and is not a folder: pass a folder path")
    if not out.is_dir():
        return
    foreign = [p.name for p in out.iterdir() if p.name not in FILES and not p.name.startswith(".lean-tmp-")]
    if foreign:
        raise GGUFError(f"output folder {out} holds files this converter did not write "
                        f"({', '.join(sorted(foreign)[:5])}): pass an empty or new folder")


def _atomic_write(path: Path, write):
    tmp = path.with_name(f".lean-tmp-{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str):
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# ----------------------------------------------------------------------------- reading the GGUF

def _open(src: Path):
    """A GGUFReader over `src`, after checking the magic and that no tensor runs past the end."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise GGUFError("reading .gguf files needs the `gguf` package: pip install gguf") from e
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{src} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
                        "pass a .gguf model file")
    size = src.stat().st_size
    try:
        reader = GGUFReader(str(src))
    except Exception as e:  # the header parse reads past the end or finds garbage
        raise GGUFError(f"{src} ({size} bytes) is a truncated or corrupt GGUF file ({type(e).__name__}: "
                        f"{e}): download it again") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"{src} is truncated: tensor {t.name} ends at byte {end} but the file has "
                            f"{size} bytes: download it again")
    return reader


def _metadata(reader) -> dict:
    """Every key/value of the header as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _check_architecture(meta: dict, src: Path):
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{src}: general.architecture is {arch!r}; lean's GGUF converter supports "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} only. Convert an HF folder of this model "
                        "instead (lean.load_model reads Llama, Qwen2 and Qwen3 safetensors folders)")
    unknown = sorted(k for k in meta if k.startswith("llama.") and k[len("llama."):] not in LLAMA_KEYS)
    if unknown:
        raise GGUFError(f"{src}: metadata {', '.join(unknown)} is not handled by lean's GGUF converter and "
                        "may change the model's math: it is refused rather than ignored. Use the HF "
                        "safetensors release of this model")


def _int(meta, key, src, default=None):
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"{src}: metadata {key} is missing: the file is not a complete llama GGUF")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{src}: {key} differs between layers ({value}); lean needs one value")
        value = value[0]
    return int(value)


def _f32(value) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict, reader, src: Path) -> dict:
    """rope_scaling for config.json: {} (none) or linear. Everything else is refused."""
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{src}: the file holds rope_freqs.weight (llama3-style RoPE scaling stored as "
                        "per-dimension factors); the converter cannot recover its parameters. Use the HF "
                        "safetensors release of this model")
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = float(meta.get("llama.rope.scaling.factor", 1.0))
    if kind == "none" and factor == 1.0:
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise GGUFError(f"{src}: llama.rope.scaling.type={kind!r} with factor {factor} is not supported by "
                    "lean's GGUF converter (only none and linear): use the HF safetensors release of this model")


def _hf_config(meta: dict, reader, src: Path) -> dict:
    """config.json for a LlamaForCausalLM from llama.* and tokenizer.ggml.* metadata."""
    hidden = _int(meta, "llama.embedding_length", src)
    n_heads = _int(meta, "llama.attention.head_count", src)
    n_kv = _int(meta, "llama.attention.head_count_kv", src, default=n_heads)
    head_dim = _int(meta, "llama.attention.key_length", src, default=hidden // n_heads)
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        if _int(meta, key, src, default=head_dim) != head_dim:
            raise GGUFError(f"{src}: {key}={meta[key]} differs from head_dim {head_dim} (partial RoPE or "
                            "value heads of another size): not supported by lean")
    if _int(meta, "llama.expert_count", src, default=0) > 0:
        raise GGUFError(f"{src}: llama.expert_count={meta['llama.expert_count']}: a mixture-of-experts "
                        "model (Mixtral-style) in llama layout; lean's GGUF converter supports dense "
                        "llama models only")
    names = {t.name for t in reader.tensors}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = _int(meta, "llama.vocab_size", src, default=len(tokens) or None)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int(meta, "llama.feed_forward_length", src),
        "num_hidden_layers": _int(meta, "llama.block_count", src),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": _int(meta, "llama.context_length", src),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
    }
    scaling = _rope_scaling(meta, reader, src)
    if scaling:
        config["rope_scaling"] = scaling
    for name in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


# ----------------------------------------------------------------------------- weights

def _tensor_plan(reader, config: dict, src: Path) -> list:
    """[(HF name, ReaderTensor, HF shape, heads to unpermute or 0)] in HF-name order; refuses
    unknown or missing tensors and shapes that disagree with the config."""
    n_layers = config["num_hidden_layers"]
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    plan = []
    for t in reader.tensors:
        hf, n_heads = GGUF_NAMES.get(t.name), 0
        if hf is None and t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if layer.isdigit() and int(layer) < n_layers and rest in GGUF_TO_HF_LAYER:
                hf, n_heads = f"model.layers.{layer}.{GGUF_TO_HF_LAYER[rest]}", heads.get(rest, 0)
        if hf is None:
            raise GGUFError(f"{src}: tensor {t.name} is not a dense llama tensor lean knows (biases, "
                            "experts and extra tensors are not supported); nothing was written")
        # GGUF lists ne0 (columns) first; sync: none (numpy metadata on the host)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # sync: none
        plan.append((hf, t, shape, n_heads))
    _check_plan(plan, config, src)
    return sorted(plan, key=lambda p: p[0])


def _check_plan(plan: list, config: dict, src: Path):
    C, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    Oq = config["num_attention_heads"] * config["head_dim"]
    Okv = config["num_key_value_heads"] * config["head_dim"]
    expected = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (V, C)
    layer = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
             "self_attn.q_proj.weight": (Oq, C), "self_attn.k_proj.weight": (Okv, C),
             "self_attn.v_proj.weight": (Okv, C), "self_attn.o_proj.weight": (C, Oq),
             "mlp.gate_proj.weight": (F, C), "mlp.up_proj.weight": (F, C), "mlp.down_proj.weight": (C, F)}
    for i in range(config["num_hidden_layers"]):
        expected.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    got = {hf: (shape, t.name) for hf, t, shape, _ in plan}
    missing = [k for k in expected if k not in got]
    if missing:
        raise GGUFError(f"{src}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:4])}: the file "
                        "is not a complete llama GGUF")
    for hf, (shape, name) in got.items():
        if shape != expected[hf]:
            raise GGUFError(f"{src}: tensor {name} has shape {shape} but the metadata implies {expected[hf]}: "
                            "the file is inconsistent")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows read as (H, D/2, 2, ...) are written as (H, 2, D/2, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(t, shape, n_heads) -> np.ndarray:
    from gguf.quants import dequantize

    w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # a copy, not the mmap
    return unpermute_rows(w, n_heads) if n_heads else w


def _write_safetensors(f, plan: list, dtype_name: str):
    """Stream a safetensors file: 8-byte header length, JSON header, then each tensor's bytes."""
    torch_dtype, code = _DTYPES[dtype_name]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for hf, _, shape, _ in plan:
        nbytes = int(np.prod(shape)) * itemsize
        header[hf] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned, as safetensors writes it
    f.write(len(blob).to_bytes(8, "little") + blob)
    for hf, t, shape, n_heads in plan:
        w = torch.from_numpy(_dequantized(t, shape, n_heads)).to(torch_dtype).contiguous()
        f.write(w.view(-1).view(torch.uint8).numpy().tobytes())
