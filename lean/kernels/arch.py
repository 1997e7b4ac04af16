"""The arch table: what each NVIDIA GPU family gives a Triton kernel, and which path lean takes there.

Every kernel's config chooser asks this module, never `major >= N` and never a constant SM count:

    a = arch(x.device)      # Arch of the GPU x lives on (cached), or of the CPU interpreter
    a.smem                  # shared memory per block, opt-in max, bytes (the device's own number)
    a.sms                   # streaming multiprocessors (read from the device)
    a.tma                   # True: TMA descriptors and the Hopper main loops; False: the portable path
    a.tier                  # which config table the kernels read: "sm90", "sm80" or "sm86"
    target(8, 6)            # the same row for a compute capability given by hand (no GPU needed)

| family (cc)                      | smem/block | SMs       | tier | path     | configs                        |
|----------------------------------|-----------:|-----------|------|----------|--------------------------------|
| T4, RTX 20 (7.5)                 |   65,536 B | 40-72     |  -   | refused  | Triton 3.6 lowers tl.dot to FMA (no mma) there, and there is no bf16 |
| A100, A30 (8.0), Orin (8.7)      |  166,912 B | 108       | sm80 | portable | untuned: chosen by the compiler's measure (fit, no spill in a loop) |
| RTX 30, A10, A40 (8.6)           |  101,376 B | 16-84     | sm86 | portable | untuned: chosen by the compiler's measure (fit, no spill in a loop) |
| RTX 40, L4, L40S (8.9)           |  101,376 B | 24-142    | sm86 | portable | untuned (as 8.6)               |
| H100, H200 (9.0)                 |  232,448 B | 132       | sm90 | Hopper   | tuned on an H100 (BENCHMARKS.md) |
| B200 (10.0), GB300 (10.3)        |  232,448 B | 148       | sm90 | Hopper   | untuned: H100's tables; no B200 has run them |
| RTX 50, RTX PRO 6000 (12.0)      |  101,376 B | 20-188    | sm86 | portable | untuned; TMA not taken until a GPU of this kind has run it |
| DGX Spark, GB10 (12.1)           |  101,376 B | 48        | sm86 | portable | untuned (as 12.0)              |

"Portable" means pointer loads (cp.async pipelining) and whatever matrix instruction Triton emits for
the target (mma.sync on 8.x/12.x, wgmma on 9.0): the code any NVIDIA GPU from 8.0 up runs. The tier
names the row whose configs a family reads; each config of each tier is checked to fit its arch's
shared memory by tests/test_arch.py, which compiles every kernel at every config its chooser returns
for sm_80/86/89/90/100/120/121 on the CPU.

Overrides (read at every call, so tests and tools may change them):
  LEAN_PORTABLE=1 (or `with portable():`)  the portable path on any GPU, with the GPU's own tier.
  LEAN_ARCH=8.6 (or `with emulate(8, 6):`) the kernels choose as on that arch (its tier, its smem
      limit, its path), on whatever GPU runs them: an H100 runs the configs an RTX card would.
      The SM count stays the running GPU's.
  forced(arch) (tests/tools): every device answers this Arch, the CPU too (compile-only runs).
The CPU interpreter (TRITON_INTERPRET=1) answers INTERPRETER: no TMA, and 132 "SMs" so that grid
sizes, chunking and the planner's workspace sums match an H100's.
"""
import contextlib
import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Row:
    name: str            # a family of GPUs
    ccs: tuple           # compute capabilities (major, minor) of the family
    smem: int            # opt-in shared memory per block, bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    sms: int             # a typical SM count (a real device reports its own)
    tier: str            # the config table its kernels read
    tma: bool            # TMA descriptors and the Hopper main loops
    tuned: bool          # its configs were timed on a GPU of this family
    how: str             # how its configs were chosen, and what has run where


ROWS = (
    Row("A100, A30, Jetson Orin", ((8, 0), (8, 7)), 166_912, 108, "sm80", False, False,
        "untuned: tiles chosen by the compiler's measure: they fit 166,912 B and spill nowhere in a hot "
        "loop (tests/test_arch.py, tools/ptxas_report.py)"),
    Row("RTX 30, A10, A40", ((8, 6),), 101_376, 84, "sm86", False, False,
        "untuned: tiles chosen by the compiler's measure: they fit 101,376 B and spill nowhere in a hot "
        "loop (tests/test_arch.py, tools/ptxas_report.py); LEAN_ARCH=8.6 runs them on any GPU"),
    Row("RTX 40, L4, L40S", ((8, 9),), 101_376, 76, "sm86", False, False, "untuned (as 8.6)"),
    Row("H100, H200", ((9, 0),), 232_448, 132, "sm90", True, True,
        "tuned on an H100 (Triton 3.6); LEAN_PORTABLE=1 runs the portable path there"),
    Row("B200, GB200, GB300", ((10, 0), (10, 3)), 232_448, 148, "sm90", True, False,
        "untuned: the H100's tables (same shared memory); no GPU of this family has run lean"),
    Row("RTX 50, RTX PRO 6000", ((12, 0),), 101_376, 82, "sm86", False, False,
        "untuned (as 8.6); the portable path: TMA stays off until a GPU of this kind has run it"),
    Row("DGX Spark (GB10)", ((12, 1),), 101_376, 48, "sm86", False, False, "untuned (as 12.0)"),
)
# Below 8.0 lean refuses the GPU (UnsupportedGPU): Triton 3.6 compiles tl.dot for sm_75 as FMA loops
# (no mma instruction in the PTX of gemm.py's kernel, fp16 or bf16; checked with triton.compile for
# GPUTarget("cuda", 75, 32)), so every GEMM would run on the CUDA cores, and sm_75 has no bf16.
MIN_CC = (8, 0)


@dataclass(frozen=True)
class Arch:
    cc: tuple            # (major, minor); (0, 0) for the CPU interpreter
    name: str            # "sm_86", or "interpreter"
    smem: int            # shared memory per block, bytes
    sms: int             # SM count
    tier: str            # config table: "sm90", "sm80", "sm86"
    tma: bool            # TMA + Hopper loops taken (after LEAN_PORTABLE)
    row: Row = None      # the table row (None for the interpreter)

    @property
    def path(self):
        return "Hopper (TMA, wgmma)" if self.tma else "portable"


INTERPRETER = Arch((0, 0), "interpreter", 1 << 30, 132, "sm90", False)


class UnsupportedGPU(RuntimeError):
    pass


def row_of(major, minor):
    """The table row of a compute capability: its family, else the nearest lower family of the same
    major (a new minor revision), else UnsupportedGPU."""
    cc = (major, minor)
    if cc < MIN_CC:
        raise UnsupportedGPU(
            f"compute capability {major}.{minor} is not supported: lean needs 8.0 or newer (A100, RTX 30/40/50, "
            "H100, ...). Triton 3.6 runs matrix products on such a GPU without its tensor cores (tl.dot compiles "
            "to FMA loops for sm_75), and it has no bfloat16; use a newer GPU, or the CPU for tiny models")
    same = [r for r in ROWS if any(c == cc for c in r.ccs)]
    if same:
        return same[0]
    lower = [(c, r) for r in ROWS for c in r.ccs if c[0] == major and c < cc]
    if lower:
        return max(lower, key=lambda x: x[0])[1]
    raise UnsupportedGPU(f"compute capability {major}.{minor} is not in lean's arch table (lean/kernels/arch.py): "
                         "run lean-check on it, and report its output so a row can be added")


def target(major, minor, sms=None, smem=None):
    """The Arch of a compute capability given by hand (the table's smem and SM count unless given)."""
    r = row_of(major, minor)
    return Arch((major, minor), f"sm_{major}{minor}", smem or r.smem, sms or r.sms, r.tier, r.tma, r)


# ------------------------------------------------------------------------------------------- overrides

_FORCED = {"arch": None, "emulate": None, "portable": None}  # None: not set by code (env vars decide)
_CACHE = {}


def _env_emulate():
    v = os.environ.get("LEAN_ARCH", "").strip().lower().replace("sm_", "").replace("sm", "")
    if not v:
        return None
    major, _, minor = v.partition(".") if "." in v else (v[:-1], "", v[-1:])
    try:
        return int(major), int(minor)
    except ValueError:
        raise UnsupportedGPU(f"LEAN_ARCH={os.environ['LEAN_ARCH']!r}: expected a compute capability such as 8.6 "
                             "or sm_86") from None


def portable_forced():
    """True under LEAN_PORTABLE=1 or `with portable():`."""
    if _FORCED["portable"] is not None:
        return _FORCED["portable"]
    return os.environ.get("LEAN_PORTABLE", "0") not in ("", "0")


@contextlib.contextmanager
def _setting(key, value):
    old, _FORCED[key] = _FORCED[key], value
    try:
        yield
    finally:
        _FORCED[key] = old


def portable(on=True):
    """Within: the portable path on any GPU (as LEAN_PORTABLE=1)."""
    return _setting("portable", bool(on))


def emulate(major, minor):
    """Within: kernels choose their configs and path as on compute capability major.minor (as LEAN_ARCH)."""
    row_of(major, minor)
    return _setting("emulate", (major, minor))


def forced(a):
    """Within: every device (the CPU too) answers Arch a: compile-only runs (tests/test_arch.py)."""
    return _setting("arch", a)


# ------------------------------------------------------------------------------------------- lookup

def _device_arch(idx):
    """The Arch a real GPU reports (cached per index): its cc, SM count and opt-in shared memory."""
    if idx not in _CACHE:
        p = torch.cuda.get_device_properties(idx)
        try:
            smem = getattr(p, "shared_memory_per_block_optin", 0) or row_of(p.major, p.minor).smem
            _CACHE[idx] = target(p.major, p.minor, sms=p.multi_processor_count, smem=smem)
        except UnsupportedGPU as e:
            raise UnsupportedGPU(f"GPU {idx} ({p.name}): {e}") from None
    return _CACHE[idx]


def interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def arch(device=None):
    """The Arch kernels on `device` choose by (None: the current CUDA device), after the overrides.
    Called at every launch: the answer is cached per device and override setting."""
    if _FORCED["arch"] is None and device is not None and device.type == "cuda":
        key = (device.index, _FORCED["emulate"], _FORCED["portable"], os.environ.get("LEAN_ARCH"),
               os.environ.get("LEAN_PORTABLE"), os.environ.get("TRITON_INTERPRET"))
        a = _RESOLVED.get(key)
        if a is None:
            a = _RESOLVED[key] = _arch(device)
        return a
    return _arch(device)


_RESOLVED = {}


def _arch(device):
    if _FORCED["arch"] is not None:
        a = _FORCED["arch"]
        return replace(a, tma=False) if portable_forced() else a
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() and not interpreting() else torch.device("cpu")
    if device.type != "cuda" or interpreting():
        return INTERPRETER
    a = _device_arch(device.index if device.index is not None else torch.cuda.current_device())
    emu = _FORCED["emulate"] or _env_emulate()
    if emu is not None:
        e = target(*emu)
        a = replace(e, sms=a.sms, smem=min(a.smem, e.smem), name=f"{a.name} as {e.name}",
                    tma=e.tma and a.tma)  # TMA only where the running GPU has it too
    return replace(a, tma=False) if a.tma and portable_forced() else a


def describe(device=None):
    """One line for logs: 'NVIDIA H100 80GB HBM3: sm_90, 132 SMs, 232,448 B shared/block, path Hopper ...'."""
    a = arch(device)
    if a is INTERPRETER:
        return "CPU (Triton interpreter): no GPU, kernels run through TRITON_INTERPRET=1"
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else a.name
    row = a.row
    return (f"{name}: {a.name} (compute capability {a.cc[0]}.{a.cc[1]}), {a.sms} SMs, {a.smem:,} B shared "
            f"memory per block, path {a.path}, configs {a.tier}" + ("" if row is None or row.tuned else " (untuned)"))
