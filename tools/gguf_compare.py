"""Compare two GGUF files tensor by tensor: names, types, shapes and bytes.

    python tools/gguf_compare.py lean-Q4_K_M.gguf llama-quantize-Q4_K_M.gguf   # exit 1 on a difference

For checking lean's export against llama.cpp's: quantize lean's F16 export with llama-quantize (or
llama_cpp.llama_model_quantize), then compare it with lean's own Q4_K_M export of the same model.
A tensor whose type matches but whose bytes do not gets the count of differing blocks and the
largest |difference| after dequantisation (gguf.quants.dequantize), to tell a rounding difference
in a few blocks from a different recipe.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES


def compare_gguf_files(a, b):
    """Per-tensor report: a list of dicts (name, type_a, type_b, shape_a, shape_b, same_type,
    same_bytes, blocks_differing, max_abs_diff); a tensor missing from one file has type None."""
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
    if len(argv) != 2:
        sys.exit("usage: python tools/gguf_compare.py A.gguf B.gguf")
    report = compare_gguf_files(*argv)
    for r in report:
        verdict = "same" if r["same_bytes"] else (
            f"{r['blocks_differing']} blocks differ, max |diff| {r['max_abs_diff']:.3g}" if r["same_type"]
            else "TYPE/SHAPE DIFFERS")
        print(f"{r['name']:40s} {str(r['type_a']):6s} {str(r['type_b']):6s} {verdict}")
    bad = sum(not r["same_bytes"] for r in report)
    print(f"{len(report) - bad} of {len(report)} tensors identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
