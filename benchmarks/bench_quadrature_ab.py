"""A/B of the exact decomposition's node choice before and after its floor probe.

The decomposition audit of 2026-12-04 found ``_Quadrature.choose`` accepting a step's
quadrature error under a round-off floor learnt at another step (a float32 Adam step at
10x its share of ``tol``, without a warning). The fix spends one node more where a
residual is under that learnt floor but above the step's own round-off. This measures
what that costs on the default estimators, where it matters most: ``decompose`` of 100
queries (every output) and ``attribute`` (the contracted margin), the ref being
``_Quadrature`` as at commit ``af7ae1d`` (before the fix), the tree the working tree's,
in one process, alternating; beside the times, the nodes per step (mean and total) and
each side's ``error`` (the reconstruction's).

Usage: ``python -m benchmarks.bench_quadrature_ab [--ref REV] [--out PATH] [--reps N]``
(default ``benchmarks/results/quadrature_ab``).
"""

import argparse
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_diabetes, load_digits
from sklearn.preprocessing import StandardScaler

from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel import PathKernelClassifier, PathKernelMachine
from skpathkernel._analysis import _decomposition
from skpathkernel.datasets import make_sine

ROOT = Path(__file__).resolve().parent.parent
MODULE = "skpathkernel/_analysis/_decomposition.py"


def _problems():
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    yield "default PathKernelClassifier, digits (1000 train)", \
        PathKernelClassifier(random_state=0).fit(X[:1000], y[:1000]), X[1000:1100]
    # The review's case: a float32 sine fit whose stalls raise the learnt floor early.
    X, y = make_sine(n_samples=200, random_state=0)
    yield "default PathKernelMachine, make_sine (200 train)", \
        PathKernelMachine(random_state=0).fit(X, y), X[:100]
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    yield "default PathKernelMachine, diabetes (342 train)", \
        PathKernelMachine(random_state=0).fit(X[:342], y[:342]), X[342:442]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="af7ae1d")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quadrature_ab"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    classes = {"ref": reference_module(ROOT, args.ref, MODULE)._Quadrature,
               "tree": _decomposition._Quadrature}
    prov = ab_provenance(ROOT, "bench_quadrature_ab", [MODULE, "benchmarks/bench_quadrature_ab.py"],
                         f"_Quadrature at {args.ref}", args.reps)
    rows = []
    for name, est, Xq in _problems():
        for verb in ("decompose", "attribute"):
            times, nodes, errors = {"ref": [], "tree": []}, {}, {}
            results = {}
            for rep in range(args.reps + 1):
                for side, cls in classes.items():
                    _decomposition._Quadrature = cls
                    start = time.process_time()
                    if verb == "decompose":
                        res = est.decompose(Xq)
                        nodes[side], errors[side] = res.n_nodes, res.error
                        results[side] = res.contributions
                    else:
                        results[side] = est.attribute(Xq)
                    if rep:
                        times[side].append(time.process_time() - start)
            _decomposition._Quadrature = classes["tree"]
            diff = float(np.abs(results["tree"] - results["ref"]).max()
                         / np.abs(results["ref"]).max())
            extra = {}
            if verb == "decompose":
                extra = dict(nodes=" / ".join(f"{nodes[s].mean():.2f} ({nodes[s].sum()})"
                                              for s in ("ref", "tree")),
                             error=" / ".join(f"{errors[s]:.1e}" for s in ("ref", "tree")))
            rows.append(ab_row(f"{name}: {verb}(X[:100])", times, os.getloadavg()[0],
                               max_rel_diff=diff, **extra))
            print(rows[-1]["case"], f"{rows[-1]['ratio_least']:.3f}", extra, flush=True)
            write_ab(Path(args.out), "Exact decomposition's node choice: before (ref) and "
                     "after (tree) the floor probe", "time.process_time, one thread", prov,
                     rows, 3, columns=[("nodes per step, mean (total) ref / tree", "nodes"),
                                       ("error ref / tree", "error")])


if __name__ == "__main__":
    main()
