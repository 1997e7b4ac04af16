"""Plain-torch references for lean/kernels/linear_ce.py (lm_head + summed cross-entropy + dh)."""
import torch
import torch.nn.functional as F


def linear_ce_ref(h, w, targets, *, grad_scale=1.0, ignore_index=-100):
    """HF's recipe at the inputs' precision, differentiated by autograd.

    logits = h @ w^T in h's dtype, upcast to fp32 (fp64 stays fp64) for F.cross_entropy with
    reduction='sum'. Pass fp32/fp64 inputs for the reference, fp16/bf16 inputs for torch's own
    low-precision result. Returns (loss_sum, count, dh): two 0-d tensors and dh in h's dtype.
    """
    h = h.detach().clone().requires_grad_(True)
    logits = h @ w.detach().t()  # (N, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets.long(), reduction="sum", ignore_index=ignore_index)
    (loss * grad_scale).backward()
    count = (targets != ignore_index).sum().to(loss.dtype)
    return loss.detach(), count, h.grad


def linear_ce_chunked_ref(h, w, targets, *, grad_scale=1.0, ignore_index=-100, chunk_rows=1024,
                          upcast=True):
    """The same quantities in closed form, chunk by chunk, for sizes where N x V does not fit.

    dloss/dlogits = softmax(logits) - onehot(target), 0 on ignored rows.
    upcast=True:  everything in fp32 (the reference; pass fp32 or 16-bit inputs).
    upcast=False: HF's low-precision recipe: logits in h's dtype, upcast to fp32 for the softmax,
                  the fp32 gradient cast back to h's dtype before the dh matmul.
    """
    dt = torch.float32 if upcast else h.dtype
    wt = w.to(dt)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    dh = torch.empty(h.shape, dtype=dt, device=h.device)
    for r0 in range(0, h.shape[0], chunk_rows):
        r1 = min(h.shape[0], r0 + chunk_rows)
        t = targets[r0:r1].long()
        valid = t != ignore_index
        logits = (h[r0:r1].to(dt) @ wt.t()).float()  # (rows, V)
        lse = torch.logsumexp(logits, dim=1)
        tc = torch.where(valid, t, 0)
        x_t = logits.gather(1, tc[:, None])[:, 0]
        loss += torch.where(valid, lse - x_t, 0.0).sum()
        g = torch.softmax(logits, dim=1)  # (rows, V) fp32, becomes the gradient in place
        g.scatter_add_(1, tc[:, None], -torch.ones_like(x_t)[:, None])
        g *= torch.where(valid, grad_scale, 0.0)[:, None]
        dh[r0:r1] = g.to(dt) @ wt
        del logits, g
    count = (targets != ignore_index).sum().float()
    return loss, count, dh


def loss_atol(dtype, ref_loss):
    """The rule's atol for a 16-bit run's summed loss: one 16-bit rounding flip of a target logit of
    size ~4 (the fp32 GEMM accumulation order may round a logit the other way than torch) plus fp32
    summation order."""
    return 4 * torch.finfo(dtype).eps + 1e-5 * abs(float(ref_loss))


def dh_atol(dtype, ref_dh):
    """The rule's atol for a 16-bit dh: one half-ulp rounding of dh's largest element (torch and
    lean may round a tie apart)."""
    return torch.finfo(dtype).eps / 2 * ref_dh.abs().max().item()
