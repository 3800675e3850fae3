"""contribution_error's float32 round-off, measured (this commit) against the fixed
``15 eps sum_t |share_t|`` (another commit's ``_decomposition.py``, OLD.py, loaded
beside the package), both against the true per-contribution error: a float64 16-node
reference of the same recorded path (``audit_contribution_error.reference``). The
cases of ``audit_contribution_roundoff.py`` (those whose names hold one of the words
given). In units of tol * S (the default tol, 1e-6; S the largest |f| along the path);
the warnings each raises with tol=None (checked against 1e-5 * S on a float32 path):
P PrecisionWarning, C ConvergenceWarning, - none.

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_roundoff_model_s56.py OLD.py
[words] (results: benchmarks/results/roundoff_model-s56.md)
"""
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from audit_contribution_roundoff import cases
from contribution_check_overhead import load_old

from skpathkernel import PrecisionWarning
from skpathkernel._analysis import _decomposition as new

torch.set_num_threads(1)


def judged(module, args, net):
    res, checks = module.decompose(*args, memory_budget=net.memory_budget, warn=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.finish(res, checks)
    words = "".join(sorted({"P" if issubclass(w.category, PrecisionWarning) else "C"
                            for w in caught if w.category.__name__ in (
                                "PrecisionWarning", "ConvergenceWarning")})) or "-"
    return res, checks, words


def main(old_path, *want):
    old = load_old(old_path)
    print("| case | true | old | old/true | old warns | new | new/true | new warns |")
    print("|---|---|---|---|---|---|---|---|")
    for name, net, Xq, args in audit_check_rows.fitted(cases(), want):
        ref = ace.reference(net, Xq).contributions
        row = [name]
        for k, module in enumerate((old, new)):
            res, checks, words = judged(module, args, net)
            ts = res.tol * checks.scale
            true = np.abs(res.contributions - ref).max()
            if k == 0:
                row.append(f"{true / ts:.3g}")
            row += [f"{res.contribution_error / ts:.3g}", f"{res.contribution_error / true:.3g}",
                    words]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
