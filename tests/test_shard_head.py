"""The sharded lm_head (lean/runtime/shard.py's ShardHead) on the CPU: 2 and 3 gloo processes forked
here, each holding 1/N of every chunk of a (V, C) head, run linear_ce_vchunks and logits_vchunks
through it. What each rank gets equals, bit for bit, the same call through DeviceChunks on the
whole head with the same chunk rows (the same chunks in the same order: only where their rows come
from differs); a rank with no tokens still fills every chunk (the others' gathers need its part),
and every rank counts the fills one loss call makes (Gather.complete's arithmetic)."""
import contextlib
import os
import socket
import sys
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from lean.kernels.linear_ce_vchunk import DeviceChunks, linear_ce_vchunks, logits_vchunks


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, V, C, chunk_v, errors):
    import torch.distributed as dist

    from lean.runtime.shard import ShardHead

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        g = torch.Generator().manual_seed(7)  # the same head on every rank
        w = torch.randn(V, C, generator=g) * C**-0.5  # (V, C)
        d = SimpleNamespace(rank=rank, world=world, gathers=None, collective=lambda what: contextlib.nullcontext())
        head = ShardHead(w, d, "cpu", chunk_v=chunk_v)
        assert head.chunk_v % world == 0 and head.shard.shape == (head.n, head.chunk_v // world, C)
        assert head.w is None  # the whole table is not held by the head (on a GPU it would stay there)
        whole = DeviceChunks(w, head.chunk_v)
        gr = torch.Generator().manual_seed(100 + rank)  # this rank's own tokens; rank 1 has none
        N = 0 if rank == 1 else 37 + 5 * rank
        h = torch.randn(N, C, generator=gr)  # (N, C)
        t = torch.randint(0, V, (N,), generator=gr)
        t[::4] = -100
        for with_dh in (True, False):
            head.fills = 0
            outs = []
            for src in (head, whole):
                loss = torch.empty(2)
                dh = torch.empty(N, C) if with_dh else None
                linear_ce_vchunks(loss, dh, h, src, t, grad_scale=0.5)
                outs.append((loss, dh))
            assert head.fills == head.fills_per_call(with_dh), (head.fills, head.fills_per_call(with_dh))
            (l1, d1), (l2, d2) = outs
            assert torch.equal(l1, l2), (l1, l2)
            assert d1 is None or torch.equal(d1, d2)
        logits, ref = torch.empty(N, V), torch.empty(N, V)
        logits_vchunks(logits, h, head)
        logits_vchunks(ref, h, whole)
        assert torch.equal(logits, ref)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        os._exit(1)


@pytest.mark.parametrize("world,V,C,chunk_v", [(2, 131, 16, 40), (3, 127, 8, 32), (2, 50, 8, None)])
def test_sharded_head_equals_the_whole_head(world, V, C, chunk_v):
    """chunk_v 40 over 2 ranks: 4 chunks of 20 + 20 rows (the last one 11 real rows, the rest zero
    padding); 32 over 3: rounded up to 33, 4 chunks; None: one chunk of the whole vocabulary."""
    if sys.platform != "linux":
        pytest.skip("forks gloo processes")
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, V, C, chunk_v, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not alive and not msgs and all(p.exitcode == 0 for p in procs), (msgs, [p.exitcode for p in procs])
