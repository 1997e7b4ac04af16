"""lean-train's guard rails (issue 22) on the tiny random Llama of test_train.py.

Covers: one owner per run folder (two real lean-train processes on one --out: the second is refused
naming the first's PID; a SIGKILLed run leaves no lock that blocks --resume); every setting checked
before anything loads, with what is allowed, and --help listing the same ranges; an --out that is a
file, under a file or not writable named in one line before loading; --resume --merge on a finished
run; the held-out cap and the evaluation's progress bar; Ctrl-C messages that say what is saved;
a cut-off tokenizer.json named as such; no interpreter exp2 noise from masked lanes; data warnings
as one line; lean-out/ ignored by git. The in-process checks stop before any weight loads; the few
runs are one or two steps.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lean.runtime.train as T
import lean.runtime.train_setup as train_setup
from lean.cli import build_parser, main
from lean.runtime.run_lock import LOCK
from lean.runtime.data import split_heldout
from lean.runtime.settings import RANGES
from tests.hf_models import build_hf
from tests.test_train import _raise_on_call, _records, _write_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    rng = np.random.default_rng(5)
    build_hf("llama", 5).save_pretrained(root / "model")
    _write_tokenizer(root / "model")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(rng)))
    return root / "model", data, root


def _args(tiny, out, *extra):
    model, data, _ = tiny
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--max-tokens", "64", "--r", "2",
            "--targets", "q", "--sample-tokens", "0", "--device", "cpu", *extra]


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a run gets as far as resolving (converting, fetching) the model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")
    monkeypatch.setattr(train_setup, "resolve_model", refuse)


# ---------------------------------------------------------------- one owner per run folder

def _wait_for(cond, what, proc, timeout=600):  # a limit against a hang, not a speed test
    t = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"lean-train exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.time() - t > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_second_run_on_a_folder_is_refused_and_a_killed_run_resumes(tiny, tmp_path):
    """Run B starts while run A is in its first evaluation (A's metrics.jsonl exists, nothing
    trained): B is refused naming A's PID and changes nothing; A, SIGKILLed after a checkpoint,
    leaves its lock file but no lock: --resume continues and finishes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lean.cli", *_args(tiny, out, "--steps", "12", "--save-every", "1", "--quiet")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    a = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists(), "run A opened its metrics", a)
        a.send_signal(signal.SIGSTOP)  # A paused, its lock held: however slowly B starts, A cannot end first
        try:
            b = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        finally:
            a.send_signal(signal.SIGCONT)
        assert a.poll() is None, "run A ended before run B was checked: the test proves nothing"
        assert b.returncode == 2, b.stderr[-2000:]
        assert f"is in use by another lean-train run (PID {a.pid}" in b.stderr, b.stderr
        assert len(b.stderr.strip().splitlines()) == 1, b.stderr  # one line, no traceback
        assert (out / "metrics.jsonl").exists()  # A's log is still there
        _wait_for(lambda: (out / "checkpoint" / "state.json").exists(), "run A saved a checkpoint", a)
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
        a.stdout.close()
        a.stderr.close()
    assert json.loads((out / LOCK).read_text())["pid"] == a.pid  # the killed run's file stays; its lock went
    assert main(_args(tiny, out, "--steps", "12", "--save-every", "1", "--quiet", "--resume")) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 13))
    assert not (out / LOCK).exists()  # a run that ends removes its lock file


# ---------------------------------------------------------------- settings checked before loading

BAD = [
    (["--lr", "nan"], "--lr nan: must be a number in \\(0, 1\\]"),
    (["--lr", "-0.0001"], "--lr -0.0001: must be a number in \\(0, 1\\]"),
    (["--grad-accum", "0"], "--grad-accum 0: must be an integer >= 1"),
    (["--max-tokens", "1"], "--max-tokens 1: must be an integer >= 2"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--eval-every", "-1"], "--eval-every -1: must be an integer >= 0"),
    (["--save-every", "-5"], "--save-every -5: must be an integer >= 0"),
    (["--r", "0"], "--r 0: must be an integer in \\[1, 128\\]"),
    (["--r", "1000"], "--r 1000: must be an integer in \\[1, 128\\]"),
    (["--alpha", "-1"], "--alpha -1.0: must be a number > 0"),
    (["--dropout", "1"], "--dropout 1.0: must be a number in \\[0, 1\\)"),
    (["--heldout", "1.5"], "--heldout 1.5: must be a number in \\[0, 1\\)"),
    (["--heldout-tokens", "0"], "--heldout-tokens 0: must be an integer >= 1"),
    (["--sample-tokens", "-1"], "--sample-tokens -1: must be an integer in \\[0, 4096\\]"),
    (["--seed", "-1"], "--seed -1: must be an integer in \\[0, "),
    (["--max-grad-norm", "inf"], "--max-grad-norm inf: must be a number >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be a number in \\[0, 1\\]"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio 2.0: must be a number in \\[0, 1\\]"),
    (["--vram-budget", "0"], "--vram-budget 0.0: must be a number > 0"),
    (["--steps", "3", "--warmup", "5"], "--warmup 5 is longer than --steps 3.*--warmup 3 or less"),
    (["--targets", "bogus"], "--targets: unknown LoRA target 'bogus'"),
    (["--resume", "--overwrite"], "--resume and --overwrite: pass one"),
    (["--dtype", "bfloat16"], "--dtype bfloat16 on the CPU"),
    (["--sample-tokens", "2", "--sample-prompt", " "], "--sample-prompt is empty"),
    (["--lora-state", "host"], "--lora-state host keeps the LoRA state in pinned host memory beside a GPU"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(x) for x, _ in BAD])
def test_bad_settings_are_refused_before_anything_loads(tiny, tmp_path, capsys, no_loading, extra, message):
    out = tmp_path / "run"
    assert main(_args(tiny, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("lean-train: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("flag,value,message", [
    ("--out", "", "--out is empty"),
    ("--data", "missing.jsonl", "data path .*missing.jsonl does not exist"),
    ("--model", "model.txt", "model.txt is a file, not a model folder"),
    ("--data", "empty", "empty holds no data file"),
    ("--data", "blob.bin", "blob.bin: unknown data file extension '.bin'"),
])
def test_bad_paths_are_refused_before_anything_loads(tiny, tmp_path, capsys, no_loading, flag, value, message):
    (tmp_path / "model.txt").write_text("not a model\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    args = _args(tiny, tmp_path / "run")
    args[args.index(flag) + 1] = str(tmp_path / value) if value else ""
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_unsupported_architecture_is_named_before_the_tokenizer_and_data(tiny, tmp_path, capsys):
    # A folder of a model lean does not train, without a tokenizer or weights: the architecture is
    # the cause to name (a tokenizer.json added would only lead to it), in one line, nothing written.
    model = tmp_path / "mamba"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    args = _args(tiny, tmp_path / "run", "--steps", "1")
    args[args.index("--model") + 1] = str(model)
    rc = main(args)
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err, err
    assert re.search(r"lean-train: error: .*config.json: unsupported architecture \['MambaForCausalLM'\]: "
                     r"lean supports LlamaForCausalLM", err), err
    assert "tokenizer" not in err and not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu(tiny, tmp_path, capsys, no_loading):
    assert main(_args(tiny, tmp_path / "run", "--device", "cuda")) == 2
    assert "--device cuda: no CUDA GPU is visible" in capsys.readouterr().err


def test_help_lists_every_checked_range():
    text = " ".join(build_parser().format_help().split())
    for field, (flag, allowed) in RANGES.items():
        assert flag in text, flag
        assert " ".join(allowed.text.split()) in text, (flag, allowed.text)


@pytest.mark.parametrize("where", ["a file", "under a file", "not writable"])
def test_out_folder_errors_are_one_line_before_loading(tiny, tmp_path, capsys, no_loading, where):
    f = tmp_path / "taken.txt"
    f.write_text("mine\n")
    out = {"a file": f, "under a file": f / "run", "not writable": Path("/sys/lean-guard-test")}[where]
    assert main(_args(tiny, out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    expected = {"a file": f"--out {f} is a file, not a folder",
                "under a file": f"--out {f / 'run'} is under {f}, which is a file",
                "not writable": "--out /sys/lean-guard-test: cannot write in /sys/lean-guard-test"}[where]
    assert expected in err, err
    assert f.read_text() == "mine\n"


@pytest.mark.parametrize("where", ["the data folder", "in the data folder", "the model folder"])
def test_out_in_the_data_folder_or_the_model_folder_is_refused(tiny, tmp_path, capsys, no_loading, where):
    """--data D --out D (or D/run): the run's metrics.jsonl, checkpoint/ and adapter/ would land in
    the data folder, and the next run (--resume too) would read them as data; --out = the --model
    folder would mix the run's files with the model's. Refused in one line, nothing written."""
    model, data, _ = tiny
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(data, folder / "a.jsonl")
    out = {"the data folder": folder, "in the data folder": folder / "run", "the model folder": model}[where]
    args = _args(tiny, out, "--steps", "1")
    args[args.index("--data") + 1] = str(folder)
    before = {p: sorted(x.name for x in p.rglob("*")) for p in (folder, model)}
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    expected = {"the data folder": f"--out {out} is the --data folder",
                "in the data folder": f"--out {out} is inside the --data folder {folder}",
                "the model folder": f"--out {out} is the --model folder"}[where]
    assert expected in err, err
    assert {p: sorted(x.name for x in p.rglob("*")) for p in (folder, model)} == before


# ---------------------------------------------------------------- finished runs, held-out set

def test_finished_run_merges_with_resume_and_eval_shows_progress(tiny, tmp_path, capsys):
    """One step, held-out capped at 30 tokens (the rest train) with its progress bar on; then
    --resume --merge on the finished run (no checkpoint: --save-every 0) merges its adapter."""
    out = tmp_path / "run"
    args = _args(tiny, out, "--steps", "1", "--save-every", "0", "--heldout", "0.5", "--heldout-tokens", "30")
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "held-out: 100%" in printed.err and "1/1" in printed.err, printed.err  # the evaluation's bar
    held = int(printed.out.split(" held out (")[1].split(" tokens")[0])
    assert 0 < held <= 30 and "at most --heldout-tokens 30" in printed.out
    assert main(args + ["--resume", "--merge"]) == 0
    printed = capsys.readouterr()
    assert "finished step 1 of 1, nothing left to train" in printed.out, printed
    assert (out / "merged" / "model.safetensors").is_file()


def test_heldout_cap_in_tokens():
    docs = [(np.zeros(n, np.int32), np.ones(n, bool)) for n in [40] * 50]
    train, held = split_heldout(docs, 0.5, seed=3, max_tokens=130)
    assert len(held) == 3 and len(train) == 47  # 3 x 40 <= 130; the other 22 drawn train
    train_all, held_all = split_heldout(docs, 0.5, seed=3)
    assert len(held_all) == 25
    ids = {id(d[0]) for d in held}
    assert ids <= {id(d[0]) for d in held_all}  # the first documents of the same draw
    assert split_heldout(docs, 0.5, seed=3, max_tokens=10)[1] != []  # at least one


# ---------------------------------------------------------------- what every exit says

def _interrupt_at(monkeypatch, name, n=1):
    _raise_on_call(monkeypatch, name, n, KeyboardInterrupt)


def test_ctrl_c_messages_say_what_is_saved(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the first evaluation; Ctrl-C in step 2 and again inside its checkpoint's write;
    Ctrl-C while the model loads: each says what is saved and what to run next."""
    _interrupt_at(monkeypatch, "evaluate")
    assert main(_args(tiny, tmp_path / "a", "--steps", "2", "--quiet")) == 130
    err = capsys.readouterr().err
    assert "interrupted before step 1 was trained: nothing trained is saved: run the same command again" in err, err
    monkeypatch.undo()

    _interrupt_at(monkeypatch, "forward_backward", 2)
    _interrupt_at(monkeypatch, "save_checkpoint")
    assert main(_args(tiny, tmp_path / "b", "--steps", "3", "--save-every", "0", "--quiet")) == 130
    err = capsys.readouterr().err
    assert ("interrupted after step 1, and again while its checkpoint was written: the checkpoint of step 1 "
            "was not saved; no checkpoint is saved in") in err and "--overwrite" in err, err
    assert not (tmp_path / "b" / "checkpoint").exists()
    monkeypatch.undo()

    _interrupt_at(monkeypatch, "load_model")
    assert main(_args(tiny, tmp_path / "c", "--steps", "1", "--quiet")) == 130
    err = capsys.readouterr().err
    assert f"interrupted while loading, before anything was written to {tmp_path / 'c'}" in err, err
    assert not (tmp_path / "c").exists()


def test_sigterm_saves_a_checkpoint_and_says_so(tiny, tmp_path):
    """`kill PID` (SIGTERM: timeout, a scheduler stopping the job) after step 1 with --save-every 0:
    like Ctrl-C, the checkpoint of the last completed step is saved and one line says so (exit
    143); the default SIGTERM ended the process silently with nothing to --resume."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lean.cli", *_args(tiny, out, "--steps", "50", "--save-every", "0", "--quiet")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists() and '"kind": "train"' in (out / "metrics.jsonl").read_text(),
                  "step 1", p)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, (p.returncode, err[-2000:])
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"stopped by SIGTERM: interrupted after step \d+: checkpoint of step \d+ saved in .*--resume", err), err
    assert (out / "checkpoint" / "state.json").is_file()


def test_a_full_disk_is_one_line_naming_the_file(tiny, tmp_path, capsys, monkeypatch):
    """safetensors raises its own SafetensorError on a full disk (no OSError, no errno): it was a
    traceback; now the run's one-line error names the file and says to free disk space. An
    OSError with no path (a write's ENOSPC) names the run folder."""
    from safetensors import SafetensorError
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(_args(tiny, tmp_path / "run", "--steps", "1", "--quiet")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"adapter_model.safetensors: No space left on device: free disk space", err), err
    assert "writing in /some/run: No space left on device" in T.os_error_text(OSError(28, "No space left on device"),
                                                                           Path("/some/run"))


def test_cut_off_tokenizer_json_is_named(tiny, tmp_path):
    from lean.runtime.tokenizer import Tokenizer, TokenizerError

    model, _, _ = tiny
    shutil.copytree(model, tmp_path / "m")
    tok = tmp_path / "m" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:len(tok.read_bytes()) // 2])
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path / "m")
    assert "is not valid JSON" in str(e.value) and "cut off" in str(e.value), e.value
    assert "version" not in str(e.value)


# ---------------------------------------------------------------- odds and ends

def test_masked_lane_exp2_overflow_is_silent_real_ones_are_not(tiny):
    """Large q and k: the attention backward's masked (future) lanes overflow exp2 in numpy."""
    import lean

    model_dir, _, _ = tiny
    model = lean.load_model(model_dir, dtype=torch.float32, device="cpu")
    for w in model.layers:  # x100: dozens of masked lanes overflow (x30 may leave none on this model)
        w.q.mul_(100)
        w.k.mul_(100)
    lora = lean.LoRA.init(model, r=2, alpha=4, targets="q", seed=0)
    g = torch.Generator().manual_seed(0)
    batch = lean.pack([torch.randint(2, 16, (n,), generator=g).tolist() for n in (20, 9)], max_tokens=64, device="cpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        lean.forward_backward(model, lora, batch)
        np.exp2(np.float32(300))  # a real one, outside the masked lanes: still shown
    overflow = [str(r.message) for r in rec if "overflow" in str(r.message)]
    assert overflow == ["overflow encountered in exp2"], overflow
    assert torch.isfinite(lora.grads).all()


def test_data_warnings_print_as_one_line(tiny, tmp_path, capsys, monkeypatch):
    data = tmp_path / "chat.yml"
    data.write_text("conversations:\n- [Hi, Hello there]\n- just a string\n- [How are you, Fine]\n")
    args = _args(tiny, tmp_path / "run", "--quiet")
    args[args.index("--data") + 1] = str(data)
    assert main(args) == 2  # the tiny tokenizer has no chat template: refused once the data is read
    err = capsys.readouterr().err
    assert f"lean-train: warning: {data}: skipped 1 malformed conversations (indices [1])" in err, err
    assert "records.py" not in err and "warnings.warn" not in err and "return _chatterbot" not in err, err


def test_default_out_folder_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    res = subprocess.run(["git", "check-ignore", "-q", "lean-out/adapter/x"], cwd=ROOT)
    assert res.returncode == 0, "the README's first command leaves an untracked lean-out/ in the repository"


def test_cli_on_the_cpu_runs_numpys_blas_on_one_thread(tiny, tmp_path, monkeypatch):
    from lean.runtime import interp

    if interp.blas_threads() is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS this process can find")
    interp._call(interp.SETTERS, 2)
    assert interp.blas_threads() == 2
    _interrupt_at(monkeypatch, "resolve_model")  # stop before anything loads
    assert main(_args(tiny, tmp_path / "run", "--quiet")) == 130
    assert interp.blas_threads() == 1


def test_report_beside_the_training_equals_the_one_in_process(tiny, tmp_path, monkeypatch):
    """report_process=True: the untrained model's held-out loss and sample, and the trained
    adapter's sample, come from a second process, with the same values and records in order; the
    adapter's sample process is started beside the last step and waits for the adapter."""
    model, data, _ = tiny
    runs, started = {}, []
    start = T.ReportJob.start.__func__
    monkeypatch.setattr(T.ReportJob, "start", classmethod(
        lambda cls, spec, wait=False: started.append((bool(spec.get("adapter")), wait)) or start(cls, spec, wait)))
    for beside in (False, True):
        cfg = T.TrainConfig(model=str(model), data=str(data), out_dir=str(tmp_path / str(beside)), max_tokens=64,
                            steps=2, warmup_steps=1, r=2, targets=["q"], sample_tokens=2, sample_prompt="the cat",
                            heldout_fraction=0.2, report_process=beside, progress=False, tensorboard=False)
        r = T.train(cfg)
        lines = [json.loads(x) for x in (tmp_path / str(beside) / "metrics.jsonl").read_text().splitlines()]
        runs[beside] = ([r[k] for k in ("eval_loss_before", "eval_loss", "sample_before", "sample_after")],
                        [(m["kind"], m["step"], m.get("loss"), m.get("text")) for m in lines])
    assert runs[True] == runs[False]
    assert [(k, s) for k, s, _, _ in runs[True][1]] == [("sample", 0), ("eval", 0), ("train", 1), ("train", 2),
                                                        ("eval", 2), ("sample", 2)]
    assert started == [(False, False), (True, True)]  # the report before; the adapter's sample, waiting


def test_report_goes_beside_the_training_where_it_pays(tiny, monkeypatch):
    import lean
    from lean.runtime import report

    model = lean.load_model(tiny[0], dtype=torch.float32, device="cpu")
    cfg = T.TrainConfig(model="", data="", report_process=None)
    assert not report.report_in_process(cfg, "cpu", model)  # a tiny model: its report is cheaper than a process
    monkeypatch.setattr(report, "MIN_PARAMS", 1)
    monkeypatch.setattr(report.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert report.report_in_process(cfg, "cpu", model) and not report.report_in_process(cfg, "cuda", model)
    monkeypatch.setattr(report.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not report.report_in_process(cfg, "cpu", model)  # one core: nothing to gain
    cfg.report_process = False
    assert not report.report_in_process(cfg, "cpu", model)


def test_cpu_evaluates_the_heldout_set_in_one_batch():
    """The interpreter's cost is per launch: on the CPU the held-out set (up to --heldout-tokens) is
    one forward; on a GPU batches of --max-tokens, where the step's memory is known to fit."""
    cfg = T.TrainConfig(model="", data="", max_tokens=64, heldout_tokens=1000)
    assert T.eval_budget(cfg, "cpu") == 1000 and T.eval_budget(cfg, "cuda") == 64
    cfg.heldout_tokens = 30
    assert T.eval_budget(cfg, "cpu") == 64
