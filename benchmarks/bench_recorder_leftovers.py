"""Session s52's fixes of the s51 reviews' leftovers, this tree against the code before
them (``--base``: a directory holding d79f84f's ``skpathkernel`` renamed ``skpk_base``,
``git archive d79f84f skpathkernel``), pinned by the caller, one torch thread, CPU
time, the sides alternating in one process, medians.

``reads``: a recorded loop reading ``rec.trajectory.parameters(-1)`` every step with
``record_every=3`` (the tail kept apart), and loops without reads (the weak hooks' cost).
``gpr``: a GaussianProcessRegressor fit over ``ConstantKernel() * PathKernel(est) +
WhiteKernel()`` after ``est.set_params(memory_budget=2**20)``: Grams computed and time.
``budget``: whether a fitted estimator's Grams are bit-identical across
``memory_budget`` values (what the search memo may return for another budget).
``drop``: recorders dropped without ``close()`` (module and optimizer dropped too), the
process's resident memory after ``gc.collect()``; one fresh process per side.

    taskset -c 1 python -m benchmarks.bench_recorder_leftovers reads --base /tmp/b --out f.json
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

from benchmarks.bench_recording_segments import OPTIMIZERS, _data, _load, _net, _step
from benchmarks.bench_review_segments_reads import alternated

READ_CASES = [  # optimizer, parameters, steps, record_every, read
    ("adam", 300_000, 300, 3, ("read", 1)),
    ("sgd", 20_000, 1000, 3, ("read", 1)),
    ("adam", 300_000, 300, 1, ("none", 0)),
    ("sgd", 2_000, 3000, 1, ("none", 0)),
]


def cmd_reads(args):
    old, new = _load(args.base)
    cases = READ_CASES if args.cases is None else [READ_CASES[i] for i in args.cases]
    rows = alternated({"base": old, "tree": new}, cases, args.rounds)
    json.dump(rows, open(args.out, "w"), indent=1)


def _gpr(pkg, budget):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel

    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(200, 5))
    y = np.sin(2 * X[:, 0]) + X[:, 1] ** 2 + 0.1 * rng.randn(200)
    est = pkg.PathKernelMachine(hidden_layer_sizes=(64, 64), max_iter=30, tol=None,
                                random_state=0, device="cpu").fit(X, y)
    est.set_params(memory_budget=budget)
    kernels = pkg.kernels.PathKernel
    engine, calls = kernels._gram_blocks, []
    kernels._gram_blocks = lambda self, A, B: calls.append(len(A)) or engine(self, A, B)
    try:
        t0 = time.process_time()
        gpr = GaussianProcessRegressor(
            kernel=ConstantKernel() * kernels(est) + WhiteKernel(),
            random_state=0).fit(X, y)
        seconds = time.process_time() - t0
    finally:
        kernels._gram_blocks = engine
    return seconds, len(calls), gpr.kernel_.theta.tolist(), gpr.predict(X[:20])


def cmd_gpr(args):
    old, new = _load(args.base)
    sides = {"base": old, "tree": new}
    times, grams, out = {s: [] for s in sides}, {}, {}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            seconds, n, theta, pred = _gpr(sides[side], 2**20)
            times[side].append(seconds)
            grams[side], out[side] = n, (theta, pred)
    row = dict(base=statistics.median(times["base"]), tree=statistics.median(times["tree"]),
               base_all=times["base"], tree_all=times["tree"],
               grams_base=grams["base"], grams_tree=grams["tree"],
               theta_equal=out["base"][0] == out["tree"][0],
               predictions_equal=bool(np.array_equal(out["base"][1], out["tree"][1])),
               load=os.getloadavg()[0])
    print(row, flush=True)
    json.dump(row, open(args.out, "w"), indent=1)


def cmd_budget(args):
    new = _load(args.base)[1]
    rng = np.random.RandomState(0)
    X = rng.randn(60, 10)
    y = np.sin(X[:, 0]) + 0.1 * rng.randn(60)
    rows = []
    for dtype in ("float32", "float64"):
        for solver in ("sgd", "adam"):
            est = new.PathKernelMachine(hidden_layer_sizes=(32, 16), solver=solver,
                                        max_iter=8, batch_size=30, tol=None,
                                        random_state=0, dtype=dtype).fit(X, y)
            for kernel in (new.TangentKernel, new.PathKernel):
                for normalized in (False, True):
                    grams = {}
                    for budget in (2**30, 2**22, 2**19, 2**17):
                        est.set_params(memory_budget=budget)
                        grams[budget] = kernel(est, normalized=normalized)(X)
                    ref = grams[2**30]
                    row = dict(dtype=dtype, solver=solver, kernel=kernel.__name__,
                               normalized=normalized, **{
                                   f"budget {b}": dict(
                                       bit_equal=bool(np.array_equal(g, ref)),
                                       rel_diff=float(np.abs(g - ref).max()
                                                      / np.abs(ref).max()))
                                   for b, g in grams.items() if b != 2**30})
                    rows.append(row)
                    print(row, flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def _drop_one(pkg):
    net = _net(300_000)
    X, y = _data(net)
    opt = OPTIMIZERS["adam"](net.parameters())
    rec = pkg.PathRecorder(net, opt, n_samples=len(X))
    for step in range(50):
        _step(net, opt, X, y, rec, step)
    rec.trajectory.parameters(0)  # read, never close()d


def cmd_drop_side(args):
    pkg = _load(args.base)[0 if args.side == "base" else 1]
    _drop_one(pkg)
    gc.collect()
    before = _rss()
    for _ in range(args.n):
        _drop_one(pkg)
        gc.collect()
    print(json.dumps(dict(side=args.side, recorders=args.n, rss_before=before,
                          rss_after=_rss())), flush=True)


def cmd_drop(args):
    rows = []
    for side in ("base", "tree", "base", "tree"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_recorder_leftovers",
                              "drop-side", "--base", args.base, "--side", side,
                              "--n", str(args.n)], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("reads", "gpr", "budget", "drop", "drop-side"):
        p = sub.add_parser(name)
        p.add_argument("--base", required=True, help="directory holding skpk_base")
        p.add_argument("--out")
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--cases", type=int, nargs="*", help="indices into READ_CASES")
        p.add_argument("--side", choices=["base", "tree"])
        p.add_argument("--n", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    {"reads": cmd_reads, "gpr": cmd_gpr, "budget": cmd_budget, "drop": cmd_drop,
     "drop-side": cmd_drop_side}[args.cmd](args)


if __name__ == "__main__":
    main()
