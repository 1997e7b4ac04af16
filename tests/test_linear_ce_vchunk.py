"""lean/kernels/linear_ce_vchunk.py: the loss and dh over vocabulary chunks, against torch in fp64 (the
tolerance rule) and against linear_ce_fwd_bwd, whose math it shares (close to its last bits)."""
import pytest
import torch

from lean.kernels.linear_ce import linear_ce_fwd_bwd
from lean.kernels.linear_ce_vchunk import DeviceChunks, linear_ce_vchunks, logits_vchunks
from tests.test_linear_ce import check_against_reference, make_inputs
from tests.util import DEVICE, fresh_generator, poison

gpu = pytest.mark.gpu


class Recorder(DeviceChunks):
    """DeviceChunks that checks the protocol: every get follows begin's order and is matched by done."""

    def begin(self, order):
        self.order, self.calls = list(order), []

    def get(self, c):
        assert not self.calls or self.calls[-1][0] == "done", "get before the previous chunk's done"
        self.calls.append(("get", c))
        return super().get(c)

    def done(self, c):
        assert self.calls[-1] == ("get", c)
        self.calls.append(("done", c))


def run(h, w, targets, chunk_v, *, with_dh=True, **kw):
    loss = torch.empty(2, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if with_dh else None
    poison(loss, dh)
    src = Recorder(w, chunk_v)
    linear_ce_vchunks(loss, dh, h, src, targets, **kw)
    assert [c for kind, c in src.calls if kind == "get"] == src.order
    n = src.n
    assert src.order == list(range(n)) + (list(reversed(range(n))) if with_dh and h.shape[0] else [])
    return loss, dh


# (N, V, C, chunk_v, grad_scale, ignore_index): several chunks with a short last one, one-row chunks,
# a single chunk bigger than V, chunks of more than one interpreter block (512).
CASES = [
    (1, 97, 64, 10, 1.0, -100),
    (37, 2053, 64, 700, 0.37, -100),  # chunks 700, 700, 653: two blocks of 512 each
    (45, 13, 48, 1, 2.5, -1),  # 13 one-row chunks; another ignore_index
    (20, 300, 80, 512, 1 / 20, -100),  # one chunk
    pytest.param(4096, 151936, 1024, 8192, 1 / 4096, -100, marks=gpu),
    pytest.param(2048, 151936, 5120, 3200, 1 / 2048, -100, marks=gpu),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,V,C,chunk_v,grad_scale,ignore_index", CASES)
def test_close_to_reference(dtype, N, V, C, chunk_v, grad_scale, ignore_index):
    if DEVICE == "cuda" and dtype == torch.float16:
        dtype = torch.bfloat16
    g = fresh_generator()
    h, w, targets = make_inputs(N, V, C, dtype, g, ignore_index=ignore_index)
    targets[0] = V - 1  # the last chunk's last row is a target
    loss, dh = run(h, w, targets, chunk_v, grad_scale=grad_scale, ignore_index=ignore_index)
    check_against_reference(loss, dh, h, w, targets, grad_scale=grad_scale, ignore_index=ignore_index)
    # and against the one-chunk kernel: the same per-element math, sum-exp and dh added in other orders
    ref_loss, ref_dh = torch.empty(2, device=h.device), torch.empty_like(h)
    linear_ce_fwd_bwd(ref_loss, ref_dh, h, w, targets, grad_scale=grad_scale, ignore_index=ignore_index)
    assert loss[1] == ref_loss[1]
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(loss[0], ref_loss[0], rtol=tol, atol=0), (loss, ref_loss)
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -10 if dtype == torch.float16 else -7)
    err = (dh.float() - ref_dh.float()).abs().max().item()
    if dh.is_cuda and dtype == torch.float32 and V >= 16384:
        # fp32 on the GPU sums each element's V products on CUDA cores in its own order (slices of
        # gemm.IEEE_STEPS K steps, then the chunks): each kernel is held to the fp32 rule (1e-5 of
        # max|dh| from fp64; test_linear_ce), so the two lie within twice that of each other
        assert err <= 2e-5 * ref_dh.float().abs().max().item(), err
    else:
        # a few roundings of dh's largest, and one more per vocab chunk (its partial sums are added in
        # another order: seed 482218300 gave 4.7 at V 2053 in 3 chunks)
        assert err <= 4 * ulp * (1 + V // chunk_v) * ref_dh.float().abs().max().item(), err


@pytest.mark.parametrize("with_dh", [True, False])
def test_all_rows_ignored_and_loss_only(with_dh):
    g = fresh_generator()
    h, w, targets = make_inputs(19, 257, 64, torch.float32, g, ignore_frac=0.0)
    if with_dh:
        targets[:] = -100
    loss, dh = run(h, w, targets, 100, with_dh=with_dh)
    check_against_reference(loss, dh, h, w, targets)
    if with_dh:
        assert loss.tolist() == [0.0, 0.0] and not dh.any()


def test_grad_scale_tensor_and_empty_batch():
    g = fresh_generator()
    h, w, targets = make_inputs(23, 300, 64, torch.float32, g)
    scale = torch.full((1,), 0.25, device=h.device)
    loss, dh = run(h, w, targets, 64, grad_scale=scale)
    check_against_reference(loss, dh, h, w, targets, grad_scale=0.25)
    loss, dh = run(h[:0], w, targets[:0], 64)
    assert loss.tolist() == [0.0, 0.0] and dh.shape == (0, 64)


@pytest.mark.parametrize("chunk_v", [1, 77, 1000])
def test_logits_by_chunks(chunk_v):
    g = fresh_generator()
    h, w, _ = make_inputs(9, 300, 64, torch.float32, g)
    out = torch.empty(9, 300, device=h.device)
    poison(out)
    logits_vchunks(out, h, DeviceChunks(w, chunk_v))
    ref = h.double() @ w.double().t()
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_errors():
    g = fresh_generator()
    h, w, targets = make_inputs(4, 50, 64, torch.float32, g)
    loss = torch.empty(2, device=h.device)
    with pytest.raises(ValueError, match="lm_head chunks"):
        linear_ce_vchunks(loss, None, h[:, :32].contiguous(), DeviceChunks(w, 10), targets)
    with pytest.raises(ValueError, match="chunk_v"):
        DeviceChunks(w, 0)
