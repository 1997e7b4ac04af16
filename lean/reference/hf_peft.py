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


def hf_loss_and_grads(pm, docs, device="cpu", token_losses=False):
    """Sum of token losses over documents run one at a time; grads of (sum / count) by PEFT key.
    token_losses: also every counted token's loss, (count,) fp32 in document order (a 4th item).

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
            per_token = F.cross_entropy(logits[:-1], tgt, reduction="none", ignore_index=-100)
            losses.append(per_token[tgt != -100])
            count += int((tgt != -100).sum())
        tokens = torch.cat(losses)
        total = tokens.sum()
        (total / count).backward()
    grads = {}
    for name, p in pm.named_parameters():
        if "lora_" in name:
            grads[name.replace(".default", "")] = p.grad.detach().clone()
    if token_losses:
        return total.detach(), count, grads, tokens.detach()
    return total.detach(), count, grads


def lean_token_losses(model, lora, batch):
    """lean's loss per counted token, (n_targets,) fp32 in batch order, from its evaluation forward's
    logits (the training step's layers without a tape; no dropout) and torch's cross entropy."""
    import torch.nn.functional as F

    from lean.runtime.step import forward

    keep = batch.targets != -100
    logits = forward(model, lora, batch)[keep].float()
    return F.cross_entropy(logits, batch.targets[keep].long(), reduction="none")


def step_loss_verdicts(loss, tokens, ref_tokens, lowp_tokens, rel=1e-4):
    """A low-precision step's loss (the sum over tokens) against the references, two verdicts:
    - the step's loss equals its forward's token losses (lean_token_losses) summed, within `rel`:
      the fused linear+CE against torch's cross entropy on lean's own logits;
    - those token losses within the rule (l2_rule: 2x torch's own low-precision error + 1e-3,
      relative L2) of the fp32 reference's, torch's error measured on the same (n,) vector.
    Why per token: in the sum, token errors of either sign cancel by chance, so one scalar draw of
    torch's error bounds nothing (H100, gpt-oss-20b shapes cut to 4 layers, 3 seeds: the summed
    loss of lean bf16 off HF fp32 by -1.0e-3, +1.3e-3, -6e-5 and of HF bf16 by -2.0e-3, +9.6e-4,
    +2.2e-4; at another seed lean 1.07e-3 against HF bf16's 6.3e-6, while per token the two were
    1.80e-2 and 2.04e-2)."""
    from lean.reference.rule import Verdict, l2_rule

    total = tokens.double().sum().item()
    got = loss.double().sum().item()
    err = abs(got - total) / (abs(total) or 1.0)
    same = Verdict(err <= rel, err, rel, f"loss {got:.6g} = its forward's token losses summed ({total:.6g}): "
                                         f"relative difference {err:.2e} {'<=' if err <= rel else '>'} {rel:.0e}")
    return [same, l2_rule(tokens.cpu(), ref_tokens.cpu(), lowp_tokens.cpu(), name="loss per token")]
