"""llama.cpp as the oracle for lean's GGUF quantisation: ggml's quantiser on float32 rows, llama-quantize
on a file, lean's Q4_K_M of the same file, and a tensor-by-tensor comparison of two GGUF files.

    python tools/gguf_oracle.py compare A.gguf B.gguf        # exit 1 on a difference
    python tools/gguf_oracle.py llama MODEL-F16.gguf OUT.gguf   # llama-quantize Q4_K_M (llama_cpp)
    python tools/gguf_oracle.py lean MODEL-F16.gguf OUT.gguf    # lean's Q4_K_M of the same tensors

The file-level check of lean's export: quantize lean's F16 export both ways and compare; or compare
lean's own Q4_K_M export with llama-quantize's Q4_K_M of lean's F16 export. ggml's functions come
from the libggml-base / libllama that llama-cpp-python installs (built from its sdist, which carries
llama.cpp: `CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36
--no-binary :all:`, 31 min on 2 shared cores). `lean` needs only gguf and numpy.
"""
import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lean.runtime.gguf_quants import quantize, row_bytes  # noqa: E402
from lean.runtime.gguf_types import q4_k_m_types  # noqa: E402


def ggml_quantize(x, qtype, threads=1):
    """ggml_quantize_chunk (ggml-quants.c, no importance matrix) on float32 rows (R, C) -> uint8 bytes,
    the rows split into `threads` contiguous runs as llama-quantize splits them."""
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    x = np.ascontiguousarray(x, np.float32)
    R, C = x.shape
    out = np.empty((R, row_bytes(C, qtype)), np.uint8)
    cuts = np.linspace(0, R, threads + 1).astype(int)

    def run(i):  # start = the first element: ggml writes from row start / C
        fn(int(qtype), x.ctypes.data, out.ctypes.data, int(cuts[i]) * C, int(cuts[i + 1] - cuts[i]), C, None)

    with ThreadPoolExecutor(threads) as pool:  # ctypes drops the GIL during the call
        list(pool.map(run, range(threads)))
    return out


def llama_quantize(src, dst, threads=1, quiet=True):
    """llama_model_quantize(src, dst) with ftype Q4_K_M and default parameters (no imatrix)."""
    import llama_cpp

    if quiet:
        llama_quantize.log = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(llama_quantize.log, None)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    if llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def lean_q4_k_m(src, dst, threads=None):
    """lean's Q4_K_M of a GGUF file's tensors (types from q4_k_m_types, bytes from quantize), written
    with the source's architecture and no other metadata: a file for compare_gguf_files."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    hp = {k: (r.fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in r.fields else 0)
          for k in ("block_count", "attention.head_count", "attention.head_count_kv", "expert_count")}
    types = q4_k_m_types([(t.name, tuple(int(n) for n in t.shape[::-1])) for t in r.tensors], arch=arch,
                         n_layer=hp["block_count"], n_head=hp["attention.head_count"],
                         n_head_kv=hp["attention.head_count_kv"], n_expert=hp["expert_count"])
    w = GGUFWriter(dst, arch)
    for t in r.tensors:
        shape = tuple(int(n) for n in t.shape[::-1])
        values = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        raw = quantize(values.astype(np.float32, copy=False), types[t.name], threads=threads)
        w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=types[t.name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def compare_gguf_files(a, b):
    """Per-tensor report: a list of dicts (name, type_a, type_b, shape_a, shape_b, same_type,
    same_bytes, blocks_differing, max_abs_diff); a tensor missing from one file has type None.
    A tensor of the same type and shape whose bytes differ gets the count of differing blocks and
    the largest |difference| after dequantisation: a few rounding ties or a different recipe."""
    ta = {t.name: t for t in GGUFReader(a).tensors}
    tb = {t.name: t for t in GGUFReader(b).tensors}
    report = []
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        row = dict(name=name, type_a=x and x.tensor_type.name, type_b=y and y.tensor_type.name,
                   shape_a=x and tuple(int(n) for n in x.shape[::-1]),
                   shape_b=y and tuple(int(n) for n in y.shape[::-1]),
                   same_type=False, same_bytes=False, blocks_differing=None, max_abs_diff=None)
        report.append(row)
        if x is None or y is None or x.tensor_type != y.tensor_type or row["shape_a"] != row["shape_b"]:
            continue
        row["same_type"] = True
        ra = np.asarray(x.data).view(np.uint8).reshape(-1)
        rb = np.asarray(y.data).view(np.uint8).reshape(-1)
        row["same_bytes"] = bool(np.array_equal(ra, rb))
        if not row["same_bytes"]:
            size = GGML_QUANT_SIZES[x.tensor_type][1]
            row["blocks_differing"] = int((ra.reshape(-1, size) != rb.reshape(-1, size)).any(axis=1).sum())
            rows = int(np.prod(row["shape_a"][:-1]))
            da = gq.dequantize(ra.reshape(rows, -1), x.tensor_type)
            db = gq.dequantize(rb.reshape(rows, -1), y.tensor_type)
            row["max_abs_diff"] = float(np.abs(da.astype(np.float64) - db).max())
    return report


def main(argv):
    if len(argv) != 3 or argv[0] not in ("compare", "llama", "lean"):
        sys.exit(__doc__)
    if argv[0] == "llama":
        return llama_quantize(argv[1], argv[2], threads=len(os.sched_getaffinity(0)), quiet=False)
    if argv[0] == "lean":
        return lean_q4_k_m(argv[1], argv[2])
    report = compare_gguf_files(argv[1], argv[2])
    for r in report:
        verdict = "same" if r["same_bytes"] else (
            f"{r['blocks_differing']} blocks differ, max |diff| {r['max_abs_diff']:.3g}" if r["same_type"]
            else "TYPE OR SHAPE DIFFERS")
        print(f"{r['name']:40s} {str(r['type_a']):6s} {str(r['type_b']):6s} {verdict}")
    bad = sum(not r["same_bytes"] for r in report)
    print(f"{len(report) - bad} of {len(report)} tensors identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
