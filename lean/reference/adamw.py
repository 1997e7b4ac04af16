"""Reference for lean/kernels/adamw.py: torch.optim.AdamW on one flat fp32 parameter, with
torch.nn.utils.clip_grad_norm_'s clipping before each step, as a training loop would call them.

The clip scales the gradient by min(1, max_norm / (norm + 1e-6)) as clip_grad_norm_ does, with the
norm summed in float64: torch's own fp32 norm of millions of elements on the CPU is ~1e-4 off
(measured: 1.27e-4 at P = 4.9M, SmolLM2's LoRA at r = 16), which would make the reference, not the
kernel, the less accurate side.
"""
import torch


class AdamWRef:
    """torch.optim.AdamW (single-tensor path, foreach=False) over a flat fp32 copy of params.

    step(grads, lr) upcasts grads to fp32 (the master weights' dtype; the kernel does the same),
    optionally clips them, steps, and returns the fp64 L2 norm of the grads before clipping.
    """

    def __init__(self, params, *, beta1, beta2, eps, weight_decay, max_grad_norm=None):
        self.p = torch.nn.Parameter(params.detach().float().clone())
        self.max_grad_norm = max_grad_norm
        self.opt = torch.optim.AdamW([self.p], lr=0.0, betas=(beta1, beta2), eps=eps,
                                     weight_decay=weight_decay, foreach=False)

    def step(self, grads, lr):
        self.p.grad = grads.detach().float().clone()
        norm = torch.linalg.vector_norm(grads.detach().double())
        if self.max_grad_norm is not None:  # clip_grad_norm_'s rule, the norm in fp64
            self.p.grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).float())
        self.opt.param_groups[0]["lr"] = lr
        self.opt.step()
        return norm.reshape(1)

    @property
    def m(self):
        return self.opt.state[self.p]["exp_avg"]

    @property
    def v(self):
        return self.opt.state[self.p]["exp_avg_sq"]
