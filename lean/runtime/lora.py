"""LoRA adapters in one flat buffer, saved and loaded in PEFT's layout.

Shape legend: R rank, C hidden, F MLP hidden, Oq = H*D, Okv = KVH*D.

For every layer and every target projection W (out, in): A (R, in), B (out, R), and the layer
computes y = x W^T + scale * (drop(x) A^T) B^T with scale = alpha / R (alpha / sqrt(R) with rsLoRA).

Buffers (all flat, all views share one layout: layer-major, then target order, A before B):
  params  (P,) fp32   master weights: what AdamW updates and what is saved
  lowp    (P,) dtype  the compute copy the kernels read (the same tensor as params in fp32)
  grads   (P,) fp32   gradients, accumulated with += by the step; zero_grad() clears them
Initialisation follows PEFT: A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0,
drawn on the host from `seed`.
"""
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_MODULE = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
ALIASES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
           "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# adapter_config.json fields that change what the adapter computes beyond one rank on every layer's
# seven projections: lean refuses an adapter that sets any of them rather than apply it wrongly
UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform",
               "layer_replication", "lora_bias", "trainable_token_indices", "alora_invocation_tokens",
               "target_parameters", "use_qalora")
# (target_modules and exclude_modules need no check: the tensors say what is adapted, and an
# adapter with weights beyond the seven projections, lm_head say, is refused for them below)
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoRAError(ValueError):
    pass


def _target_shape(cfg, t):
    """(out, in) of target projection t."""
    C, F = cfg.hidden, cfg.intermediate
    return {"q": (cfg.q_dim, C), "k": (cfg.kv_dim, C), "v": (cfg.kv_dim, C), "o": (C, cfg.q_dim),
            "gate": (F, C), "up": (F, C), "down": (C, F)}[t]


def _normalise_targets(targets):
    if targets in (None, "all", "all-linear"):
        return TARGETS
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not targets:
        raise LoRAError(f"no LoRA target: name at least one of {', '.join(TARGETS)}, or 'all'")
    out = []
    for t in targets:
        t = ALIASES.get(t, t)
        if t not in TARGETS:
            raise LoRAError(f"unknown LoRA target {t!r}: choose from {', '.join(TARGETS)} "
                            f"(or their HF names {', '.join(ALIASES)})")
        if t not in out:
            out.append(t)
    return tuple(t for t in TARGETS if t in out)


class Adapter:
    """The views of one target projection's A and B in every flat buffer."""

    def __init__(self, a, b, a_lowp, b_lowp, da, db):
        self.a, self.b, self.a_lowp, self.b_lowp, self.da, self.db = a, b, a_lowp, b_lowp, da, db


class LoRA:
    def __init__(self, model, r, alpha, targets, dropout=0.0, use_rslora=False, seed=0):
        if r < 1 or r != int(r):
            raise LoRAError(f"LoRA rank r={r}: must be an integer >= 1")
        if not alpha > 0:
            raise LoRAError(f"LoRA alpha={alpha}: must be > 0 (the update is scaled by alpha / r)")
        if not 0.0 <= dropout < 1.0:
            raise LoRAError(f"LoRA dropout={dropout}: must be in [0, 1)")
        cfg = model.config
        self.model_config = cfg
        self.r, self.alpha, self.dropout, self.use_rslora = int(r), float(alpha), float(dropout), bool(use_rslora)
        self.targets = _normalise_targets(targets)
        self.scale = self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
        self.seed = int(seed)
        self.steps = 0  # forward_backward calls so far: each draws a fresh dropout seed
        self.base_model_name = model.path
        self.layout = []  # (layer, target, offset of A, (out, in))
        off = 0
        for i in range(cfg.n_layers):
            for t in self.targets:
                out_f, in_f = _target_shape(cfg, t)
                self.layout.append((i, t, off, (out_f, in_f)))
                off += self.r * in_f + out_f * self.r
        self.numel = off
        dev = model.device
        self.params = torch.zeros(off, dtype=torch.float32, device=dev)  # (P,)
        self.grads = torch.zeros(off, dtype=torch.float32, device=dev)  # (P,)
        self.lowp = self.params if model.dtype == torch.float32 else torch.empty(off, dtype=model.dtype, device=dev)
        self.layers = [dict() for _ in range(cfg.n_layers)]
        R = self.r
        for i, t, o, (out_f, in_f) in self.layout:
            na, nb = R * in_f, out_f * R

            def views(buf):
                return buf[o:o + na].view(R, in_f), buf[o + na:o + na + nb].view(out_f, R)

            a, b = views(self.params)
            al, bl = views(self.lowp)
            da, db = views(self.grads)
            self.layers[i][t] = Adapter(a, b, al, bl, da, db)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def init(cls, model, r=16, alpha=32, targets="all", dropout=0.0, seed=0, use_rslora=False):
        """PEFT's initialisation from a seed: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0."""
        lora = cls(model, r, alpha, targets, dropout, use_rslora, seed)
        rng = np.random.default_rng(seed)
        host = np.zeros(lora.numel, dtype=np.float32)
        for _, _, o, (out_f, in_f) in lora.layout:
            bound = 1.0 / math.sqrt(in_f)
            host[o:o + lora.r * in_f] = rng.uniform(-bound, bound, lora.r * in_f)
        lora.params.copy_(torch.from_numpy(host))
        lora.sync_lowp()
        return lora

    @classmethod
    def load(cls, model, adapter_dir):
        """Load a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import load_file

        d = Path(adapter_dir)
        cfg_path, w_path = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
        if not cfg_path.exists() or not w_path.exists():
            raise LoRAError(f"{d} is not a PEFT LoRA adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        try:
            pc = json.loads(cfg_path.read_text())
            if not isinstance(pc, dict) or "r" not in pc:
                raise ValueError("no 'r' (the rank)")
        except ValueError as e:
            raise LoRAError(f"{cfg_path} is not a PEFT adapter config ({e}): save the adapter again") from e
        if pc.get("peft_type", "LORA") != "LORA":
            raise LoRAError(f"{cfg_path}: peft_type={pc.get('peft_type')!r}; lean loads LORA adapters only")
        unsupported = [f"{k}={pc[k]!r}" for k in UNSUPPORTED if pc.get(k) not in (None, False, {}, [], "")]
        if pc.get("bias", "none") != "none":
            unsupported.append(f"bias={pc['bias']!r}")
        if unsupported:
            raise LoRAError(f"{cfg_path}: {', '.join(unsupported)}: lean applies one rank to the q/k/v/o/gate/"
                            "up/down projections of the layers, nothing else; merge this adapter with PEFT "
                            "(merge_and_unload) and load the merged model, or train one without these")
        try:
            tensors = load_file(str(w_path))
        except Exception as e:
            raise LoRAError(f"{w_path} is not a readable safetensors file ({e}): save the adapter again") from e
        found = set()
        for k in tensors:
            for t, mod in PEFT_MODULE.items():
                if f".{mod}.lora_" in k:
                    found.add(t)
        if not found:
            raise LoRAError(f"{w_path} holds no LoRA weights for q/k/v/o/gate/up/down projections")
        lora = cls(model, pc["r"], float(pc.get("lora_alpha", PEFT_DEFAULT_ALPHA)), sorted(found, key=TARGETS.index),
                   float(pc.get("lora_dropout", 0.0)), bool(pc.get("use_rslora", False)))
        lora.base_model_name = pc.get("base_model_name_or_path") or model.path
        base = pc.get("base_model_name_or_path") or "not recorded"
        expected = dict(lora._peft_items(lora.params))
        keys = {k: _key(tensors, k) for k in expected}
        missing = [k for k, key in keys.items() if key is None]
        if missing:
            raise LoRAError(f"{w_path}: missing {len(missing)} LoRA tensor(s), e.g. {missing[:3]}: the adapter "
                            f"covers fewer layers or modules than this {model.config.n_layers}-layer model (its "
                            f"base model: {base}); load it with the model it was trained on")
        extra = sorted(set(tensors) - set(keys.values()))
        if extra:
            raise LoRAError(f"{w_path}: {len(extra)} tensor(s) lean would not apply, e.g. {extra[:3]}: the adapter "
                            f"was made for a deeper or other model (its base model: {base}) or holds weights "
                            "beyond LoRA A/B; load it with the model it was trained on")
        for k, view in expected.items():
            t = tensors[keys[k]]
            if tuple(t.shape) != tuple(view.shape):
                raise LoRAError(f"{w_path}: {k} has shape {tuple(t.shape)}, expected {tuple(view.shape)} "
                                "(an adapter for another model or rank?)")
            view.copy_(t)
        lora.sync_lowp()
        return lora

    # ---- state ----------------------------------------------------------------------------------
    def sync_lowp(self):
        """Refresh the compute copy from the fp32 master weights (a cast copy)."""
        if self.lowp is not self.params:
            self.lowp.copy_(self.params)

    def next_seed(self):
        """The dropout seed of the next forward_backward (a host int; saved with a checkpoint)."""
        self.steps += 1
        return (self.seed * 7919 + self.steps) % (2**31 - 1)

    def zero_grad(self):
        self.grads.zero_()

    def _peft_items(self, buf_name_or_tensor):
        """(PEFT key, view) pairs over a flat buffer laid out like params."""
        buf = buf_name_or_tensor
        R = self.r
        for i, t, o, (out_f, in_f) in self.layout:
            na, nb = R * in_f, out_f * R
            base = f"base_model.model.model.layers.{i}.{PEFT_MODULE[t]}"
            yield f"{base}.lora_A.weight", buf[o:o + na].view(R, in_f)
            yield f"{base}.lora_B.weight", buf[o + na:o + na + nb].view(out_f, R)

    def state_dict(self):
        return dict(self._peft_items(self.params))

    def grad_state_dict(self):
        """Gradients under PEFT's key names (views into the flat gradient buffer)."""
        return dict(self._peft_items(self.grads))

    def peft_config(self):
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model_name,
            "r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "use_rslora": self.use_rslora,
            "target_modules": [PEFT_MODULE[t].split(".")[-1] for t in self.targets], "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_dora": False,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        }

    def save(self, adapter_dir):
        """Write adapter_config.json + adapter_model.safetensors atomically (temp file, then rename)."""
        d = Path(adapter_dir)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}  # sync: save point
        _atomic_write(d / ADAPTER_WEIGHTS, lambda p: save_tensors(tensors, p, {"format": "pt"}, d / ADAPTER_WEIGHTS))
        _atomic_write(d / ADAPTER_CONFIG, lambda p: Path(p).write_text(json.dumps(self.peft_config(), indent=2)))


def _key(tensors, key):
    """The key under which tensors holds `key`: PEFT keys may carry the adapter name
    ('.lora_A.default.weight') in some versions; None when it is not there."""
    if key in tensors:
        return key
    alt = key.replace(".weight", ".default.weight")
    return alt if alt in tensors else None


def save_tensors(tensors, path, metadata=None, shown=None):
    """safetensors' save_file, its I/O failures (a full disk, say) raised as the OSError they are,
    naming `shown` (default: path): safetensors raises its own SafetensorError, which is no
    OSError and carries no errno, so lean-train's one-line error for the run's files missed it."""
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        n = int(m.group(1))
        raise OSError(n, os.strerror(n), str(shown or path)) from e


def _atomic_write(path, write):
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
