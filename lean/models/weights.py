"""Frozen weights held as flat tensors: one contiguous buffer per layer, fields are views into it.

Shape legend: C hidden, H/KVH heads, D head dim, F MLP hidden, V vocab; for a Mixture-of-Experts
layer E experts and Fe = moe_intermediate, one expert's MLP width.

The HF-name map is explicit (gpt-fast style): every tensor a checkpoint must hold is listed here
with its shape, and the loader refuses anything missing, unexpected or mis-shaped.

A Mixture-of-Experts layer (Qwen3-MoE) holds each kind of expert weight as one (E, ...) view of the
layer's buffer, in the layout transformers 5 writes (transformers 5.24 on the CPU:
Qwen3MoeExperts.gate_up_proj (E, 2Fe, C), gate rows first, `gate, up =
linear(x, gate_up_proj[e]).chunk(2, dim=-1)`; down_proj (E, C, Fe); transformers 5.17's on the
device, through tests/test_moe_gpu.py, which loads HF's own state dict and matches its step):

    router      mlp.gate.weight               (E, C)
    gate_up     mlp.experts.gate_up_proj      (E, 2Fe, C)   [e, :Fe] gate, [e, Fe:] up
    down_e      mlp.experts.down_proj         (E, C, Fe)

The hub's checkpoints (transformers 4 layout) hold one tensor per expert instead, and load into the
same views (expert_aliases):

    mlp.experts.{e}.gate_proj.weight (Fe, C) -> gate_up[e, :Fe]
    mlp.experts.{e}.up_proj.weight   (Fe, C) -> gate_up[e, Fe:]
    mlp.experts.{e}.down_proj.weight (C, Fe) -> down_e[e]

GPT-OSS's hub checkpoints hold the experts in MXFP4 (kernels/mxfp4.py; G = C/32, Gf = Fe/32). They
stay so (cfg.expert_quant == "mxfp4", set by the loader from the tensors it finds): the four uint8
tensors live in the layer's second flat buffer `qbuf`, and gate_up / down_e are Mxfp4 pairs whose
dequantised weight Wd is (E, out, in), the transpose of the bf16 layout, which is gmm's weight as is:

    gate_up_blocks  mlp.experts.gate_up_proj_blocks  (E, 2Fe, G, 16)  Wd (E, 2Fe, C)
    gate_up_scales  mlp.experts.gate_up_proj_scales  (E, 2Fe, G)
    down_blocks     mlp.experts.down_proj_blocks     (E, C, Gf, 16)   Wd (E, C, Fe)
    down_scales     mlp.experts.down_proj_scales     (E, C, Gf)

(gpt-oss-20b: 0.42 GB a layer instead of 1.6 GB in bf16.)

4-bit base weights (cfg.weight_quant == "nf4", QLoRA): each of a layer's seven projections (an MoE
layer's q, k, v, o) is an Nf4 (kernels/nf4.py) whose parts are views of `qbuf`, each part's start
aligned to 16 bytes (its fp32 parts are uint8 bytes viewed as fp32). A pre-quantised checkpoint
(bitsandbytes' 4-bit layout, as the hub's *-bnb-4bit uploads hold it) names them:

    packed   self_attn.q_proj.weight                              (O*K/2, 1) uint8 -> (O, K/2)
             (or the same bytes in a bnb_4bit_quant_storage dtype: bf16 (O*K/4, 1), as FSDP-QLoRA saves)
    absmax   self_attn.q_proj.weight.absmax                       (nb,) uint8
    absmax2  self_attn.q_proj.weight.nested_absmax                (nb2,) fp32
    code2    self_attn.q_proj.weight.nested_quant_map             (256,) fp32
    code     self_attn.q_proj.weight.quant_map                    (16,) fp32
    offset   self_attn.q_proj.weight.quant_state.bitsandbytes__nf4   uint8 bytes of a JSON object:
             quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset
A bf16 checkpoint loaded with quant="nf4" is quantised as it loads (runtime/loader.py).
(Qwen3-8B: 3.58 GB for its 36 layers' projections against 13.9 GB in bf16.)
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..kernels.nf4 import Nf4, nf4_sizes
from .config import ModelConfig

PROJECTIONS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
               ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
               ("down", "mlp.down_proj"))


class Mxfp4(NamedTuple):
    """An expert weight held in MXFP4: Wd (E, A, Bd) = dequant(blocks, scales), blocks along Bd."""
    blocks: torch.Tensor  # (E, A, Bd/32, 16) uint8
    scales: torch.Tensor  # (E, A, Bd/32) uint8

    @property
    def shape(self):
        E, A, G, _ = self.blocks.shape
        return (E, A, G * 32)

    def dense(self, dtype=torch.float32):
        """Wd (E, A, Bd) in dtype, dequantised on the weights' device (a new tensor)."""
        from ..kernels.mxfp4 import mxfp4_dequant

        out = torch.empty(self.shape, dtype=dtype, device=self.blocks.device)
        mxfp4_dequant(out, self.blocks, self.scales)
        return out


def random_mxfp4_(t, name, generator):
    """Fill a uint8 MXFP4 tensor of a random-init model in place: uniform nibbles, and block scales
    2^-8 .. 2^-6, so that the weights' spread is about a random bf16 init's (std ~0.02)."""
    if name.endswith("_blocks"):
        t.random_(0, 256, generator=generator)
    else:
        t.random_(127 - 8, 127 - 5, generator=generator)


def quant_fields(cfg: ModelConfig, li: int = 0):
    """Ordered (field, HF suffix, shape) of layer li's uint8 MXFP4 tensors (none unless its experts
    are held in MXFP4)."""
    if not (cfg.expert_quant == "mxfp4" and cfg.is_moe(li)):
        return []
    C, Fe, E = cfg.hidden, cfg.moe_intermediate, cfg.n_experts
    return [("gate_up_blocks", "mlp.experts.gate_up_proj_blocks", (E, 2 * Fe, C // 32, 16)),
            ("gate_up_scales", "mlp.experts.gate_up_proj_scales", (E, 2 * Fe, C // 32)),
            ("down_blocks", "mlp.experts.down_proj_blocks", (E, C, Fe // 32, 16)),
            ("down_scales", "mlp.experts.down_proj_scales", (E, C, Fe // 32))]


def nf4_projections(cfg: ModelConfig, li: int = 0):
    """(field, HF module, (O, K)) of layer li's projections held in NF4 (none unless cfg.weight_quant
    is "nf4"): every projection of the layer (an MoE layer's attention ones) but those cfg.quant_dense
    names."""
    if cfg.weight_quant != "nf4":
        return []
    C, F, Oq, Okv = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim
    shapes = {"q": (Oq, C), "k": (Okv, C), "v": (Okv, C), "o": (C, Oq), "gate": (F, C), "up": (F, C), "down": (C, F)}
    moe = cfg.is_moe(li)
    return [(t, f"model.layers.{li}.{m}", shapes[t]) for t, m in PROJECTIONS
            if not (moe and t in ("gate", "up", "down")) and f"model.layers.{li}.{m}" not in cfg.quant_dense]


def _nf4_parts(O, K, blocksize):
    """(part, bytes) of one NF4 weight in qbuf, in order (each start aligned to 16 bytes)."""
    nb, nb2 = nf4_sizes(O, K, blocksize)
    return [("packed", O * K // 2), ("absmax", nb), ("absmax2", 4 * nb2), ("offset", 4), ("code2", 4 * 256),
            ("code", 4 * 16)]


def _align(n):
    return (n + 15) // 16 * 16


def layer_fields(cfg: ModelConfig, li: int = 0, dequantised=False):
    """Ordered (field, HF suffix, shape) of decoder layer li's frozen tensors in the model dtype
    (without the MXFP4 experts, which quant_fields lists, unless dequantised: then with the bf16
    checkpoint's gate_up / down_e in their place). q, k and v are adjacent so that one
    (Oq + 2*Okv, C) view covers them."""
    C, F, D = cfg.hidden, cfg.intermediate, cfg.head_dim
    Oq, Okv = cfg.q_dim, cfg.kv_dim
    E, Fe = cfg.n_experts, cfg.moe_intermediate
    if cfg.is_moe(li) and cfg.expert_bias:  # GPT-OSS: experts stored (E, in, out), gate/up interleaved
        mlp = [("router", "mlp.router.weight", (E, C)),
               ("router_bias", "mlp.router.bias", (E,)),
               ("gate_up", "mlp.experts.gate_up_proj", (E, C, 2 * Fe)),
               ("gate_up_bias", "mlp.experts.gate_up_proj_bias", (E, 2 * Fe)),
               ("down_e", "mlp.experts.down_proj", (E, Fe, C)),
               ("down_bias", "mlp.experts.down_proj_bias", (E, C))]
    elif cfg.is_moe(li):
        mlp = [("router", "mlp.gate.weight", (E, C)),
               ("gate_up", "mlp.experts.gate_up_proj", (E, 2 * Fe, C)),
               ("down_e", "mlp.experts.down_proj", (E, C, Fe))]
    else:
        mlp = [("gate", "mlp.gate_proj.weight", (F, C)),
               ("up", "mlp.up_proj.weight", (F, C)),
               ("down", "mlp.down_proj.weight", (C, F))]
    f = [
        ("q", "self_attn.q_proj.weight", (Oq, C)),
        ("k", "self_attn.k_proj.weight", (Okv, C)),
        ("v", "self_attn.v_proj.weight", (Okv, C)),
        ("o", "self_attn.o_proj.weight", (C, Oq)),
        *mlp,
        ("in_norm", "input_layernorm.weight", (C,)),
        ("post_norm", "post_attention_layernorm.weight", (C,)),
    ]
    if cfg.qkv_bias:
        f += [("q_bias", "self_attn.q_proj.bias", (Oq,)),
              ("k_bias", "self_attn.k_proj.bias", (Okv,)),
              ("v_bias", "self_attn.v_proj.bias", (Okv,))]
    if cfg.o_bias:
        f += [("o_bias", "self_attn.o_proj.bias", (C,))]
    if cfg.qk_norm:
        f += [("q_norm", "self_attn.q_norm.weight", (D,)),
              ("k_norm", "self_attn.k_norm.weight", (D,))]
    if cfg.sinks:
        f += [("sinks", "self_attn.sinks", (cfg.n_heads,))]
    if quant_fields(cfg, li) and not dequantised:
        f = [x for x in f if x[0] not in ("gate_up", "down_e")]
    if not dequantised:
        nf4 = {t for t, _, _ in nf4_projections(cfg, li)}
        f = [x for x in f if x[0] not in nf4]
    return f


def expert_aliases(layer, li, cfg: ModelConfig):
    """(HF name, view, fused name) of an MoE layer's per-expert tensors (the hub's layout): each
    is one expert's slice of a fused view; a checkpoint holds either these or the fused tensors."""
    if not cfg.is_moe(li) or cfg.expert_bias:  # GPT-OSS checkpoints hold the fused tensors
        return
    Fe, pre = cfg.moe_intermediate, f"model.layers.{li}.mlp.experts"
    for e in range(cfg.n_experts):
        yield f"{pre}.{e}.gate_proj.weight", layer.gate_up[e, :Fe], f"{pre}.gate_up_proj"
        yield f"{pre}.{e}.up_proj.weight", layer.gate_up[e, Fe:], f"{pre}.gate_up_proj"
        yield f"{pre}.{e}.down_proj.weight", layer.down_e[e], f"{pre}.down_proj"


# Tensors some checkpoints carry that the model never reads (HF ignores them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Layer:
    """One decoder layer's frozen weights: `buf` is the flat buffer, every field a view of it.
    buf, qbuf: flat buffers (of at least the layer's size) to lay the fields over instead of
    allocating them: a gathered full layer of sharded weights (runtime/shard.py)."""

    def __init__(self, cfg: ModelConfig, dtype, device, li: int = 0, buf=None, qbuf=None):
        fields = layer_fields(cfg, li)
        self.moe = cfg.is_moe(li)
        numel = sum(_prod(s) for _, _, s in fields)
        self.buf = torch.empty(numel, dtype=dtype, device=device) if buf is None else buf[:numel]
        self.fields = [name for name, _, _ in fields]
        off = 0
        for name, _, shape in fields:
            n = _prod(shape)
            setattr(self, name, self.buf[off:off + n].view(shape))
            off += n
        qfields = quant_fields(cfg, li)  # MXFP4 experts and NF4 projections: a second, uint8 buffer
        nf4 = [(t, O, K, _nf4_parts(O, K, cfg.quant_block)) for t, _, (O, K) in nf4_projections(cfg, li)]
        qbytes = _align(sum(_prod(s) for _, _, s in qfields))
        qbytes += sum(_align(n) for *_, parts in nf4 for _, n in parts)
        self.qbuf = torch.empty(qbytes, dtype=torch.uint8, device=device) if qbuf is None else qbuf[:qbytes]
        off = 0
        for name, _, shape in qfields:
            n = _prod(shape)
            setattr(self, name, self.qbuf[off:off + n].view(shape))
            off += n
        off = _align(off)
        for t, O, K, parts in nf4:
            views = {}
            for part, n in parts:
                v = self.qbuf[off:off + n]
                views[part] = v if part in ("packed", "absmax") else v.view(torch.float32)
                off += _align(n)
            views["packed"] = views["packed"].view(O, K // 2)
            setattr(self, t, Nf4(blocksize=cfg.quant_block, **views))
        if qfields:
            self.gate_up = Mxfp4(self.gate_up_blocks, self.gate_up_scales)  # Wd (E, 2Fe, C)
            self.down_e = Mxfp4(self.down_blocks, self.down_scales)  # Wd (E, C, Fe)
        for name in ("q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
                     "gate", "up", "down", "router", "gate_up", "down_e", "sinks", "router_bias",
                     "gate_up_bias", "down_bias"):
            if not hasattr(self, name):
                setattr(self, name, None)


@dataclass
class Model:
    """A loaded model: config, frozen weights and where they live."""
    config: ModelConfig
    embed: torch.Tensor  # (V, C)
    layers: list
    norm: torch.Tensor  # (C,)
    lm_head: torch.Tensor  # (V, C); the same tensor as embed when tied
    dtype: torch.dtype
    device: torch.device
    path: str = ""
    cache: dict = field(default_factory=dict)  # per-model device tables (RoPE inverse frequencies)

    def hf_tensors(self, dequantised=False):
        """(HF name, tensor) for every frozen tensor, in checkpoint naming; dequantised: MXFP4 experts
        as the bf16 checkpoint's (E, in, out) tensors and NF4 projections as (O, K), fp32, freshly
        dequantised (one at a time). Not dequantised, an NF4 projection comes as its Nf4 under the
        weight's name."""
        yield "model.embed_tokens.weight", self.embed
        for i, layer in enumerate(self.layers):
            for name, suffix, _ in layer_fields(self.config, i, dequantised):
                t = getattr(layer, name)
                if isinstance(t, Mxfp4):
                    t = t.dense().transpose(1, 2)
                elif isinstance(t, Nf4):
                    t = t.dense()
                yield f"model.layers.{i}.{suffix}", t
            if not dequantised:
                for name, module, _ in nf4_projections(self.config, i):
                    yield f"{module}.weight", getattr(layer, name)  # an Nf4: the loader fills or quantises it
            if not dequantised:
                for name, suffix, _ in quant_fields(self.config, i):
                    yield f"model.layers.{i}.{suffix}", getattr(layer, name)
        yield "model.norm.weight", self.norm
        if not self.config.tie_embeddings:
            yield "lm_head.weight", self.lm_head


def empty_model(cfg: ModelConfig, dtype, device, path="", stage_tables=False) -> Model:
    """Allocate every frozen tensor (uninitialised); the loader fills them. stage_tables (a CUDA
    device under a VRAM budget): the embedding table and the lm_head are allocated in pinned host
    memory, model.cache["staged"] says so, and the first runtime/planner.plan_for moves each to the
    GPU or leaves it on the host as its plan says: the GPU never holds a table its plan puts on the
    host (Qwen3-14B: 2 x 1.45 GiB above an 8.5 GiB budget while loading)."""
    staged = stage_tables and torch.device(device).type == "cuda"
    where = dict(device="cpu", pin_memory=True) if staged else dict(device=device)
    embed = torch.empty(cfg.vocab, cfg.hidden, dtype=dtype, **where)  # (V, C)
    lm_head = embed if cfg.tie_embeddings else torch.empty(cfg.vocab, cfg.hidden, dtype=dtype, **where)
    model = Model(
        config=cfg,
        embed=embed,
        layers=[Layer(cfg, dtype, device, li) for li in range(cfg.n_layers)],
        norm=torch.empty(cfg.hidden, dtype=dtype, device=device),
        lm_head=lm_head,
        dtype=dtype,
        device=torch.device(device),
        path=path,
    )
    if staged:
        model.cache["staged"] = True
    return model


def embed_to_host(model: Model):
    """Move an untied embedding table to pinned host memory, freeing V * C elements of GPU memory
    (Qwen3-8B: 1.16 GiB); the gather then reads only the batch's rows over PCIe (kernels/embedding.py).
    What runtime/planner.plan_for does when a VRAM budget needs the room. A tied table is also the
    lm_head, which the loss reads whole, twice a step: it stays. Returns the bytes freed."""
    if model.embed is model.lm_head:
        raise ValueError("embed_to_host: the embedding is tied to the lm_head, which stays on the GPU")
    if model.embed.device.type != "cuda":
        return 0
    host = torch.empty(model.embed.shape, dtype=model.embed.dtype, pin_memory=True)  # (V, C)
    host.copy_(model.embed)  # sync: set-up, once, before the first step
    freed = model.embed.numel() * model.embed.element_size()
    model.embed = host
    return freed


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n
