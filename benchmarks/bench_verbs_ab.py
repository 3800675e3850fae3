"""One process A/B of the decomposition's per-step work (issue 35): a git ref's
``_analysis/_decomposition.py`` and ``_tangent/_pairs.py`` against the working tree's, on
the default classifier's ``decompose`` / ``attribute`` / ``explain`` (standardised digits,
1000 training points, 100 queries; ``solver="sgd", learning_rate_init=0.1`` and the
default Adam).

The ref's two modules are imported beside the tree's; the tree's ``decompose`` walks the
steps through the ref's ``_factored_block`` (with the ref's ``factor_shares`` and
``directional``) and cuts the queries in the ref's chunks (``node_chunk``), or its own,
alternately, ``REPS`` times each (default 2), timed by
``time.process_time`` on one torch thread. The results' largest difference relative to
their largest entry is reported beside the ratio.

Usage: ``THREADS=1 taskset -c 0 python -m benchmarks.bench_verbs_ab [REF] [CASES] [RESULTS]``
(REF ``main``: the commit to compare with, e.g. the one before a change, since ``main``
after a merge compares the tree with itself; CASES comma-separated ``solver:call`` of
``sgd``/``adam`` and ``decompose_first``, ``attribute_first``,
``attribute_first_expected``, ``decompose_first_expected``, ``attribute``, ``explain``,
``decompose20`` (exact, all outputs, 20 queries); RESULTS the results file name,
``verbs_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json`` (provenance:
command, commit, ref, date, machine, load, cores).
"""

import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

import skpathkernel._analysis._decomposition as decomposition
import skpathkernel._network._trained as trained
from benchmarks._ab import ab_provenance, outputs_row, write_ab
from skpathkernel import PathKernelClassifier

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"skpathkernel._tangent._pairs_ref": "skpathkernel/_tangent/_pairs.py",
           "skpathkernel._analysis._decomposition_ref":
               "skpathkernel/_analysis/_decomposition.py"}
CASES = ("sgd:decompose_first,sgd:attribute_first,sgd:attribute_first_expected,"
         "sgd:attribute,sgd:explain,adam:attribute_first,adam:attribute")


def _reference_modules(ref):
    """The modules at git ``ref``, imported beside the working tree's."""
    mods = {}
    folder = Path(tempfile.mkdtemp())
    for name, path in MODULES.items():
        source = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        file = folder / (name.rsplit(".", 1)[1] + ".py")
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    pairs, dec = mods.values()
    dec.factor_shares, dec.directional = pairs.factor_shares, pairs.directional
    return dec


def _chunk_rule(mod):
    """``mod``'s ``node_chunk`` as the estimators call it, ``(traj, method, n_queries)``
    (a ref from before the rule read the route takes ``n_queries`` alone)."""
    rule = mod.node_chunk
    if len(inspect.signature(rule).parameters) == 1:
        return lambda traj, method, n: rule(n)
    return rule


def _calls(clf, Xq):
    return {
        "decompose_first": lambda: clf.decompose(Xq, method="first_order").contributions,
        "decompose_first_expected": lambda: clf.decompose(
            Xq, method="first_order", weighting="expected").contributions,
        "attribute_first": lambda: clf.attribute(Xq, method="first_order"),
        "attribute_first_expected": lambda: clf.attribute(Xq, method="first_order",
                                                          weighting="expected"),
        "attribute": lambda: clf.attribute(Xq),
        "explain": lambda: clf.explain(Xq)[1],
        # Exact, every output (all ten), of the first 20 queries.
        "decompose20": lambda: clf.decompose(Xq[:20]).contributions,
    }


def main(ref="main", cases=CASES, results="verbs_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "2"))
    old = _reference_modules(ref)
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:1000].astype(np.float32)
    y = y[:1000]
    Xq = X[:100]
    fitted = {}
    load_before = os.getloadavg()
    rows = []
    for case in cases.split(","):
        solver, name = case.split(":")
        if solver not in fitted:
            kw = dict(solver="sgd", learning_rate_init=0.1) if solver == "sgd" else {}
            fitted[solver] = PathKernelClassifier(random_state=0, **kw).fit(X, y)
        call = _calls(fitted[solver], Xq)[name]
        # The walk over the steps and the queries' chunks (node_chunk, which the
        # estimators' decompose reads from _trained).
        impl = {"ref": (old._factored_block, _chunk_rule(old)),
                "tree": (decomposition._factored_block, decomposition.node_chunk)}
        times, out = {"ref": [], "tree": []}, {}
        try:
            for r in range(reps):
                for key in ("ref", "tree") if r % 2 == 0 else ("tree", "ref"):
                    decomposition._factored_block, trained.node_chunk = impl[key]
                    t = time.process_time()
                    out[key] = np.asarray(call())
                    times[key].append(time.process_time() - t)
        finally:
            decomposition._factored_block, trained.node_chunk = impl["tree"]
        rows.append(outputs_row(case, times, out))
    prov = ab_provenance(ROOT, "bench_verbs_ab", [*MODULES.values(),
                                                  "benchmarks/bench_verbs_ab.py",
                                                  "benchmarks/_ab.py"], ref, reps,
                         load_before=load_before, load_after=os.getloadavg())
    write_ab(ROOT / "benchmarks" / "results" / results,
             "The decomposition's per-step work: one process A/B against a git ref",
             "time.process_time", prov, rows, 2)


if __name__ == "__main__":
    main(*sys.argv[1:])
