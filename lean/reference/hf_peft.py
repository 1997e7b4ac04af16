"""The oracle for a whole LoRA step: HF transformers + PEFT, run the plain way.

hf_loss_and_grads runs each document alone through transformers + PEFT (no packing tricks), sums
the token losses, divides by the total target count and backpropagates with torch.autograd: what
lean must reproduce from one packed batch. peft_wrap gives an HF model exactly lean's adapter
weights. transformers and peft are imported on call (the `check` and `test` extras).
"""
import torch


def peft_wrap(hf_model, lora):
    """PEFT model carrying exactly lean's adapter weights."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    c = lora.peft_config()  # an MoE model's experts: target_parameters (PEFT adds their rank pattern)
    pc = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=c["target_modules"], lora_dropout=0.0,
                    use_rslora=lora.use_rslora, target_parameters=c["target_parameters"],
                    rank_pattern=c["rank_pattern"], alpha_pattern=c["alpha_pattern"])
    pm = get_peft_model(hf_model, pc)
    sd = {k: v.detach().cpu().to(torch.float32) for k, v in lora.state_dict().items()}
    res = set_peft_model_state_dict(pm, sd)
    unused = [k for k in res.unexpected_keys if "lora" in k]
    if unused:
        raise RuntimeError(f"peft_wrap: PEFT did not take lean's adapter tensors {unused[:4]}")
    return pm


def hf_loss_and_grads(pm, docs, device="cpu"):
    """Sum of token losses over documents run one at a time; grads of (sum / count) by PEFT key.

    Under parametrize.cached(): PEFT's LoRA on expert tensors is a parametrization, folded once for
    the whole call instead of at every read (HF's expert loop reads the whole folded tensor once per
    expert hit, and each fold stayed alive for the backward: at gpt-oss-20b's shapes that outgrew an
    80 GB card)."""
    import torch.nn.functional as F
    from torch.nn.utils import parametrize

    pm.zero_grad(set_to_none=True)
    count = 0
    losses = []
    with parametrize.cached():
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
