"""How close the randomly drawn tests sit to their tolerance bounds.

    LEAN_RULE_LOG=/tmp/rule.log python -m pytest -q -n 2 --dist loadfile   # any test selection
    python tools/rule_margins.py /tmp/rule.log [--top 25]

Every close_rule / l2_rule verdict appends "err/bound <tab> test <tab> text" to the log
(lean/reference/rule.py). This prints the verdicts nearest their bound, one line per (test, what
was compared), worst first: the tests whose fresh random inputs may one day draw a failure. Tests
that check the rule's failing side (tests/test_check.py, tests/test_rule.py) sit over it on purpose.
"""
import argparse
import collections


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    worst = {}
    counts = collections.Counter()
    for line in open(args.log):
        ratio, test, text = line.rstrip("\n").split("\t", 2)
        key = (test, text.split(":")[0])                    # the test and the compared quantity
        counts[key] += 1
        if key not in worst or float(ratio) > worst[key][0]:
            worst[key] = (float(ratio), text)
    rows = sorted(worst.items(), key=lambda kv: -kv[1][0])
    print(f"{sum(counts.values())} verdicts, {len(rows)} (test, quantity) pairs; "
          f"{sum(r > 1 for r, _ in worst.values())} over their bound")
    print(f"{'err/bound':>9}  test :: verdict")
    for (test, _), (ratio, text) in rows[:args.top]:
        print(f"{ratio:9.3f}  {test} :: {text}")


if __name__ == "__main__":
    main()
