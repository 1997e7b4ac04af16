"""lean-check's output: one line per check, the worst of its verdicts, and the counts for the summary.

    report = Report()
    report.check("rmsnorm fwd", "N8192 C576 +residual", [close_rule(y, y_ref, y_low, name="y"), ...])
    report.error("attention", exc)           # a crash is a failed check, with its traceback's tail
    report.note("gemm", "split-K: 11 slices")

A line shows the verdict with the largest error / bound (its output's name last), and on a failure
every failing verdict's text below it, so one report names all the bad outputs.
"""
import traceback

COLUMNS = "{:<30} {:<44} {:>9} {:>9}  {:<6}  {}"


class Report:
    def __init__(self, out=print):
        self.out = out
        self.passed, self.failed = [], []

    def header(self):
        self.out(COLUMNS.format("check", "shape", "error", "bound", "result", "worst output"))

    def check(self, name, shape, verdicts):
        """One line for the verdicts of one kernel call (or one comparison): PASS only if all are ok."""
        worst = max(verdicts, key=_margin)
        ok = all(v.ok for v in verdicts)
        label = worst.text.split(":", 1)[0]
        self.out(COLUMNS.format(name, shape, _num(worst.err), _num(worst.bound), "PASS" if ok else "FAIL", label))
        for v in verdicts:
            if not v.ok:
                self.out(f"    {v.text}")
        (self.passed if ok else self.failed).append(name)
        return ok

    def error(self, name, exc):
        """A check that raised: FAIL, with the exception and the last frames of its traceback."""
        self.out(COLUMNS.format(name, "-", "-", "-", "FAIL", f"{type(exc).__name__}: {_one_line(exc)}"))
        tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:]
        for line in "".join(tail).rstrip().splitlines():
            self.out(f"    {line}")
        self.failed.append(name)

    def note(self, name, text):
        self.out(f"{name:<30} {text}")


def _margin(v):
    """How close a verdict is to (or how far past) its bound: error / bound (NaN: a yes/no check)."""
    if not v.ok:
        return float("inf")
    if v.bound != v.bound or v.err == 0:
        return 0.0
    return v.err / v.bound if v.bound > 0 else float("inf")


def _num(x):
    return "-" if x != x else f"{x:.2e}"


def _one_line(exc):
    return " ".join(str(exc).split())[:160]
