"""Test configuration: CPU runs the real Triton kernels through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, when pytest
loads this file and before any test module imports lean.
"""
import fcntl
import os
import signal

# Several GPUs (LEAN_TEST_GPUS=2,3, tools/gpu_check.sh TEST_GPUS): each pytest-xdist worker takes
# one of them, before torch first reads CUDA_VISIBLE_DEVICES, so the suite spreads over the cards
_gpus = [g for g in os.environ.get("LEAN_TEST_GPUS", "").split(",") if g]
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus and _worker.startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(_worker[2:]) % len(_gpus)]

import pytest  # noqa: E402
import torch  # noqa: E402

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so
# would every rank the tests spawn: the Ctrl-C tests (test_dist.py, test_train.py) need Python's own
# handler, as a terminal or CI gives it
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The CPU suite (the README's `pytest -n 2 --dist loadfile`, CI's two cores): the files with the most
# work go first, so that the two workers end together (longest first). xdist's own order deals the
# files with the most tests first, which can leave a one-test file of minutes (test_default_run) to
# run alone at the end. Seconds of test time per file on the 2-core machine (`--durations=0`, the
# whole suite at 27264a0, 2,798 s in all): train 375, offload 295, gpt_oss 215, default_run 210,
# attention 162, moe 158, host_state 154, qlora 154, dist 135, cli_guard 126; every other file < 70.
SLOW_FILES = ("test_train.py", "test_offload.py", "test_gpt_oss.py", "test_default_run.py", "test_attention.py",
              "test_moe.py", "test_host_state.py", "test_qlora.py", "test_dist.py", "test_cli_guard.py")


def pytest_configure(config):
    if not torch.cuda.is_available() and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False   # xdist then deals the files in the order collected


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tools/gpu_check.sh on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# On the GPU, pytest-xdist runs several test processes on one card (tools/gpu_check.sh: the suite is
# compile-bound). A whole-model step takes tens of GiB, so those tests hold an exclusive lock and the
# kernel tests a shared one: a big test runs alone, and every test hands its cached blocks back.
BIG_GPU_FILES = {"test_step_gpu.py", "test_graph.py", "test_offload.py", "test_train.py", "test_moe_gpu.py",
                 "test_gpt_oss_gpu.py", "test_qlora_gpu.py", "test_head_host.py", "test_dist_gpu.py"}
GPU_LOCK = f"/tmp/lean-gpu-tests{os.environ.get('CUDA_VISIBLE_DEVICES', '').replace(',', '-')}.lock"  # one per card


@pytest.fixture(autouse=True)
def _gpu_share(request):
    if not torch.cuda.is_available() or "gpu" not in request.node.keywords:
        yield
        return
    big = request.node.path.name in BIG_GPU_FILES or "big_gpu" in request.node.keywords
    with open(GPU_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if big else fcntl.LOCK_SH)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)
