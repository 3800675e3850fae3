"""TangentKernel(net)(X) (trace, float32) against torch.func vmap(jacrev) J J^T (or the
per-sample autograd loop where vmap fails), alternated, CPU time, median of 3:
``python timing.py N model ...``.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402
import json
import sys
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
from models import build, data
from run import train
from torch.func import functional_call, jacrev, vmap

from skpathkernel.kernels import TangentKernel


def torch_func_gram(module, params, X):
    def f(p, x):
        return functional_call(module, p, (x[None],))[0]

    J = vmap(jacrev(f), in_dims=(None, 0))(params, X)
    J = torch.cat([j.reshape(X.shape[0], j.shape[1], -1) for j in J.values()], 2)
    return torch.einsum("ncp,mcp->nm", J, J) / J.shape[1]


def main(name, n, rounds=3):
    module, kind = build(name, dtype=torch.float32)
    X = data(kind, n)
    X = X.float() if X.is_floating_point() else X
    C = module(X[:1]).shape[1]
    y = torch.zeros(n, C)
    warnings.simplefilter("ignore")
    rec = train(module, X, y, steps=1)
    net = rec.as_estimator(X, y)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def skp():
        return TangentKernel(net)(X)

    def tf():
        return torch_func_gram(module, params, X)

    times = {"skp": [], "tf": []}
    res = {}
    for fn_name, fn in (("skp", skp), ("tf", tf)):
        try:
            res[fn_name] = np.asarray(fn())
        except Exception as e:
            res[fn_name] = repr(e)[:200]
    for _ in range(rounds):
        for fn_name, fn in (("skp", skp), ("tf", tf)):
            if isinstance(res[fn_name], str):
                continue
            t = time.process_time()
            fn()
            times[fn_name].append(time.process_time() - t)
    if isinstance(res["tf"], str):
        # torch.func cannot run it: the per-sample autograd loop is the user's alternative.
        from ref import jacobian

        state = {k: v.detach().clone() for k, v in module.state_dict().items()}

        def loop():
            J = jacobian(module, {k: state[k] for k in params}, X)
            return torch.einsum("ncp,mcp->nm", J, J) / J.shape[1]

        res["loop"] = np.asarray(loop())
        times["loop"] = []
        for _ in range(rounds):
            for fn_name, fn in (("skp", skp), ("loop", loop)):
                t = time.process_time()
                fn()
                times[fn_name].append(time.process_time() - t)
        times["skp"] = times["skp"][-rounds:]
    out = {"model": name, "n": n, "params": sum(p.numel() for p in params.values())}
    for k in times:
        out[k] = float(np.median(times[k])) if times[k] else res[k]
    if "loop" in res:
        out["ratio_skp_over_loop"] = out["skp"] / out["loop"]
        out["rel_diff_loop"] = float(
            np.abs(res["skp"] - res["loop"]).max() / np.abs(res["loop"]).max()
        )
    if not isinstance(res["tf"], str):
        out["ratio_skp_over_tf"] = out["skp"] / out["tf"]
        out["rel_diff"] = float(np.abs(res["skp"] - res["tf"]).max() / np.abs(res["tf"]).max())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    n = int(sys.argv[1])
    for name in sys.argv[2:]:
        main(name, n)
