"""lean/reference/rule.py: the max-error rule's bound, and lowp_ref (torch's own error measured
from another reference than out's)."""
import torch

from lean.reference.rule import close_rule


def test_close_rule_bound_and_lowp_ref():
    ref = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    out = (ref + torch.tensor([0.0, 0.0, 0.03], dtype=torch.float64)).half()
    lowp = (ref + torch.tensor([0.02, 0.0, 0.0], dtype=torch.float64)).half()
    v = close_rule(out, ref, lowp)                     # 2 x 0.02 (fp16-rounded) >= 0.03: ok
    assert v.ok and abs(v.bound - 2 * (float(lowp[0]) - 1.0)) < 1e-12
    # out against a shifted reference, torch's error still from the true one: the same bound
    shift = torch.tensor([0.0, 0.0, 0.03], dtype=torch.float64)
    w = close_rule(out, ref + shift, lowp, lowp_ref=ref)
    assert w.ok and w.err < v.err and w.bound == v.bound
    # without lowp_ref torch's error would be measured from the shifted reference: a wider bound
    assert close_rule(out, ref + shift, lowp).bound > v.bound
    # a result outside 2 x torch's error fails
    bad = (ref + torch.tensor([0.0, 0.0, 0.05], dtype=torch.float64)).half()
    assert not close_rule(bad, ref, lowp).ok


def test_rule_log_and_margins_tool(tmp_path, monkeypatch):
    # LEAN_RULE_LOG: one line per verdict; tools/rule_margins.py ranks them, worst first
    import subprocess
    import sys
    log = tmp_path / "rule.log"
    monkeypatch.setenv("LEAN_RULE_LOG", str(log))
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    close_rule(ref + 1e-6, ref, name="near")                      # err / bound = 1e-6 / 2e-5
    close_rule(ref + 1e-4, ref, name="over")                      # 5x over its bound
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("5.0000\ttests/test_rule.py::test_rule_log_and_margins_tool")
    assert abs(float(lines[0].split("\t")[0]) - 0.05) < 1e-3
    out = subprocess.run([sys.executable, "tools/rule_margins.py", str(log), "--top", "1"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0].startswith("2 verdicts, 2 (test, quantity) pairs; 1 over their bound")
    assert len(out) == 3 and out[2].startswith("    5.000  tests/test_rule.py") and ":: over: max error" in out[2]
