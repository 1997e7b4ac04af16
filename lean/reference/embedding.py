"""Plain-torch reference for lean/kernels/embedding.py."""
import torch


def embedding_ref(ids, table):
    """out = table[ids], with rows of out-of-range ids (outside [0, V)) set to zero, as the
    kernel documents."""
    V = table.shape[0]
    ok = (ids >= 0) & (ids < V)
    out = table[ids.clamp(0, V - 1).long()]
    return torch.where(ok[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
