"""Routes, kernels against the autograd reference, decomposition, per model:
``python run.py N model ...``.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, E501
import json
import os
import sys
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
from models import build, data
from ref import full, jacobian, rel

from skpathkernel import PathRecorder
from skpathkernel.kernels import PathKernel, TangentKernel
from skpathkernel.rules import layer_routes

LR, STEPS = 0.05, 3


def train(module, X, y, steps=STEPS, lr=LR, weights=None):
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=lr)
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for _ in range(steps):
            opt.zero_grad()
            f = module(X)
            l = 0.5 * (f - y).pow(2).mean(1)
            (l.mean() if weights is None else (weights * l).sum() / weights.sum()).backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    return rec


def main(name, n):
    out = {"model": name}
    module, kind = build(name)
    X = data(kind, n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routes = layer_routes(module, X)
    fb = [r for r in routes if r.route == "fallback"]
    out["routes"] = (
        f"{len(routes) - len(fb)} rule / {len(fb)} fallback ({sum(r.n_params for r in fb)} of {sum(r.n_params for r in routes)} params)"
    )
    out["fallback"] = sorted({f"{r.type}: {r.reason}" for r in fb})
    out["route_warnings"] = sorted({str(w.message)[:200] for w in caught})
    C = module(X[:1]).shape[1]
    y = torch.randn(n, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.process_time()
        rec = train(module, X, y)
        net = rec.as_estimator(
            X, y, loss="squared_error", memory_budget=int(os.environ.get("MB", 2**30))
        )
        out["train_record_cpu_s"] = time.process_time() - t
        traj = rec.trajectory
        t = time.process_time()
        K = TangentKernel(net, output="full")(X)
        Kt = TangentKernel(net)(X)
        P = PathKernel(net, output="full")(X)
        out["kernels_cpu_s"] = time.process_time() - t
        t = time.process_time()
        res = None if os.environ.get("NODEC") else net.decompose(X)
        out["decompose_cpu_s"] = time.process_time() - t
    out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught})
    PR = 0
    for k in range(len(traj)):
        J = jacobian(module, traj.state_dict(k), X)
        if k < len(traj) - 1:
            PR = PR + traj.learning_rates[k] * full(J)
        del J
    KR = full(jacobian(module, traj.state_dict(len(traj) - 1), X))
    out["TK_full"] = rel(K, KR)
    out["TK_trace"] = rel(Kt, torch.einsum("nmcc->nm", KR) / C)
    out["PK_full"] = rel(P, PR)
    with torch.no_grad():
        f = module(X).numpy()
    if res is not None:
        recon = res.initial + res.contributions.sum(1) + res.regularization
        out["dec_error"] = float(res.error)
        out["dec_gap"] = float(np.abs(recon - f).max())
    out["max_out"] = float(np.abs(f).max())
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    for name in sys.argv[2:]:
        try:
            main(name, int(sys.argv[1]))
        except Exception as e:
            import traceback

            traceback.print_exc()
            print(json.dumps({"model": name, "error": repr(e)[:500]}), flush=True)
