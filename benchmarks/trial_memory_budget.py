"""User trial (s52): does every verb that computes over many rows or a long path stay
within ``memory_budget``?

Each case runs in a fresh process (``python -m benchmarks.trial_memory_budget case NAME
BUDGET``): the fitted estimator is loaded from a pickle made once (``setup``), the
resident set's high-water mark is reset (``/proc/self/clear_refs`` 5) just before the
call, and the growth is ``VmHWM`` after the call minus ``VmRSS`` before it. The driver
(``run``) pins every case to one core and prints one JSON line per case; ``table``
renders them (``benchmarks/results/user_trial_memory-s52.md``).

    taskset -c 1 python -m benchmarks.trial_memory_budget setup
    taskset -c 1 python -m benchmarks.trial_memory_budget run [CASE ...] > rows.jsonl
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

MiB = 2**20
DIR = os.environ.get("TRIAL_DIR", "/tmp/trial_memory_s52")
BUDGETS = (64 * MiB, 256 * MiB, 2**30)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _data(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, *shape)).astype(np.float32)
    return X


def _mlp_data(n=2000, d=64, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    y = np.tanh(X[:, :4].sum(1)) + 0.1 * rng.standard_normal(n)
    return X, y.astype(np.float32)


def _cnn_module(arch, n_features_in=None, n_outputs=None):
    from benchmarks._nets import build

    return build(arch)


def _estimator(kind, budget=2**30, **extra):
    from skpathkernel import PathKernelClassifier, PathKernelMachine

    if kind == "mlp":
        # 64 -> 1000 -> 1000 -> 1: P = 1,067,001; 2000 rows, batches of 200: 10 SGD steps
        # an epoch, 20 epochs, 201 points (4.3 MB each).
        return PathKernelMachine(
            hidden_layer_sizes=(1000, 1000),
            solver="sgd",
            learning_rate_init=0.01,
            batch_size=200,
            max_iter=20,
            tol=0,
            n_iter_no_change=1000,
            random_state=0,
            memory_budget=budget,
            device="cpu",
            **extra,
        )
    # A bench net (benchmarks/_nets.py) trained on random images, 10 epochs of 20 steps.
    return PathKernelClassifier(
        module=functools.partial(_cnn_module, kind),
        solver="sgd",
        learning_rate_init=0.01,
        batch_size=50,
        max_iter=10,
        tol=0,
        n_iter_no_change=1000,
        random_state=0,
        memory_budget=budget,
        device="cpu",
        **extra,
    )


def _train(kind):
    if kind == "mlp":
        return _mlp_data()
    from benchmarks._nets import ARCHS

    X = _data(1000, ARCHS[kind]["shape"])
    y = np.arange(len(X)) % 10
    return X, y


def setup(kinds=("mlp", "cifar", "resnet", "vit")):
    os.makedirs(DIR, exist_ok=True)
    for kind in kinds:
        X, y = _train(kind)
        t = time.perf_counter()
        est = _estimator(kind).fit(X, y)
        with open(f"{DIR}/{kind}.pkl", "wb") as f:
            pickle.dump((est, X, y), f, protocol=5)
        print(
            kind,
            "P",
            est.trajectory_.parameters(0).numel(),
            "points",
            len(est.trajectory_),
            f"{time.perf_counter() - t:.1f}s",
            flush=True,
        )


def _load(kind, budget):
    with open(f"{DIR}/{kind}.pkl", "rb") as f:
        est, X, y = pickle.load(f)
    est.set_params(memory_budget=budget)
    return est, X, y


# ---------------------------------------------------------------- the cases
# Each returns (setup, call): setup loads what the call needs (outside the measurement),
# call runs the verb and returns its result (whose bytes are the allowance).


def _case(name, budget):
    from skpathkernel import OODRankDetector, PathKernel, TangentFeatures, TangentKernel

    kind, verb = name.split(":", 1)
    if verb == "fit":
        X, y = _train(kind)
        est = _estimator(kind, budget, trajectory_storage="auto", trajectory_dir=DIR)
        return lambda: est.fit(X, y).trajectory_.steps
    if verb == "fit_memory":  # storage="memory": record_every thins to the budget
        X, y = _train(kind)
        est = _estimator(kind, budget)
        return lambda: est.fit(X, y).trajectory_.steps
    est, X, y = _load(kind, budget)
    if verb.startswith("predict"):  # the fixed overhead: a forward pass's first call
        n = int(verb.split("_")[-1])
        return lambda: est.predict(X[:n])
    if verb.startswith("tk_trace"):
        n = int(verb.split("_")[-1])
        k = TangentKernel(est)
        return lambda: k(X[:n])
    if verb.startswith("tk_xy"):
        n = int(verb.split("_")[-1])
        k = TangentKernel(est)
        return lambda: k(X[:n], X[n : 2 * n])
    if verb.startswith("tk_full"):
        n = int(verb.split("_")[-1])
        k = TangentKernel(est, output="full")
        return lambda: k(X[:n])
    if verb.startswith("tk_diag"):
        n = int(verb.split("_")[-1])
        k = TangentKernel(est)
        return lambda: k.diag(X[:n])
    if verb.startswith("pk_trace"):
        n = int(verb.split("_")[-1])
        k = PathKernel(est)
        return lambda: k(X[:n])
    if verb.startswith("pk_diag"):
        n = int(verb.split("_")[-1])
        k = PathKernel(est)
        return lambda: k.diag(X[:n])
    if verb.startswith("pk_full"):
        n = int(verb.split("_")[-1])
        k = PathKernel(est, output="full")
        return lambda: k(X[:n])
    if verb.startswith("transform"):
        n = int(verb.split("_")[-1])
        return lambda: est.transform(X[:n])
    if verb.startswith("tf_proj"):
        n = int(verb.split("_")[-1])
        tf = TangentFeatures(est, n_components=256, random_state=0).fit(X, y)
        return lambda: tf.transform(X[:n])
    if verb.startswith("decompose"):
        n = int(verb.split("_")[-1])
        return lambda: est.decompose(X[:n]).contributions
    if verb.startswith("attribute"):
        _, method, n = verb.split("_")
        method = method.replace("-", "_")
        return lambda: est.attribute(X[: int(n)], method=method)
    if verb.startswith("kneighbors"):
        n = int(verb.split("_")[-1])
        return lambda: est.kneighbors(X[:n], n_neighbors=10)
    if verb.startswith("ood"):
        _, method, n = verb.split("_")
        det = OODRankDetector(est, method=method).fit(X, y)
        return lambda: det.score_samples(X[: int(n)])
    if verb.startswith("oodfit"):
        _, method = verb.split("_")
        det = OODRankDetector(est, method=method)
        return lambda: det.fit(X, y).n_features_in_
    if verb.startswith("self-influence"):
        return lambda: est.self_influence()
    raise ValueError(name)


def _nbytes(r):
    if isinstance(r, np.ndarray):
        return r.nbytes
    if isinstance(r, (tuple, list)):
        return sum(_nbytes(x) for x in r)
    if hasattr(r, "__dict__"):
        return sum(_nbytes(v) for v in vars(r).values())
    return 0


def case(name, budget):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    call = _case(name, int(budget))
    rss0 = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0, c0 = time.perf_counter(), time.process_time()
    err = None
    try:
        r = call()
    except Exception as e:  # the trial reports what the user sees
        r, err = None, f"{type(e).__name__}: {e}"[:300]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    hwm = _status("VmHWM")
    out = dict(
        case=name,
        budget=int(budget),
        growth=hwm - rss0,
        result=_nbytes(r),
        wall=wall,
        cpu=cpu,
        error=err,
    )
    if os.environ.get("TRIAL_SAVE"):
        np.save(
            os.environ["TRIAL_SAVE"],
            np.asarray(r, dtype=np.float64)
            if isinstance(r, np.ndarray)
            else np.asarray(getattr(r, "contributions", 0)),
        )
    print(json.dumps(out), flush=True)


CASES = [
    "mlp:fit",
    "mlp:fit_memory",
    "mlp:tk_trace_2000",
    "mlp:tk_xy_1000",
    "mlp:tk_diag_2000",
    "mlp:pk_trace_500",
    "mlp:pk_diag_500",
    "mlp:transform_256",
    "mlp:tf_proj_1000",
    "mlp:decompose_20",
    "mlp:attribute_exact_20",
    "mlp:attribute_first-order_20",
    "mlp:attribute_second-order_20",
    "mlp:attribute_unrolled_2",
    "mlp:kneighbors_500",
    "mlp:ood_local_500",
    "mlp:ood_residual_500",
    "cifar:fit",
    "cifar:tk_trace_1000",
    "cifar:tk_full_300",
    "cifar:pk_trace_200",
    "cifar:transform_500",
    "cifar:decompose_10",
    "cifar:attribute_unrolled_10",
    "cifar:ood_local_200",
    "resnet:tk_trace_500",
    "resnet:pk_trace_100",
    "resnet:decompose_4",
    "resnet:attribute_unrolled_4",
    "vit:tk_trace_500",
    "vit:pk_trace_100",
    "vit:decompose_4",
    "vit:attribute_unrolled_4",
]


def run(names, budgets=BUDGETS, timeout=120):
    for name in names:
        for b in budgets:
            cmd = [
                "taskset",
                "-c",
                os.environ.get("TRIAL_CORE", "1"),
                sys.executable,
                "-m",
                "benchmarks.trial_memory_budget",
                "case",
                name,
                str(b),
            ]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                line = (p.stdout.strip().splitlines() or [""])[-1]
                if not line.startswith("{"):
                    line = json.dumps(dict(case=name, budget=b, error=p.stderr[-300:]))
            except subprocess.TimeoutExpired:
                line = json.dumps(dict(case=name, budget=b, error=f"timeout {timeout}s"))
            print(line, flush=True)


FIXED = 48 * MiB  # the fixed overhead of the allowance (see the results file)


def table(path):
    """Markdown rows; "over" where the growth passes 1.25 x budget + result + FIXED."""
    print("| case | budget | peak above baseline | ratio to budget | result | verdict | CPU time |")
    print("|---|---|---|---|---|---|---|")
    for line in open(path):
        r = json.loads(line)
        b = r["budget"]
        err = (r.get("error") or "").strip().splitlines()
        err = err[-1][:110] if err else ""
        if r.get("growth") is None:
            print(f"| {r['case']} | {b // MiB} MiB | - | - | - | not measured | {err} |")
            continue
        g = r["growth"]
        over = g > 1.25 * b + r["result"] + FIXED
        verdict = "refused: " + err if err else ("**over**" if over else "within")
        print(
            f"| {r['case']} | {b // MiB} MiB | {g / MiB:.0f} MiB | {g / b:.2f} | "
            f"{r['result'] / MiB:.1f} MiB | {verdict} | {r['cpu']:.1f} s |"
        )


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "setup":
        setup(*([args] if args else []))
    elif cmd == "case":
        case(args[0], float(args[1]))
    elif cmd == "run":
        run(args or CASES)
    elif cmd == "table":
        table(args[0])
