"""One process A/B of the stacked path kernel's tiles (``skpathkernel/_tangent/_stacked.py``):
a git ref's module against the working tree's, on the default Adam classifier's
``PathKernel`` of standardised digits (1000 training points, ``max_iter=5``: 26 recorded
points).

Where one point's block over all the rows exceeds ``memory_budget``, the ref's route gave
up and the step-by-step sum ran (10 to 70 times slower); the tree's sums tiles of the
rows. Cases: ``cliff`` (``K(X[:200], X[:256])`` at 4 MiB, where the ref takes the
step-by-step sum) and ``default`` (``K(X[:1000], X[:256])`` at the default 1 GiB, where
both take the one stacked route). The two modules run alternately, 3 (cliff) and 9 (default)
times each (``REPS`` in the environment: that many for every case), timed by
``time.thread_time`` on one torch thread, float32 as the estimator's default.

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_tiled_path_ab [REF] [CASES]``
(REF ``main``, CASES ``cliff,default``). Writes ``benchmarks/results/tiled_path_ab``
``.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

import skpathkernel._tangent._stacked as new
from benchmarks._ab import ab_provenance, outputs_row, reference_module, write_ab
from skpathkernel import PathKernelClassifier, kernels
from skpathkernel.kernels import PathKernel

ROOT = Path(__file__).resolve().parent.parent
MODULE = "skpathkernel/_tangent/_stacked.py"
# (rows, columns, budget, repeats): the ref's cliff takes a minute a call.
CASES = {"cliff": (200, 256, 4 * 2**20, 3), "default": (1000, 256, 2**30, 9)}


def main(ref="main", names="cliff,default"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    old = reference_module(ROOT, ref, MODULE)
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short fit's ConvergenceWarning
        est = PathKernelClassifier(random_state=0, max_iter=5).fit(X[:1000], y[:1000])
    rows = []
    for name in names.split(","):
        n, m, budget, reps = CASES[name]
        reps = int(os.environ.get("REPS", reps))
        net = est.network_.replace(memory_budget=budget)
        times, out = {"ref": [], "tree": []}, {}
        for r in range(reps):
            order = [("ref", old), ("tree", new)]
            for key, mod in order if r % 2 == 0 else order[::-1]:
                # The module's own layer records: its functions test their type.
                with mock.patch.multiple(
                    kernels,
                    stacked_mlp=mod.stacked_mlp,
                    block_forward_error=mod.block_forward_error,
                    stacked_path_sum=mod.stacked_path_sum,
                ):
                    t = time.thread_time()
                    out[key] = PathKernel(net)(X[:n], X[:m])
                    times[key].append(time.thread_time() - t)
        rows.append(outputs_row(f"{name}: K({n} x {m}), budget {budget / 2**20:g} MiB", times, out))
    prov = ab_provenance(
        ROOT,
        "bench_tiled_path_ab",
        [MODULE, __file__],
        ref,
        {name: CASES[name][3] for name in names.split(",")},
    )
    write_ab(
        ROOT / "benchmarks" / "results" / "tiled_path_ab",
        "Stacked path kernel's tiles: A/B",
        "time.thread_time",
        prov,
        rows,
        3,
        machine=True,
    )
    return np.array([r["ratio_median"] for r in rows])


if __name__ == "__main__":
    main(*sys.argv[1:])
