"""Tiny random HF models of every supported architecture, and the HF + PEFT oracle for a step.

The oracle runs each document alone through transformers + PEFT (no packing tricks), sums the
token losses, divides by the total target count and backpropagates with torch.autograd: what lean
must reproduce from one packed batch.
"""
import torch

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


def peft_wrap(hf_model, lora):
    """PEFT model carrying exactly lean's adapter weights."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    names = [{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
              "up": "up_proj", "down": "down_proj"}[t] for t in lora.targets]
    pc = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=names, lora_dropout=0.0,
                    use_rslora=lora.use_rslora)
    pm = get_peft_model(hf_model, pc)
    sd = {k: v.detach().cpu().to(torch.float32) for k, v in lora.state_dict().items()}
    res = set_peft_model_state_dict(pm, sd)
    assert not [k for k in res.unexpected_keys if "lora" in k], res.unexpected_keys
    return pm


def hf_loss_and_grads(pm, docs, device="cpu"):
    """Sum of token losses over documents run one at a time; grads of (sum / count) by PEFT key."""
    import torch.nn.functional as F

    pm.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    losses = []
    for doc in docs:
        ids, mask = (doc if isinstance(doc, tuple) else (doc, None))
        ids_t = torch.tensor([ids], device=device)
        logits = pm(input_ids=ids_t).logits[0].float()
        tgt = torch.tensor(ids[1:], device=device, dtype=torch.long)
        if mask is not None:
            keep = torch.tensor(mask[1:], device=device, dtype=torch.bool)
            tgt = torch.where(keep, tgt, torch.full_like(tgt, -100))
        losses.append(F.cross_entropy(logits[:-1], tgt, reduction="sum", ignore_index=-100))
        count += int((tgt != -100).sum())
    total = torch.stack(losses).sum()
    (total / count).backward()
    grads = {}
    for name, p in pm.named_parameters():
        if "lora_" in name:
            grads[name.replace(".default", "")] = p.grad.detach().clone()
    return total.detach(), count, grads
