"""The streaming GGUF writer of gguf_export.py: a plan of tensors -> one .gguf file, atomically.

    path = write_gguf(out, arch, meta, plan, src, device)   # plan: [Out], meta: {key: (value, type, sub)}

Shape legend: O / K a tensor's rows / columns (numpy order), E experts.

gguf-py's GGUFWriter writes the header: the metadata, then every tensor's name, shape, type and
offset (add_tensor_info with the sizes the types imply: nothing is read yet). Then each tensor's
data, at the 32-byte aligned offsets the header promised (the writer's own padding rule: pad to the
alignment before a tensor and after its bytes), in chunks of rows: CHUNK_BYTES of fp32 rows at
most, whole heads where Q/K rows are permuted (Out.unit), one expert at a time, a vector or an
expert read whole to be transposed in one; each chunk read through gguf_source.merged_rows (the
LoRA folded in), quantised, written, dropped. Host memory: a few chunks.
A tensor whose chunks do not add up to the bytes its header entry announced stops the write.

Where each chunk is quantised (quantizer):
  "numpy"   (device None, or a CPU device): every type by gguf_quants.quantize on the host. One
            worker thread reads and merges the next chunk while the main thread quantises and
            writes this one (numpy and pread release the GIL).
  "triton"  (the default on a CUDA device): Q8_0, Q4_K and Q6_K by kernels/gguf_quant.py on the
            device, the same bytes as gguf_quants.quantize. WORKERS threads, each on its own CUDA
            stream, take a chunk each in file order: pread of the stored rows into pinned memory,
            copied over, widened, merged (lean's matmul), quantised, its bytes copied back into
            pinned memory; the main thread waits for a chunk's copy (its event: the one host sync
            a chunk, which the write needs anyway) and writes it while the workers run ahead. Other
            types (F32 norms, F16 / BF16 files, Q4_K_M's Q5_0 / Q8_0 fallbacks) are merged on the
            device and quantised by numpy. On a CPU device "triton" runs the kernels in Triton's
            interpreter, one worker: how the tests check that path's bytes without a GPU.
NaN or inf: numpy refuses them chunk by chunk; on the device each chunk's rows are checked by a
reduction there whose flag comes back with its bytes (no extra sync). Either way the export stops
with a GGUFError naming the tensor and its rows, and nothing is left under the final name.

The disk: every FLUSH_BYTES written, a thread of its own (_Flusher) starts those bytes' writeback
(sync_file_range on Linux, else an fdatasync) while the next chunks are made; without it a file under
Linux's background-writeback threshold waits in the page cache for the closing fsync, and the disk
idles until then. LAST_WRITE keeps the
phases of the last write (lean-export's closing line prints them).
Atomic: the file is <out>.tmp-<pid> until it is complete, flushed and fsynced; then os.replace
puts it under the final name and the folder is fsynced. Any failure (an error, Ctrl-C, a full disk:
OSError, raised as a GGUFError naming the fix) removes the temporary file: nothing half-written
under the final name, and an earlier file there stays as it was. The free space is checked first
(the file's size is known from the plan). A tqdm bar in bytes when tqdm is installed.
Tested: tests/test_gguf_export.py (chunked and whole writes are the same bytes; a full disk
mid-write and too little free space leave nothing and keep the earlier file; the "triton" path's
file, through the interpreter, equals the numpy path's at Q8_0 and Q4_K_M; a NaN refused on both).
Measured: tools/bench_gguf_export.py gpu (the 8B on the H100 against writing as many bytes).
"""
import errno
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from .gguf import GGUFError
from .gguf_names import gguf_arch
from .gguf_quants import quantize
from .gguf_source import LAUNCH, fold_lora, merged_rows

CHUNK_BYTES = 64 << 20  # fp32 rows per chunk: the streaming unit
FLUSH_BYTES = 64 << 20  # written bytes between two background flushes (_Flusher: the disk works beside the chunks)
LAST_WRITE = {}          # the phases of the last write_gguf, in s from its start: header, tensors, done
WORKERS = 4             # chunks in flight on a CUDA device (each a thread with its own stream)
GPU_QTYPES = (Q.Q8_0, Q.Q4_K, Q.Q6_K)  # kernels/gguf_quant.py's QTYPES (not imported: it imports triton)


class Out(NamedTuple):
    """One GGUF tensor of the plan."""
    name: str             # GGUF name
    shape: tuple          # numpy order: (O, K), (E, O, K), (O,), (E, O)
    qtype: Q
    hf: str = ""          # the HF tensor it comes from
    idx: np.ndarray = None  # HF row (out, in orientation) of each GGUF row
    transposed: bool = False
    lora: tuple = None    # (a, b, scale) folded in
    data: np.ndarray = None  # a tensor computed whole (rope_freqs, an adapter's A and B)
    experts: int = 0      # E: the tensor is read one expert at a time
    vector: bool = False  # rows are single values (a norm, a bias): read whole, per expert
    unit: int = 1         # a chunk holds whole multiples of this many rows (a head: Q/K's permutation)

    @property
    def nbytes(self):
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * self.shape[-1] // block * size


def quantize_rows(x: np.ndarray, qtype: Q) -> np.ndarray:
    """(n, K) fp32 rows -> their bytes in `qtype` (uint8 (n, bytes per row)): gguf_quants.quantize."""
    return quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def _jobs(o: Out):
    """(expert or None, row slice) of tensor `o`'s chunks, in file order (whole heads, one expert at a time)."""
    rows = len(o.idx)
    if o.vector or o.transposed:  # a vector, or an expert read whole to be transposed: one chunk
        step = rows
    else:
        step = max(o.unit, CHUNK_BYTES // (4 * o.shape[-1]) // o.unit * o.unit)
    for e in range(o.experts) if o.experts else [None]:
        for a in range(0, rows, step):
            yield e, slice(a, a + step)


class _Bytes(NamedTuple):
    """A chunk quantised on a device: its bytes and NaN/inf flag on their way to the host."""
    raw: object           # (n, bytes a row) uint8 torch tensor on the host (pinned on a GPU)
    bad: object           # () bool torch tensor: the rows held NaN or inf
    done: object          # torch.cuda.Event recorded after both copies; None on the CPU

    def wait(self):
        """(the bytes as numpy, whether the rows held NaN or inf)."""
        if self.done is not None:
            self.done.synchronize()  # sync: this chunk's bytes are on the host (the write needs them)
        return self.raw.numpy(), bool(self.bad)


def _quantize_on_device(w, qtype: Q) -> _Bytes:
    """(n, K) fp32 rows on a device -> their qtype bytes by kernels/gguf_quant.py, copied back."""
    from ..kernels.gguf_quant import quantize_rows as quantize_on_device
    from ..kernels.gguf_quant import row_bytes

    dst = torch.empty(w.shape[0], row_bytes(w.shape[1], qtype), dtype=torch.uint8, device=w.device)  # (n, B)
    quantize_on_device(dst, w, qtype)
    bad = torch.isfinite(w).all().logical_not()  # read on the host with the bytes: no sync of its own
    if w.device.type != "cuda":
        return _Bytes(dst, bad, None)
    raw = torch.empty(dst.shape, dtype=torch.uint8, pin_memory=True)
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    raw.copy_(dst, non_blocking=True)
    flag.copy_(bad, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return _Bytes(raw, flag, done)


def _job(o: Out, e, rows, src, device, on_device: bool):
    """A chunk, in a worker: fp32 rows on the host for quantize_rows, or (on_device) _Bytes."""
    if o.data is not None:
        return o.data.reshape(-1, o.shape[-1])
    idx = o.idx[rows]
    if device is None or not (on_device or o.lora is not None):  # numpy on the host
        w = merged_rows(src, o.lora, o.hf, e, idx, o.transposed, len(o.idx))
        return w.reshape(1, -1) if o.vector else w
    w = merged_rows(src, None, o.hf, e, idx, o.transposed, len(o.idx), device)  # read and copied over
    with LAUNCH:  # the reads run in parallel, the launches one thread at a time
        if o.lora is not None:
            fold_lora(w, o.lora, e, idx)
        w = w.reshape(1, -1) if o.vector else w
        if on_device:
            return _quantize_on_device(w, o.qtype)
    return w.cpu().numpy()  # sync: in the worker, the merged rows go to numpy's quantiser


def _chunks(plan: list, src, device, quantizer):
    """(tensor, expert, row slice, _job's result) of every chunk of the plan, in order, the workers
    running ahead (the module docstring)."""
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    workers = WORKERS if cuda else 1
    local = threading.local()

    def run(o, e, rows):
        on_device = quantizer == "triton" and o.data is None and o.qtype in GPU_QTYPES
        if not cuda:
            return _job(o, e, rows, src, device, on_device)
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(local.stream):
            return _job(o, e, rows, src, device, on_device)

    if cuda:  # sync: the adapter is on the device before the workers' streams read it
        torch.cuda.current_stream(device).synchronize()
    jobs = ((o, e, rows) for o in plan for e, rows in ([(None, None)] if o.data is not None else _jobs(o)))
    ahead = deque()
    with ThreadPoolExecutor(workers) as pool:
        try:
            for o, e, rows in jobs:
                ahead.append((o, e, rows, pool.submit(run, o, e, rows)))
                if len(ahead) > workers:
                    o, e, rows, job = ahead.popleft()
                    yield o, e, rows, job.result()
            while ahead:
                o, e, rows, job = ahead.popleft()
                yield o, e, rows, job.result()
        finally:  # an error or Ctrl-C: the chunks not started are not read
            for *_, job in ahead:
                job.cancel()


def _nonfinite(o: Out, e, rows) -> GGUFError:
    where = "" if rows is None else f" rows {rows.start}..{min(rows.stop, len(o.idx)) - 1}"
    where += "" if e is None else f" of expert {e}"
    return GGUFError(f"{o.name}:{where} hold NaN or inf, which {o.qtype.name} cannot encode: the base model or "
                     "the adapter holds them; fix the weights (a NaN in training stops lean-train) and export again")


def write_gguf(path, arch: str, meta: dict, plan: list, src=None, device=None, progress=True,
               quantizer=None) -> Path:
    """Write `plan` as a GGUF at `path`, atomically (the module docstring); returns the path. device:
    where the LoRA is merged (None: numpy on the host); quantizer: "numpy", "triton" (on device) or
    None (triton on a CUDA device, numpy otherwise)."""
    path = Path(path)
    quantizer = quantizer or ("triton" if device is not None and str(device).startswith("cuda") else "numpy")
    if quantizer not in ("numpy", "triton") or (quantizer == "triton" and device is None):
        raise ValueError(f"quantizer={quantizer!r}: 'numpy', or 'triton' with a torch device")
    total = sum(o.nbytes for o in plan)
    _check_space(path, total)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(tmp, gguf_arch(arch))
    for k, (value, vtype, sub) in meta.items():
        w.add_key_value(k, value, vtype, sub)
    for o in plan:
        w.add_tensor_info(o.name, o.shape, np.float32, o.nbytes, raw_dtype=o.qtype)
    bar = _bar(total, path.name) if progress else None
    t0 = time.perf_counter()
    LAST_WRITE.clear()
    flusher = _Flusher()
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        LAST_WRITE["header"] = time.perf_counter() - t0
        current, written = None, 0
        for o, e, rows, got in _chunks(plan, src, device, quantizer):
            if o is not current:
                _finish(w, f, current, written)
                current, written = o, 0
                w.write_padding(f, f.tell())
            if isinstance(got, _Bytes):
                chunk, bad = got.wait()
                if bad:
                    raise _nonfinite(o, e, rows)
            else:
                try:
                    chunk = quantize_rows(got, o.qtype)
                except ValueError as err:
                    if "NaN or inf" not in str(err):
                        raise
                    raise _nonfinite(o, e, rows) from err
            f.write(np.ascontiguousarray(chunk).data)
            written += chunk.nbytes
            flusher.wrote(f, chunk.nbytes)
            if bar is not None:
                bar.update(chunk.nbytes)
        _finish(w, f, current, written)
        LAST_WRITE["tensors"] = time.perf_counter() - t0
        f.flush()
        flusher.close()
        os.fsync(f.fileno())
        w.close()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        LAST_WRITE["done"] = time.perf_counter() - t0
    except OSError as e:
        raise GGUFError(f"writing {path}: {e.strerror or e} ({total / 2**30:.2f} GiB to write): free space or pass "
                        "another --out; nothing was written under the final name") from e
    finally:
        flusher.close(raise_error=False)
        w.close()
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return path


def _sync_file_range(fn=None):
    """start_writeback(fd, offset, nbytes) over libc's sync_file_range through ctypes (Linux; fn: a
    stand-in with its signature, for tests), or None where there is none."""
    import ctypes
    import sys

    if fn is None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int

    def start_writeback(fd, offset, nbytes):
        if fn(fd, offset, nbytes, 2) != 0:  # 2: SYNC_FILE_RANGE_WRITE, start the range's writeback, wait for none
            err = ctypes.get_errno()
            if err in _NOT_HERE:  # this file system or sandbox does not take it: the plain flush instead
                return _fdatasync(fd)
            raise OSError(err, os.strerror(err))
    return start_writeback


_NOT_HERE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE, errno.EPERM}
_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS and Windows have no fdatasync


_WRITEBACK = _sync_file_range()
FLUSH = "range" if _WRITEBACK is not None else "fdatasync"  # how _Flusher sends the written bytes on


class _Flusher:
    """Sends the written bytes to the disk while the next chunks are made, not all in the closing fsync (a
    5 GB file fits under Linux's background writeback threshold, so without it the disk idles until the
    end). Every FLUSH_BYTES written, in a thread of its own, one call in flight at a time:
      FLUSH "range" (Linux): sync_file_range(SYNC_FILE_RANGE_WRITE) on the bytes written since the last
                 call: their writeback starts, nothing is waited for (the closing fsync waits once; a
                 file system that does not take the call gets an fdatasync instead);
      "fdatasync": the whole file's dirty pages written and waited for (fsync where there is none).
    A failed call's OSError comes back through wrote() or close(); a full disk under "range" shows at
    the closing fsync (the writeback it started fails there), under "fdatasync" at the next call."""

    def __init__(self):
        self.pool, self.job, self.pending, self.start = None, None, 0, None

    def wrote(self, f, nbytes):
        if self.start is None:
            self.start = f.tell() - nbytes
        self.pending += nbytes
        if self.pending < FLUSH_BYTES or (self.job is not None and not self.job.done()):
            return
        if self.job is not None:
            self.job.result()  # a flush that failed raises here
        f.flush()  # Python's buffer into the kernel's page cache, then the disk in the background
        end = f.tell()
        self.pool = self.pool or ThreadPoolExecutor(1)
        if FLUSH == "range":
            self.job = self.pool.submit(_WRITEBACK, f.fileno(), self.start, end - self.start)
        else:
            self.job = self.pool.submit(getattr(os, "fdatasync", os.fsync), f.fileno())
        self.pending, self.start = 0, end

    def close(self, raise_error=True):
        """Wait for the flush in flight (re-raising its error unless raise_error is False)."""
        job, pool, self.job, self.pool = self.job, self.pool, None, None
        try:
            if job is not None:
                if raise_error:
                    job.result()
                else:
                    job.exception()
        finally:
            if pool is not None:
                pool.shutdown()


def _finish(w, f, o, written):
    """After tensor o's last chunk: its bytes must be what the header announced; pad to the alignment."""
    if o is None:
        return
    if written != o.nbytes:
        raise GGUFError(f"{o.name}: wrote {written} bytes, the header says {o.nbytes}: nothing was kept")
    w.write_padding(f, o.nbytes)


def _check_space(path: Path, total: int):
    if path.is_dir():
        raise GGUFError(f"--out {path} is a folder: pass the path of the .gguf file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < total + (64 << 20):
        raise GGUFError(f"{path.parent} has {free / 2**30:.2f} GiB free, the file needs {total / 2**30:.2f} GiB: "
                        "free space or pass an --out on another disk")


def _fsync_dir(folder: Path):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _bar(total, name):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"lean-export {name}", dynamic_ncols=True)
