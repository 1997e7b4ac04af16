"""Model configuration read from a Hugging Face `config.json` (as data: transformers is not imported).

Supported architectures (dense decoders with RMSNorm, RoPE, GQA attention and a SwiGLU MLP):
  LlamaForCausalLM  Llama 3.x (default or llama3 RoPE scaling), SmolLM; optional attention bias
  Qwen2ForCausalLM  bias on q/k/v (always, as in transformers), none on o
  Qwen3ForCausalLM  per-head RMSNorm on q and k over head_dim before RoPE; head_dim may differ
                    from hidden/heads
  GptOssForCausalLM  biased q/k/v/o, a learned sink logit per head in the softmax denominator,
                    sliding-window attention on the layers layer_types marks sliding_attention,
                    YaRN RoPE; every MLP a Mixture-of-Experts block with a biased router, top-k on
                    the logits then softmax over the k, biased experts stored (E, in, out) with
                    gate/up interleaved and the clamped GLU (swiglu_limit, swiglu_alpha)
  Qwen3MoeForCausalLM  Qwen3's attention; the MLP of layer i is a Mixture-of-Experts block (E experts
                    of width moe_intermediate_size, top-k routing, lean/models/moe.py) unless i is in
                    mlp_only_layers or (i + 1) % decoder_sparse_step != 0, where it is a dense SwiGLU
                    MLP of width intermediate_size (as transformers' Qwen3MoeDecoderLayer decides)

Both config dialects are read: transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`). Anything lean does not implement is refused with a message naming what is
supported, never silently ignored.
"""
from dataclasses import dataclass, field

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "gpt_oss"
    hidden: int  # C
    n_layers: int  # L
    n_heads: int  # H
    n_kv_heads: int  # KVH
    head_dim: int  # D
    intermediate: int  # F
    vocab: int  # V
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool  # bias on q, k, v projections (Qwen2; Llama with attention_bias)
    o_bias: bool  # bias on o_proj (Llama with attention_bias)
    qk_norm: bool  # Qwen3: RMSNorm per head on q and k before RoPE
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type and its parameters; {} = default
    max_position: int = 0
    hf_architecture: str = ""
    # Mixture-of-Experts (Qwen3-MoE); n_experts 0 = a dense model
    n_experts: int = 0  # E
    top_k: int = 0  # K experts per token
    moe_intermediate: int = 0  # F of one expert
    norm_topk: bool = False  # renormalise the top-k probabilities to sum 1
    moe_layers: tuple = ()  # indices of the layers whose MLP is the MoE block (the others are dense)
    aux_loss_coef: float = 0.0  # router_aux_loss_coef, applied when output_router_logits (else 0.0)
    # GPT-OSS
    windows: tuple = ()  # per layer: the sliding window of a sliding_attention layer, 0 for full attention
    sinks: bool = False  # a learned sink logit per head (self_attn.sinks (H,))
    softmax_first: bool = True  # routing: softmax over E then top-k (Qwen3-MoE); False: top-k then softmax (GPT-OSS)
    expert_bias: bool = False  # router and expert biases; experts stored (E, in, out), gate/up interleaved (GPT-OSS)
    glu_limit: float = 0.0  # the clamped GLU's limit (GPT-OSS swiglu_limit); 0: SwiGLU
    glu_alpha: float = 1.0  # its sigmoid slope (swiglu_alpha)
    expert_quant: str = ""  # "mxfp4": expert weights held in MXFP4 (models/weights.py); "": model dtype
    # 4-bit base weights (QLoRA): "nf4" holds the seven projections of every layer in NF4 with double
    # quantisation (kernels/nf4.py; an MoE layer's attention projections, its experts stay in the model
    # dtype); quant_block its blocksize; quant_dense the HF module names a pre-quantised checkpoint
    # left in the model dtype (e.g. "model.layers.0.mlp.down_proj").
    weight_quant: str = ""
    quant_block: int = 64
    quant_dense: tuple = ()

    def window(self, layer):
        """Layer `layer`'s sliding window (0: full causal attention)."""
        return self.windows[layer] if self.windows else 0

    def is_moe(self, layer):
        """Whether layer `layer`'s MLP is the Mixture-of-Experts block."""
        return layer in self.moe_layers

    @property
    def q_dim(self):
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_dim


def _refuse(msg):
    raise UnsupportedModelError(msg)


def _int(cfg, key):
    """cfg[key] as an int; UnsupportedModelError naming the key when it is missing or not a number."""
    try:
        return int(cfg[key])
    except KeyError:
        _refuse(f"no {key!r}: the config is incomplete; re-download the model")
    except (TypeError, ValueError):
        _refuse(f"{key}={cfg[key]!r} is not an integer; re-download the model")


def config_from_hf(cfg: dict) -> ModelConfig:
    """Parse a config.json dict. Raises UnsupportedModelError naming the unsupported value."""
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MODEL_TYPES:  # configs written without architectures
        archs = [MODEL_TYPES[cfg["model_type"]]]
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        model_type = cfg.get("model_type", "?")
        _refuse(
            f"unsupported architecture {archs or model_type!r}: lean supports "
            f"{', '.join(ARCHITECTURES)} (Llama 3.x, SmolLM, Qwen2, Qwen3, Qwen3-MoE, GPT-OSS)"
        )
    hidden = _int(cfg, "hidden_size")
    n_heads = _int(cfg, "num_attention_heads")
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    if n_heads % n_kv:
        _refuse(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu" and arch != "gpt_oss":
        _refuse(f"hidden_act={act!r}: lean implements the SwiGLU MLP with silu only")
    if cfg.get("mlp_bias"):
        _refuse("mlp_bias=true: lean's MLP projections have no bias")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        _refuse("pretraining_tp != 1 is not supported (set it to 1; it only changes the matmul split)")
    if arch != "gpt_oss" and (cfg.get("use_sliding_window")
                              or any(t != "full_attention" for t in (cfg.get("layer_types") or []))):
        _refuse("sliding-window attention layers are not supported for this architecture yet "
                "(set use_sliding_window=false)")
    if not 16 <= head_dim <= 256 or head_dim % 2:
        _refuse(f"head_dim={head_dim}: lean's attention and RoPE support even head_dim from 16 to 256")

    # RoPE: 5.x puts theta and the scaling in rope_parameters, 4.x uses rope_theta + rope_scaling.
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        theta = float(rp["rope_theta"])
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        _refuse(f"rope type {rope_type!r}: lean supports {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        scaling = {}
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse("partial_rotary_factor != 1 is not supported")

    attention_bias = bool(cfg.get("attention_bias", False))
    n_layers = _int(cfg, "num_hidden_layers")
    moe = _moe_fields(cfg, n_layers) if arch == "qwen3_moe" else _gpt_oss_fields(cfg, n_layers) if arch == "gpt_oss" else {}
    return ModelConfig(
        arch=arch,
        hidden=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate=(_int(cfg, "intermediate_size") if not moe
                      else int(cfg.get("intermediate_size", 6144 if arch == "qwen3_moe" else 2880))),
        vocab=_int(cfg, "vocab_size"),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # transformers 4.x omits the key when it equals PretrainedConfig's default (True).
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=attention_bias if arch in ("llama", "gpt_oss") else False,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=int(cfg.get("max_position_embeddings", 0) or 0),
        hf_architecture=next(a for a in archs if a in ARCHITECTURES),
        **moe,
    )


def _moe_fields(cfg, n_layers):
    """The Mixture-of-Experts fields of a Qwen3-MoE config.json, as transformers 5's
    Qwen3MoeConfig and Qwen3MoeDecoderLayer read them (its defaults where a key is absent)."""
    E = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))  # transformers 5 writes the second
    K = int(cfg.get("num_experts_per_tok", 8))
    F = int(cfg.get("moe_intermediate_size", 768))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = cfg.get("mlp_only_layers") or []
    if E < 0 or (E > 0 and not 1 <= K <= E):
        _refuse(f"num_experts_per_tok={K} with num_experts={E}: need 1 <= num_experts_per_tok <= num_experts")
    if E > 256:
        _refuse(f"num_experts={E}: lean's routing kernels hold one token's {E} router logits in one block; "
                "at most 256 experts are supported")
    if F < 1 or step < 1:
        _refuse(f"moe_intermediate_size={F}, decoder_sparse_step={step}: both must be >= 1")
    if any(not isinstance(i, int) or not 0 <= i < n_layers for i in dense):
        _refuse(f"mlp_only_layers={dense!r}: expected layer indices in [0, {n_layers})")
    layers = tuple(i for i in range(n_layers) if E > 0 and i not in dense and (i + 1) % step == 0)
    coef = float(cfg.get("router_aux_loss_coef", 0.001)) if cfg.get("output_router_logits") else 0.0
    return dict(n_experts=E, top_k=K, moe_intermediate=F, norm_topk=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=layers, aux_loss_coef=coef)


def _gpt_oss_fields(cfg, n_layers):
    """GPT-OSS's fields, as transformers 5's GptOssConfig reads them (its defaults where absent):
    every layer an MoE block of num_local_experts experts of width intermediate_size."""
    E = int(cfg.get("num_local_experts", cfg.get("num_experts", 128)))
    K = int(cfg.get("num_experts_per_tok", 4))
    if not 1 <= K <= E <= 256:
        _refuse(f"num_experts_per_tok={K} with num_local_experts={E}: need 1 <= k <= E <= 256")
    window = int(cfg.get("sliding_window") or 128)
    types = list(cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(n_layers)])[:n_layers]  # a config cut to fewer layers
    if len(types) != n_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        _refuse(f"layer_types={types!r}: expected {n_layers} of 'sliding_attention' / 'full_attention'")
    coef = float(cfg.get("router_aux_loss_coef", 0.001)) if cfg.get("output_router_logits") else 0.0
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        _refuse(f"quantization_config.quant_method={quant!r}: lean loads GPT-OSS in bf16 or MXFP4 only")
    F = int(cfg.get("intermediate_size", 2880))
    if quant == "mxfp4" and (F % 32 or int(cfg["hidden_size"]) % 32):
        _refuse(f"MXFP4 experts need hidden_size and intermediate_size multiples of 32 (got "
                f"{cfg['hidden_size']}, {F}): the 32-value blocks run along both")
    return dict(n_experts=E, top_k=K, moe_intermediate=F, norm_topk=False,
                moe_layers=tuple(range(n_layers)), aux_loss_coef=coef,
                windows=tuple(window if t == "sliding_attention" else 0 for t in types), sinks=True,
                softmax_first=False, expert_bias=True, glu_limit=float(cfg.get("swiglu_limit", 7.0)),
                glu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                expert_quant=quant or "")
