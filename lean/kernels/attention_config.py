"""Launch configuration of lean/kernels/attention.py's kernels, and the measurements behind it.

    config(kernel, block_d, dtype, max_seqlen, width, tma) -> (BLOCK_M, BLOCK_N, num_warps, num_stages)
    grid(kernel, heads, items) -> the launch grid, by SORTED[kernel] (the walk's order)
    DELTA_BLOCK_R: rows per delta program
kernel is "fwd", "dkdv" or "dq"; block_d the head dim padded to a power of two; width = H * D.
The tables hold what tools/attn_tune.py measured (it edits them in place to sweep); tests patch
TMA_TABLES and SORTED to compare the paths and orders bit for bit. Host-side only.
"""
import os

import torch
import triton

# launch configuration: (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by the padded head dim.
# Forward and dq need BLOCK_M % BLOCK_N == 0, dk/dv needs BLOCK_N % BLOCK_M == 0 (diagonal split).
# Evidence: tools/attn_tune.py --sweep on an H100 (bf16, triton 3.6, two sweeps), time summed over
# the packed N=8192 (exponential lengths, mean 512) and 4x2048 cases, H=16/KVH=8 (D=128) and
# H=32/KVH=8 (D=64); every kernel timed with the others at their chosen configs:
#   fwd  (64, 64, 4, 3): D=128 0.290 ms vs 0.314 (64, 32, 4, 3), 0.322 (64, 64, 4, 2),
#                        0.324 (128, 64, 8, 3), 0.342 (128, 128, 8, 3), 0.426 (64, 64, 8, 3);
#                        D=64  0.300 ms vs 0.310 (64, 64, 4, 2), 0.325 (128, 64, 8, 3).
#   dkdv (bwd total)     D=128 (32, 64, 4, 2) 1.058 ms vs 1.116 (32, 64, 4, 3), 1.193 (16, 64, 4, 3),
#                        1.217 (64, 64, 4, 2), 1.284 (32, 128, 8, 3), 1.805 (32, 64, 8, 3);
#                        D=64  (32, 64, 4, 3) 1.255 ms vs 1.267 (32, 64, 4, 2), 1.361 (64, 64, 4, 2),
#                        1.430 (32, 128, 4, 3).
#   dq   (bwd total)     D=128 (64, 32, 4, 3) 1.119 ms ~ 1.120 (128, 64, 8, 3), 1.125 (64, 64, 4, 2),
#                        vs 1.214 (64, 64, 4, 3), 1.605 (64, 32, 8, 3);
#                        D=64  (64, 64, 4, 3) 1.255 ms ~ 1.247 (64, 64, 4, 2), vs 1.275 (64, 32, 4, 3).
# Result (fwd+bwd, causal TFLOP/s, 3.5x fwd FLOPs): D=128 packed 144 vs torch flash varlen 102,
# 4x2048 263 vs 210; D=64 packed 138 vs 93, 4x2048 228 vs 200 (fwd alone 194-360 vs 90-250),
# measured with dkdv D=128 at (32, 64, 4, 3); (32, 64, 4, 2) was adopted from the same sweep after.
# D=256 is untuned (small tiles that fit shared memory; tests pass on H100).
FWD_CONFIG = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)}
DKDV_CONFIG = {64: (32, 64, 4, 3), 128: (32, 64, 4, 2), 256: (16, 64, 8, 2)}
DQ_CONFIG = {64: (64, 64, 4, 3), 128: (64, 32, 4, 3), 256: (64, 16, 8, 2)}
# fp32 (tests only; ieee dots run on CUDA cores, not tensor cores): small tiles that fit shared memory.
FP32_CONFIG = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
# Triton interpreter (CPU tests): small, unequal blocks so several blocks and a split diagonal run.
INTERPRET_CONFIG = {"fwd": (32, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}
# Interpreter, model-sized heads (H * D >= 512; the tests' are at most 320): the interpreter's cost
# is per program and per key/query step (~3-8 ms of Python each), not per score, so square blocks
# that cover the longest document, up to 256. SmolLM2 (9 heads of 64), 8 documents of 53-67
# tokens, fp32, 1 core, CPU time: fwd 2.4 s -> 0.86 s, bwd 4.3 s -> 1.4 s (128 x 128 blocks);
# 64 x 64 blocks: 1.2 s and 2.0 s, 256 x 256: 0.88 s and 1.6 s.
INTERPRET_MAX_BLOCK = 256
TABLES = {"fwd": FWD_CONFIG, "dkdv": DKDV_CONFIG, "dq": DQ_CONFIG}
# The TMA loops (Hopper): the rows each loop step reads come through descriptors (the copy engine
# fills shared memory; no per-row address or mask math). H100, bf16, kernel medians over bench
# step's packed documents (11, max 3101) and 4 x 2048, pointer loops at their table configs above
# -> TMA at these (the outputs bit-equal):
#   (H, KVH, D) = (32, 8, 128): fwd 0.379 -> 0.318 ms, dkdv 0.958 -> 0.859, dq 0.468 -> 0.441;
#   (16, 8, 128): fwd 0.208 -> 0.176, dkdv 0.490 -> 0.446, dq 0.262 -> 0.244;
#   (32, 8, 64):  fwd 0.214 -> 0.202, dkdv 0.699 -> 0.638, dq 0.222 -> 0.204 (packed; 4 x 2048 alike).
# Runner-up configs within 3%: fwd (128, 128, 8, 3) at D=128, dkdv (32, 64, 4, 2) at D=64.
# With the sorted backward walk (SORTED below), `tools/attn_tune.py --tma --sweep --kernels
# dkdv,dq` (backward ms summed over its three batches; 13 dk/dv and 10 dq configs a head dim): dkdv
# stays (32, 64, 4, 2) at D=128 (1.478; next (64, 64, 4, 2) 1.567) and (64, 64, 4, 3) at D=64;
# dq at D=128 (128, 64, 8, 3) 1.474 -> (64, 64, 4, 2) 1.424 (each batch 2-7% faster), at D=64
# (64, 64, 4, 3) stays (1.744; next (64, 64, 4, 2) 1.774).
TMA_TABLES = {"fwd": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
               "dkdv": {64: (64, 64, 4, 3), 128: (32, 64, 4, 2)},
               "dq": {64: (64, 64, 4, 3), 128: (64, 64, 4, 2)}}


def _override_tma_tables(spec):
    """LEAN_ATTN_TMA="kernel:D:BM,BN,W,S;...": rows that replace TMA_TABLES' (experiments: step A/Bs)."""
    for row in spec.split(";"):
        kernel, d, cfg = row.split(":")
        TMA_TABLES[kernel][int(d)] = tuple(int(v) for v in cfg.split(","))


if os.environ.get("LEAN_ATTN_TMA"):
    _override_tma_tables(os.environ["LEAN_ATTN_TMA"])
# The walk's order (attention._work_item, _query_program). SORTED takes the documents longest
# first and puts the heads on grid axis 0, so that every head's heaviest programs launch first;
# unsorted, the heads are axis 1 and the last heads' heavy programs launch after every other
# head's items, and a dk/dv program (a key block of one kv head, its G query heads inside: the
# longest program of the kernel) can then start late and run alone at the end. H100, bf16, TMA
# loops, the graph's 64 document slots, backward (delta + dk/dv + dq) unsorted -> sorted: (32, 8,
# 128) 1.289 -> 1.078 ms on bench step's documents (11, max 3101), 1.086 -> 0.880 and 0.748 ->
# 0.646 on bench_offload's two batches (18 each), 1.298 -> 1.168 on 4 x 2048; (16, 8, 128) 0.699
# -> 0.550, 0.582 -> 0.457, 0.403 -> 0.343, 0.679 -> 0.601; (32, 8, 64) 0.857 -> 0.669, 0.700 ->
# 0.544, 0.478 -> 0.400, 0.826 -> 0.723 (the same bits). dq alone gains 0-4% from it. The
# forward's programs are short (one head each): sorted it measured 3-10% slower at (32, 8, 128),
# within noise elsewhere.
SORTED = {"fwd": False, "dkdv": True, "dq": True}
DELTA_BLOCK_R = 64                                  # rows per delta program; a memory-bound pass
# dk/dv programs per key block and kv head, by (G, D): G = H // KVH query heads per kv head, D the
# head dim. A program walks the query blocks of its key block's document once per query head it
# takes, so at large G the first key block of the longest document is the longest program of the
# kernel and finishes alone. SPLIT programs take every SPLIT-th query head each and write fp32
# partial sums, which a second pass adds in split order (deterministic; 2 * SPLIT * N * KVH * D * 4
# bytes of scratch: attention_bwd_scratch). Missing: 1 (no partials). Evidence, `python
# tools/attn_tune.py --split` on the H100 (TMA loops, CUDA-graph medians of delta + dk/dv + dq, bench
# step's packed batch | 4 x 2048), ms at S = 1 / 2 / 4 / 8:
#   (32, 4, 128) Qwen3-30B-A3B: 1.327 / 1.098 / 1.139 / 1.234 | 1.435 / 1.239 / 1.304 / 1.388
#   (64, 8, 64)  gpt-oss-20b:   1.317 / 1.344 / 1.385 / 1.487 | 1.452 / 1.491 / 1.540 / 1.636
#                its window 128: 0.612 / 0.652 / 0.718 / 0.838 (window layers never split)
#   (32, 8, 128) Qwen3-8B 1.079 / 1.148 / 1.248; (32, 8, 64) Llama-3.2-1B 0.666 / 0.700 / 0.749;
#   (16, 8, 128) Qwen3-0.6B 0.550 / 0.629 (4 x 2048 alike)
# At D = 64 a program's steps are half as long and the kernel is busy enough without the split.
DKDV_SPLIT = {(8, 128): 2}
if os.environ.get("LEAN_DKDV_SPLIT") is not None:  # "G:D:S,..." replaces the table ("" empties it): experiments
    DKDV_SPLIT = {(int(g), int(d)): int(s) for g, d, s in
                  (kv.split(":") for kv in os.environ["LEAN_DKDV_SPLIT"].split(",") if kv)}


def dkdv_split(group, head_dim, window=0):
    """Programs per kv head of the dk/dv kernel, a divisor of group (every dtype, the interpreter
    too). A sliding window keeps every program short (its key block meets ~window rows): 1."""
    s = 1 if window else DKDV_SPLIT.get((group, head_dim), 1)
    if group % s:
        raise ValueError(f"attention DKDV_SPLIT[{group, head_dim}] = {s} must divide the group size {group}")
    return s


def attention_bwd_scratch(n_tokens, n_heads, n_kv_heads, head_dim, window=0):
    """Bytes attention_bwd allocates besides its arguments: the dk/dv partials (DKDV_SPLIT)."""
    s = dkdv_split(n_heads // n_kv_heads, head_dim, window)
    return 2 * s * n_tokens * n_kv_heads * head_dim * 4 if s > 1 else 0


# The mma.sync tiers (lean/kernels/arch.py's sm80 and sm86: A100, RTX 30/40/50, DGX Spark), where
# these kernels' dots take their operands from registers: untuned, chosen by ptxas
# (tools/ptxas_report.py, Triton 3.6's ptxas, no GPU). dk/dv at D=128 and the table's (32, 64, 4, 2)
# spilled 84-408 B a thread there, 1-10 spill instructions inside its key loop (sm_80, 86, 120; the
# Qwen3 heads, split or not); at (32, 64, 8, 2) none in any loop (219-255 registers, 53,504 B). The
# tables above stay for the H100's pointer loops (wgmma), where 8 warps ran 1.7x slower (the sweep).
MMA_SYNC_CONFIG = {"dkdv": {128: (32, 64, 8, 2)}}
MMA_SYNC_TIERS = ("sm80", "sm86")


def interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"  # read at launch: tests set it before use


def config(kernel, block_d, dtype, max_seqlen, width, tma=False, tier=None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); width = H * D; tier: the GPU's config tier
    (arch.arch(device).tier; MMA_SYNC_CONFIG on the mma.sync tiers)."""
    if interpreting() and width >= 512:
        b = min(INTERPRET_MAX_BLOCK, max(16, triton.next_power_of_2(max_seqlen)))
        cfg = (b, b, 1, 1)
    elif interpreting():
        cfg = INTERPRET_CONFIG[kernel]
    elif dtype == torch.float32:
        cfg = FP32_CONFIG[kernel]
    elif tma:
        if block_d not in TMA_TABLES[kernel]:
            raise ValueError(f"attention tma=True: the GPU's TMA loops are tuned for D = "
                             f"{sorted(TMA_TABLES[kernel])} only (got D = {block_d}); pass tma=None")
        cfg = TMA_TABLES[kernel][block_d]
    elif tier in MMA_SYNC_TIERS and max(64, block_d) in MMA_SYNC_CONFIG.get(kernel, {}):
        cfg = MMA_SYNC_CONFIG[kernel][max(64, block_d)]
    else:
        cfg = TABLES[kernel][max(64, block_d)]
    q_block, k_block = cfg[:2]
    if (k_block % q_block) if kernel == "dkdv" else (q_block % k_block):  # the diagonal split
        raise ValueError(f"attention {kernel} config {cfg}: the query and key blocks must nest "
                         "(BLOCK_N % BLOCK_M == 0 for dkdv, BLOCK_M % BLOCK_N == 0 otherwise)")
    return cfg


def grid(kernel, heads, items):
    return (heads, items) if SORTED[kernel] else (items, heads)
