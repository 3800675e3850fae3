"""Training cost of skpathkernel against other ways to train the same MLP on the CPU.

Per case, same module (same initial weights), data, epochs, batch size, optimizer and
learning rate: skpathkernel's recorded training loop (what ``PathKernelMachine.fit``
runs), the same plain torch loop without recording, skorch's ``NeuralNetRegressor``
(peers venv, its own process, interleaved with the others by :mod:`benchmarks._serve`) and
scikit-learn's ``MLPRegressor`` (its own numpy implementation and initialisation; no early
stopping, tol=0, so that it runs every epoch). Ratios are to the plain torch loop.
"""

from __future__ import annotations

import copy
import time
import warnings

import numpy as np
import torch

from benchmarks._serve import PeakRSS
from benchmarks.bench_training import _fmt, _plain_loop, _recorded_loop
from skpathkernel._estimators._base import make_mlp
from skpathkernel._path._trajectory import SolverSpec

CASES = [
    # name, d_in, hidden, n, batch (None = full batch), solver, lr, epochs (full, quick)
    ("2-64-64-1 full-batch sgd", 2, [64, 64], 400, None, "sgd", 1e-2, (300, 60)),
    ("2-64-64-1 batch 32 adam", 2, [64, 64], 400, 32, "adam", 1e-3, (30, 5)),
    ("64-512-512-1 batch 128 adam", 64, [512, 512], 1024, 128, "adam", 1e-3, (4, 1)),
]

NOTES = ('skorch uses `torch.nn.MSELoss` (mean squared error; the others minimise half of it: '
         'same minimiser, gradients twice as large) and its default callbacks (epoch timer, '
         'loss logging). MLPRegressor trains in float32 numpy (BLAS limited to the same '
         'threads) with its own Glorot initialisation. Peak memory: extra resident memory of '
         'the first (warm-up) call, sampled every millisecond; in-process rows reuse memory '
         'already held by the process, so they are lower bounds.')


def training_problem(case):
    """Module, X, Y of a case; the skorch worker rebuilds the same from this dict."""
    torch.manual_seed(0)
    base = make_mlp(case["d_in"], 1, case["hidden"], "tanh")
    X = torch.randn(case["n"], case["d_in"])
    Y = torch.randn(case["n"], 1)
    return base, X, Y


def _calls(case):
    """The in-process methods of one case, each a fresh training from the same start."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPRegressor

    base, X, Y = training_problem(case)
    solver = SolverSpec(name=case["solver"])
    lr, batch, epochs, n = case["lr"], case["batch"], case["epochs"], case["n"]
    Xn, yn = X.numpy(), Y.numpy().ravel()

    def torch_call(loop):
        def call():
            module = copy.deepcopy(base)
            loop(module, X, Y, solver, lr, batch, epochs, torch.Generator().manual_seed(0))
        return call

    def mlp_call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            MLPRegressor(hidden_layer_sizes=tuple(case["hidden"]), activation="tanh",
                         solver=case["solver"], learning_rate_init=lr, momentum=0.0,
                         nesterovs_momentum=False, alpha=0.0, batch_size=batch or n,
                         max_iter=epochs, tol=0.0, n_iter_no_change=epochs + 1,
                         shuffle=True, random_state=0).fit(Xn, yn)

    return {"plain torch": torch_call(_plain_loop),
            "skpathkernel (recorded)": torch_call(_recorded_loop),
            "MLPRegressor": mlp_call}


def run(quick: bool = False, threads: int | None = None) -> list[dict]:
    from benchmarks.__main__ import peers_python, start_server

    repeats = 2 if quick else 3
    rows = []
    for name, d_in, hidden, n, batch, solver_name, lr, epochs in CASES:
        epochs = epochs[1] if quick else epochs[0]
        case = dict(kind="skorch_training", d_in=d_in, hidden=hidden, n=n, batch=batch,
                    solver=solver_name, lr=lr, epochs=epochs)
        calls = _calls(case)
        times = {k: [] for k in [*calls, "skorch"]}
        peaks = {}
        for label, call in calls.items():
            with PeakRSS() as mem:
                call()
            peaks[label] = mem.delta
        server, skorch_note = None, None
        if peers_python() is None:
            skorch_note = "skipped: no peers venv"
        else:
            try:
                server = start_server(case, threads)
                peaks["skorch"] = server.ask("mem")["peak_bytes"]
            except RuntimeError as exc:
                skorch_note = f"failed: {str(exc)[-200:]}"
        try:
            for _ in range(repeats):
                for label, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[label].append(time.perf_counter() - start)
                if server is not None:
                    times["skorch"].append(server.ask("time")["t"])
            if server is not None:
                server.close()
        finally:
            if server is not None:
                server.kill()
        plain = np.median(times["plain torch"])
        for label, ts in times.items():
            row = {"case": name, "epochs": epochs, "method": label}
            if not ts:
                row.update({"s (median, min-max)": skorch_note, "/ plain torch": "-",
                            "peak memory": "-"})
            else:
                row.update({"s (median, min-max)": _fmt(ts),
                            "/ plain torch": round(float(np.median(ts) / plain), 2),
                            "peak memory": f"{peaks[label] / 2**20:.1f} MiB"})
            rows.append(row)
    return rows

