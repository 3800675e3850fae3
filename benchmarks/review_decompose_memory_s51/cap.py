# ruff: noqa
"""Sweep memory_budget down to the refusal on a CNN whose steps need ~30 nodes (tanh,
lr 1.5, float64): node counts, reported error vs |initial + sum c + reg - f(theta_T)|
from the module's own forward, and the warnings. argv: budgets..."""
import sys
import warnings

import numpy as np
import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nets import record


def cnn(dtype=torch.float64, lr=1.5, width=8):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.Tanh(),
                      nn.Conv2d(width, 16, 3, stride=2, padding=1), nn.Tanh(),
                      nn.Flatten(), nn.Linear(16 * 4 * 4, 3)).to(dtype)
    X = torch.randn(4, 3, 8, 8, dtype=dtype)
    y = torch.randn(4, 3, dtype=dtype)
    return record(m, torch.optim.SGD(m.parameters(), lr=lr), X, y, 3), m, X, y


if __name__ == "__main__":
    dt = torch.float32 if "f32" in sys.argv else torch.float64
    rec, m, X, y = cnn(dt)
    with torch.no_grad():
        f = m(X).double().numpy()
    for b in [a for a in sys.argv[1:] if a != "f32"]:
        est = rec.as_estimator(X, y, memory_budget=int(float(b)))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                r = est.decompose(X.numpy())
            except Exception as e:  # noqa: BLE001
                print(b, "raised", type(e).__name__, str(e)[:160])
                continue
        true = np.abs(r.initial + r.contributions.sum(1) + r.regularization - f).max()
        msgs = [str(x.message) for x in w]
        print(b, "n", r.n_nodes.tolist(), "step_err", np.array2string(r.step_errors, precision=2),
              "err %.3g true %.3g tol %s" % (r.error, true, r.tol),
              "warn:", [(type(x.message).__name__, "memory" in str(x.message)) for x in w])
        for s in msgs:
            print("   ", s[:400])
