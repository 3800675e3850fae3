"""Exact decomposition of 100 queries versus the training time of the path it decomposes.

Each row trains once (timed) and decomposes once (timed), interleaved repeats, at the
defaults (float32, nodes chosen per step for the default tolerance). The roofline columns
put the measured time next to the FLOP floor of the exact method for the solver, at the
node counts the decomposition used (see :func:`flop_floor`), divided by the measured
torch.matmul rate of a 1024^3 float32 product in the same process: the time the method's
arithmetic would take at GEMM speed.
"""

from __future__ import annotations

import statistics
import time
import warnings

import numpy as np
import torch

from skpathkernel import PathKernelMachine

CASES = [
    # name, hidden, n_train, batch, solver, momentum, epochs (full, quick)
    ("64-512-512-1 sgd full-batch", (512, 512), 1024, None, "sgd", 0.0, (20, 5)),
    ("64-512-512-1 sgd batch 128", (512, 512), 1024, 128, "sgd", 0.0, (2, 1)),
    ("64-512-512-1 sgd+momentum batch 128", (512, 512), 1024, 128, "sgd", 0.9, (2, 1)),
    ("64-512-512-1 adam batch 128", (512, 512), 1024, 128, "adam", 0.0, (2, 1)),
    ("64-512-512-1 rmsprop batch 128", (512, 512), 1024, 128, "rmsprop", 0.0, (2, 1)),
    ("2-64-64-1 adam batch 32", (64, 64), 400, 32, "adam", 0.0, (10, 3)),
]

NOTES = ("FLOP floor: per step, the queries' forward pass and one backward pass per output "
         "at every quadrature node (the layers' factors), the same for the step's batch, "
         "and for plain SGD the Gram of factors between them; for momentum, Adam and "
         "RMSprop instead the per-layer GEMM that folds the nodes into the adjoint "
         "(2 n Q C P) and its contraction with the batch (2 Q C P B), the product that any "
         "method forming the per-step query-by-sample terms performs. Not counted: the "
         "error control's float64 probes (one J . dtheta per node evaluation) and the "
         "memory-bound update of the adjoint buffer.")


def flop_floor(module: torch.nn.Module, n_nodes, batch_sizes, n_queries: int, n_outputs: int,
               pairs: bool) -> float:
    """FLOPs of the exact decomposition at the given node counts, for an MLP of Linears.

    Parameters
    ----------
    module : torch.nn.Module
        Its ``nn.Linear`` layers, in order, are the network.
    n_nodes, batch_sizes : sequences of int
        Per step: the quadrature nodes used and the samples of the batch.
    n_queries, n_outputs : int
    pairs : bool
        True for momentum / Adam / RMSprop (the adjoint's GEMMs), False for plain SGD
        (the Gram of factors).
    """
    layers = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    P = sum(m.in_features * m.out_features + m.out_features for m in layers)
    forward = sum(2 * m.in_features * m.out_features for m in layers)
    backward = sum(2 * m.in_features * m.out_features for m in layers[1:])
    Q, C = n_queries, n_outputs

    def capture(rows):
        return rows * (forward + C * backward)

    total = 0.0
    for n, B in zip(n_nodes, batch_sizes):
        total += n * capture(Q) + capture(B)
        if pairs:
            total += 2 * n * Q * C * P + 2 * Q * C * P * B
        else:
            total += n * sum(2 * Q * C * B * m.out_features + 2 * Q * B * m.in_features
                             for m in layers)
    return total


def matmul_rate(size: int = 1024, repeats: int = 5, clock=time.perf_counter,
                dtype: torch.dtype = torch.float32, least: bool = False,
                device: str = "cpu") -> float:
    """FLOP/s of a size^3 torch.matmul by ``clock``: the median of repeats into fresh
    results, or with ``least`` the least time into one preallocated result (a fresh
    result's page faults make the median read low: ``matmul_probe.md``). On a GPU each
    product is timed to its end (a wall ``clock`` then: a GPU's time is not the thread's).
    """
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    b = torch.randn(size, size, dtype=dtype, device=dev)
    out = a @ b
    times = []
    for _ in range(repeats):
        sync()
        t0 = clock()
        if least:
            torch.matmul(a, b, out=out)
        else:
            a @ b
        sync()
        times.append(clock() - t0)
    return 2 * size**3 / (min(times) if least else statistics.median(times))


def run(quick: bool = False, repeats: int = 3, n_queries: int = 100,
        device: str = "cpu") -> list[dict]:
    from benchmarks.bench_training import _probe

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # A throwaway fit and decomposition first: the first call in a process pays one-time
    # costs (thread pools, lazy imports) that belong to neither column.
    warm = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=2, tol=None, random_state=0)
    warm.fit(np.zeros((4, 2)), np.zeros(4)).decompose(np.zeros((1, 2)))
    rows = []
    for name, hidden, n, batch, solver, momentum, epochs in CASES:
        epochs = epochs[1] if quick else epochs[0]
        rng = np.random.RandomState(0)
        d_in = 2 if hidden == (64, 64) else 64
        X = rng.normal(size=(n, d_in)).astype(np.float32)
        y = np.tanh(X[:, 0]) + 0.1 * X[:, 1]
        est = PathKernelMachine(hidden_layer_sizes=hidden, solver=solver, momentum=momentum,
                                learning_rate_init=1e-3, batch_size=batch, max_iter=epochs,
                                activation="tanh", tol=None, record_every=1,
                                normalize_y=False, device=device, random_state=0)
        t_train, t_dec, errors = [], [], []
        for rep in range(1 if quick else repeats):
            start = time.perf_counter()
            est.fit(X, y)
            t_train.append(time.perf_counter() - start)
            # fit and decompose return host arrays: no device sync needed around them.
            with _probe(torch.device(device)) as mem:
                start = time.perf_counter()
                res = est.decompose(X[:n_queries])
                t_dec.append(time.perf_counter() - start)
            if rep == 0:
                peak = mem.delta
            errors.append(res.error / max(np.abs(res.prediction).max(), 1e-300))
        traj = est.trajectory_
        pairs = not (solver == "sgd" and momentum == 0)
        flops = flop_floor(est.module_, res.n_nodes, [len(b) for b in traj.batches],
                           n_queries, res.prediction.shape[1], pairs)
        floor_s = flops / matmul_rate(device=device)
        med = float(np.median(t_dec))
        rows.append({
            "case": name,
            "steps": est.t_,
            "train s": f"{np.median(t_train):.2f}",
            f"decompose {n_queries} s": f"{med:.2f} ({min(t_dec):.2f}-{max(t_dec):.2f})",
            "decompose / train": round(float(med / np.median(t_train)), 1),
            "nodes mean (max)": f"{res.n_nodes.mean():.1f} ({res.n_nodes.max()})",
            "max rel. error": f"{max(errors):.1e}",
            "FLOP floor": f"{flops / 1e9:.1f} GFLOP",
            "floor s": f"{floor_s:.2f}",
            "decompose / floor": round(med / floor_s, 2),
            "peak memory of decompose": f"{peak / 2**20:.1f} MiB",
        })
    return rows



# The default classifier's verbs on digits: PathKernelClassifier(random_state=0) (Adam,
# 64-64 GELU, ten outputs) on 1000 standardised training digits, queries from the rest.
DIGITS_NOTES = (
    "Default estimator: `PathKernelClassifier(random_state=0)` (Adam, (64, 64) GELU, "
    "P = 8,970, ten outputs) fit on the first 1000 digits of `load_digits` after "
    "`StandardScaler`; queries are the next digits. Times are CPU seconds of one thread "
    "(`torch.set_num_threads(1)`, `time.process_time()`), one call each. FLOP floor: "
    "`flop_floor` with C = 10 outputs for `decompose` and C = 1 for the contracted "
    "margin of `attribute` / `explain`, at the node counts each call used; 'floor s' "
    "divides it by the float32 1024^3 matmul rate measured in the same process (the "
    "adjoint's contraction with the batch, 2 Q C P B of those FLOPs, accumulates in "
    "float64 by design, whose GEMM rate is about half).")


def digits_case(n_queries: int = 100, verbs=("decompose", "attribute", "explain")) -> dict:
    """CPU seconds, node counts and FLOP floors of the default classifier's verbs."""
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    clf = PathKernelClassifier(random_state=0).fit(X[:1000], y[:1000])
    Xq = X[1000 : 1000 + n_queries]
    traj = clf.trajectory_
    batches = [len(b) for b in traj.batches]
    # CPU time, as the calls: on shared cores wall time counts the other processes.
    out = {"steps": len(traj) - 1, "rate": matmul_rate(clock=time.thread_time),
           "rate64": matmul_rate(clock=time.thread_time, dtype=torch.float64)}
    for verb in verbs:
        start = time.process_time()
        if verb == "decompose":
            res = clf.decompose(Xq)
        elif verb == "attribute":
            res = clf.attribute(Xq)
        elif verb == "explain":
            res = clf.explain(Xq)
        else:
            res = clf.kneighbors(Xq, kernel="path")
        out[verb] = {"s": time.process_time() - start}
        if verb == "decompose":
            out[verb].update(nodes=res.n_nodes.tolist(), error=float(
                res.error / max(np.abs(res.prediction).max(), 1e-300)))
    # The contracted margin's nodes, for its floor: the same decomposition with weights.
    if "decompose" in out:
        n = out["decompose"]["nodes"]
        out["floor"] = {C: flop_floor(clf.module_, n, batches, n_queries, C, True)
                        for C in (1, 10)}
    return out
