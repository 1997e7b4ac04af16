"""gmm on a persistent grid whose tile loop is flattened into its K loop, against lean's gmm.

    python tools/gmm_flat_probe.py [--models a3b,oss] [--zipf 0] [--programs 1]
    TRITON_INTERPRET=1 python tools/gmm_flat_probe.py --check     # CPU: the forms agree (fp32, tiny)

A question for issue 18: gmm (lean/kernels/grouped_gemm.py) runs one program per tile, one program an
SM at its 128 x 256 tile (196 KB of shared memory), so each tile's pipeline fill, its prologue (the
expert lookup, the gather indices, the LoRA term) and its epilogue (a 64 KB masked store) leave the
SM's tensor cores idle. The dense x W^T gained 4-5% from the same change (gemm.TMA_FLAT); a
persistent gmm grid without it was slower (a1e6187). Forms, each timed on gmm_tune.py's cases:
  lean     grouped_gemm.gmm as the step runs it (tuned tile, the short tail tile on)
  notail   the same with grouped_gemm.TAIL off (what the flat forms give up: one tile height)
  persist  one program per SM walking the tiles in gmm's grouped order, the experts' tile table
           read once per program into registers; no flattening
  flat     persist with tl.range(flatten=True): the next tile's first K steps load under this
           tile's last ones and its epilogue
Each form's y is compared with notail's bit for bit (the same products in the same order).
The LoRA term (rank <= 64) is one dot ahead of the main loop, as gmm's _lora_first.
Measured (H200, 2026-11-29, --zipf 0, BENCHMARKS.md's MoE section): persist 0.82-1.05x lean's time a
case, flat 0.81-1.04x without LoRA and 0.41-0.64x with it (its LoRA dot in the flattened prologue);
every y bit-equal to notail's. Neither was built into gmm.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lean.kernels.grouped_gemm as GG  # noqa: E402
from lean.kernels.arch import arch  # noqa: E402
from lean.kernels.gemm import grouped_tile  # noqa: E402


@triton.jit
def _gmm_persist_kernel(
    y_ptr, x_ptr, w_ptr, off_ptr, gather_ptr, xa_ptr, b_ptr,
    O, Kd, R, E, gather_div, scale, n_programs,
    stride_ym, stride_xm, stride_xk, stride_we, stride_wo, stride_wk,
    stride_am, stride_ar, stride_be, stride_bo, stride_br,
    GATHER: tl.constexpr, LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, W_DESC: tl.constexpr, FLAT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    ar = tl.arange(0, BLOCK_E)
    lo = tl.load(off_ptr + ar, mask=ar < E, other=0)
    hi = tl.load(off_ptr + ar + 1, mask=ar < E, other=0)
    tiles_e = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles_e, 0)
    total_m = tl.sum(tiles_e, 0)
    tiles = total_m * tl.cdiv(O, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for t in tl.range(tl.program_id(0), tiles, n_programs, flatten=FLAT):
        pid_m, pid_n = grouped_tile(t, total_m * BLOCK_M, O, BLOCK_M, BLOCK_N, GROUP_M)
        e = tl.sum((ends <= pid_m).to(tl.int32), 0)
        mine = ar == e
        row0 = tl.sum(tl.where(mine, lo, 0), 0) + (pid_m - tl.sum(tl.where(mine, ends - tiles_e, 0), 0)) * BLOCK_M
        row_end = tl.sum(tl.where(mine, hi, 0), 0)
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < row_end
        n_ok = rn < O
        e64 = e.to(tl.int64)
        if GATHER:
            rx = tl.load(gather_ptr + rm, mask=m_ok, other=0) // gather_div
        else:
            rx = rm
        if W_DESC == 0 or GATHER:
            x_rows = x_ptr + rx.to(tl.int64)[:, None] * stride_xm
        if LORA:
            rr = tl.arange(0, BLOCK_R)
            at = tl.load(xa_ptr + rm.to(tl.int64)[:, None] * stride_am + rr[None, :] * stride_ar,
                         mask=m_ok[:, None] & (rr < R)[None, :], other=0.0)
            bt = tl.load(b_ptr + e64 * stride_be + rr[:, None] * stride_br + rn.to(tl.int64)[None, :] * stride_bo,
                         mask=(rr < R)[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(at, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=PRECISION) * scale
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, Kd, BLOCK_K):
            if W_DESC == 0 or GATHER:
                xt = tl.load(x_rows + (k0 + rk)[None, :] * stride_xk, mask=m_ok[:, None] & (k0 + rk < Kd)[None, :],
                             other=0.0)
            else:
                xt = x_ptr.load([row0, k0])
            if W_DESC == 0:
                wt = tl.load(w_ptr + e64 * stride_we + (k0 + rk)[:, None] * stride_wk
                             + rn.to(tl.int64)[None, :] * stride_wo, mask=(k0 + rk < Kd)[:, None] & n_ok[None, :],
                             other=0.0)
            elif W_DESC == 1:
                wt = w_ptr.load([e * O + pid_n * BLOCK_N, k0]).T
            else:
                wt = w_ptr.load([e * Kd + k0, pid_n * BLOCK_N])
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gmm_persist(y, x, w, offsets, *, gather=None, gather_div=1, lora=None, flat=True, programs=1):
    """grouped_gemm.gmm's y on the persistent grid (flat: its tile loop flattened into the K loop)."""
    E, O, Kd = w.shape
    P = y.shape[0]
    BM, BN, BK, warps, stages = GG._config(triton.cdiv(P, E), O, Kd, x.dtype, x.device)
    xa, b, scale = lora if lora is not None else (None, None, 0.0)
    R = xa.shape[1] if lora is not None else 0
    assert R <= 64
    mode, x_src, w_src, _ = GG._loads(x, w, gather is not None, P * O * Kd, BM, BN, BK, 0)
    n_programs = programs * arch(x.device).sms
    _gmm_persist_kernel[(n_programs,)](
        y, x_src, w_src, offsets, gather if gather is not None else offsets,
        xa if xa is not None else y, b if b is not None else y,
        O, Kd, R, E, int(gather_div), float(scale), n_programs,
        y.stride(0), x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        *(xa.stride() if xa is not None else (0, 0)), *(b.stride() if b is not None else (0, 0, 0)),
        GATHER=gather is not None, LORA=lora is not None,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=GG._pow2(R, 16, 64), BLOCK_E=GG._pow2(E, 16, GG.MAX_E),
        GROUP_M=8, W_DESC=mode, FLAT=flat, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)


def forms(programs):
    def lean(y, x, w, off, **kw):
        GG.TAIL = True
        GG.gmm(y, x, w, off, **kw)

    def notail(y, x, w, off, **kw):
        GG.TAIL = False
        GG.gmm(y, x, w, off, **kw)
        GG.TAIL = True
    return {"lean": lean, "notail": notail,
            "persist": lambda *a, **kw: gmm_persist(*a, flat=False, programs=programs, **kw),
            "flat": lambda *a, **kw: gmm_persist(*a, flat=True, programs=programs, **kw)}


def check(device="cpu", dtype=torch.float32):
    """The persistent forms against gmm on small problems with empty experts, every flag, both
    weight layouts (the interpreter on the CPU: fp32 or fp16); returns the largest relative diff."""
    g = torch.Generator().manual_seed(0)
    E, P, O, Kd, R = 5, 45, 36, 28, 6   # O, Kd: 16-byte fp32 rows, so the descriptor loads can be forced
    counts = torch.tensor([0, 20, 0, 17, 8])
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    offsets = offsets.to(device)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    x, w = r(P, Kd), r(E, O, Kd)
    gather = torch.randperm(P, generator=g).to(device, torch.int32)
    lora = (r(P, R), r(E, O, R), 0.5)
    worst = 0.0
    for kw in ({}, {"gather": gather}, {"lora": lora}, {"gather": gather, "lora": lora}):
        for wt in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
            ref = torch.empty(P, O, device=device, dtype=dtype)
            GG.gmm(ref, x, wt, offsets, **kw)
            for flat in (False, True):
                y = torch.full((P, O), float("nan"), device=device, dtype=dtype)
                gmm_persist(y, x, wt, offsets, flat=flat, **kw)
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                print(f"check {sorted(kw)} w {'T' if wt.stride(1) == 1 else 'N'} flat {flat}: max |diff| {err:.2e}")
                worst = max(worst, err)
    return worst


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="a3b,oss")
    p.add_argument("--zipf", type=float, default=0.0)
    p.add_argument("--programs", type=int, default=1, help="persistent programs per SM")
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    if a.check:
        worst = check()
        assert worst <= 1e-6, worst
        return
    from triton.testing import do_bench

    from gmm_tune import MODELS, cases
    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    fs = forms(a.programs)
    for model in a.models.split(","):
        offsets, order, K, big, _ = cases(MODELS[model], "cuda", a.zipf)
        for name, x, w, gather, lora in big:
            E, O, Kd = w.shape
            P = order.numel()
            kw = dict(gather=order, gather_div=K) if gather else {}
            if lora:
                kw["lora"] = lora
            flops = 2.0 * P * O * Kd + (2.0 * P * O * lora[0].shape[1] if lora else 0.0)
            ys = {}
            cells = []
            for f, fn in fs.items():
                y = torch.empty(P, O, device="cuda", dtype=torch.bfloat16)
                try:
                    fn(y, x, w, offsets, **kw)
                    torch.cuda.synchronize()
                except Exception as ex:  # noqa: BLE001 (a form that does not compile: reported)
                    cells.append(f"{f} failed ({type(ex).__name__}: {str(ex)[:60]})")
                    continue
                ys[f] = y
                ms = do_bench(lambda: fn(y, x, w, offsets, **kw))
                same = "" if f in ("lean", "notail") else (" =" if torch.equal(y, ys["notail"]) else
                                                          f" diff {(y.float() - ys['notail'].float()).abs().max().item():.1e}")
                cells.append(f"{f} {ms:.3f} ({flops / ms / 1e9:.0f}){same}")
            print(f"{model} {name:13} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
