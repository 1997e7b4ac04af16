"""LoRA adapters in one flat buffer, saved and loaded in PEFT's layout.

Shape legend: R rank, C hidden, F MLP hidden, Oq = H*D, Okv = KVH*D.

For every layer and every target projection W (out, in): A (R, in), B (out, R), and the layer
computes y = x W^T + scale * (drop(x) A^T) B^T with scale = alpha / R (alpha / sqrt(R) with rsLoRA).

Mixture-of-Experts layers (Qwen3-MoE) adapt their experts as PEFT 0.21 does on transformers 5
(`target_parameters` on the fused expert weights; the router stays frozen). Targets gate or up adapt
gate_up (E, 2Fe, C), down adapts down_e (E, C, Fe), one A and B per expert:
    gate_up  A (E, 2R, C), B (E, 2Fe, 2R)   PEFT's rank_pattern/alpha_pattern give it rank 2R, alpha 2*alpha
    down_e   A (E, R, Fe), B (E, C, R)
and y_e = x W_e^T + scale * (x A_e^T) B_e^T. PEFT stores A as (E*R, in), expert-major (a view of
ours), and B as (out, R*E), rank-major with the expert fastest: B_peft.view(out, R, E)[o, r, e] =
B[e, o, r], so B is permuted on save and load. PEFT gives a dense-MLP layer of an MoE model (one in
mlp_only_layers) no adapter when asked for gate/up/down (it maps those names onto the experts), and so
does lean: adapters load both ways.

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
    C, F, Fe = cfg.hidden, cfg.intermediate, cfg.moe_intermediate
    return {"q": (cfg.q_dim, C), "k": (cfg.kv_dim, C), "v": (cfg.kv_dim, C), "o": (C, cfg.q_dim),
            "gate": (F, C), "up": (F, C), "down": (C, F), "gate_up": (2 * Fe, C), "down_e": (C, Fe)}[t]


EXPERT_TARGETS = ("gate_up", "down_e")  # the adapters of an MoE layer's experts


def layer_targets(cfg, li, targets):
    """The adapters of layer li for the user's targets: an MoE layer's gate/up/down are its experts'."""
    if not cfg.is_moe(li):
        return tuple(t for t in targets if not (cfg.n_experts and t in ("gate", "up", "down")))
    out = [t for t in targets if t in ("q", "k", "v", "o")]
    if "gate" in targets or "up" in targets:
        out.append("gate_up")
    if "down" in targets:
        out.append("down_e")
    return tuple(out)


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
    """The views of one target projection's A and B in every flat buffer (an MoE layer's expert
    adapters: (E, R, in) and (E, out, R), with their own scale)."""

    def __init__(self, a, b, a_lowp, b_lowp, da, db, scale=None):
        self.a, self.b, self.a_lowp, self.b_lowp, self.da, self.db = a, b, a_lowp, b_lowp, da, db
        self.scale = scale


class LoRA:
    def __init__(self, model, r, alpha, targets, dropout=0.0, use_rslora=False, seed=0, host_state=False):
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
        self.layout = []  # (layer, target, offset of A, A's shape, B's shape)
        off = 0
        for i in range(cfg.n_layers):
            for t in layer_targets(cfg, i, self.targets):
                out_f, in_f = _target_shape(cfg, t)
                R = self.r * (2 if t == "gate_up" and not cfg.expert_bias else 1)  # PEFT's Qwen3-MoE pattern
                sa, sb = ((R, in_f), (out_f, R)) if t not in EXPERT_TARGETS else \
                    ((cfg.n_experts, R, in_f), (cfg.n_experts, out_f, R))
                self.layout.append((i, t, off, sa, sb))
                off += _numel(sa) + _numel(sb)
        self.numel = off
        if self.dropout and any(t in EXPERT_TARGETS for _, t, *_ in self.layout):
            raise LoRAError(f"LoRA dropout={dropout} on an MoE model's experts: PEFT does not apply dropout to "
                            "expert weights (target_parameters), and neither does lean; use dropout 0 "
                            "(--dropout 0), or adapt only the attention (--targets q,k,v,o)")
        dev = model.device
        self.host_state = bool(host_state)
        self.ring = None
        if self.host_state:  # master weights and gradients in pinned host memory (runtime/host_state.py)
            from .host_state import GradRing, pinned

            self.params, self.grads = pinned(off), pinned(off)  # (P,) fp32 host
            self.lowp = torch.empty(off, dtype=model.dtype, device=dev)  # (P,) the GPU's copy, also in fp32
            self.ring = GradRing(self.grads, self.layer_spans(), dev)
        else:
            self.params = torch.zeros(off, dtype=torch.float32, device=dev)  # (P,)
            self.grads = torch.zeros(off, dtype=torch.float32, device=dev)  # (P,)
            self.lowp = self.params if model.dtype == torch.float32 else torch.empty(off, dtype=model.dtype, device=dev)
        self.layers = [dict() for _ in range(cfg.n_layers)]
        for i, t, o, sa, sb in self.layout:
            na, nb = _numel(sa), _numel(sb)

            def views(buf, at=o):
                return buf[at:at + na].view(sa), buf[at + na:at + na + nb].view(sb)

            a, b = views(self.params)
            al, bl = views(self.lowp)
            # the gradients: host state, layer i's slot of the ring at the layer's own offsets
            da, db = views(self.ring.slot(i), o - self.ring.spans[i][0]) if self.ring else views(self.grads)
            scale = self.target_scale(t) if t in EXPERT_TARGETS else None
            self.layers[i][t] = Adapter(a, b, al, bl, da, db, scale)

    def layer_spans(self):
        """Per layer, (start, stop) of its adapters in the flat layout (layer-major: contiguous)."""
        spans = [[None, None] for _ in range(self.model_config.n_layers)]
        for i, _, o, sa, sb in self.layout:
            spans[i][0] = o if spans[i][0] is None else spans[i][0]
            spans[i][1] = o + _numel(sa) + _numel(sb)
        ends = [0]
        for sp in spans:  # a layer without adapters: an empty span where the next one starts
            if sp[0] is None:
                sp[0] = sp[1] = ends[-1]
            ends.append(sp[1])
        return [tuple(sp) for sp in spans]

    def target_scale(self, t):
        """alpha / r of target t: gate_up's rank and alpha are both doubled (PEFT's patterns), which
        changes the scale under rsLoRA only."""
        k = 2 if t == "gate_up" and not self.model_config.expert_bias else 1
        return k * self.alpha / (math.sqrt(k * self.r) if self.use_rslora else k * self.r)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def init(cls, model, r=16, alpha=32, targets="all", dropout=0.0, seed=0, use_rslora=False, host_state=False):
        """PEFT's initialisation from a seed: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0. host_state: the
        master weights, gradients and AdamW moments in pinned host memory (runtime/host_state.py)."""
        lora = cls(model, r, alpha, targets, dropout, use_rslora, seed, host_state)
        rng = np.random.default_rng(seed)
        host = np.zeros(lora.numel, dtype=np.float32)
        for _, _, o, sa, _ in lora.layout:
            bound = 1.0 / math.sqrt(sa[-1])  # 1 / sqrt(in)
            host[o:o + _numel(sa)] = rng.uniform(-bound, bound, _numel(sa))
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
        experts = _expert_targets(pc, model.config)  # an MoE model's experts: what PEFT writes for them
        unsupported = [f"{k}={pc[k]!r}" for k in UNSUPPORTED if pc.get(k) not in (None, False, {}, [], "")
                       and not (experts is not None and k in ("target_parameters", "rank_pattern", "alpha_pattern"))]
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
        found = set(experts or ())
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
        if self.ring is not None:  # host state: the backward zeroes each layer's slot (no host memset;
            self.ring.start()     # lora.grads keeps the last backward's values until the next one)
        else:
            self.grads.zero_()

    def sync(self):
        """Host state: wait for the GPU's copies and updates before the host reads params or grads."""
        if self.host_state:
            from .host_state import sync

            sync(self.lowp.device)
            self.ring.pending = False  # the last update is done: the next forward need not wait for it

    def _peft_items(self, buf_name_or_tensor):
        """(PEFT key, view) pairs over a flat buffer laid out like params. An expert B is a
        permuted view (out, R*E) of ours: read it with .contiguous(), write it with copy_."""
        buf = buf_name_or_tensor
        for i, t, o, sa, sb in self.layout:
            na, nb = _numel(sa), _numel(sb)
            a, b = buf[o:o + na].view(sa), buf[o + na:o + na + nb].view(sb)
            if t in EXPERT_TARGETS:  # A (E, R, in) -> (E*R, in); B (E, out, R) -> (out, R, E) -> (out, R*E)
                E, R, in_f = sa
                a, b = a.view(E * R, in_f), _PeftB(b)
            base = f"base_model.model.model.layers.{i}.{self._peft_module(i, t)}"
            yield f"{base}.lora_A.weight", a
            yield f"{base}.lora_B.weight", b

    def _peft_module(self, i, t):
        """PEFT's module path of target t in layer i. PEFT wraps the experts module once per target
        parameter, gate_up first: with both adapted, gate_up's adapter sits one level down."""
        if t not in EXPERT_TARGETS:
            return PEFT_MODULE[t]
        both = "gate_up" in self.layers[i] and "down_e" in self.layers[i]
        return "mlp.experts.base_layer" if t == "gate_up" and both else "mlp.experts"

    def state_dict(self):
        self.sync()
        return {k: _peft_tensor(v) for k, v in self._peft_items(self.params)}

    def grad_state_dict(self):
        """Gradients under PEFT's key names (views into the flat gradient buffer; an expert B a copy)."""
        self.sync()
        return {k: _peft_tensor(v) for k, v in self._peft_items(self.grads)}

    def peft_config(self):
        moe = self.model_config.n_experts > 0
        modules = [t for t in self.targets if not (moe and t in ("gate", "up", "down"))]
        params = ([f"mlp.experts.{p}" for t, p in (("gate_up", "gate_up_proj"), ("down_e", "down_proj"))
                   if any(t == u for _, u, *_ in self.layout)] if moe else None)
        gate_up = moe and params and params[0].endswith("gate_up_proj") and not self.model_config.expert_bias
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model_name,
            "r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "use_rslora": self.use_rslora,
            "target_modules": [PEFT_MODULE[t].split(".")[-1] for t in modules], "bias": "none",
            "target_parameters": params or None,
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None,
            # what PEFT writes for gate_up_proj (two projections in one parameter): rank and alpha doubled
            "rank_pattern": {GATE_UP_PATTERN: 2 * self.r} if gate_up else {},
            "alpha_pattern": {GATE_UP_PATTERN: 2 * self.alpha} if gate_up else {},
        }

    def save(self, adapter_dir):
        """Write adapter_config.json + adapter_model.safetensors atomically (temp file, then rename)."""
        d = Path(adapter_dir)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}  # sync: save point
        _atomic_write(d / ADAPTER_WEIGHTS, lambda p: save_tensors(tensors, p, {"format": "pt"}, d / ADAPTER_WEIGHTS))
        _atomic_write(d / ADAPTER_CONFIG, lambda p: Path(p).write_text(json.dumps(self.peft_config(), indent=2)))


GATE_UP_PATTERN = ".*\\.gate_up_proj"


class _PeftB:
    """An expert B (E, out, R) seen in PEFT's (out, R*E) layout: .shape, .contiguous(), copy_()."""

    def __init__(self, b):
        self.b = b
        E, out_f, R = b.shape
        self.shape = (out_f, R * E)

    def contiguous(self):
        return self.b.permute(1, 2, 0).reshape(self.shape)  # (out, R, E) -> (out, R*E): a copy

    def copy_(self, t):
        E, out_f, R = self.b.shape
        self.b.copy_(t.reshape(out_f, R, E).permute(2, 0, 1))
        return self


def _peft_tensor(v):
    return v.contiguous() if isinstance(v, _PeftB) else v


def _expert_targets(pc, cfg):
    """For an MoE model, the user-level targets ("gate"/"up", "down") an adapter config's
    target_parameters adapt, if its rank and alpha patterns are the ones PEFT writes for them;
    None when the config has no target_parameters (or the model no experts)."""
    params = pc.get("target_parameters") or []
    if not params or not cfg.n_experts:
        return None
    names = {p.split(".")[-1] for p in params}
    if not names <= {"gate_up_proj", "down_proj"}:
        raise LoRAError(f"target_parameters={params!r}: lean adapts an MoE model's mlp.experts.gate_up_proj "
                        "and mlp.experts.down_proj, nothing else")
    r, alpha = pc["r"], float(pc.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    doubled = "gate_up_proj" in names and not cfg.expert_bias  # PEFT's Qwen3-MoE pattern; GPT-OSS: rank r
    patterns = ({GATE_UP_PATTERN: 2 * r}, {GATE_UP_PATTERN: 2 * alpha}) if doubled else ({}, {})
    got = ({k: v for k, v in (pc.get("rank_pattern") or {}).items()},
           {k: float(v) for k, v in (pc.get("alpha_pattern") or {}).items()})
    if got != (patterns[0], {k: float(v) for k, v in patterns[1].items()}):
        raise LoRAError(f"rank_pattern={pc.get('rank_pattern')!r}, alpha_pattern={pc.get('alpha_pattern')!r}: "
                        f"lean gives the experts' gate_up_proj rank {2 * r} and alpha {2 * alpha} (what PEFT "
                        "writes), and every other adapter rank r")
    return (("gate", "up") if "gate_up_proj" in names else ()) + (("down",) if "down_proj" in names else ())


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


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
