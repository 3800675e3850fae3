# ruff: noqa: E402, E501, B023
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
from skpathkernel import PathKernel, PathKernelMachine, TangentKernel

rng = np.random.RandomState(0)
X, y = rng.normal(size=(30, 2)), rng.normal(size=30)


def err(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


def check(name, K, ref, old):
    e = err(K, ref)
    print(
        f"{'BAD ' if e > 1e-10 else 'ok  '}{name}: err {e:.2e} (true Gram moved {err(ref, old):.2e})"
    )


def build(n_in, n_out):
    m = torch.nn.Sequential(
        torch.nn.Linear(n_in, 8),
        torch.nn.BatchNorm1d(8).eval(),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, n_out),
    )
    for p in m[3].parameters():
        p.requires_grad_(False)
    return m


est = PathKernelMachine(module=build, max_iter=5, tol=None, random_state=0, dtype="float64").fit(
    X, y
)
m = est.network_.module
for KC in (TangentKernel, PathKernel):
    print("==", KC.__name__)

    def case(name, do, undo):
        k = KC(est)
        old, _ = k(X, eval_gradient=True)
        do()
        check(name, k(X), KC(est)(X), old)
        undo()

    case(
        "bn.running_var.data.mul_(3)",
        lambda: m[1].running_var.data.mul_(3),
        lambda: m[1].running_var.data.div_(3),
    )
    saved = m[1].running_var.data.clone()
    case(
        "bn.running_var.data = 3*...",
        lambda: setattr(m[1].running_var, "data", saved * 3),
        lambda: setattr(m[1].running_var, "data", saved.clone()),
    )
    case(
        "frozen weight .data.mul_(2)",
        lambda: m[3].weight.data.mul_(2),
        lambda: m[3].weight.data.div_(2),
    )
    case(
        "frozen weight with no_grad mul_(2)",
        lambda: torch.no_grad()(lambda: m[3].weight.mul_(2))(),
        lambda: torch.no_grad()(lambda: m[3].weight.div_(2))(),
    )
    case(
        "bn.eps = 0.5 attribute",
        lambda: setattr(m[1], "eps", 0.5),
        lambda: setattr(m[1], "eps", 1e-5),
    )
    case(
        "swap Tanh -> ReLU submodule",
        lambda: m.__setitem__(2, torch.nn.ReLU()),
        lambda: m.__setitem__(2, torch.nn.Tanh()),
    )
    k = KC(est)
    k(X, eval_gradient=True)
    m.train()
    try:
        k(X)
        print("BAD module.train(): the memo answered where a fresh call refuses")
    except ValueError:
        print("ok  module.train(): refused as a fresh call is")
    m.eval()
    case(
        "load_state_dict (bn x3)",
        lambda: m.load_state_dict({**m.state_dict(), "1.running_var": m[1].running_var * 3}),
        lambda: m.load_state_dict({**m.state_dict(), "1.running_var": m[1].running_var / 3}),
    )
