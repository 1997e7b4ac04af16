"""GGUF file -> Hugging Face model folder, so that `lean.load_model(folder)` can train a .gguf model.

    folder = ensure_hf_folder("SmolLM2-135M-Instruct.Q4_1.gguf")   # converts once, then reuses
    model = lean.load_model(folder, dtype=torch.bfloat16)

Names (architectures, tensors, metadata keys, pre-tokenizers) come from gguf_names.py, the table
the GGUF writer (gguf_export.py) reads too.

What is written into the folder:
  config.json            LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM: the {arch}.* keys
                         of gguf_names.HPARAMS (sizes, rms_norm_eps, rope_theta, context_length as
                         max_position_embeddings, head_dim), tie_word_embeddings (true when the file
                         has no output.weight), llama's attention_bias (q/k/v/o biases in the file),
                         rope_scaling (linear only), bos/eos/pad token ids
  model.safetensors      every tensor dequantised (gguf.quants.dequantize: F32, F16, BF16, Q4_0,
                         Q4_1, Q8_0, the K-quants, ...) to `dtype`, under HF names (gguf_names),
                         written one tensor at a time (peak memory: one tensor, not the model)
  tokenizer.json         the `tokenizers` byte-level BPE built from tokenizer.ggml.* metadata
  tokenizer_config.json  chat_template (tokenizer.chat_template; named ones as a list),
                         bos/eos/pad/unk tokens as strings, add_bos_token / add_eos_token
  lean_gguf_source.json  the source's absolute path, size, mtime and the dtype: a folder whose
                         record matches is complete and is not converted again

Math:
  llama.cpp stores the rows of a llama file's attn_q and attn_k (weights and biases) permuted for
  its RoPE kernel: per head, the D rows (two halves of the rotary dims) are interleaved, GGUF row
  (i, j, half) = HF row (i, half, j) for head i, j < D/2. Undone here (gguf_names.unpermute_rows)
  by reading the rows as (H, D/2, 2, C) and writing them as (H, 2, D/2, C), with H =
  num_key_value_heads for attn_k. Same direction as transformers' modeling_gguf_pytorch_utils.
  LlamaTensorProcessor._reverse_permute_weights. Qwen2 and Qwen3 files are stored in HF's order.

Supported: general.architecture "llama" (Llama 2/3 shaped dense decoders, SmolLM), "qwen2" (q/k/v
  biases), "qwen3" (q/k norms, head_dim from key_length) with tokenizer.ggml.model "gpt2"
  (byte-level BPE) and a tokenizer.ggml.pre of gguf_names.PRE:
    "smollm" (and starcoder / refact / codeshell): split off every \\p{N} character, then ByteLevel's
              GPT-2 regex, without prefix space (llama.cpp's llama-vocab.cpp does the same)
    "default" / "gpt2" / absent: ByteLevel's GPT-2 regex, no prefix space
    "llama-bpe" / "llama3" / "llama-v3": the Llama 3 split regex, then ByteLevel without regex
    "qwen2": Qwen2's split regex (digits one by one), then ByteLevel without regex; NFC first
    "gpt-4o": o200k's split regex, then ByteLevel without regex
  token_type 3 (control) tokens become special added tokens, token_type 4 (user-defined) plain
  added tokens; the decoder is ByteLevel; BOS/EOS are added when add_bos_token / add_eos_token say so.

Errors are GGUFError (a ValueError) naming the file and the fix: not a GGUF file, a truncated file,
an architecture other than those, a tokenizer or pre-tokenizer not listed above, rope scaling other
than linear (llama3 scaling stored as a rope_freqs tensor included), mixture-of-experts files, any
{arch}.* metadata key or tensor this converter does not know (never silently ignored).

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
GGUF; Q/K permutation, untied heads and the errors on small synthetic GGUF files; synthetic Qwen2 and
Qwen3 files against transformers' GGUF loader, tensors and logits, and their tokenizers).
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from gguf import Keys

from .gguf_names import (HF_ARCHITECTURES, HPARAMS, MOE_HPARAMS, READABLE, ROPE_FREQS, ROPE_SCALING,
                         ROPE_SCALING_TYPE, hf_name_of, key, lean_arch, unpermute_rows)

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = READABLE  # llama.cpp's names: "llama", "qwen2", "qwen3"
RECORD_NAME = "lean_gguf_source.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", RECORD_NAME)
CONVERTER_VERSION = 2  # bump when the output changes, so old conversions are redone

# {arch}.* metadata keys read here (after the "{arch}." prefix; gguf_names' tables). Any other
# {arch}.* key is refused.
ARCH_KEYS = {k.split(".", 1)[1] for k in (*(h.key for h in HPARAMS + MOE_HPARAMS[:2]), ROPE_SCALING_TYPE,
                                          ROPE_SCALING["factor"])}

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
    arch = _check_architecture(meta, src)
    config = _hf_config(meta, reader, src, arch)
    plan = _tensor_plan(reader, config, src, arch)
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


def _arch(meta: dict, src: Path) -> str:
    """lean's architecture of the file ("llama", "qwen2", "qwen3"); GGUFError for any other."""
    name = meta.get("general.architecture")
    arch = lean_arch(name)
    if arch not in READABLE:
        raise GGUFError(f"{src}: general.architecture is {name!r}; lean's GGUF converter supports "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} only. Convert an HF folder of this model "
                        "instead (lean.load_model reads Llama, Qwen2, Qwen3, Qwen3-MoE and GPT-OSS safetensors "
                        "folders)")
    return arch


def _check_architecture(meta: dict, src: Path) -> str:
    arch = _arch(meta, src)
    pre = meta["general.architecture"] + "."
    unknown = sorted(k for k in meta if k.startswith(pre) and k[len(pre):] not in ARCH_KEYS)
    if unknown:
        raise GGUFError(f"{src}: metadata {', '.join(unknown)} is not handled by lean's GGUF converter and "
                        "may change the model's math: it is refused rather than ignored. Use the HF "
                        "safetensors release of this model")
    return arch


def _int(meta, key, src, default=None):
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"{src}: metadata {key} is missing: the file is not a complete GGUF model")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{src}: {key} differs between layers ({value}); lean needs one value")
        value = value[0]
    return int(value)


def _f32(value) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict, reader, src: Path, arch: str) -> dict:
    """rope_scaling for config.json: {} (none) or linear. Everything else is refused."""
    if any(t.name == ROPE_FREQS for t in reader.tensors):
        raise GGUFError(f"{src}: the file holds {ROPE_FREQS} (llama3-style RoPE scaling stored as "
                        "per-dimension factors); the converter cannot recover its parameters. Use the HF "
                        "safetensors release of this model")
    type_key, factor_key = key(ROPE_SCALING_TYPE, arch), key(ROPE_SCALING["factor"], arch)
    kind = meta.get(type_key, "none")
    factor = float(meta.get(factor_key, 1.0))
    if kind == "none" and factor == 1.0:
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise GGUFError(f"{src}: {type_key}={kind!r} with factor {factor} is not supported by lean's GGUF "
                    "converter (only none and linear): use the HF safetensors release of this model")


def _hf_config(meta: dict, reader, src: Path, arch: str) -> dict:
    """config.json of the HF architecture from {arch}.* (gguf_names.HPARAMS) and tokenizer.ggml.* metadata."""
    def get(h, default=None):
        return _int(meta, key(h.key, arch), src, default) if h.kind is int else \
            _f32(meta.get(key(h.key, arch), default))

    by_key = {h.key: h for h in HPARAMS}
    hidden, n_heads = get(by_key[Keys.LLM.EMBEDDING_LENGTH]), get(by_key[Keys.Attention.HEAD_COUNT])
    head_dim = get(by_key[Keys.Attention.KEY_LENGTH], hidden // n_heads)
    for k in (Keys.Attention.VALUE_LENGTH, Keys.Rope.DIMENSION_COUNT):  # the other head_dim keys
        if get(by_key[k], head_dim) != head_dim:
            raise GGUFError(f"{src}: {key(k, arch)}={meta[key(k, arch)]} differs from head_dim {head_dim} "
                            "(partial RoPE or value heads of another size): not supported by lean")
    experts = key(MOE_HPARAMS[0].key, arch)
    if _int(meta, experts, src, default=0) > 0:
        raise GGUFError(f"{src}: {experts}={meta[experts]}: a mixture-of-experts model; lean's GGUF converter "
                        "reads dense models only: use the HF safetensors release of this model")
    names = {t.name for t in reader.tensors}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {"architectures": [HF_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu", "head_dim": head_dim}
    defaults = {"num_key_value_heads": n_heads, "vocab_size": len(tokens) or None, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0}
    for h in HPARAMS:
        if h.hf != "head_dim":
            config[h.hf] = get(h, defaults.get(h.hf))
    biases = {n.split(".", 2)[2] for n in names if n.startswith("blk.") and n.endswith(".bias")}
    if arch == "llama":  # llama.cpp loads q/k/v/o biases when the file has them (attention_bias)
        config.update(attention_bias=bool(biases), mlp_bias=False)
    config["tie_word_embeddings"] = "output.weight" not in names
    scaling = _rope_scaling(meta, reader, src, arch)
    if scaling:
        config["rope_scaling"] = scaling
    for name in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


# ----------------------------------------------------------------------------- weights

def _tensor_plan(reader, config: dict, src: Path, arch: str) -> list:
    """[(HF name, ReaderTensor, HF shape, heads to unpermute or 0)] in HF-name order; refuses
    unknown or missing tensors and shapes that disagree with the config."""
    n_layers = config["num_hidden_layers"]
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    plan = []
    for t in reader.tensors:
        found = hf_name_of(arch, t.name)
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if found is None or (layer is not None and int(layer) >= n_layers):
            raise GGUFError(f"{src}: tensor {t.name} is not a {arch} tensor lean knows (experts and extra tensors "
                            "are not supported); nothing was written")
        hf, part = found
        # GGUF lists ne0 (columns) first; sync: none (numpy metadata on the host)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # sync: none
        plan.append((hf, t, shape, heads.get(part.rope, 0)))
    _check_plan(plan, config, src, arch)
    return sorted(plan, key=lambda p: p[0])


def _check_plan(plan: list, config: dict, src: Path, arch: str):
    from ..models.config import config_from_hf
    from ..models.weights import layer_fields

    cfg = config_from_hf(config)
    expected = {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden), "model.norm.weight": (cfg.hidden,)}
    if not cfg.tie_embeddings:
        expected["lm_head.weight"] = (cfg.vocab, cfg.hidden)
    for i in range(cfg.n_layers):
        expected.update({f"model.layers.{i}.{suffix}": shape for _, suffix, shape in layer_fields(cfg, i)})
    got = {hf: (shape, t.name) for hf, t, shape, _ in plan}
    missing = [k for k in expected if k not in got]
    if missing:
        raise GGUFError(f"{src}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:4])}: the file "
                        f"is not a complete {arch} GGUF")
    for hf, (shape, name) in got.items():
        if shape != expected[hf]:
            raise GGUFError(f"{src}: tensor {name} has shape {shape} but the metadata implies {expected[hf]}: "
                            "the file is inconsistent")


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
