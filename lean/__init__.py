"""lean: LoRA fine-tuning in pure Triton with a hand-scheduled backward.

    model = lean.load_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype=torch.bfloat16)
    lora = lean.LoRA.init(model, r=16, alpha=32, targets="all", dropout=0.0, seed=0)
    opt = lean.AdamW(lora, lr=2e-4)
    batch = lean.pack(docs, max_tokens=8192)          # docs: token-id lists (optionally with masks)
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, batch)
    opt.step()
    lora.save("adapter/")                             # PEFT layout
"""
import os as _os

import torch as _torch

# Without a GPU the same Triton kernels run through Triton's CPU interpreter, which must be chosen
# before any kernel is defined (triton.jit reads it at decoration time).
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .models.config import ModelConfig, UnsupportedModelError  # noqa: E402
from .runtime.batch import Batch, BatchError, pack  # noqa: E402
from .runtime.graph import StepGraph, StepGraphError  # noqa: E402
from .runtime.loader import ModelLoadError, load_model, model_from_tensors  # noqa: E402
from .runtime.lora import LoRA, LoRAError  # noqa: E402
from .runtime.optim import AdamW  # noqa: E402
from .runtime.step import forward, forward_backward, loss_eval  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "AdamW", "Batch", "BatchError", "LoRA", "LoRAError", "ModelConfig", "ModelLoadError", "StepGraph",
    "StepGraphError",
    "UnsupportedModelError", "forward", "forward_backward", "load_model", "model_from_tensors", "loss_eval", "pack",
]
