"""Fold a LoRA adapter into the frozen weights and write an HF folder transformers loads.

    W' = W + scale * B A          for every adapted projection (O, K) = (O, R) @ (R, K)
    W'[e] = W[e] + scale * B[e] A[e]   for each expert e of an adapted MoE expert weight (E, O, K)

Experts held in MXFP4 (GPT-OSS's hub checkpoints) are dequantised and written in the merge's dtype
(bf16 by default) under the bf16 checkpoint's names, and config.json loses its quantization_config:
a merged MXFP4 model is a bf16 model (about 3x the experts' bytes), as PEFT's merge makes it.

The product runs in fp32 (the master A and B, W upcast) through lean's matmul kernel on a GPU and
numpy on the host (as gguf_source.py's; the interpreter would take minutes), then each tensor is
cast to `dtype` and written under its HF name. config.json and the tokenizer files are
copied from the model's folder, config.json with its dtype set to the merge's (what transformers
5 loads the folder in by default). The folder is written as out_dir.tmp-<pid> and renamed into
place, so a crash never leaves a half-written merge under the final name; an existing out_dir is
replaced only with overwrite=True, and never when it is the model's own folder.
Caution: holds every merged tensor on the host until the write (fine for the models lean trains
on one GPU; a streaming writer is the fix for larger ones).
"""
import json
import os
import shutil
from pathlib import Path

import torch

from ..kernels.gemm import matmul

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def merged_tensors(model, lora, dtype):
    """{HF name: host tensor} of the model with the adapter folded in (MXFP4 experts dequantised)."""
    from ..models.weights import layer_fields

    adapted = {}
    lora.sync()  # host state (runtime/host_state.py): the master weights are on the host, complete
    for li in range(model.config.n_layers):
        suffix = {f: s for f, s, _ in layer_fields(model.config, li, dequantised=True)}
        for t, ad in lora.layers[li].items():
            adapted[f"model.layers.{li}.{suffix[t]}"] = ad
    out = {}
    for name, w in model.hf_tensors(dequantised=True):
        ad = adapted.get(name)
        if ad is not None:
            w32 = torch.empty(w.shape, dtype=torch.float32, device=w.device)  # (O, K) or (E, O, K)
            w32.copy_(w)
            scale = ad.scale if ad.scale is not None else lora.scale
            swap = w.dim() == 3 and model.config.expert_bias  # GPT-OSS stores W_e (in, out): += scale (B A)^T
            a_, b_ = ad.a.to(w.device), ad.b.to(w.device)  # host state: copies on the GPU
            for we, b, a in zip(*((w32, b_, a_) if w.dim() == 3 else ([w32], [b_], [a_]))):
                if w.device.type == "cpu":  # the host: numpy's fp32 product, as gguf_source.py's (the
                    b, a = b.float().numpy(), a.float().numpy()  # interpreter ran a 135M merge in 12 min)
                    we.numpy()[...] += scale * ((b @ a).T if swap else b @ a)
                elif swap:
                    matmul(we, a.t(), b.t(), accumulate=True, alpha=scale)
                else:
                    matmul(we, b, a, accumulate=True, alpha=scale)  # W += scale * B A (per expert)
            w = w32
        out[name] = w.to(device="cpu", dtype=dtype).contiguous()  # sync: merge is a save point
    return out


def merge_and_save(model, lora, out_dir, *, dtype="bfloat16", src_dir=None, overwrite=False):
    """Write model + adapter, merged, as an HF folder at out_dir; returns its path."""
    from .lora import save_tensors

    if dtype not in DTYPES:
        raise ValueError(f"merge dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    src = Path(os.path.expanduser(str(src_dir or model.path)))
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src} has no config.json to copy: pass src_dir=, the model's HF folder")
    out = Path(os.path.expanduser(str(out_dir)))
    if out.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents):
        raise ValueError(f"merge into {out}: it holds the model's own folder {src}; write the merge elsewhere")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"merge into {out}: the folder exists and is not empty; pick a new folder "
                         "(or pass overwrite=True to replace it)")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_tensors(merged_tensors(model, lora, DTYPES[dtype]), tmp / "model.safetensors", {"format": "pt"})
        for name in COPIED:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
        config = json.loads((tmp / "config.json").read_text())
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
            config[key] = dtype
        config.pop("quantization_config", None)  # MXFP4 experts were dequantised above
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
