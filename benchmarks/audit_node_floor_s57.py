"""The node choice's round-off floor (this commit: a residual that does not halve when
nodes are added, under ``FLOOR_MAX * eps * spread``, is round-off) against another
commit's ``_decomposition.py`` (OLD.py), on the float32 audit paths of
``audit_roundoff_model_s56.py``: per path, the nodes (``n_nodes``: the rule returned, a
node more than the choice's), the steps that failed or were capped (the
ConvergenceWarning's), the warnings with tol=None, and ``contribution_error`` against
the true error (a float64 16-node reference of the same recorded path,
``audit_contribution_error.reference``), which it must bound (ratio >= 1).

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_node_floor_s57.py OLD.py
[words] (results: benchmarks/results/node_floor-s57.md)
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from audit_contribution_roundoff import cases
from audit_roundoff_model_s56 import judged
from contribution_check_overhead import load_old

from skpathkernel._analysis import _decomposition as new

torch.set_num_threads(1)


def main(old_path, *want):
    old = load_old(old_path)
    print("| case | true | old: nodes sum / max, failed steps, warns, ce/true | "
          "new: nodes sum / max, failed steps, warns, ce/true |")
    print("|---|---|---|---|")
    for name, net, Xq, args in audit_check_rows.fitted(cases(), want):
        ref = ace.reference(net, Xq).contributions
        row = [name]
        for k, module in enumerate((old, new)):
            res, checks, words = judged(module, args, net)
            true = np.abs(res.contributions - ref).max()
            if k == 0:
                row.append(f"{true / (res.tol * checks.scale):.3g}")
            bad = len(set(checks.failed) | set(checks.capped))
            row.append(f"{res.n_nodes.sum()} / {res.n_nodes.max()}, {bad}, {words}, "
                       f"{res.contribution_error / true:.3g}")
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
