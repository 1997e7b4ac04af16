"""lean: LoRA fine-tuning in pure Triton with a hand-scheduled backward."""
__version__ = "0.1.0"
