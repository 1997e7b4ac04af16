"""lean/kernels/embedding.py against lean/reference/embedding.py: a gather is a copy, so every
dtype must match bit for bit."""
import pytest
import torch

from lean.kernels.embedding import embedding_fwd
from lean.reference.embedding import embedding_ref
from tests.util import DEVICE, fresh_generator, poison, randn

# A copy is exact, and the interpreter's bf16 trouble is only in tl.dot: bf16 runs on CPU too.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 37, 11), (7, 131, 257), (129, 1000, 131),
          pytest.param(4099, 4096, 32003, marks=pytest.mark.gpu)]


def _assert_equal(out, ref):
    assert out.shape == ref.shape
    bad = ~((out == ref) | (torch.isnan(out) & torch.isnan(ref)))
    assert not bad.any(), f"{int(bad.sum())} elements differ (first at {bad.nonzero()[0].tolist()})"
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) elements"


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("N,C,V", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd(dtype, N, C, V, id_dtype, strided):
    g = fresh_generator()
    pad = 5 if strided else 0
    table = randn(V, C + pad, g=g, dtype=dtype)[:, pad:]        # (V, C), maybe row-strided
    ids = torch.randint(0, V, (N,), generator=g, device=DEVICE).to(id_dtype)
    out_base = torch.empty(N, C + 2 * pad, device=DEVICE, dtype=dtype)
    poison(out_base)
    out = out_base[:, pad:pad + C]
    embedding_fwd(out, ids, table)
    _assert_equal(out, embedding_ref(ids, table))
    if strided:
        assert torch.isnan(out_base[:, :pad]).all() and torch.isnan(out_base[:, pad + C:]).all(), \
            "wrote outside the view"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fwd_from_pinned_host_table_gpu(dtype):
    """A table in pinned host memory (the planner's place for an untied table under a VRAM budget):
    the kernel reads its rows over PCIe; the same bits as a device table, ids out of range too."""
    g = fresh_generator("cuda")
    V, C, N = 32003, 4099, 8191
    table = randn(V, C, g=g, dtype=dtype, device="cuda")            # (V, C) on the GPU
    host = torch.empty(V, C, dtype=dtype, pin_memory=True)
    host.copy_(table)
    ids = torch.randint(-3, V + 3, (N,), generator=g, device="cuda").to(torch.int32)
    out, ref = torch.empty(N, C, device="cuda", dtype=dtype), torch.empty(N, C, device="cuda", dtype=dtype)
    poison(out)
    embedding_fwd(out, ids, host)
    embedding_fwd(ref, ids, table)
    _assert_equal(out, ref)
    with pytest.raises(ValueError, match=r"table: expected it on out's device \(cuda:0\) .* \(not pinned\)"):
        embedding_fwd(out, ids, host.clone())                       # pageable host memory: refused


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_out_of_range_ids_write_zeros(id_dtype):
    """ids outside [0, V) read nothing and give zero rows; the rows around them are intact."""
    g = fresh_generator()
    V, C = 13, 37
    table = randn(V, C, g=g)
    ids = torch.tensor([3, -1, V, 0, V + 1000, -(2**31) + 1, V - 1], device=DEVICE, dtype=id_dtype)
    out = torch.empty(ids.shape[0], C, device=DEVICE)
    poison(out)
    embedding_fwd(out, ids, table)
    _assert_equal(out, embedding_ref(ids, table))
    assert (out[[1, 2, 4, 5]] == 0).all()


def test_rejects_bad_arguments():
    table = torch.randn(11, 37, device=DEVICE)
    ids = torch.tensor([1, 2, 3], device=DEVICE)
    out = torch.empty(3, 37, device=DEVICE)
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 37\)"):
        embedding_fwd(torch.empty(4, 37, device=DEVICE), ids, table)
    with pytest.raises(ValueError, match=r"ids: expected shape \(\*\)"):
        embedding_fwd(out, ids[None, :], table)
    with pytest.raises(TypeError, match="ids: expected dtype torch.int32 or torch.int64"):
        embedding_fwd(out, ids.float(), table)
    with pytest.raises(TypeError, match="out: expected dtype torch.float32"):
        embedding_fwd(out.half(), ids, table)
    with pytest.raises(ValueError, match="table: expected unit stride in the last dimension"):
        embedding_fwd(out, ids, torch.randn(37, 11, device=DEVICE).t())
    with pytest.raises(ValueError, match="ids: expected a contiguous tensor"):
        embedding_fwd(out[:2], torch.arange(4, device=DEVICE)[::2], table)
    with pytest.raises(ValueError, match="ids: expected device"):
        embedding_fwd(out, ids.to("meta"), table)
    with pytest.raises(ValueError, match="table: expected it on out's device"):
        embedding_fwd(out, ids, table.to("meta"))
