"""The streaming GGUF writer of gguf_export.py: a plan of tensors -> one .gguf file, atomically.

    path = write_gguf(out, arch, meta, plan, src, device)   # plan: [Out], meta: {key: (value, type, sub)}

Shape legend: O / K a tensor's rows / columns (numpy order), E experts.

gguf-py's GGUFWriter writes the header: the metadata, then every tensor's name, shape, type and
offset (add_tensor_info with the sizes the types imply: nothing is read yet). Then each tensor's
data, at the 32-byte aligned offsets the header promised (the writer's own padding rule: pad to the
alignment before a tensor and after its bytes), in chunks of rows: CHUNK_BYTES of fp32 rows at
most, whole heads where Q/K rows are permuted (Out.unit), one expert at a time, a vector or an
expert read whole to be transposed in one; each chunk read through gguf_source.merged_rows (the
LoRA folded in), quantised by gguf_quants.quantize, written, dropped. Host memory: a few chunks.
A tensor whose chunks do not add up to the bytes its header entry announced stops the write.

Atomic: the file is <out>.tmp-<pid> until it is complete, flushed and fsynced; then os.replace
puts it under the final name and the folder is fsynced. Any failure (an error, Ctrl-C, a full disk:
OSError, raised as a GGUFError naming the fix) removes the temporary file: nothing half-written
under the final name, and an earlier file there stays as it was. The free space is checked first
(the file's size is known from the plan). A tqdm bar in bytes when tqdm is installed.
Tested: tests/test_gguf_export.py (chunked and whole writes are the same bytes; a full disk
mid-write and too little free space leave nothing and keep the earlier file).
"""
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from .gguf import GGUFError
from .gguf_names import gguf_arch
from .gguf_quants import quantize
from .gguf_source import merged_rows

CHUNK_BYTES = 64 << 20  # fp32 rows per chunk: the streaming unit


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


def _rows(o: Out, e, rows, src, device) -> np.ndarray:
    """A chunk's fp32 rows, ready for the quantiser: (n, K), or (1, n) for a vector."""
    if o.data is not None:
        return o.data.reshape(-1, o.shape[-1])
    w = merged_rows(src, o.lora, o.hf, e, o.idx[rows], o.transposed, len(o.idx), device)
    return w.reshape(1, -1) if o.vector else w


def _chunks(plan: list, src, device):
    """(tensor, fp32 rows) of every chunk of the plan in order; the next chunk is read and merged on a
    second thread while this one is quantised and written (numpy and pread release the GIL): one
    chunk more in memory, the reading and the quantising overlapped."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = ((o, e, rows) for o in plan for e, rows in ([(None, None)] if o.data is not None else _jobs(o)))
    with ThreadPoolExecutor(1) as pool:
        ahead = None
        for o, e, rows in jobs:
            job = pool.submit(_rows, o, e, rows, src, device)
            if ahead is not None:
                yield ahead[0], ahead[1].result()
            ahead = (o, job)
        if ahead is not None:
            yield ahead[0], ahead[1].result()


def write_gguf(path, arch: str, meta: dict, plan: list, src=None, device=None, progress=True) -> Path:
    """Write `plan` as a GGUF at `path`, atomically (the module docstring); returns the path."""
    path = Path(path)
    total = sum(o.nbytes for o in plan)
    _check_space(path, total)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(tmp, gguf_arch(arch))
    for k, (value, vtype, sub) in meta.items():
        w.add_key_value(k, value, vtype, sub)
    for o in plan:
        w.add_tensor_info(o.name, o.shape, np.float32, o.nbytes, raw_dtype=o.qtype)
    bar = _bar(total, path.name) if progress else None
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        current, written = None, 0
        for o, rows in _chunks(plan, src, device):
            if o is not current:
                _finish(w, f, current, written)
                current, written = o, 0
                w.write_padding(f, f.tell())
            chunk = quantize_rows(rows, o.qtype)
            f.write(np.ascontiguousarray(chunk).data)
            written += chunk.nbytes
            if bar is not None:
                bar.update(chunk.nbytes)
        _finish(w, f, current, written)
        f.flush()
        os.fsync(f.fileno())
        w.close()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise GGUFError(f"writing {path}: {e.strerror or e} ({total / 2**30:.2f} GiB to write): free space or pass "
                        "another --out; nothing was written under the final name") from e
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return path


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
