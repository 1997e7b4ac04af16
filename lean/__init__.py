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
from .models.config import ModelConfig, UnsupportedModelError
from .runtime.batch import Batch, BatchError, pack
from .runtime.graph import StepGraph, StepGraphError
from .runtime.loader import ModelLoadError, load_model, model_from_tensors
from .runtime.lora import LoRA, LoRAError
from .runtime.optim import AdamW
from .runtime.step import forward, forward_backward, loss_eval

__version__ = "0.1.0"
__all__ = [
    "AdamW", "Batch", "BatchError", "LoRA", "LoRAError", "ModelConfig", "ModelLoadError", "StepGraph",
    "StepGraphError",
    "UnsupportedModelError", "forward", "forward_backward", "load_model", "model_from_tensors", "loss_eval", "pack",
]
