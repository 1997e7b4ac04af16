"""Load a Hugging Face model (hub id or local folder) from safetensors into flat tensors.

Shards are read one at a time, each tensor copied straight into its view of the flat per-layer
buffers in the compute dtype through the explicit name map of lean/models/weights.py. transformers
is never imported. Pickle checkpoints (*.bin, *.pt) are refused: they can run code when loaded.
"""
import dataclasses
import json
import os
from collections import Counter
from pathlib import Path

import torch

from ..kernels.arch import arch
from ..models.config import UnsupportedModelError, config_from_hf
from ..models.weights import IGNORED_SUFFIXES, empty_model, expert_aliases

# What a training run needs from a hub repository: config, weights, tokenizer and chat template.
HUB_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class ModelLoadError(RuntimeError):
    pass


def local_model_dir(path_or_id):
    """The local model folder path_or_id names, None for a hub id; ModelLoadError for a file or a
    local-looking path with nothing there (checked before anything loads)."""
    p = Path(os.path.expanduser(str(path_or_id)))
    if p.is_dir():
        return p
    if p.exists():
        raise ModelLoadError(f"{p} is a file, not a model folder: pass the folder holding config.json "
                             "and *.safetensors (a .gguf file goes through lean-train --model)")
    looks_local = str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") > 1
    if looks_local:
        raise ModelLoadError(f"model folder {p} does not exist: check the path")
    return None


def resolve_model_dir(path_or_id) -> Path:
    """A local folder as is; otherwise a hub id fetched with huggingface_hub (needed files only)."""
    p = local_model_dir(path_or_id)
    if p is not None:
        return p
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(path_or_id), allow_patterns=HUB_PATTERNS))
    except Exception as e:  # network, auth, missing repo: say which and what to do
        raise ModelLoadError(
            f"could not fetch {path_or_id!r} from the Hugging Face hub ({type(e).__name__}: {' '.join(str(e).split())}). "
            "Pass a local folder instead, or check the id, your network and HF_TOKEN for gated models."
        ) from e


def read_config(model_dir: Path):
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json: point at a Hugging Face model folder")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({e}): re-download the model") from e
    try:
        return config_from_hf(raw)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{cfg_path}: {e}") from None


def shard_files(model_dir: Path):
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:  # bad JSON, no weight_map, not a dict
            raise ModelLoadError(f"{index} is broken ({type(e).__name__}: {e}): re-download the model") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not there: {missing}; re-download the model")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [f.name for f in model_dir.iterdir() if f.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); lean reads safetensors only, "
            "since unpickling can run code. Convert once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{model_dir} has no *.safetensors weights")


def load_model(path_or_id, dtype=torch.bfloat16, device=None):
    """Load config and weights into a lean Model (flat per-layer tensors in `dtype` on `device`)."""
    from safetensors import safe_open

    model_dir = resolve_model_dir(path_or_id)
    cfg = read_config(model_dir)

    def open_shard(f):
        try:
            return safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file ({e}); it may be truncated: "
                                 "delete it and download it again") from e

    files = shard_files(model_dir)
    names = []
    for f in files:  # the headers only: which layout the experts are stored in
        with open_shard(f) as handle:
            names += list(handle.keys())

    def tensors():
        for f in files:
            with open_shard(f) as handle:
                for name in handle.keys():
                    yield name, (lambda n=name: handle.get_tensor(n)), f

    return _fill(_stored_as(cfg, names), tensors(), dtype, device, str(model_dir))


def model_from_tensors(config: dict, tensors: dict, dtype=torch.bfloat16, device=None):
    """A lean Model from a config.json dict and HF-named tensors already in memory."""
    cfg = _stored_as(config_from_hf(config), list(tensors))
    return _fill(cfg, ((k, (lambda t=t: t), "tensors") for k, t in tensors.items()), dtype, device, "")


def _stored_as(cfg, names):
    """cfg with expert_quant set from the tensors a checkpoint holds: GPT-OSS experts stay MXFP4 when
    the checkpoint has them so (*_blocks / *_scales), and load in the model dtype when it holds bf16
    ones (a dequantised copy may keep config.json's quantization_config)."""
    if not cfg.expert_bias:
        return cfg
    mx = any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names)
    if mx and (cfg.hidden % 32 or cfg.moe_intermediate % 32):
        raise ModelLoadError(f"MXFP4 experts need hidden_size and intermediate_size multiples of 32 (got "
                             f"{cfg.hidden}, {cfg.moe_intermediate}): the weights do not match the config")
    return dataclasses.replace(cfg, expert_quant="mxfp4" if mx else "")


def _fill(cfg, named, dtype, device, path):
    """Copy (name, get_tensor, source) items into a fresh model through the name map."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    arch(torch.device(device))  # a GPU lean cannot run on is refused here, before any weight moves
    model = empty_model(cfg, dtype, device, path=path)
    targets = dict(model.hf_tensors())
    # The hub's per-expert tensors fill slices of the fused expert views (weights.expert_aliases):
    # a fused tensor counts as loaded once every one of its slices has been.
    parts = {}  # per-expert name -> fused name
    for li, layer in enumerate(model.layers):
        for name, view, fused in expert_aliases(layer, li, cfg):
            targets[name], parts[name] = view, fused
    n_parts = Counter(parts.values())
    seen, unexpected = set(), []
    for name, get, src in named:
        dst = targets.get(name)
        if dst is None:
            if not (name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings)):
                unexpected.append(name)
            continue
        try:
            t = get()
        except Exception as e:
            raise ModelLoadError(f"{src}: tensor {name} could not be read ({e}); the file may be "
                                 "truncated: download it again") from e
        if tuple(t.shape) != tuple(dst.shape):
            raise ModelLoadError(f"{src}: tensor {name} has shape {tuple(t.shape)}, but config.json "
                                 f"implies {tuple(dst.shape)}: the weights do not match the config")
        dst.copy_(t)  # host -> device copy with the cast to the compute dtype
        seen.add(name)
    n_seen = Counter(f for p, f in parts.items() if p in seen)
    seen.update(f for f, n in n_parts.items() if n_seen[f] == n)  # every slice seen: the fused tensor is there
    for p, fused in parts.items():  # one layout or the other is required, not both
        if fused in seen:
            seen.add(p)
    missing = [n for n in targets if n not in seen]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
        raise ModelLoadError(f"{path or 'tensors'}: checkpoint does not match a {cfg.hf_architecture} with this "
                             "config: " + "; ".join(parts) + ": re-download the model, or point at the "
                             "folder whose config.json belongs to these weights")
    return model
