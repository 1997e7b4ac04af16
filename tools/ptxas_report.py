"""What ptxas says of every kernel a model's step launches, on the CPU: registers, spills, warnings.

    python tools/ptxas_report.py --models qwen3-0.6b,qwen3-30b-a3b --target 90      # the step's kernels on sm_90
    python tools/ptxas_report.py --models llama-3.2-1b --target 86 --all             # every launch, not only findings

A GPU run shows a slow kernel; this shows two reasons for one without a GPU: register spills (local
memory traffic inside the main loop) and ptxas's warnings and performance advisories, such as
C7515 ("Potential Performance Loss: wgmma.mma_async instructions are serialized"), where a Hopper kernel's warpgroup MMAs run one after another instead of overlapping
(gemm.py's x W^T loop nest exists because of one). The launches are tools/arch_compile.py's: the
step's variants recorded on the meta device under the target's arch row, each distinct launch
compiled by Triton (its own cache: a launch compiled before, by arch_compile or here, is not
compiled again), then its PTX given to Triton's bundled ptxas as triton.compile gives it (-lineinfo
-v --gpu-name=sm_XX[a]) and the log read. Where a launch spills, its SASS (cuobjdump) says how many
spill instructions sit in an innermost loop ("in loop": each iteration pays; 0: a prologue or
epilogue pays once a tile). Findings: spills or a warning; exit status 0 (a report), or with
--no-loop-spills 1 when a launch spills inside a loop (tests/test_arch.py's gate on the RTX tier).
"""
import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arch_compile as AC  # noqa: E402  (sets TRITON_INTERPRET=0 before lean is imported)

from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402

USED = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
STACK = re.compile(r"(\d+) bytes stack frame")


def _ptx(key, job):
    """The launch's PTX from Triton's cache, compiled first where it is not there."""
    name = job[1]
    path = get_cache_manager(key).get_file(f"{name}.ptx")
    if path is None:
        _, _, err = AC._compile_job(job)
        if err is not None:
            return None, err
        path = get_cache_manager(key).get_file(f"{name}.ptx")
    return (open(path).read(), None) if path else (None, "compiled, but no PTX in Triton's cache")


def ptxas_log(ptx, cc):
    """(registers, spill store bytes, spill load bytes, stack bytes, warnings) from ptxas -v."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cc).path, "-lineinfo", "-v", f"--gpu-name={sm_arch_from_capability(cc)}", src,
               "-o", os.path.join(d, "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = max((int(m) for m in USED.findall(log)), default=-1)
    spills = [tuple(map(int, m)) for m in SPILL.findall(log)]
    stack = max((int(m) for m in STACK.findall(log)), default=0)
    warnings = sorted({re.sub(r"^.*?(warning|info)\s*:\s*", "", x).strip() for x in log.splitlines()
                       if "warning" in x.lower() or "Performance" in x or re.search(r"\(C\d{4}\)", x)})
    return regs, max((s for s, _ in spills), default=0), max((ld for _, ld in spills), default=0), stack, warnings


ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")


def spills_in_loops(key, name, cc):
    """Spill instructions (STL/LDL) inside the kernel's innermost loops, from its SASS (cuobjdump of
    the cubin in Triton's cache): a spill there costs every iteration, one outside them once a tile.
    A loop is a backward branch's span; innermost: no other loop's span inside it."""
    cubin = get_cache_manager(key).get_file(f"{name}.cubin")
    if cubin is None:
        return -1
    tool = os.path.join(os.path.dirname(get_ptxas(cc).path), "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    code = [(int(m.group(1), 16), line) for line in sass.splitlines() if ";" in line
            for m in [ADDR.search(line)] if m]
    loops = []
    for at, line in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return sum(1 for at, line in code if re.search(r"\b(STL|LDL)", line) and any(a <= at <= b for a, b in inner))


def _one(item):
    key, job, cc = item
    ptx, err = _ptx(key, job)
    if ptx is None:
        return None, err
    regs, st, ld, stack, warns = ptxas_log(ptx, cc)
    return (regs, st, ld, stack, warns, spills_in_loops(key, job[1], cc) if st or ld else 0), None


def report(models, cc, workers=2, show_all=False, kernels=None, skip=(), log=print):
    """Record the models' launches on target cc, compile what Triton's cache lacks, read ptxas's log
    of each distinct launch (kernels: only these names; skip: not a launch whose config text holds
    one of these); prints the table, returns [(kernel, config, models, result, error)]."""
    from lean.kernels import arch as A
    from lean.models.presets import PRESETS

    jobs, seen = {}, defaultdict(list)
    with A.forced(A.target(cc // 10, cc % 10)):
        for m in models:
            for fn, args, kwargs in AC.model_launches(m, PRESETS[m]):
                if kernels and fn.fn.__name__ not in kernels:
                    continue
                key, job = AC.specialize(fn, args, kwargs, cc)
                if any(x in AC.config_text(fn, job[4], job[6]) for x in skip):
                    continue
                jobs.setdefault(key, (fn, job))
                if m not in seen[key]:
                    seen[key].append(m)
    log(f"# {len(jobs)} distinct launches on sm_{cc} ({', '.join(models)})")
    keys = list(jobs)
    with cf.ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        outs = list(pool.map(_one, [(k, jobs[k][1], cc) for k in keys]))
    rows = []
    for k, (res, err) in zip(keys, outs):
        fn, job = jobs[k]
        rows.append((fn.fn.__name__, AC.config_text(fn, job[4], job[6]), seen[k], res, err))
    rows.sort(key=lambda r: (r[0], r[1]))
    log(f"{'kernel':34} {'regs':>5} {'spill st/ld B':>14} {'in loop':>7}  config; findings")
    found = 0
    for name, config, ms, res, err in rows:
        if err is not None:
            found += 1
            log(f"{name:34} {'-':>5} {'-':>14} {'-':>6}  {config}; COMPILE ERROR {err}")
            continue
        regs, st, ld, stack, warns, looped = res
        finding = st or ld or warns
        found += bool(finding)
        if finding or show_all:
            log(f"{name:34} {regs:>5} {f'{st}/{ld}':>14} {looped:>7}  {config}"
                + (f"; {' | '.join(warns)}" if warns else "") + f"  [{','.join(ms)}]")
    log(f"# {len(rows)} launches, {found} with spills, warnings or errors")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,qwen3-30b-a3b,gpt-oss-20b",
                   help="preset names (lean/models/presets.py), comma-separated")
    p.add_argument("--target", type=int, default=90, help="compute capability, e.g. 90 or 86")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--all", action="store_true", help="every launch, not only those with findings")
    p.add_argument("--kernels", help="only these kernels (comma-separated names)")
    p.add_argument("--skip", action="append", default=[], help="leave out launches whose config holds this text")
    p.add_argument("--no-loop-spills", action="store_true",
                   help="exit 1 when a launch spills inside an innermost loop or fails to compile (a gate)")
    a = p.parse_args(argv)
    rows = report(a.models.split(","), a.target, a.workers, a.all, a.kernels.split(",") if a.kernels else None, a.skip)
    bad = [r for r in rows if r[4] is not None or r[3][5] > 0]
    for name, config, ms, res, err in bad if a.no_loop_spills else []:
        print(f"LOOP SPILLS sm_{a.target} {name} [{config}] ({', '.join(ms)}): "
              + (err or f"{res[5]} spill instructions inside an innermost loop"))
    return 1 if a.no_loop_spills and bad else 0


if __name__ == "__main__":
    sys.exit(main())
