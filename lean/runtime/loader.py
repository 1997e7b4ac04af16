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
from ..kernels.nf4 import Nf4, nf4_quantize
from ..models.weights import IGNORED_SUFFIXES, PROJECTIONS, empty_model, expert_aliases, nf4_projections

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


def load_model(path_or_id, dtype=torch.bfloat16, device=None, quant=None, stage_tables=False):
    """Load config and weights into a lean Model (flat per-layer tensors in `dtype` on `device`).
    quant="nf4": the seven projections of every layer quantised to NF4 as they load (QLoRA; see
    models/weights.py). A checkpoint already in bitsandbytes' 4-bit layout loads as NF4 either way."""
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

    def read(name):  # one small tensor by name (a quant state's JSON)
        for f in files:
            with open_shard(f) as handle:
                if name in handle.keys():
                    return handle.get_tensor(name)

    return _fill(_stored_as(cfg, names, quant, read), tensors(), dtype, device, str(model_dir), names,
                 stage_tables=stage_tables)


def model_from_tensors(config: dict, tensors: dict, dtype=torch.bfloat16, device=None, quant=None):
    """A lean Model from a config.json dict and HF-named tensors already in memory."""
    cfg = _stored_as(config_from_hf(config), list(tensors), quant, tensors.get)
    return _fill(cfg, ((k, (lambda t=t: t), "tensors") for k, t in tensors.items()), dtype, device, "", list(tensors))


NF4_STATE = ".quant_state.bitsandbytes__nf4"
# bitsandbytes' names of an NF4 weight's parts, after the weight's own name -> Nf4 field
NF4_PARTS = ((".absmax", "absmax"), (".nested_absmax", "absmax2"), (".nested_quant_map", "code2"),
             (".quant_map", "code"), (NF4_STATE, "state"))


def _quant_state(t, src, name):
    """The JSON object of a bitsandbytes quant state tensor (uint8 bytes)."""
    try:
        return json.loads(bytes(t.reshape(-1).tolist()).decode())  # sync: set-up, a few hundred bytes of JSON at load
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{src}: {name} is not a bitsandbytes quant state ({e}): re-download the model") from e


def _nf4_config(cfg, names, quant, read):
    """cfg with weight_quant / quant_block / quant_dense for a checkpoint of these tensor names."""
    if quant not in (None, "nf4"):
        raise ValueError(f"quant={quant!r}: lean quantises base weights to 'nf4' only (or None: as stored)")
    if any(n.endswith(".quant_state.bitsandbytes__fp4") for n in names):
        raise ModelLoadError("this checkpoint holds bitsandbytes FP4 weights; lean reads NF4 only: load the "
                             "bf16 model with --load-in-4bit (quant='nf4') instead")
    states = [n for n in names if n.endswith(NF4_STATE)]
    stored = _nf4_modules(names)  # the modules the checkpoint holds in bitsandbytes' NF4 layout
    if not stored and quant is None:
        return cfg
    block, dense = 64, ()
    if stored:  # pre-quantised: the blocksize from the file; projections stored without NF4 parts stay dense
        held = {m for li in range(cfg.n_layers)
                for _, m, _ in nf4_projections(dataclasses.replace(cfg, weight_quant="nf4", quant_dense=()), li)}
        other = sorted(stored - held)
        if other:
            more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
            raise ModelLoadError(f"{other[0]}{more} is stored in NF4, but lean reads NF4 only for the attention and "
                                 "dense-MLP projections: load the bf16 model with --load-in-4bit (quant='nf4')")
        if not states:
            raise ModelLoadError(f"{min(stored)}.weight{NF4_STATE} is missing (the checkpoint holds NF4 parts but "
                                 "no quant state): re-download the model")
        state = _quant_state(read(states[0]), "checkpoint", states[0])
        block = int(state.get("blocksize", 0))
        if "nested_offset" not in state:
            raise ModelLoadError(f"{states[0]}: quantised without double quantisation (bnb_4bit_use_double_quant "
                                 "false); lean holds NF4 with double quantisation only: load the bf16 model with "
                                 "--load-in-4bit (quant='nf4') instead")
        dense = tuple(f"model.layers.{li}.{m}" for li in range(cfg.n_layers) for _, m in PROJECTIONS
                      if f"model.layers.{li}.{m}" not in stored and f"model.layers.{li}.{m}.weight" in names)
    if block not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ModelLoadError(f"{states[0]}: NF4 blocksize {block} is not one of bitsandbytes' (32 .. 4096)")
    dense_mlp = any(not cfg.is_moe(li) for li in range(cfg.n_layers))  # an MoE layer's MLP stays unquantised
    sizes = [cfg.hidden, cfg.q_dim] + [cfg.intermediate] * dense_mlp
    if any(n % block for n in sizes):
        widths = f"(hidden {cfg.hidden}, intermediate {cfg.intermediate}, heads x head_dim {cfg.q_dim})"
        if stored:
            raise ModelLoadError(f"{states[0]}: this checkpoint's NF4 blocks of {block} do not divide every "
                                 f"projection's input width {widths}, and lean holds NF4 only where each block "
                                 "lies in one row: load the bf16 model instead")
        raise ModelLoadError(f"NF4 blocks of {block} must divide every projection's input width {widths}: "
                             "this model cannot be held in NF4; load it without 4-bit")
    return dataclasses.replace(cfg, weight_quant="nf4", quant_block=block, quant_dense=dense)


def _nf4_modules(names):
    """The modules whose weight a checkpoint holds in bitsandbytes' NF4 layout: any of its parts named."""
    suffixes = tuple(".weight" + s for s, _ in NF4_PARTS)
    return {n[:-len(s)] for n in names for s in suffixes if n.endswith(s)}


def _stored_as(cfg, names, quant=None, read=None):
    """cfg with expert_quant set from the tensors a checkpoint holds: GPT-OSS experts stay MXFP4 when
    the checkpoint has them so (*_blocks / *_scales), and load in the model dtype when it holds bf16
    ones (a dequantised copy may keep config.json's quantization_config). NF4 projections: asked
    for (quant="nf4") or stored so (bitsandbytes' 4-bit layout)."""
    cfg = _nf4_config(cfg, names, quant, read)
    if not cfg.expert_bias:
        return cfg
    mx = any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names)
    if mx and (cfg.hidden % 32 or cfg.moe_intermediate % 32):
        raise ModelLoadError(f"MXFP4 experts need hidden_size and intermediate_size multiples of 32 (got "
                             f"{cfg.hidden}, {cfg.moe_intermediate}): the weights do not match the config")
    return dataclasses.replace(cfg, expert_quant="mxfp4" if mx else "")


def _fill(cfg, named, dtype, device, path, names=(), stage_tables=False):
    """Copy (name, get_tensor, source) items into a fresh model through the name map (names: every
    tensor name the items hold, for the NF4 weights stored with a quant state)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    arch(torch.device(device))  # a GPU lean cannot run on is refused here, before any weight moves
    model = empty_model(cfg, dtype, device, path=path, stage_tables=stage_tables)
    targets = dict(model.hf_tensors())
    # The hub's per-expert tensors fill slices of the fused expert views (weights.expert_aliases):
    # a fused tensor counts as loaded once every one of its slices has been.
    parts = {}  # per-expert name -> fused name
    for li, layer in enumerate(model.layers):
        for name, view, fused in expert_aliases(layer, li, cfg):
            targets[name], parts[name] = view, fused
    n_parts = Counter(parts.values())
    nf4_parts = {w + suffix: (w, part) for w, t in targets.items() if isinstance(t, Nf4) for suffix, part in NF4_PARTS}
    with_state = {n[:-len(NF4_STATE)] for n in names if n.endswith(NF4_STATE)}  # weights stored as packed NF4
    stored_nf4 = set()  # NF4 weights read as stored (their parts then required)
    seen, unexpected = set(), []
    for name, get, src in named:
        if name in nf4_parts:
            w, part = nf4_parts[name]
            _load_nf4_part(targets[w], part, _get(get, src, name), src, name)
            seen.add(name)
            continue
        dst = targets.get(name)
        if dst is None:
            if not (name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings)):
                unexpected.append(name)
            continue
        t = _get(get, src, name)
        if isinstance(dst, Nf4):
            if _load_nf4(dst, t, dtype, src, name, name in with_state):
                stored_nf4.add(name)
            seen.add(name)
            continue
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
    missing += [n for n, (w, _) in nf4_parts.items() if w in stored_nf4 and n not in seen]
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


def _get(get, src, name):
    try:
        return get()
    except Exception as e:
        raise ModelLoadError(f"{src}: tensor {name} could not be read ({e}); the file may be "
                             "truncated: download it again") from e


def _load_nf4(q: Nf4, t, dtype, src, name, packed=False):
    """Fill NF4 weight q from checkpoint tensor t: bitsandbytes' packed bytes (True: its parts must
    follow), or a float weight (O, K), cast to the model dtype and quantised here (False). packed: t
    has a quant state beside it, so it is the packed bytes in whatever dtype it is stored as
    (bnb_4bit_quant_storage, bfloat16 in FSDP-QLoRA's checkpoints: (O*K/4, 1))."""
    O, K = q.shape
    if packed and t.dtype != torch.uint8:
        if t.numel() * t.element_size() != O * K // 2:
            raise ModelLoadError(f"{src}: tensor {name} is {t.dtype} {tuple(t.shape)} beside an NF4 quant state, not "
                                 f"the {O * K // 2} packed bytes of ({O}, {K}) in a bnb_4bit_quant_storage dtype: "
                                 "the weights do not match the config")
        t = t.reshape(-1).view(torch.uint8)  # the packed bytes as stored (bnb_4bit_quant_storage)
    if t.dtype == torch.uint8:
        if t.numel() != O * K // 2:
            raise ModelLoadError(f"{src}: tensor {name} holds {t.numel()} packed bytes, but config.json implies "
                                 f"({O}, {K}) = {O * K // 2}: the weights do not match the config")
        q.packed.copy_(t.reshape(O, K // 2))
        return True
    if tuple(t.shape) != (O, K):
        raise ModelLoadError(f"{src}: tensor {name} has shape {tuple(t.shape)}, but config.json implies "
                             f"{(O, K)}: the weights do not match the config")
    w = torch.empty((O, K), dtype=dtype, device=q.packed.device)  # (O, K): the weight in the model dtype, once
    w.copy_(t)
    nf4_quantize(q, w)
    return False


def _load_nf4_part(q: Nf4, part, t, src, name):
    """One bitsandbytes quant-state part of q (see models/weights.py for the names)."""
    O, K = q.shape
    if part == "state":
        st = _quant_state(t, src, name)
        want = dict(quant_type="nf4", blocksize=q.blocksize, shape=[O, K], nested_blocksize=256)
        bad = {k: st.get(k) for k, v in want.items() if st.get(k) != v}
        if bad or "nested_offset" not in st:
            raise ModelLoadError(f"{src}: {name} describes {bad or 'no nested_offset'}, expected {want} with "
                                 "double quantisation: the weights do not match the config, or lean does not "
                                 "read this bitsandbytes layout; load the bf16 model with --load-in-4bit")
        q.offset.copy_(torch.tensor([float(st["nested_offset"])], dtype=torch.float32))
        return
    dst = getattr(q, part)
    if t.dtype != dst.dtype or t.numel() != dst.numel():
        raise ModelLoadError(f"{src}: tensor {name} is {t.dtype} with {t.numel()} values, expected {dst.dtype} "
                             f"with {dst.numel()} (NF4 blocks of {q.blocksize} over ({O}, {K}), double "
                             "quantisation): the weights do not match the config")
    dst.copy_(t.reshape(dst.shape))
