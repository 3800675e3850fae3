"""One process A/B of the morning's memory changes against a git ref (before them):
the stacked path kernel's blocks (``_tangent/_stacked.py``), the second-order
decomposition (``_analysis/_decomposition.py``) and ``map_fixed_blocks``
(``_memory.py``, ``TangentFeatures().transform``).

The ref's module is imported beside the working tree's and put in the tree's place at the
call site, alternately, ``REPS`` times each (default 2), one torch thread, timed by
``time.process_time``. Cases:

- ``blocks``: the path kernel's points per block at the default budget (1 GiB), each
  module's choice for the default classifier's ``path_kernel_(X[:N])``, N = 100 and 1000,
  Adam and ``solver="sgd", learning_rate_init=0.1`` (no timing);
- ``adam100``, ``sgd100``, ``adam1000``, ``sgd1000``: ``path_kernel_(X[:N])`` (issue 35),
  the ref's ``stacked_path_sum`` or the tree's;
- ``so``: ``decompose(X[:20], method="second_order")`` of a small MLP (one hidden layer
  of 16 units, 200 digits, 30 iterations);
- ``transform``: ``TangentFeatures().transform`` of 1000 digits (the default
  classifier's network, 30 iterations).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_mem_change_ab [REF] [CASES]
[RESULTS]`` (REF 4a46127, CASES ``blocks,adam100,sgd100,so,transform``, each timed case
optionally ``case*reps``; RESULTS ``mem_change_ab``). Writes
``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import dataclasses
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

import skpathkernel._analysis._decomposition as decomposition
import skpathkernel._estimators._base as base
import skpathkernel._memory as memory
import skpathkernel._network._trained as trained
import skpathkernel._tangent._stacked as stacked
from benchmarks._ab import ab_provenance, outputs_row, reference_module, write_ab
from skpathkernel import PathKernelClassifier, TangentFeatures, kernels

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["skpathkernel/_tangent/_stacked.py", "skpathkernel/_analysis/_decomposition.py",
           "skpathkernel/_memory.py"]


class _Stop(Exception):
    pass


def _as(mod, mlp):
    """``mlp`` rebuilt from ``mod``'s own layer records (its functions test their type)."""
    items = tuple(mod._Linear(**dataclasses.asdict(it)) if dataclasses.is_dataclass(it)
                  else it for it in mlp.items)
    return mod.StackedMLP(items, mlp.n_inputs)


def _in(mod):
    """``mod``'s ``stacked_path_sum`` in the place of the tree's."""
    if mod is stacked:
        return stacked.stacked_path_sum

    def call(mlp, *args, **kw):
        return mod.stacked_path_sum(_as(mod, mlp), *args, **kw)
    return call


def _block(mod, est, X):
    """The points of ``mod``'s first block in ``est.path_kernel_(X)`` (its first load)."""
    seen = []

    def call(mlp, layout, load, *args, **kw):
        def first(points):
            seen.append(len(points))
            raise _Stop
        return _in(mod)(mlp, layout, first, *args, **kw)

    with mock.patch.object(kernels, "stacked_path_sum", call):
        try:
            est.path_kernel_(X)
        except _Stop:
            pass
    return seen[0] if seen else None


def main(ref="4a46127", names="blocks,adam100,sgd100,so,transform", results="mem_change_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "2"))
    old = {path: reference_module(ROOT, ref, path) for path in MODULES}
    old_stacked = old[MODULES[0]]
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    Xtr, ytr = X[:1000], y[:1000]
    fitted = {}

    def est(solver):
        if solver not in fitted:
            kw = dict(solver="sgd", learning_rate_init=0.1) if solver == "sgd" else {}
            fitted[solver] = PathKernelClassifier(random_state=0, **kw).fit(Xtr, ytr)
        return fitted[solver]

    load_before = os.getloadavg()
    rows, blocks = [], []
    for case in names.split(","):
        name, _, n_reps = case.partition("*")
        n_reps = int(n_reps or reps)
        if name == "blocks":
            for solver in ("adam", "sgd"):
                for n in (100, 1000):
                    b = {key: _block(mod, est(solver), Xtr[:n])
                         for key, mod in (("ref", old_stacked), ("tree", stacked))}
                    blocks.append(dict(solver=solver, n=n, T=len(est(solver).trajectory_), **b))
                    print("block", blocks[-1], flush=True)
            continue
        if name in ("adam100", "sgd100", "adam1000", "sgd1000"):
            solver = name.rstrip("0123456789")
            clf, n = est(solver), int(name[len(solver):])
            Xn = Xtr[:n]
            impl = {"ref": (kernels, "stacked_path_sum", _in(old_stacked)),
                    "tree": (kernels, "stacked_path_sum", _in(stacked))}

            def call(Xn=Xn, clf=clf):
                return clf.path_kernel_(Xn)
        elif name == "so":
            Xs = X[:200].astype(np.float32)
            clf = PathKernelClassifier(hidden_layer_sizes=(16,), max_iter=30,
                                       random_state=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                clf.fit(Xs, y[:200])
            impl = {"ref": (trained, "decompose_path",
                            old[MODULES[1]].decompose),
                    "tree": (trained, "decompose_path", decomposition.decompose)}

            def call(clf=clf, Xq=Xs[:20]):
                return clf.decompose(Xq, method="second_order").contributions
        elif name == "transform":
            Xf = Xtr.astype(np.float32)
            tf = TangentFeatures(PathKernelClassifier(max_iter=30, random_state=0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tf.fit(Xf, ytr)
            # The dense features' blocks (``_tangent_features``, the default
            # ``n_components=None``).
            impl = {"ref": (base, "map_fixed_blocks", old[MODULES[2]].map_fixed_blocks),
                    "tree": (base, "map_fixed_blocks", memory.map_fixed_blocks)}

            def call(tf=tf, Xf=Xf):
                return tf.transform(Xf)
        else:
            raise ValueError(name)
        times, out = {"ref": [], "tree": []}, {}
        for r in range(n_reps):
            for key in ("ref", "tree") if r % 2 == 0 else ("tree", "ref"):
                with mock.patch.object(*impl[key]):
                    t = time.process_time()
                    out[key] = np.asarray(call())
                    times[key].append(time.process_time() - t)
        rows.append(outputs_row(name, times, out))
    prov = ab_provenance(ROOT, "bench_mem_change_ab", [*MODULES,
                                                       "benchmarks/bench_mem_change_ab.py"],
                         ref, reps, load_before=load_before, load_after=os.getloadavg())
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, "The morning's memory changes: one process A/B against a git ref",
             "time.process_time", prov, rows, 3)
    if blocks:
        with out.with_suffix(".md").open("a") as f:
            f.write("\nPoints per block of the path kernel at the default budget (1 GiB), "
                    "each module's choice (`stacked_path_sum`'s first block):\n\n"
                    "| solver | N | T (points) | ref | tree |\n|---|---|---|---|---|\n")
            for b in blocks:
                f.write(f"| {b['solver']} | {b['n']} | {b['T']} | {b['ref']} | {b['tree']} |\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
