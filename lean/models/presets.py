"""The real configs lean is measured and checked on, as HF config.json values (no weights).

    PRESETS["qwen3-0.6b"]   -> a dict config_from_hf reads (and transformers' AutoConfig.for_model)

Used where a real model's shapes are needed without its weights: tools/bench_step.py (random-init
models of these configs, lean against the peers), tests/test_arch.py (every kernel compiled at the
configs its chooser returns for these shapes) and `lean-check --model qwen3-0.6b` (random init);
qwen3-30b-a3b (Qwen3-MoE) also by tests/test_moe_gpu.py, cut to a few of its 48 layers; gpt-oss-20b
(GPT-OSS with bf16 experts) and gpt-oss-20b-mxfp4 (the hub's config: experts held in MXFP4).
The values are those of the models' own config.json files on the hub.
"""
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1e6}


def _llama(C, F, L, H, KVH, D, tie, **kw):
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=C, intermediate_size=F,
                num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KVH, head_dim=D,
                tie_word_embeddings=tie, **kw)


def _qwen3(C, F, L, H, KVH, tie):
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=C, intermediate_size=F,
                num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KVH, head_dim=128,
                vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=40960,
                rope_parameters=_QWEN3_ROPE)


def _qwen3_moe(C, F, Fe, L, H, KVH, E, K):
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=C, intermediate_size=F,
                moe_intermediate_size=Fe, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KVH,
                head_dim=128, vocab_size=151936, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
                max_position_embeddings=40960, rope_parameters=_QWEN3_ROPE, router_aux_loss_coef=0.001,
                output_router_logits=False)


PRESETS = {
    "smollm2-135m": _llama(576, 1536, 30, 9, 3, 64, True, vocab_size=49152, rms_norm_eps=1e-5,
                           max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, 64, True, vocab_size=128256, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128, True, vocab_size=128256, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, rms_norm_eps=1e-5,
        swiglu_limit=7.0, tie_word_embeddings=False, max_position_embeddings=131072,
        output_router_logits=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}),
}
PRESETS["gpt-oss-20b-mxfp4"] = dict(PRESETS["gpt-oss-20b"], quantization_config={
    "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"]})
