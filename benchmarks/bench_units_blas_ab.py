"""Which BLAS the path kernel's "units" route should use on this CPU, in one process.

The stacked path kernel (``skpathkernel/_tangent/_stacked.py``) takes the "units"
route's panel products by SciPy's GEMMs (OpenBLAS) where ``_UNITS_SCIPY`` says so
(everywhere but on an Intel CPU with torch's MKL), else by torch's. This script times
public calls of the default Adam classifier (standardised digits, 1000 training points)
both ways, alternating, ``REPS`` times each (default 3), on one torch thread, CPU time
of the call (``time.process_time``): "ref" is SciPy's GEMMs, "tree" torch's products.

Cases: ``path21`` ``PathKernel(clf, stop=21)(X[:1000])`` (the first of the call's
blocks of points); ``knn_path`` ``clf.kneighbors(X_test, kernel="path")`` (100 queries,
``K(X_test, X_train)``); ``adam100`` ``clf.path_kernel_(X[:100])`` (panels below
``_BLAS_MIN``: torch's products either way, a control); ``full21``
``PathKernel(clf, stop=21, output="full")(X[:256])`` (the ``C x C`` blocks: the layer
below the output layer takes the "mixed" route, :func:`_units` with its rows' mix).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_units_blas_ab [CASES]``.
Writes ``benchmarks/results/units_blas_ab.md`` and ``.json``.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel import PathKernelClassifier
from skpathkernel._tangent import _stacked
from skpathkernel.kernels import PathKernel

ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.partition(":")[2].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def main(names="path21,knn_path,adam100,full21"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    if torch.get_num_threads() != 1 or not _stacked._blas_process_wide():
        # Both sides would run torch's products: the table would read as no difference.
        sys.exit("SciPy's GEMMs take the units route only on one torch thread (THREADS=1) "
                 "with a SciPy OpenBLAS whose thread limit is process-wide; not here.")
    reps = int(os.environ.get("REPS", "3"))
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    Xtr, ytr, Xte = X[:1000], y[:1000], X[1000:1100]
    clf = PathKernelClassifier(random_state=0).fit(Xtr, ytr)
    cases = {
        "path21": lambda: PathKernel(clf, stop=21)(Xtr),
        "knn_path": lambda: clf.kneighbors(Xte, kernel="path")[0],
        "adam100": lambda: clf.path_kernel_(Xtr[:100]),
        "full21": lambda: PathKernel(clf, stop=21, output="full")(Xtr[:256]),
    }
    default = _stacked._UNITS_SCIPY
    load_before = os.getloadavg()
    rows = []
    try:
        for name in names.split(","):
            times, results = {"ref": [], "tree": []}, {}
            for r in range(reps):
                order = [("ref", True), ("tree", False)]
                for key, scipy_units in order if r % 2 == 0 else order[::-1]:
                    _stacked._UNITS_SCIPY = scipy_units
                    t = time.process_time()
                    results[key] = np.asarray(cases[name]())
                    times[key].append(time.process_time() - t)
            diff = (np.abs(results["ref"] - results["tree"]).max()
                    / np.abs(results["ref"]).max())
            row = ab_row(name, times, os.getloadavg()[0], max_rel_diff=float(diff))
            rows.append(row)
            print(f"{name}: SciPy {row['ref_least']:.3f} s (median {row['ref_median']:.3f}), "
                  f"torch {row['tree_least']:.3f} s (median {row['tree_median']:.3f}), "
                  f"ratio {row['ratio_least']:.3f} least, {row['ratio_median']:.3f} median, "
                  f"max rel. diff {diff:.1e}, load {row['load']:.2f}", flush=True)
    finally:
        _stacked._UNITS_SCIPY = default
    prov = ab_provenance(ROOT, "bench_units_blas_ab",
                         ["skpathkernel/_tangent/_stacked.py",
                          "benchmarks/bench_units_blas_ab.py", "benchmarks/_ab.py"],
                         "SciPy's GEMMs for the units route (tree: torch's)", reps,
                         cpu=_cpu_model(), cpu_vendor=_stacked._cpu_vendor(),
                         torch_mkl=torch.backends.mkl.is_available(),
                         blas_process_wide=_stacked._blas_process_wide(),
                         units_scipy_by_default=default, load_before=load_before)
    write_ab(ROOT / "benchmarks" / "results" / "units_blas_ab",
             "The units route's BLAS: SciPy's GEMMs (ref) against torch's (tree)",
             "time.process_time", prov, rows, 3)


if __name__ == "__main__":
    main(*sys.argv[1:])
