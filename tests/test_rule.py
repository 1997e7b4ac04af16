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
