"""decompose(method='exact')'s float32 contribution_error with its round-off estimate,
against the true error, on the 39 float32 paths of ``audit_contribution_roundoff.py``.

The package itself computes each case (no probe copy): ``contribution_error`` is, per
contribution, the two rules' difference plus ``ROUNDOFF * eps32 * sum_t |s_t|``, the
largest over contributions, checked against ``FLOAT32_CHECK_TOL * S`` with tol=None and
against ``tol * S`` with an explicit tol (S the largest |f| along the path). The true
error is the largest of one contribution against a float64 16-node reference of the
same recorded path (``audit_contribution_error.reference``). Per case: the true error,
the difference alone (main's contribution_error: the kept walk's, read from the walks
the check makes), the new contribution_error and its ratio to the true one, the round-off
estimate alone, ``K_min`` (the coefficient of eps32 sum_t |s_t| that would just reach the
true error beside the difference; 0 where the difference does), the warnings of
``decompose`` with tol=None and with tol=1e-6 of a single contribution (P
PrecisionWarning, C the check's ConvergenceWarning, - neither; s the ConvergenceWarning
that some steps' sums gained less than twofold by a node more, f that some steps
failed), and whether the true
error is over each threshold. All in units of 1e-6 * S (the default tol of the node
choice, the old file's tol * S): tol=None's threshold is 10 of them.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_contribution_roundoff_s45.py
[words] (results: benchmarks/results/contribution_roundoff-s45.md; with words, only the
cases whose names hold one, printed and not written)
"""
import os
import platform
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from audit_contribution_roundoff import cases, k_for
from sklearn.exceptions import ConvergenceWarning

from skpathkernel import PrecisionWarning
from skpathkernel._analysis import _decomposition as package

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "results", "contribution_roundoff-s45.md")
UNIT = 1e-6
STRICT = 1e-6


def warned(res, checks):
    """What ``finish`` warns of a single contribution: P (PrecisionWarning), C (the
    check's ConvergenceWarning), - (neither); + s where another ConvergenceWarning says
    that contribution_error does not measure some steps (a step's sum gained less than
    twofold by a node more), + f where one says that steps failed (which skips the
    check's warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        package.finish(res, checks)
    words = ["P" if m.category is PrecisionWarning
             else "C" if "quadrature error is measured at" in str(m.message)
             else "s" if "does not measure a single contribution" in str(m.message)
             else "f" if "Gauss-Legendre nodes or stopped converging" in str(m.message)
             else "" for m in caught if issubclass(m.category, (PrecisionWarning,
                                                              ConvergenceWarning))]
    word = "".join(sorted(w for w in words if w in "PC" and w)) or "-"
    return " ".join([word] + sorted(set(words) & {"s", "f"}))


def main(*want):
    check = package._contribution_check
    seen = {}

    def keep(walk, first, *args, **kwargs):
        # Each walk's difference and sums of absolute shares: a chunk keeps the walk of
        # its smallest largest difference (as the check does).
        walks = [first[3]]

        def recorded(plan=None):
            out = walk(plan)
            walks.append(out[3])
            return out

        out = check(recorded, first, *args, **kwargs)
        if walks[0][2] is None:  # the float64 reference
            return out
        diff, size = np.abs(walks[0][0]), walks[0][2].copy()
        for q in out[2]:
            best = min(walks, key=lambda w: np.max(np.abs(w[0][q.rows])))
            diff[q.rows], size[q.rows] = np.abs(best[0][q.rows]), best[2][q.rows]
        seen["walk"] = diff, size
        return out

    package._contribution_check = keep
    rows = []
    try:
        for name, net, Xq, args in audit_check_rows.fitted(cases(), want):
            t0 = time.time()
            res, checks = package.decompose(*args, memory_budget=net.memory_budget,
                                             warn=False)
            diff, size = seen["walk"]
            strict, strict_checks = package.decompose(
                *args, memory_budget=net.memory_budget, tol=STRICT, warn=False)
            moved = np.abs(strict.contributions - res.contributions).max()
            ref = ace.reference(net, Xq)
            unit = UNIT * checks.scale
            true = np.abs(res.contributions - ref.contributions).max()
            row = [name, true / unit, diff.max() / unit, res.contribution_error / unit,
                   res.contribution_error / true, checks.roundoff / unit,
                   k_for(diff, size, true), warned(res, checks),
                   "yes" if true > res.contribution_tol * checks.scale else "no",
                   strict.contribution_error / unit, warned(strict, strict_checks),
                   "yes" if true > STRICT * checks.scale else "no", moved / unit,
                   res.contribution_tol]
            rows.append(row)
            print(row, f"{time.time() - t0:.0f}s", flush=True)
    finally:
        package._contribution_check = check
    if not want:
        write(rows)


def write(rows):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    lines = [
        "# Float32 contribution_error with its round-off estimate (ROUNDOFF = "
        f"{package.ROUNDOFF:g}), checked at float32's floor", "",
        f"`python benchmarks/audit_contribution_roundoff_s45.py` at commit {commit} (torch "
        f"{torch.__version__}, one thread, {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}). The 39 float32 paths of "
        "`benchmarks/results/contribution_roundoff.md`, computed by the package's "
        "decompose. In units of 1e-6 * S (S the largest |f| along the path; the old "
        "file's tol * S). `true`: the largest error of one contribution against a float64 "
        "16-node reference of the same recorded path. `diff`: the two rules' difference "
        "alone (main's contribution_error). `new`: contribution_error, the difference "
        f"plus {package.ROUNDOFF:g} eps32 sum_t abs(s_t) per contribution; `new/true` its "
        "ratio to the true error; `roundoff`: the estimate alone (its largest over "
        "contributions); `K_min`: the coefficient that would just reach `true` (0 where "
        "the difference does). tol=None is checked against "
        f"{package.FLOAT32_CHECK_TOL:g} * S (10 units), tol=1e-6 against 1e-6 * S "
        "(1 unit): the PrecisionWarning (P) and the check's ConvergenceWarning (C) each "
        "raises (- neither; s: the ConvergenceWarning that contribution_error does not "
        "measure some steps, whose sum a node more did not halve; f: the "
        "ConvergenceWarning that steps did not converge, which skips the check's "
        "warnings; both raised by main too), and whether `true` is over that "
        "threshold. `moved`: the largest change of a contribution between the two "
        "calls.", "",
        "| case | true | diff | new | new/true | roundoff | K_min | tol=None warns | "
        "true over 1e-5 S | tol=1e-6: new | tol=1e-6 warns | true over 1e-6 S | moved |",
        "|" + "---|" * 13]
    for r in rows:
        cells = [r[0]] + [c if isinstance(c, str) else f"{c:.3g}" for c in r[1:13]]
        lines.append("| " + " | ".join(cells) + " |")
    with open(OUT, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
