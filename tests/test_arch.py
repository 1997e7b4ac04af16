"""lean/kernels/arch.py, and every kernel compiled for every GPU target against its shared memory.

test_every_kernel_fits_every_target runs tools/arch_compile.py: the step of every preset model
(Llama-3.2-1B/3B, Qwen3-0.6B/8B/14B, SmolLM2-135M) on meta tensors under each target's arch row,
every launch recorded with the config its chooser returned, and each distinct launch compiled by
Triton 3.6 (its bundled ptxas) for sm_80, 86, 89, 90, 100, 120 and 121; metadata.shared must stay
within the arch table's limit. Launches whose Triton compile key is in tests/arch_fit.json take
the shared size recorded there (the memo: the same key means Triton would reuse the same binary),
except a few drawn at random each run, which are compiled again and must agree; every other
launch is compiled. test_a_config_too_large_fails is the test of that test.
test_rtx_tier_keeps_spills_out_of_the_hot_loops: on sm_86 the LoRA GEMMs and attention compile with
no spill instruction inside a loop (tools/ptxas_report.py); test_a_spilling_config_fails_the_loop_
spill_gate is its test.
"""
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys

import pytest
import torch

import lean.kernels
import lean.kernels.arch as A

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "arch_compile.py")
TARGETS = (80, 86, 89, 90, 100, 120, 121)
# Kernels only the Hopper path launches (TMA descriptors): compiled for the targets that take it.
HOPPER_ONLY = {"_matmul_tma_kernel", "_lora_linear_fwd_tma_pre_kernel", "_lora_linear_bwd_tma_pre_kernel"}


def _compile_tool(args, code=None, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT)
    cmd = [sys.executable, TOOL, *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _kernels():
    """Every @triton.jit kernel (a `_..._kernel` name) defined in lean/kernels."""
    names = set()
    for info in pkgutil.iter_modules(lean.kernels.__path__):
        mod = importlib.import_module(f"lean.kernels.{info.name}")
        for name, obj in inspect.getmembers(mod):
            if name.endswith("_kernel") and getattr(obj, "fn", None) is not None and obj.fn.__module__ == mod.__name__:
                names.add(name)
    return names


def test_every_kernel_fits_every_target(tmp_path):
    out = tmp_path / "arch.json"
    res = _compile_tool(["--workers", str(min(4, os.cpu_count() or 2)), "--spot", "6", "--json", str(out)])
    print(res.stdout[-4000:], res.stderr[-4000:])
    assert res.returncode == 0, f"tools/arch_compile.py failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    results = json.loads(out.read_text())
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    seen = {(r["kernel"], r["cc"]) for r in results}
    for name in _kernels():
        for cc in TARGETS:
            if name in HOPPER_ONLY and not A.target(cc // 10, cc % 10).tma:
                continue
            assert (name, cc) in seen, f"{name} was never compiled for sm_{cc}: add its launch to tools/arch_compile.py"
    assert any(r["how"] == "memo, recompiled" for r in results) or all(r["how"] == "compiled" for r in results)


def test_a_config_too_large_fails():
    """The same check with one gemm tile enlarged past an RTX card's shared memory: it must fail,
    naming the kernel, the config and the limit."""
    code = ("import sys; sys.argv[0] = 'arch_compile'; sys.path.insert(0, 'tools'); import arch_compile as h; "
            "import lean.kernels.gemm as G; G.TILES['sm86'] = dict(G.TILES['sm86'], kmajor=(256, 256, 64, 8, 3)); "
            "sys.exit(h.main(sys.argv[1:]))")
    res = _compile_tool(["--models", "qwen3-0.6b", "--targets", "86", "--workers", "2"], code=code)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "MISFIT sm_86 _matmul_kmajor_kernel" in res.stdout and "BLOCK_M=256, BLOCK_N=256" in res.stdout, res.stdout[-3000:]
    assert "the arch allows 101,376" in res.stdout


PTXAS_TOOL = os.path.join(ROOT, "tools", "ptxas_report.py")
# The kernels of a dense step whose configs the mma.sync tiers choose (the x W^T GEMMs are held by the
# shared-memory test above and spill nowhere there); attention at head dim 256 (no preset, untuned) is left out.
HOT = "_lora_linear_fwd_kernel,_lora_linear_bwd_kernel,_attention_fwd_kernel,_attention_bwd_dkdv_kernel,_attention_bwd_dq_kernel"


def test_rtx_tier_keeps_spills_out_of_the_hot_loops():
    """On sm_86 (RTX 30/40/50: mma.sync, a dot's operands in registers) the LoRA GEMMs and attention
    at Qwen3-0.6B's shapes compile with no spill instruction inside an innermost loop, by Triton 3.6's
    ptxas and the SASS (tools/ptxas_report.py); their sm90 tiles spilled 30-55 there."""
    res = subprocess.run([sys.executable, PTXAS_TOOL, "--models", "qwen3-0.6b", "--target", "86", "--kernels", HOT,
                          "--skip", "HEAD_DIM=256", "--no-loop-spills", "--workers", "2"], cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    launches = int(res.stdout.split(" distinct launches on sm_86")[0].rsplit("# ", 1)[1])
    assert launches >= 15, res.stdout[-3000:]  # every variant of the five kernels was looked at


def test_a_spilling_config_fails_the_loop_spill_gate():
    """The gate's own test: the LoRA forward at the sm90 tile on sm_86 spills inside its main loop."""
    code = ("import sys; sys.path.insert(0, 'tools'); import ptxas_report as p; import lean.kernels.lora_linear as L; "
            "L._FWD['sm86'] = (128, 256, 32, 8, 4); sys.exit(p.main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "--models", "qwen3-0.6b", "--target", "86", "--kernels",
                          "_lora_linear_fwd_kernel", "--no-loop-spills", "--workers", "2"], cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "LOOP SPILLS sm_86 _lora_linear_fwd_kernel" in res.stdout and "BLOCK_N=256" in res.stdout, res.stdout[-3000:]


def test_arch_rows():
    h100 = A.target(9, 0)
    assert (h100.tma, h100.tier, h100.smem, h100.sms) == (True, "sm90", 232_448, 132)
    for cc in ((8, 6), (8, 9), (12, 0), (12, 1)):
        a = A.target(*cc)
        assert (a.tma, a.tier, a.smem) == (False, "sm86", 101_376), cc  # no TMA on sm_12x until it has run
    assert A.target(8, 0).smem == 166_912 and not A.target(8, 0).tma
    assert A.target(10, 0).tma and A.target(10, 0).tier == "sm90"
    assert A.target(8, 7).tier == "sm80"
    assert A.row_of(12, 3).name == A.row_of(12, 1).name  # a new minor revision: the nearest lower row
    for cc in ((7, 5), (7, 0), (6, 1)):
        with pytest.raises(A.UnsupportedGPU, match=r"needs 8.0 or newer.*tensor cores"):
            A.target(*cc)
    with pytest.raises(A.UnsupportedGPU, match="not in lean's arch table"):
        A.target(11, 0)


def test_arch_overrides(monkeypatch):
    """LEAN_PORTABLE / portable() turn TMA off; LEAN_ARCH / emulate() take another row's configs on
    the running GPU (simulated here: _device_arch answers an H100); forced() answers every device."""
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_device_arch", lambda idx: A.target(9, 0, sms=132))
    monkeypatch.setattr(A, "_RESOLVED", {})  # answers cached under the real _device_arch stay out
    monkeypatch.delenv("LEAN_PORTABLE", raising=False)
    monkeypatch.delenv("LEAN_ARCH", raising=False)
    gpu = torch.device("cuda", 0)
    assert A.arch(gpu).tma and A.arch(gpu).tier == "sm90"
    with A.portable():
        assert not A.arch(gpu).tma and A.arch(gpu).tier == "sm90" and A.arch(gpu).path == "portable"
    monkeypatch.setenv("LEAN_PORTABLE", "1")
    assert not A.arch(gpu).tma
    with A.portable(False):
        assert A.arch(gpu).tma
    monkeypatch.delenv("LEAN_PORTABLE")
    for setting in ("8.6", "sm_86", "86"):
        monkeypatch.setenv("LEAN_ARCH", setting)
        a = A.arch(gpu)
        assert (a.tier, a.tma, a.smem, a.sms) == ("sm86", False, 101_376, 132), setting
    monkeypatch.setenv("LEAN_ARCH", "banana")
    with pytest.raises(A.UnsupportedGPU, match="LEAN_ARCH"):
        A.arch(gpu)
    monkeypatch.delenv("LEAN_ARCH")
    with A.emulate(12, 0):
        assert A.arch(gpu).tier == "sm86" and not A.arch(gpu).tma
    forced = dataclasses.replace(A.target(8, 9), sms=24)
    with A.forced(forced):
        assert A.arch(torch.device("cpu")) == forced and A.arch(torch.device("meta")) == forced
    assert A.arch(torch.device("cpu")) is A.INTERPRETER


def test_describe_on_this_machine():
    line = A.describe()
    if torch.cuda.is_available():
        assert "SMs" in line and "path" in line
    else:
        assert line.startswith("CPU (Triton interpreter)")


def test_a_gpu_without_tensor_core_dots_is_refused_by_name(monkeypatch):
    """A T4 (sm_75) is refused when the arch is first read (load_model reads it before any weight
    moves), naming the GPU and what it lacks; an RTX 4060 laptop reads its own SM count."""
    from types import SimpleNamespace

    props = {0: SimpleNamespace(major=7, minor=5, name="Tesla T4", multi_processor_count=40,
                                shared_memory_per_block_optin=65536),
             1: SimpleNamespace(major=8, minor=9, name="NVIDIA GeForce RTX 4060 Laptop GPU",
                                multi_processor_count=24, shared_memory_per_block_optin=101376)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: props[idx])
    monkeypatch.setattr(A, "_CACHE", {})
    with pytest.raises(A.UnsupportedGPU, match=r"GPU 0 \(Tesla T4\): compute capability 7.5 is not supported.*bfloat16"):
        A._device_arch(0)
    rtx = A._device_arch(1)
    assert (rtx.name, rtx.sms, rtx.smem, rtx.tier, rtx.tma) == ("sm_89", 24, 101376, "sm86", False)


def test_gemm_ws_lever_still_compiles_for_sm90():
    """tools/gemm_ws.py (the warp-specialized pointer-load GEMMs BENCHMARKS.md quotes for issue 23) keeps
    compiling with the pinned Triton, within sm_90's shared memory."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gemm_ws.py"), "--compile-only",
                          "--forms", "ws,ws:2,sa"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "sm_90 compiles" in ln]
    assert len(lines) == 3, res.stdout
    for ln in lines:
        assert 0 < int(ln.split(", ")[1].split(" B")[0]) <= A.target(9, 0).smem, ln
