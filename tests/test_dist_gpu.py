"""Data parallel and sharded weights on 2 GPUs (NCCL): the CPU file's equalities in bf16, the step
graph with its all-reduce inside, and what sharding saves. Skipped with fewer than 2 GPUs.

Run on an nvidia-h100-x2 (or larger) machine: `tools/gpu_check.sh dist-tests` (one device call;
the multi-GPU bench is `dist-bench 2`, another). Every rank is a fresh `python -m tests.dist_worker`
process (tests/test_dist.py's run_ranks; no fork: no CUDA state may cross one) on cuda:LOCAL_RANK;
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, set by lean.runtime.dist). Passed on 4 x H100 (2026-11-26).
Tolerance (the project's rule, on the LoRA parameters after the run, relative L2): a bf16 run's
distance to the same run in one process is at most twice that one-process run's own distance to
its fp32 twin (the bf16 error torch-style rules allow), plus 1e-6.
"""
import json
from pathlib import Path

import pytest
import torch

import lean.runtime.train as T
from tests.hf_models import build_hf, tiny_config
from tests.test_dist import _cfg, _ok, _state, run_ranks, setup  # noqa: F401 - the module's fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: tools/gpu_check.sh dist-tests on an nvidia-h100-x2 machine")]


RUN = dict(steps=3, max_tokens=64, save_every=3, targets=["q", "down"])  # on a GPU the runs can be longer


def _l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _one_process(setup, out, **kw):
    cfg = _cfg(setup, out, **RUN, **kw)
    T.train(T.TrainConfig(**cfg))
    return _state(cfg["out_dir"])["params"]


def test_two_gpus_equal_one_gpu_bf16(setup):
    ref = _one_process(setup, "g-ref", grad_accum=2, dtype="bfloat16", graph=False)
    ref32 = _one_process(setup, "g-ref32", grad_accum=2, dtype="float32", graph=False)
    dp = _cfg(setup, "g-dp", dtype="bfloat16", graph=False, **RUN)
    _ok(run_ranks(2, dp))
    got = _state(dp["out_dir"])["params"]
    err, bound = _l2(got, ref), 2 * _l2(ref, ref32) + 1e-6
    print(f"2 GPUs vs 1 GPU: relative L2 {err:.3e} (bound {bound:.3e}; bit-equal: {torch.equal(got, ref)})")
    assert err <= bound


def test_graph_with_the_allreduce_inside(setup):
    """lean-train's captured step on 2 GPUs (grad_accum 1, dropout 0): the capture succeeds (no
    fallback line) and lands where the eager data-parallel run does, by the rule; sharded weights
    inside the graph (the layers' gathers and the sharded lm_head's) land there by the rule too
    (the sharded head's loss adds its chunks in another order than the whole head's kernel)."""
    kw = dict(RUN, dtype="bfloat16", dropout=0.0)
    eager = _cfg(setup, "g-eager", graph=False, **kw)
    _ok(run_ranks(2, eager))
    ref32 = _one_process(setup, "g-ref32-d0", grad_accum=2, dtype="float32", dropout=0.0, graph=False)
    graphed = _cfg(setup, "g-graph", graph=True, **kw)
    res = _ok_quiet(run_ranks(2, graphed))
    sharded = _cfg(setup, "g-graph-shard", graph=True, shard_weights=True, **kw)
    res_sh = _ok_quiet(run_ranks(2, sharded))
    a, b = _state(eager["out_dir"])["params"], _state(graphed["out_dir"])["params"]
    assert _l2(b, a) <= 2 * _l2(a, ref32) + 1e-6
    assert _l2(_state(sharded["out_dir"])["params"], b) <= 2 * _l2(a, ref32) + 1e-6
    assert res["step"] == res_sh["step"] == 3


def _ok_quiet(results):
    """_ok, and no rank fell back from the captured step."""
    for _, out, err in results:
        assert "the captured step with its all-reduce inside failed" not in out + err, (out + err)[-2000:]
    return _ok(results)


def test_sharded_weights_save_memory_and_keep_the_bits(tmp_path):
    """8 layers of hidden 256 over 2 GPUs: the same parameters as unsharded by the rule (against the
    sharded run's fp32 twin: the sharded lm_head's loss adds in another order), and a peak lower by
    the layers' other half less the two rotating full layers (within 10%; the tables' share of the
    saving is a few KiB at this vocabulary)."""
    config = tiny_config("llama", torch.float32)
    config.update(dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2))
    build_hf("llama", 3, config=config).save_pretrained(tmp_path / "model")
    import numpy as np

    from tests.test_train import _records, _write_tokenizer

    _write_tokenizer(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(np.random.default_rng(0))))
    here = (tmp_path, 5)  # _cfg's (root, seed)
    whole = _cfg(here, "whole", dtype="bfloat16", graph=False, **RUN)
    part = _cfg(here, "part", dtype="bfloat16", graph=False, shard_weights=True, **RUN)
    part32 = _cfg(here, "part32", dtype="float32", graph=False, shard_weights=True, **RUN)
    r_whole, r_part = _ok(run_ranks(2, whole)), _ok(run_ranks(2, part))
    _ok(run_ranks(2, part32))
    a, b, ref32 = (_state(c["out_dir"])["params"] for c in (whole, part, part32))
    err, bound = _l2(b, a), 2 * _l2(b, ref32) + 1e-6
    print(f"sharded vs whole (2 GPUs): relative L2 {err:.3e} (bound {bound:.3e})")
    assert err <= bound
    layer = sum(p.numel() for n, p in build_hf("llama", 3, config=config).named_parameters() if ".layers.0." in n) * 2
    saved = 8 * layer / 2 - 2 * layer
    print(f"peaks: whole {r_whole['peak_bytes'] / 2**20:.1f} MiB, sharded {r_part['peak_bytes'] / 2**20:.1f} MiB; "
          f"predicted saving {saved / 2**20:.1f} MiB")
    assert abs((r_whole["peak_bytes"] - r_part["peak_bytes"]) - saved) <= 0.1 * saved
    assert Path(part["out_dir"], "adapter", "adapter_model.safetensors").is_file()
