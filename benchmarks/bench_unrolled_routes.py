"""Two routes of the unrolled attribution's tangent products, one process, one tree:
by default the double backward (``ref``) against forward over reverse (``tree``), both
chosen by patching ``skpathkernel._analysis._unrolled.forward_over_reverse`` (the
measurements behind that function's rule); ``SIDES=forward,mlp`` (any two of ``double``,
``forward``, ``mlp``) puts other routes on the two sides, ``mlp`` being a plain MLP's
products by hand (``_mlp_products``; the others with ``MLP_PRODUCTS`` off). A ``:f32``
suffix (``SIDES=mlp:f32,mlp``) takes each step's gradient in the path's dtype
(``GRADIENT_DTYPE`` float32: no float64 gradient, no sensitivity probe, as before they
were added); ``max_rel_diff`` is then the scores' change by float32 gradients.

Cases: those of ``benchmarks/bench_unrolled_ab.py`` (``mlp-lr0.5``, ``cnn-lr0.5``, a
``-f64`` suffix for float64: 100 queries of digits, 80 SGD steps of batch 128);
``default`` (``PathKernelClassifier()``'s network, gelu (64, 64), Adam, 5 epochs of the
same 1000 digits, float32, ``default-f64`` float64), ``tiny`` (``self_influence`` of
the test suite's (4,) gelu MLP on 80 points, SGD batch 8, 60 epochs (600 steps), float64;
``tiny-f32``), ``self-W-B`` (the same with hidden layer (W,) and batch B; ``-f32``), and
``cnn-adam`` (the CNN of ``bench_attribution`` trained by Adam at
``learning_rate_init=1e-3``, 5 epochs, float32).
A ``-qN`` part (``default-q10``, ``mlp-lr0.5-q10-f64``) keeps the first N queries.
``attribute(X_query, y_query, method="unrolled")`` (``self_influence()`` for ``tiny`` and
``self``) by ``time.process_time`` on one torch thread, ``REPS`` times each route
(default 2), alternating.

Usage: ``THREADS=1 [SIDES=double,forward] taskset -c 1 python -m
benchmarks.bench_unrolled_routes [CASES]``.
Writes ``benchmarks/results/unrolled_routes`` ``.md`` and ``.json`` (another name by ``OUT``).
"""

import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import skpathkernel._analysis._unrolled as unrolled
from benchmarks._ab import ab_provenance, ab_row, write_ab
from benchmarks.bench_attribution import digits, estimator
from benchmarks.bench_unrolled_ab import _fit

ROOT = Path(__file__).resolve().parent.parent
CASES = "tiny,tiny-f32,mlp-lr0.5,mlp-lr0.5-f64,default,default-f64,cnn-lr0.5,cnn-lr0.5-f64"


def _call(case, data):
    """The timed call of a case, its network fitted."""
    from skpathkernel import PathKernelClassifier, PathKernelMachine

    dtype = "float64" if case.endswith("-f64") else "float32"
    if case.startswith(("tiny", "self")):
        # tiny: self-4-8; self-W-B: hidden (W,), batch B; float64 unless -f32.
        width, batch = (4, 8) if case.startswith("tiny") else map(int, case.split("-")[1:3])
        rng = np.random.RandomState(0)
        X = rng.normal(size=(80, 3))
        est = PathKernelMachine(hidden_layer_sizes=(width,), solver="sgd",
                                learning_rate_init=0.01, batch_size=batch, max_iter=60,
                                tol=None, dtype="float32" if case.endswith("-f32") else "float64",
                                normalize_y=False, random_state=0).fit(X, np.sin(X).sum(1))
        return est.self_influence
    # A "-qN" part: the first N queries only.
    queries = next((int(p[1:]) for p in case.split("-") if p[:1] == "q" and p[1:].isdigit()),
                   len(data[2]))
    if case.startswith("default"):
        clf = PathKernelClassifier(random_state=0, max_iter=5, tol=None, dtype=dtype)
        clf.fit(data[0], data[1])
    elif case.startswith("cnn-adam"):
        clf = estimator("cnn", False, lr=1e-3, epochs=5).set_params(solver="adam",
                                                                    dtype=dtype)
        clf.fit(data[0], data[1])
    else:
        clf = _fit(case.replace(f"-q{queries}", ""), data)[1]
    return lambda: clf.attribute(data[2][:queries], data[3][:queries], method="unrolled")


def main(names=CASES):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    reps = int(os.environ.get("REPS", "2"))
    sides = os.environ.get("SIDES", "double,forward").split(",")
    data = digits(False)
    load_before = os.getloadavg()
    rows = []
    warnings.simplefilter("ignore")
    for case in names.split(","):
        call = _call(case, data)
        times, scores = {"ref": [], "tree": []}, {}
        for r in range(reps):
            order = list(zip(("ref", "tree"), sides))
            for key, side in order if r % 2 == 0 else order[::-1]:
                route, _, gradient = side.partition(":")
                with mock.patch.object(unrolled, "forward_over_reverse",
                                       lambda *a, f=route == "forward": f), \
                        mock.patch.object(unrolled, "MLP_PRODUCTS", route == "mlp"), \
                        mock.patch.object(unrolled, "GRADIENT_DTYPE", torch.float32
                                          if gradient == "f32" else torch.float64):
                    t = time.process_time()
                    scores[key] = np.asarray(call())
                    times[key].append(time.process_time() - t)
        row = ab_row(case, times, os.getloadavg()[0])
        row["max_rel_diff"] = float(np.abs(scores["ref"] - scores["tree"]).max()
                                    / np.abs(scores["ref"]).max())
        rows.append(row)
        print(f"{case}: {sides[0]} {row['ref_least']:.2f} s, {sides[1]} "
              f"{row['tree_least']:.2f} s, ratio {row['ratio_least']:.3f}", flush=True)
    names = {"double": "the double backward", "forward": "forward over reverse",
             "mlp": "the MLP's products by hand"}
    names.update({f"{k}:f32": f"{v}, float32 gradients" for k, v in names.items()})
    prov = ab_provenance(ROOT, "bench_unrolled_routes",
                         ["skpathkernel/_analysis/_unrolled.py",
                          "skpathkernel/_analysis/_mlp_products.py",
                          "benchmarks/bench_unrolled_routes.py"], names[sides[0]], reps,
                         load_before=load_before, sides=",".join(sides))
    write_ab(ROOT / "benchmarks" / "results" / os.environ.get("OUT", "unrolled_routes"),
             f"Unrolled attribution: {names[sides[0]]} (ref) against {names[sides[1]]} "
             "(tree), one tree", "time.process_time", prov, rows, 2)


if __name__ == "__main__":
    main(*sys.argv[1:])
