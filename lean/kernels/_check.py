"""Launcher-boundary checks shared by every kernel file: each failure names the argument,
what was expected and what arrived."""
import torch


def check(t, name, *, shape=None, dtype=None, device=None, contiguous=False, last_contiguous=False):
    """Validate one tensor argument. shape entries may be None (any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device} (move every argument to one device)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()} (call .contiguous())")
    if last_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: expected unit stride in the last dimension, got strides {t.stride()}")
    return t
