"""AdamW over the LoRA flat buffer: fp32 master weights and moments, clipping on the device.

lr and step live in a small device tensor (`hyper`) that a captured CUDA graph reads on replay;
the host writes it before each step with one non-blocking copy. The global gradient norm stays on
the device (`grad_norm`) until a log point reads it.
"""
import torch

from ..kernels.adamw import adamw_step


class AdamW:
    def __init__(self, lora, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0):
        self.lora = lora
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.max_grad_norm = max_grad_norm
        dev = lora.params.device
        self.m = torch.zeros_like(lora.params)  # (P,) fp32
        self.v = torch.zeros_like(lora.params)  # (P,) fp32
        self.grad_norm = torch.zeros(1, dtype=torch.float32, device=dev)
        self.hyper = torch.zeros(2, dtype=torch.float32, device=dev)  # [lr, step]
        self.step_count = 0

    def step(self, lr=None):
        """One update from lora.grads; lr overrides the default (a schedule's value)."""
        self.step_count += 1
        # A fresh pinned host tensor per step: rewriting one buffer could race the previous
        # step's copy still in flight; the caching host allocator keeps each alive until its copy ran.
        host = torch.tensor([self.lr if lr is None else lr, float(self.step_count)], dtype=torch.float32)
        if self.hyper.is_cuda:
            host = host.pin_memory()
        self.hyper.copy_(host, non_blocking=True)
        lowp = None if self.lora.lowp is self.lora.params else self.lora.lowp
        adamw_step(self.lora.params, self.m, self.v, self.grad_norm, self.lora.grads, self.hyper,
                   beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay,
                   max_grad_norm=self.max_grad_norm, params_lowp=lowp)

    def state_dict(self):
        return {"m": self.m, "v": self.v, "step": self.step_count}

    def load_state_dict(self, sd):
        self.m.copy_(sd["m"])
        self.v.copy_(sd["v"])
        self.step_count = int(sd["step"])
