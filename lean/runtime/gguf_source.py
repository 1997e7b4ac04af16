"""The merged model's rows, read on demand: what gguf_export.py quantises and writes, one chunk of
rows at a time, so that no tensor (let alone the model) is ever whole in memory.

Shape legend: O / K a weight's output / input dims (HF's (out, in) orientation), E experts, R rank.

    src = Shards(model_dir)                             # the safetensors shards' headers (lazy reads)
    lora = load_adapter(model_dir, adapter_dir)         # the PEFT adapter, validated by lean's loader
    w = merged_rows(src, lora, name, e, idx)            # (len(idx), K) float32 numpy
    w = merged_rows(src, lora, name, e, idx, device=d)  # the same, a torch tensor on device d

merged_rows(src, lora, name, e, idx) = (W[e] (out, in))[idx] + scale * B[e][idx] @ A[e]:
  - W's rows read with pread from the shard (Shards: the byte span of the rows asked for, one
    contiguous span, nothing mapped), in the stored dtype (F32, F16, BF16), widened to fp32;
  - GPT-OSS's bf16 experts, stored (E, in, out), are read one expert at a time and transposed;
    its MXFP4 experts (*_blocks, *_scales; Wd (E, out, in), 32-value blocks along in) are decoded
    exactly (mxfp4_rows: e2m1 value * 2^(s-127), exact in fp32, as kernels/mxfp4.py);
  - the hub's per-expert Qwen3-MoE tensors (mlp.experts.{e}.gate_proj.weight ...) stand in for the
    fused ones (rows [0, Fe) of gate_up from gate_proj, [Fe, 2Fe) from up_proj);
  - the LoRA product is added in fp32: numpy on the host (device None), or lean's matmul kernel
    (W += scale * B A, kernels/gemm.py, as merge.py) on a torch device, where the rows then stay (a
    torch fp32 tensor there: the export quantises them there, or copies them back). A plain stored
    weight goes there as stored (Shards.rows_on: read into pinned host memory on a GPU, copied over
    asynchronously, widened there: bf16 moves half the bytes of its fp32); the others are decoded on
    the host and copied over.
The adapter is read by lean's own PEFT loader (LoRA.load) onto a stand-in model that holds the
config only (no weights): the same checks as training's (shapes, ranks, targets, patterns).
Tested: tests/test_gguf_export.py (merged rows against W + scale B A in torch on every architecture,
the matmul path against numpy, MXFP4 against kernels/mxfp4.py's reference).
"""
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .gguf import GGUFError

# Triton launches from the export's worker threads (gguf_write.py), one thread at a time: Triton's
# runtime does not guard its compile and caches against threads. A launch only enqueues.
LAUNCH = threading.Lock()
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "I8": np.int8}
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8, "I8": torch.int8}


class Shards:
    """The tensors of a model folder's safetensors shards, by name, read with pread from their byte
    offsets (safetensors: an 8-byte header length, a JSON header of dtype, shape and data_offsets,
    then the data): only the rows asked for are read, into fresh arrays, and nothing stays mapped or
    cached (a mapped file's touched pages would count in the process's memory until it closes)."""

    def __init__(self, model_dir):
        from .loader import shard_files

        self.dir = Path(model_dir)
        self.meta = {}  # name -> (file, numpy dtype, shape, byte offset of the data, safetensors dtype)
        for f in shard_files(self.dir):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                try:
                    header = json.loads(fh.read(n))
                except ValueError as e:
                    raise GGUFError(f"{f} is not a safetensors file ({e}): download the model again") from e
            for name, info in header.items():
                if name != "__metadata__":
                    if info["dtype"] not in _DTYPES:
                        raise GGUFError(f"{f}: tensor {name} is {info['dtype']}; the GGUF export reads "
                                        f"{', '.join(_DTYPES)}: convert the checkpoint to bf16 first")
                    self.meta[name] = (f, _DTYPES[info["dtype"]], tuple(info["shape"]),
                                       8 + n + info["data_offsets"][0], info["dtype"])
        self.nf4 = None  # a QLoRA run's base: Nf4Base, which base_rows reads the projections through

    def __contains__(self, name):
        return name in self.meta

    @property
    def names(self):
        return self.meta.keys()

    def shape(self, name):
        return self.meta[name][2]

    def _span(self, name, lo, hi, e):
        """(file, byte offset, byte count, shape of a row) of rows lo..hi (of expert e) of `name`."""
        f, dtype, shape, offset, _ = self.meta[name]
        inner = shape[2:] if e is not None else shape[1:]
        row = int(np.prod(inner, dtype=np.int64)) * np.dtype(dtype).itemsize
        return f, offset + ((e * shape[1] if e is not None else 0) + lo) * row, (hi - lo) * row, inner

    def raw(self, name, lo, hi, e=None) -> np.ndarray:
        """Rows lo..hi along dim 0 (or dim 1 of expert e) of `name`, in the stored dtype."""
        f, start, size, inner = self._span(name, lo, hi, e)
        with open(f, "rb") as fh:
            data = os.pread(fh.fileno(), size, start)
        if len(data) != size:
            raise GGUFError(f"{f} is truncated (tensor {name}): download the model again")
        return np.frombuffer(data, dtype=self.meta[name][1]).reshape(hi - lo, *inner)

    def rows_on(self, device, name, lo, hi, e=None) -> torch.Tensor:
        """rows() as an fp32 tensor on torch `device`: the stored bytes read straight into host memory
        (pinned on a GPU: the copy over is asynchronous, on the current stream), widened there."""
        f, start, size, inner = self._span(name, lo, hi, e)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        with open(f, "rb") as fh:
            got = os.preadv(fh.fileno(), [host.numpy()], start)
        if got != size:
            raise GGUFError(f"{f} is truncated (tensor {name}): download the model again")
        stored = host.to(device, non_blocking=True).view(_TORCH[self.meta[name][4]])
        return stored.reshape(hi - lo, *inner).float()

    def rows(self, name, lo, hi, e=None) -> np.ndarray:
        """Rows lo..hi of tensor `name` (of expert e), fp32."""
        x = self.raw(name, lo, hi, e)
        if self.meta[name][4] == "BF16":  # the high half of an fp32 (one new array, shifted in place)
            y = x.astype(np.uint32)
            y <<= 16
            return y.view(np.float32)
        return x.astype(np.float32)


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(n, G, 16) uint8 e2m1 pairs (value 2i low nibble) and (n, G) e8m0 scales -> (n, 32 G) fp32."""
    vals = np.stack([_E2M1[blocks & 15], _E2M1[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    return np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(blocks.shape[0], -1)


def base_rows(src: Shards, name: str, e, idx: np.ndarray, transposed: bool, fe: int = 0) -> np.ndarray:
    """W[e][idx] in (out, in) orientation, fp32 (idx: sorted up to one permutation within its span)."""
    lo, hi = int(idx.min()), int(idx.max()) + 1
    if src.nf4 is not None and name in src.nf4.names:
        return src.nf4.weight(src, name)[idx]
    if name in src:
        if transposed:  # (E, in, out): the expert whole, transposed
            w = src.rows(name, 0, src.shape(name)[1], e).T
            return np.ascontiguousarray(w[idx])
        return src.rows(name, lo, hi, e)[idx - lo]
    if name + "_blocks" in src:  # MXFP4: Wd (E, out, in)
        return mxfp4_rows(src.raw(name + "_blocks", lo, hi, e), src.raw(name + "_scales", lo, hi, e))[idx - lo]
    pre, _, kind = name.rpartition(".")  # the hub's per-expert Qwen3-MoE tensors
    if kind == "gate_up_proj":
        part, lo, hi = ("gate_proj", lo, hi) if hi <= fe else ("up_proj", lo - fe, hi - fe)
        return src.rows(f"{pre}.{e}.{part}.weight", lo, hi)[idx - idx.min()]
    return src.rows(f"{pre}.{e}.{kind}.weight", lo, hi)[idx - lo]


class Nf4Base:
    """The base weights a QLoRA run trained on (quant "nf4"): each of the seven projections cast to the
    run's dtype, quantised to NF4 with double quantisation and dequantised to fp32 by lean's kernels
    (kernels/nf4.py, on `device`; the interpreter's on the CPU), as the loader and merge.py make them.
    NF4's nested absmax offset is the mean over the whole tensor: a projection is quantised whole, and
    kept until the next one is asked for."""

    def __init__(self, cfg, dtype, device):
        import dataclasses

        from ..models.weights import nf4_projections

        qcfg = dataclasses.replace(cfg, weight_quant="nf4")
        self.names = {f"{m}.weight" for li in range(cfg.n_layers) for _, m, _ in nf4_projections(qcfg, li)}
        self.block, self.dtype, self.device = qcfg.quant_block, dtype, torch.device(device)
        self.name, self.w = None, None

    def weight(self, src, name) -> np.ndarray:
        from ..kernels.nf4 import empty_nf4, nf4_quantize

        with LAUNCH:  # the export's workers ask from several threads
            if name != self.name:
                self.name, self.w = None, None  # the last one goes before the next is made
                w = src.rows(name, 0, src.shape(name)[0])  # (O, K) fp32, then in the run's dtype
                t = torch.from_numpy(w).to(device=self.device, dtype=self.dtype)
                q = empty_nf4(*t.shape, self.device, self.block)
                nf4_quantize(q, t)
                self.name, self.w = name, q.dense().cpu().numpy()  # sync: the dequantised base goes to the host
            return self.w


def merged_rows(src: Shards, lora, name, e, idx, transposed=False, fe=0, device=None):
    """(W[e] + scale * B[e] A[e])[idx] in fp32: the rows of a merged weight (see the module docstring),
    numpy on the host (device None) or a torch tensor on `device`. lora: None or (a, b, scale) with
    a (R, K) / (E, R, K), b (O, R) / (E, O, R) host or device tensors."""
    if device is None:
        w = base_rows(src, name, e, idx, transposed, fe)
        if lora is not None:
            a, b, scale = lora
            if e is not None:
                a, b = a[e], b[e]
            w += (np.float32(scale) * b.numpy()[idx]) @ a.numpy()  # the scale on B's n x R rows, not on n x K
        return w
    device = torch.device(device)
    plain = name in src and not transposed and (src.nf4 is None or name not in src.nf4.names)
    if plain:  # the stored rows go over as they are
        lo = int(idx.min())
        w = src.rows_on(device, name, lo, int(idx.max()) + 1, e)[torch.from_numpy(idx - lo).to(device)]  # (n, K)
    else:
        w = torch.from_numpy(base_rows(src, name, e, idx, transposed, fe)).to(device)
    if lora is not None:
        fold_lora(w, lora, e, idx)
    return w


def fold_lora(w: torch.Tensor, lora, e, idx):
    """w (n, K) fp32 on a device += scale * B[e][idx] A[e], by lean's matmul kernel there (in place)."""
    from ..kernels.gemm import matmul

    a, b, scale = lora
    if e is not None:
        a, b = a[e], b[e]
    matmul(w, b[torch.from_numpy(idx).to(b.device)].contiguous(), a, accumulate=True, alpha=scale)


def load_adapter(model_dir, adapter_dir, device="cpu"):
    """{HF weight name: (a, b, scale)} of a PEFT adapter for the model in model_dir (fp32, on
    `device`), loaded and checked by lean's LoRA.load; GGUFError when it does not fit the model."""
    from ..models.weights import layer_fields
    from .loader import read_config
    from .lora import ADAPTER_CONFIG, LoRA, LoRAError

    cfg = read_config(Path(model_dir))
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise GGUFError(f"{adapter_dir} holds no adapter ({ADAPTER_CONFIG} is missing): export a run that has "
                        "finished (its adapter/ folder), or the base model without --adapter")
    stand_in = SimpleNamespace(config=cfg, path=str(model_dir), device=torch.device(device), dtype=torch.float32)
    try:
        lora = LoRA.load(stand_in, adapter_dir)
    except LoRAError as e:
        raise GGUFError(str(e)) from None
    out = {}
    for li in range(cfg.n_layers):
        suffix = {f: s for f, s, _ in layer_fields(cfg, li, dequantised=True)}
        for t, ad in lora.layers[li].items():
            scale = ad.scale if ad.scale is not None else lora.scale
            out[f"model.layers.{li}.{suffix[t]}"] = (ad.a, ad.b, scale)
    return out, lora


def adapter_alpha(adapter_dir) -> float:
    """lora_alpha of a PEFT adapter config (llama.cpp scales by alpha / rank, rank read from A)."""
    return float(json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("lora_alpha", 8))
