"""Issue 35's table, before and after in one process.

``case:old`` times the step-by-step route (the stacked route of ``kernels._stacked_sum``
switched off), ``case`` the stacked one. Usage:
``THREADS=1 python -m benchmarks.bench_path_defaults_ab adam100,adam100:old``. CPU time
(``time.process_time``) is reported beside wall time: on shared cores it is what the call
itself spent. The ``adam`` / ``sgd`` path-kernel cases also print their FLOP floor
(``path_flops``, halved by symmetry) and the one-thread rate of an N x 64 x N product
measured in CPU time right after the case, the floor's denominator.
"""

import contextlib
import json
import os
import sys
import time
from unittest import mock

import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

from skpathkernel import PathKernelClassifier, kernels
from skpathkernel._tangent._stacked import path_flops, stacked_mlp
from skpathkernel.kernels import PathKernel


def _gemm_rate(n):
    """FLOP/s of an n x 64 x n product, the least CPU time of many repeats.

    Into one preallocated result: a fresh n x n result is mapped anew by the allocator
    at some calls and not at others, and its page faults (up to a third of the product's time
    at n = 1000) made the rate read anywhere from 60 to 99 GFLOP/s on an idle core.
    """
    a, b = torch.randn(n, 64), torch.randn(64, n)
    out = torch.mm(a, b)
    best = min(_cpu(lambda: torch.mm(a, b, out=out)) for _ in range(max(50, 10**8 // n**2)))
    return 2 * n * n * 64 / best


def _cpu(f):
    c0 = time.process_time()
    f()
    return time.process_time() - c0


def main(names):
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    Xtr, ytr, Xte = X[:1000], y[:1000], X[1000:1100]
    adam = PathKernelClassifier(random_state=0).fit(Xtr, ytr)
    sgd = PathKernelClassifier(solver="sgd", learning_rate_init=0.1, random_state=0).fit(Xtr, ytr)
    print("points", len(adam.trajectory_), len(sgd.trajectory_), adam.n_params_, flush=True)
    cases = {
        "adam100": lambda: adam.path_kernel_(Xtr[:100]),
        "sgd100": lambda: sgd.path_kernel_(Xtr[:100]),
        "adam1000": lambda: adam.path_kernel_(Xtr[:1000]),
        "sgd1000": lambda: sgd.path_kernel_(Xtr[:1000]),
        "adam20_300": lambda: PathKernel(adam, stop=20)(Xtr[:300]),
        "adam20_1000": lambda: PathKernel(adam, stop=20)(Xtr[:1000]),
        "sgd20_1000": lambda: PathKernel(sgd, stop=20)(Xtr[:1000]),
        "knn_path": lambda: adam.kneighbors(Xte, kernel="path"),
        "attribute": lambda: adam.attribute(Xte),
        "explain": lambda: adam.explain(Xte, n_neighbors=10),
        "explain_all": lambda: adam.explain(Xte, n_neighbors=10, output="all"),
    }
    res = {}
    for case in names:
        name, _, mode = case.partition(":")
        ctx = (mock.patch.object(kernels, "_stacked_sum", lambda *a, **k: None)
               if mode == "old" else contextlib.nullcontext())
        with ctx:
            load = os.getloadavg()[0]
            t0, c0 = time.perf_counter(), time.process_time()
            cases[name]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        res[case] = dict(time=wall, cpu=cpu, load=load)
        if name[:4] in ("adam", "sgd1") and "_" not in name:
            est = adam if name.startswith("adam") else sgd
            n = int(name[4:] if name.startswith("adam") else name[3:])
            mlp = stacked_mlp(est.network_.module, est.trajectory_.names)
            floor = (len(est.trajectory_) - 1) * path_flops(
                mlp, n, n, est.n_outputs_, name.startswith("adam"), True)
            rate = _gemm_rate(n)
            res[case].update(floor_gflop=floor / 1e9, gemm_gflops=rate / 1e9,
                             cpu_over_floor=cpu * rate / floor)
        print(f"{case}: {res[case]}", flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1].split(","))
