"""What every kernel check draws from: a model's shapes, the token count, the dtypes and one seeded
generator.

Shape legend: N tokens, C hidden, H/KVH heads, D head dim, F MLP hidden, V vocab, R LoRA rank.

    case = Case(cfg, n=8192, r=16, dtype=torch.bfloat16, device="cuda", seed=1234, layers=28)
    x = case.randn(case.n, cfg.hidden)      # fresh inputs in the model dtype
    case.up(x)                              # the reference's precision (hi)
    case.lowp(fn, *args)                    # torch's own result at the model dtype, None in fp32

hi: float64 when the kernels run in float32 (the CPU interpreter: the fp32 rule needs a reference
more precise than fp32); float32 with TF32 off for bf16 on a GPU (its error is ~1e-7 of the
values, 10^4 below bf16's, and fp64 runs at 1/64 rate on RTX cards).
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.config import ModelConfig


@dataclass
class Case:
    cfg: ModelConfig
    n: int                  # N tokens in the packed batch
    r: int                  # LoRA rank
    dtype: torch.dtype      # the model's compute dtype (bf16 on a GPU, fp32 in the interpreter)
    device: str
    seed: int
    layers: int = 1         # the step's layers (adamw's P counts their LoRA parameters)
    lens: list = field(default_factory=list)   # document lengths, summing to n
    gen: torch.Generator = None

    def __post_init__(self):
        self.gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.lens = doc_lengths(self.n, mean=max(16, self.n // 16), least=max(1, self.n // 512), seed=self.seed)
        self.hi = torch.float64 if self.dtype == torch.float32 else torch.float32

    @property
    def on_gpu(self):
        return self.device != "cpu"

    def randn(self, *shape, scale=1.0, dtype=None):
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (t * scale).to(dtype or self.dtype)

    def randint(self, high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=self.gen, device=self.device).to(dtype)

    def up(self, t):
        return None if t is None else t.detach().to(self.hi)

    def lowp(self, fn, *args, **kw):
        """fn at the model dtype (torch's own low-precision result), or None when that is fp32."""
        return None if self.dtype == torch.float32 else fn(*args, **kw)

    def cu_seqlens(self):
        cu = np.concatenate([[0], np.cumsum(self.lens)])
        return torch.tensor(cu, dtype=torch.int32, device=self.device)  # (B+1,)

    def positions(self):
        """Packed positions: 0..len-1 in each document."""
        return torch.tensor(np.concatenate([np.arange(n) for n in self.lens]), dtype=torch.int32,
                            device=self.device)  # (N,)


def doc_lengths(n, mean, least, seed):
    """Document lengths ~ exponential(mean), at least `least`, summing to exactly n (seeded)."""
    rng = np.random.default_rng(seed)
    lens, left = [], n
    while left > 0:
        k = min(left, max(least, int(rng.exponential(mean))))
        if 0 < left - k < least:
            k = left
        lens.append(k)
        left -= k
    return lens
