"""The run folder's owner: one lean-train run a folder (RunLock), and the one-line errors for a
folder that cannot be one (out_dir_error).

    with RunLock(cfg.out_dir):   # taken before anything is written; RunFolderBusy names the holder
        ...

out_dir/.lean-train.lock  an OS file lock (flock; msvcrt's byte lock on Windows) held from before
  anything is written until the process ends, with the holder's PID inside; a second run on the
  folder is refused naming that PID. The kernel drops the lock when the process dies (a SIGKILLed
  run never blocks --resume); a run that ends removes the file, and removes the folder when it
  created it and left nothing in it.
Tested: tests/test_cli_guard.py (a second run refused naming the first's PID; a SIGKILLed run's
lock gone, its file left, --resume goes on; a run that ends removes the file; the folder's errors
in one line).
"""
import errno
import json
import os
import sys
import time
from pathlib import Path

from .checkpoint import TrainError

LOCK = ".lean-train.lock"
try:
    import fcntl
except ImportError:  # not POSIX (Windows): msvcrt's byte lock below
    fcntl = None


class RunFolderBusy(TrainError):
    """Another process holds the run folder's lock."""


def out_dir_error(out, e: OSError) -> TrainError:
    """A one-line TrainError for an OSError on the run folder itself: the path and the fix."""
    out = Path(out)
    if out.is_file():
        return TrainError(f"--out {out} is a file, not a folder: pass a folder path (new, or a run's)")
    above = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if above is not None:
        return TrainError(f"--out {out} is under {above}, which is a file: pass a path whose parents are folders")
    where = Path(e.filename) if e.filename else out
    where = where.parent if where.name == LOCK else where
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return TrainError(f"--out {out}: cannot write in {where} ({e.strerror}): pass an --out in a folder "
                          "you can write, or fix its permissions")
    return TrainError(f"--out {out}: {where}: {e.strerror or e}: pass another --out")


class RunLock:
    """The run folder's owner lock (see the module docstring). Re-entrant within one process:
    lean-train holds it across the run and the merge, train() takes it again inside.

        with RunLock(out_dir):   # RunFolderBusy naming the holder's PID, or TrainError (out_dir_error)
            ...
    """
    _held = {}  # resolved lock path -> [fd, depth, folders this process created]

    def __init__(self, out_dir):
        self.out = Path(out_dir)

    def __enter__(self):
        made = []
        try:
            for d in reversed([self.out, *self.out.parents]):  # the folders to create, outermost first
                if not d.exists():
                    made.append(d)
            self.out.mkdir(parents=True, exist_ok=True)
            self.path = (self.out / LOCK).resolve()
            held = RunLock._held.get(self.path)
            if held is not None:
                held[1] += 1
                return self
            fd = _acquire(self.path)
        except RunFolderBusy:
            _remove_empty(made)
            raise
        except OSError as e:
            _remove_empty(made)
            raise out_dir_error(self.out, e) from None
        RunLock._held[self.path] = [fd, 1, made]
        return self

    def __exit__(self, *exc):
        held = RunLock._held[self.path]
        held[1] -= 1
        if held[1] == 0:
            del RunLock._held[self.path]
            try:
                os.unlink(self.path)  # while still locked: a run waiting on this inode sees it went
            except OSError:
                pass
            os.close(held[0])
            _remove_empty(held[2])


def _remove_empty(folders):
    """Remove the folders a run created and left empty (innermost first)."""
    for d in reversed(folders):
        try:
            d.rmdir()
        except OSError:
            return


def _acquire(path: Path) -> int:
    """An fd holding the lock on `path` (created if missing), with this PID written in it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                import msvcrt
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK, errno.EDEADLK):
                raise
            raise RunFolderBusy(f"{path.parent} is in use by another lean-train run ({_holder(path)}): "
                                "wait for it to finish or stop it (it saves a checkpoint on Ctrl-C), or "
                                "pass another --out; nothing was changed") from None
        try:  # the holder unlinks the file on exit: a lock on the unlinked file owns nothing
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    info = json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "argv": sys.argv}).encode()
    if fcntl is not None:  # msvcrt locks byte 0 against reads: the PID stays unwritten there
        os.ftruncate(fd, 0)
        os.write(fd, info)
    return fd


def _holder(path: Path) -> str:
    """'PID 1234, started ...' from the lock file (the holder may not have written it yet)."""
    for _ in range(20):
        try:
            info = json.loads(path.read_text())
            return f"PID {info['pid']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "PID unknown: it has not written the lock file yet"
