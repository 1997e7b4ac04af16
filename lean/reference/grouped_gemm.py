"""Plain-torch references for lean/kernels/grouped_gemm.py: one loop over the experts, each expert's
rows a dense matmul. They read offsets on the host (a reference, never the step).

gmm_ref computes in the dtype of its inputs: float64 for the reference, bf16/fp16 for torch's own
low-precision result (the tolerance rule's `lowp`). gmm_wgrad_ref scales and gathers rows in the
inputs' dtype (the kernel rounds s_p * a to a's dtype too), then multiplies in `dtype`.
"""
import torch


def _rows(gather, gather_div, lo, hi):
    """The source rows of sorted rows lo..hi-1: gather[p] // gather_div, else p."""
    if gather is None:
        return torch.arange(lo, hi, device="cpu")
    return (gather[lo:hi].long() // gather_div).cpu()


def gmm_ref(x, w, offsets, *, gather=None, gather_div=1, lora=None, bias=None, y0=None):
    """y (P, O): y[p] = x[r(p)] w[e]^T [+ scale * xa[p] b[e]^T] [+ bias[e]] [+ y0[p]] for the rows p of
    each expert e; bias added in x's dtype (as HF adds GPT-OSS's expert biases)."""
    off = offsets.tolist()
    P, O = off[-1], w.shape[1]
    y = torch.zeros(P, O, dtype=x.dtype, device=x.device)
    for e in range(w.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        ye = x[_rows(gather, gather_div, lo, hi).to(x.device)] @ w[e].t()
        if lora is not None:
            xa, b, scale = lora
            ye = ye + scale * (xa[lo:hi] @ b[e].t())
        if bias is not None:
            ye = ye + bias[e].to(ye.dtype)
        y[lo:hi] = ye
    if y0 is not None:
        y = y + y0.to(y.dtype)
    return y


def gmm_wgrad_ref(a, b, offsets, *, gather_a=None, gather_b=None, gather_div=1, scale=None, alpha=1.0,
                  dtype=torch.float64):
    """dw (E, M, Kd) in `dtype`: alpha * sum over the rows p of expert e of (s_p a[ra(p)])^T b[rb(p)]."""
    off = offsets.tolist()
    E = len(off) - 1
    dw = torch.zeros(E, a.shape[1], b.shape[1], dtype=dtype, device=a.device)
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        ae = a[_rows(gather_a, gather_div, lo, hi).to(a.device)]
        be = b[_rows(gather_b, gather_div, lo, hi).to(b.device)]
        if scale is not None:
            vec, idx = scale
            s = vec[idx[lo:hi].long()]
            wide = torch.promote_types(a.dtype, torch.float32)
            ae = (ae.to(wide) * s.to(wide)[:, None]).to(a.dtype)
        dw[e] = alpha * (ae.to(dtype).t() @ be.to(dtype))
    return dw
