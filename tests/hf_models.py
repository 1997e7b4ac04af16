"""Tiny random HF models of every supported architecture (the HF + PEFT oracle for a step is
lean/reference/hf_peft.py)."""
import torch


def tiny_config(arch, dtype=torch.float32):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":  # llama3 RoPE scaling, GQA 4:1, untied
        return LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, vocab_size=131, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False, dtype=dtype,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        )
    if arch == "qwen2":  # q/k/v bias, GQA 2:1
        return Qwen2Config(
            hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=127, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, dtype=dtype,
        )
    if arch == "qwen3":  # QK-norm, tied, head_dim (32) != hidden / heads (16)
        return Qwen3Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, vocab_size=137, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=True, dtype=dtype,
        )
    raise ValueError(arch)


def build_hf(arch, seed, dtype=torch.float32, config=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = config or tiny_config(arch, dtype)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Random-init norms are all ones; draw them so the norm weights are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()
