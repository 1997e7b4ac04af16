"""lean-check's step: one LoRA step of lean against HF transformers + PEFT on the same weights,
adapter and documents, then the step's tokens/s.

The comparison (lean/reference/hf_peft.py's oracle: each document alone through transformers + PEFT,
summed losses over the target count, torch.autograd) and its rule are the tests':
  float32 (the CPU):  the loss within 1e-5 and every LoRA gradient within 1e-4 of max|ref|
                      (tests/test_step.py);
  bf16 (a GPU):       every LoRA gradient, and the loss per token, within 2x HF+PEFT-in-bf16's
                      relative L2 error + 1e-3 of the fp32 HF+PEFT reference, the summed loss equal
                      to its token losses (tests/test_step_gpu.py; reference/hf_peft.step_loss_verdicts).
The adapter is PEFT's initialisation plus N(0, 0.02) on every parameter, so B (zero at init) is
not zero and no gradient is trivially right; a zero reference gradient fails the check.

Timing: the eager step (zero_grad, forward_backward, AdamW) and, on a GPU, the whole step replayed
from lean.StepGraph (what lean-train runs there): the median of `steps` timed steps after warm-up,
CUDA events around each, tokens/s = N / that time; the peak is torch.cuda.max_memory_allocated from
a reset before the eager steps (weights, LoRA, optimizer state and the steps), and from another
before the graph is built (the same plus the graph's capture and replays). On the CPU the wall time
of the step checked against HF + PEFT is printed, and it is no speed.
"""
import statistics
import time
import warnings

import numpy as np
import torch

import lean

from ..reference.hf_peft import lean_token_losses, step_loss_verdicts
from ..reference.rule import Verdict, close_rule, exact_rule, l2_rule
from .model import hf_model


def make_lora(model, r, seed):
    """LoRA on all seven projections, PEFT's init plus N(0, 0.02) on every parameter (B not zero)."""
    lora = lean.LoRA.init(model, r=r, alpha=2 * r, targets="all", seed=seed)
    g = torch.Generator().manual_seed(seed)
    lora.params.add_(0.02 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    return lora


def make_docs(lens, vocab, seed):
    """Random token ids in the given document lengths (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def have_oracle():
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _oracle(src, model, lora, docs, dtype):
    """HF + PEFT's (loss sum, target count, LoRA grads, per-token losses) with the model's weights in dtype."""
    from ..reference.hf_peft import hf_loss_and_grads, peft_wrap

    with warnings.catch_warnings():  # transformers' and peft's deprecation notes are not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        pm = peft_wrap(hf_model(src, model, dtype, model.device), lora)
        return hf_loss_and_grads(pm, docs, model.device, token_losses=True)


def _short(key):
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> 'layers.3.q_proj.lora_A'."""
    for cut in ("base_model.model.", "model.", "self_attn.", "mlp.", ".weight"):
        key = key.replace(cut, "")
    return key


def check_step(report, src, model, lora, docs, n):
    """lean's loss and LoRA gradients against HF + PEFT's (see the module docstring)."""
    dev, dtype = model.device, model.dtype
    lora.zero_grad()
    t0 = time.perf_counter()
    batch = lean.pack(docs, max_tokens=n, device=dev)
    loss, count = lean.forward_backward(model, lora, batch)
    wall = time.perf_counter() - t0  # (a GPU's first step compiles: its time is not printed)
    ours = {k: v.clone() for k, v in lora.grad_state_dict().items()}
    ref_loss, ref_count, ref, ref_tokens = _oracle(src, model, lora, docs, torch.float32)
    head = [exact_rule(torch.tensor([count]), torch.tensor([ref_count]), name="targets")]
    if dtype == torch.float32:
        head.append(close_rule(loss.reshape(1), ref_loss.reshape(1), name="loss"))
        grads = [close_rule(ours[k], r, rtol32=1e-4, name=_short(k)) for k, r in ref.items()]
    else:
        _, _, low, low_tokens = _oracle(src, model, lora, docs, dtype)  # the loss per token (step_loss_verdicts)
        head += step_loss_verdicts(loss, lean_token_losses(model, lora, batch), ref_tokens, low_tokens)
        grads = [l2_rule(ours[k], r, low[k], name=_short(k)) for k, r in ref.items()]
    grads += [Verdict(False, 0.0, 0.0, f"{k}: the reference gradient is zero: the check would be vacuous")
              for k, r in ref.items() if not r.abs().max() > 0]
    if set(ours) != set(ref):
        grads.append(Verdict(False, 0.0, 0.0, f"LoRA tensors differ: lean {sorted(set(ours) - set(ref))[:3]}, "
                                              f"PEFT {sorted(set(ref) - set(ours))[:3]}"))
    shape = f"N{n} {len(docs)} docs, {model.config.n_layers} layers"
    report.check("step vs HF+PEFT: loss", shape, head)
    report.check("step vs HF+PEFT: grads", f"{len(ref)} LoRA tensors r{lora.r}", grads)
    if dev.type == "cpu":
        report.note("", f"lean's forward_backward: {wall:.1f} s of wall time in the CPU interpreter: not a speed")


def time_step(report, model, lora, docs, n, steps):
    """The eager step's (and on a GPU the graph step's) time, tokens/s and peak memory; returns the
    summary's words for them (None on the CPU)."""
    cuda = model.device.type == "cuda"
    opt = lean.AdamW(lora, lr=1e-4)
    batch = lean.pack(docs, max_tokens=n, device=model.device)

    def eager():
        lora.zero_grad()
        loss, count = lean.forward_backward(model, lora, batch)
        opt.step()
        return loss / count

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t, loss = _median_time(eager, 2 if cuda else 0, steps, cuda)
    label = f"N{n}, {model.config.n_layers} layers"
    report.check("step eager", label, [_finite(loss)])
    if not cuda:
        report.note("", f"{t:.1f} s per step of wall time in the CPU interpreter: not a speed")
        return None
    said = [_speed(report, "eager", n, t, steps)]
    torch.cuda.reset_peak_memory_stats()  # the graph's peak: weights, LoRA, optimizer and its captured step
    max_docs = 64 * -(-(len(docs) + 1) // 64)  # a slot for the padding document too
    graph = lean.StepGraph(model, lora, opt, budget=n, max_docs=max_docs)
    gbatch = graph.pack(docs)

    def replay():
        loss, count = graph.step(gbatch)
        return loss / count

    t, loss = _median_time(replay, 2, steps, True)
    report.check("step graph (StepGraph)", label, [_finite(loss)])
    said.append(_speed(report, "graph", n, t, steps))
    return ", ".join(said)


def _speed(report, what, n, t, steps):
    """Print tokens/s and the peak so far; return the summary's words."""
    peak = torch.cuda.max_memory_allocated() / 2**30
    report.note("", f"{n / t:,.0f} tokens/s ({t * 1e3:.1f} ms/step, median of {steps}), peak {peak:.2f} GiB")
    return f"{n / t:,.0f} tokens/s {what} (peak {peak:.2f} GiB)"


def _median_time(step, warmup, steps, cuda):
    """Median seconds of step() over `steps` calls after `warmup`, and the last step's loss."""
    times, loss = [], None
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()  # host sync: this step's time
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times), loss


def _finite(loss):
    """A yes/no verdict (no error, no bound): the step's loss is a finite number."""
    value = float(loss)  # host sync: after timing
    ok = bool(np.isfinite(value))
    said = "finite" if ok else "not finite"
    return Verdict(ok, float("nan"), float("nan"), f"loss {value:.4f} per target token: {said}")
