"""A run's folder and its checkpoints: what lean-train writes so a run survives a crash.

    with RunLock(cfg.out_dir):            # one owner per run folder (run_lock.py), before anything is written
        earlier = earlier_run(cfg)        # before anything loads: a fresh run refuses a used folder
    out = prepare_out_dir(cfg.out_dir, earlier)   # after loading: --overwrite deletes, stale temps go
    save_checkpoint(out, lora, opt, run_state(cfg, step, epoch, index, lora.steps, fingerprint))
    state, tensors = read_checkpoint(out, cfg, fingerprint)   # checked before the weights load
    restore_checkpoint(state, tensors, lora, opt)

out_dir/checkpoint/  adapter/ (PEFT layout), state.safetensors (LoRA params, AdamW m and v, fp32)
                     and state.json (run_state: step, data position, dropout counter, python/numpy
                     RNG states, the config, the training documents' fingerprint)
  written as checkpoint.tmp-<pid>, flushed to the disk (fsync: files, then folders) and renamed
  into place; the previous one waits as checkpoint.old until the renames are on the disk, so a
  crash or power loss at any point leaves a complete checkpoint or checkpoint.old to resume from.
  An unreadable checkpoint falls back to checkpoint.old (the broken one kept as checkpoint.bad).
A resumed run must match the checkpoint's RESUME_KEYS fields and training documents. Data parallel
(runtime/dist.py): state.json records world_size; the data position counts global micro-batches,
so another world size resumes exactly when world_size x grad_accum (the micro-batches a step) is
unchanged, and is refused otherwise with both sizes and the fix. Only rank 0 writes the folder.
out_dir/.lean-train.lock  the run's owner (runtime/run_lock.py).
Tested: tests/test_train.py (atomic, flushed, unreadable, fallback, the folder guard, resume).
"""
import json
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .observe import METRICS
from .settings import HELDOUT_TOKENS

CHECKPOINT = "checkpoint"
# Fields that must match between a checkpoint and a resumed run (they change batches or weights).
RESUME_KEYS = ("max_tokens", "grad_accum", "steps", "lr", "warmup_steps", "min_lr_ratio",
               "weight_decay", "max_grad_norm", "r", "alpha", "dropout", "targets", "seed",
               "heldout_fraction", "heldout_tokens", "quant")
ADDED_KEYS = {"heldout_tokens": HELDOUT_TOKENS, "quant": None}  # RESUME_KEYS later than the first checkpoints: their value then


class TrainError(RuntimeError):
    """A training run's error: names the cause and the fix."""


def data_fingerprint(docs) -> str:
    """A short hash of the training documents' tokens and loss masks: a resumed run must train on
    the same ones (a path can move; the documents must not change)."""
    import hashlib

    h = hashlib.sha256()
    for ids, mask in docs:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(np.asarray(ids, np.int32).tobytes())
        h.update(np.packbits(np.asarray(mask, bool)).tobytes())
    return h.hexdigest()[:16]


RUN_FILES = (CHECKPOINT, f"{CHECKPOINT}.old", f"{CHECKPOINT}.bad", METRICS, "adapter", "tb", "merged")
LOGS = (METRICS, "tb")  # all a run leaves when it stops before its first step


def run_exports(out) -> list:
    """The GGUF files and Ollama Modelfiles a run's exports wrote into it (lean/export.py's names:
    <run>-<TYPE>.gguf, <run>-lora-<TYPE>.gguf, each with its .Modelfile): the earlier run's model."""
    pattern = re.compile(re.escape(out.resolve().name) + r"-(lora-)?[A-Z0-9_]+\.(gguf|Modelfile)")
    return sorted(p for p in out.iterdir() if p.is_file() and pattern.fullmatch(p.name)) if out.is_dir() else []


def _trained(out) -> bool:
    """out_dir holds a run that trained: a checkpoint, or metrics with a train record."""
    if any((out / n).exists() for n in (CHECKPOINT, f"{CHECKPOINT}.old")):
        return True
    m = out / METRICS
    return m.exists() and '"kind": "train"' in m.read_text(errors="replace")


def earlier_run(cfg, world=1) -> list:
    """The files in out_dir that prepare_out_dir will delete. A fresh run (neither resume nor
    overwrite) meeting a run that trained raises TrainError (its checkpoint and metrics would mix
    with this run's); overwrite=True deletes that run's files. The logs of a run that stopped
    before its first step (an OOM, a NaN, Ctrl-C in the first evaluation) hold nothing trained and
    go without asking. Nothing that holds this run's model or data is deleted. Called before
    anything loads; nothing is deleted here. world: the processes of this run (the resume check)."""
    out = Path(cfg.out_dir)
    if cfg.resume and cfg.overwrite:
        raise TrainError("--resume and --overwrite: pass one (continue the run in --out, or delete it and start over)")
    if cfg.resume:
        _check_resume(out, cfg, world)
        return []
    if not out.is_dir():
        return []
    if _trained(out):
        found = [out / n for n in RUN_FILES if (out / n).exists()] + run_exports(out)
        if not cfg.overwrite:
            cont = "pass --resume to continue it, " if any((out / n / "state.json").is_file() for n in RUN_FILES[:2]) else ""
            raise TrainError(f"{out} holds an earlier run ({', '.join(p.name for p in found)}): {cont}pass "
                             "--overwrite to delete it and start over, or another --out")
    else:
        found = [out / n for n in LOGS if (out / n).exists()]
    inputs = {name: Path(os.path.expanduser(str(v))).resolve() for name, v in (("--model", cfg.model), ("--data", cfg.data))}
    for p in found:
        for name, x in inputs.items():
            if x == p.resolve() or p.resolve() in x.parents:
                raise TrainError(f"{p} holds this run's {name} ({x}) and would be deleted with the earlier run: "
                                 f"move it out of {out}, or use another --out")
    return found


def _check_resume(out, cfg, world=1):
    """--resume before anything loads: a checkpoint to resume from (or a finished run, which has
    nothing left to train), made with the settings given now (the documents are checked once loaded)."""
    found = [out / n for n in (CHECKPOINT, f"{CHECKPOINT}.old") if (out / n / "state.json").is_file()]
    if not found and finished_step(out, cfg) is not None:
        return
    for d in checkpoint_dirs(out):
        try:
            state = json.loads((d / "state.json").read_text())
            saved, saved_world = state["config"], int(state.get("world_size", 1))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: read_checkpoint names it, or falls back to checkpoint.old
        _check_settings(d, saved, cfg, world, saved_world)
        return


def finished_step(out, cfg):
    """cfg.steps when out holds a run that trained them and wrote its adapter, else None: its
    newest checkpoint (or, with none, its last logged step) is at cfg.steps and adapter/ is whole."""
    out = Path(out)
    from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    if not all((out / "adapter" / n).is_file() for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)):
        return None
    for n in (CHECKPOINT, f"{CHECKPOINT}.old"):
        try:
            step = json.loads((out / n / "state.json").read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return cfg.steps if step == cfg.steps else None
    steps = [r.get("step") for r in _records(out / METRICS) if r.get("kind") == "train"]
    return cfg.steps if steps and steps[-1] == cfg.steps else None


def _records(path):
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    records = []
    for x in lines:
        try:
            r = json.loads(x)
        except ValueError:
            continue
        if isinstance(r, dict):
            records.append(r)
    return records


def kept(out) -> str:
    """What a run that stops now leaves in out, and what to run next: every exit message ends so."""
    out = Path(out)
    for n in (CHECKPOINT, f"{CHECKPOINT}.old"):
        try:
            step = json.loads((out / n / "state.json").read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return f"the checkpoint of step {step} in {out / n} is kept: continue with the same command plus --resume"
    if out.is_dir() and _trained(out):
        return (f"no checkpoint is saved in {out}: start over with the same command plus --overwrite (or "
                "--save-every N to keep checkpoints)")
    return "nothing trained is saved: run the same command again"


def prepare_out_dir(out_dir, delete=()) -> Path:
    """out_dir made ready once the run has loaded: the files of `delete` (earlier_run's) go, and
    a checkpoint.tmp-* left by a killed save."""
    out = Path(out_dir)
    for p in delete:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(f"{CHECKPOINT}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    return out


# ---------------------------------------------------------------- checkpoint/

def _fsync(path):
    """Flush a file, or a folder's entries, to the disk: after a power loss the renamed checkpoint
    holds complete files, never empty ones. Files open read-write (Windows flushes no read-only
    handle); folders only where the system allows it (POSIX; some mounts refuse: then skipped)."""
    if path.is_dir():
        if os.name != "posix":
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def save_checkpoint(out_dir, lora, opt, state: dict):
    """Write out_dir/checkpoint atomically: a temp folder, flushed to the disk, then renamed into
    place; the previous checkpoint (checkpoint.old meanwhile) goes only once the renames are on disk."""
    from .lora import save_tensors

    out_dir = Path(out_dir)
    final, tmp, old = out_dir / CHECKPOINT, out_dir / f"{CHECKPOINT}.tmp-{os.getpid()}", out_dir / f"{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        lora.save(tmp / "adapter")  # (host state: lora.sync() first, in state_dict)
        tensors = {"params": lora.params, "m": opt.m, "v": opt.v}
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}  # sync: save point
        save_tensors(tensors, tmp / "state.safetensors")
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        for p in sorted(tmp.rglob("*"), reverse=True) + [tmp]:  # files before their folders
            _fsync(p)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)  # keep the last good one until the new one is in place
        os.replace(tmp, final)
        _fsync(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def checkpoint_dirs(out_dir) -> list:
    """The checkpoint folders to resume from, newest first: checkpoint, and checkpoint.old where a
    save died between its two renames."""
    out_dir = Path(out_dir)
    found = [out_dir / n for n in (CHECKPOINT, f"{CHECKPOINT}.old") if (out_dir / n / "state.json").is_file()]
    if not found:
        fresh = ("start over with --overwrite instead of --resume" if (out_dir / METRICS).exists()
                 else "run without --resume")
        raise TrainError(f"--resume: no checkpoint in {out_dir} (expected {out_dir / CHECKPOINT}/state.json): "
                         f"{fresh}, or pass the --out folder of the interrupted run")
    return found


def checkpoint_dir(out_dir) -> Path:
    """The newest checkpoint folder (see checkpoint_dirs)."""
    return checkpoint_dirs(out_dir)[0]


STATE_KEYS = ("step", "epoch", "batch_index", "lora_steps", "python_rng", "numpy_rng", "config")


def _read_checkpoint(d) -> tuple:
    """(state.json, state.safetensors' tensors) of one checkpoint folder; TrainError naming the
    file when either is unreadable or incomplete."""
    from safetensors.torch import load_file

    try:
        state = json.loads((d / "state.json").read_text())
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except (OSError, ValueError) as e:
        raise TrainError(f"{d / 'state.json'} is unreadable ({e})") from e
    try:
        t = load_file(str(d / "state.safetensors"))
        missing = [k for k in ("params", "m", "v") if k not in t]
        if missing:
            raise ValueError(f"no tensor {', '.join(missing)}")
    except Exception as e:  # safetensors raises its own SafetensorError on a truncated file
        raise TrainError(f"{d / 'state.safetensors'} is unreadable ({e})") from e
    return state, t


def read_checkpoint(out_dir, cfg, fingerprint=None, world=1) -> tuple:
    """(state.json, tensors) of the checkpoint to resume from, checked against cfg and the training
    documents' fingerprint (see data_fingerprint; when both have one) before anything loads. An
    unreadable checkpoint falls back to checkpoint.old where one is left: the broken one moves to
    checkpoint.bad and the old one into its place, so the next save has a good one to keep."""
    out_dir, errors = Path(out_dir), []
    for d in checkpoint_dirs(out_dir):
        try:
            state, t = _read_checkpoint(d)
            break
        except TrainError as e:
            errors.append(str(e))
    else:
        raise TrainError(f"--resume: {'; '.join(errors)}: restore the folder from a copy, or start over "
                         "with --overwrite instead of --resume")
    if errors:
        bad = out_dir / f"{CHECKPOINT}.bad"
        shutil.rmtree(bad, ignore_errors=True)
        os.replace(out_dir / CHECKPOINT, bad)
        os.replace(d, out_dir / CHECKPOINT)
        d = out_dir / CHECKPOINT
        print(f"lean-train: {errors[0]}: resuming from the save before it (checkpoint.old, now {d}; the "
              f"unreadable one is kept as {bad})", flush=True)
    _check_settings(d, state["config"], cfg, world, int(state.get("world_size", 1)))
    if fingerprint is not None and state.get("data") not in (None, fingerprint):
        raise TrainError(f"{d}: the checkpoint was made on other training documents (data {cfg.data}, "
                         f"fingerprint {state['data']} vs now {fingerprint}): resume with the run's data, "
                         "or start a new run with another --out")
    return state, t


def _check_settings(d, saved, cfg, world=1, saved_world=1):
    """TrainError when the checkpoint in d was made with other RESUME_KEYS settings than cfg's (a
    key that checkpoints of earlier versions lack counts as its default). Under another world size
    grad_accum may differ as long as world x grad_accum is the same (the global micro-batch stream
    then maps exactly: runtime/dist.py)."""
    now = asdict(cfg)
    keys = RESUME_KEYS
    if world != saved_world:
        was, per = saved_world * saved.get("grad_accum", 1), world * cfg.grad_accum
        if was != per:
            fix = (f"pass --grad-accum {was // world} with these {world} processes, or resume with {saved_world}"
                   if was % world == 0 else f"resume with {saved_world} processes (or a number that divides {was}, "
                   f"with --grad-accum {was} divided by it)")
            raise TrainError(f"{d}: the checkpoint was made by {saved_world} process(es) x --grad-accum "
                             f"{saved.get('grad_accum', 1)} = {was} micro-batches a step, this run is {world} x "
                             f"{cfg.grad_accum} = {per}: its data position maps exactly only onto {was} micro-batches "
                             f"a step: {fix}")
        keys = tuple(k for k in RESUME_KEYS if k != "grad_accum")
    diff = [k for k in keys if saved.get(k, ADDED_KEYS.get(k)) != now.get(k)]
    if diff:
        shown = ", ".join(f"{k}: checkpoint {saved.get(k, ADDED_KEYS.get(k))!r} vs now {now.get(k)!r}" for k in diff)
        raise TrainError(f"{d}: the checkpoint was made with other settings ({shown}): pass the same "
                         "settings to resume, or start a new run with another --out")


def restore_checkpoint(state, t, lora, opt):
    """Params, AdamW state, the dropout counter and RNG states from read_checkpoint's result."""
    if t["params"].numel() != lora.params.numel():
        raise TrainError(f"the checkpoint holds {t['params'].numel()} LoRA parameters, this run "
                         f"{lora.params.numel()}: another model? Start a new run with another --out")
    lora.sync()  # host state: no update still writing the host buffers
    lora.params.copy_(t["params"])
    lora.sync_lowp()
    lora.steps = int(state["lora_steps"])
    opt.load_state_dict({"m": t["m"], "v": t["v"], "step": state["step"]})
    random.setstate(_py_state_from_json(state["python_rng"]))
    np.random.set_state(_np_state_from_json(state["numpy_rng"]))
    return state


def load_checkpoint(out_dir, cfg, lora, opt, fingerprint=None) -> dict:
    """read_checkpoint + restore_checkpoint; returns state.json."""
    return restore_checkpoint(*read_checkpoint(out_dir, cfg, fingerprint), lora, opt)


def _np_state_to_json(st):
    return [st[0], st[1].tolist(), int(st[2]), int(st[3]), float(st[4])]  # sync: none (numpy RNG state)


def _np_state_from_json(st):
    return (st[0], np.asarray(st[1], dtype=np.uint32), st[2], st[3], st[4])


def _py_state_from_json(st):
    return (st[0], tuple(st[1]), st[2])


def run_state(cfg, step, epoch, index, lora_steps, fingerprint=None, world=1):
    """state.json of a checkpoint at `step`: data position (global micro-batches), dropout counter,
    RNG states, config, and the processes that trained it (world_size)."""
    return {"step": step, "epoch": epoch, "batch_index": index, "lora_steps": lora_steps,
            "python_rng": random.getstate(), "numpy_rng": _np_state_to_json(np.random.get_state()),
            "config": asdict(cfg), "data": fingerprint, "world_size": world}
