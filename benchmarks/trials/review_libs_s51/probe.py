# ruff: noqa: NPY002
"""Review s51 (6cb6334): the random-draw probe leaves the module's state, its modes and the
global torch and NumPy RNGs as they were; which call changes the RNG."""

import warnings

import numpy as np
import torch
from _common import recorded
from torch import nn


def snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


class Drop(nn.Module):
    def __init__(s):
        super().__init__()
        s.l = nn.Linear(4, 8)
        s.h = nn.Linear(8, 1)

    def forward(s, x):
        h = torch.tanh(s.l(x))
        if s.training:
            h = h * torch.empty_like(h[:, :1]).bernoulli_(0.9) / 0.9
        return s.h(h)


def _bneval():
    m = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 1)
    ).double()
    m[1].eval()
    return m


torch.manual_seed(0)
X = torch.randn(40, 4, dtype=torch.float64)
y = torch.randn(40, 1, dtype=torch.float64)
for name, m in [("drop-train", Drop().double()), ("bn-eval-rest-train", _bneval())]:
    rec = recorded(m, X, y, 2, 16, lr=0.1)
    st = snapshot(m)
    rng = torch.get_rng_state().clone()
    npst = np.random.get_state()[1].copy()
    modes = [l.training for l in m.modules()]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        net = rec.as_network(X, y)
        est = rec.as_estimator(X, y)
        est.predict(X.numpy()[:3])
    changed = [k for k, v in snapshot(m).items() if not torch.equal(v, st[k])]
    print(
        name,
        "warnings:",
        [str(x.message)[:60] for x in w if "different outputs" in str(x.message)].__len__(),
        "state changed:",
        changed,
        "rng same:",
        torch.equal(rng, torch.get_rng_state()),
        "np same:",
        (npst == np.random.get_state()[1]).all(),
        "modes same:",
        modes == [l.training for l in m.modules()],
    )

m = Drop().double()
rec = recorded(m, X, y, 2, 16, lr=0.1)
for what in ("as_network", "as_estimator", "predict"):
    rng = torch.get_rng_state().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if what == "as_network":
            rec.as_network(X, y)
        elif what == "as_estimator":
            e = rec.as_estimator(X, y)
            _ = e.network_
        else:
            e.predict(X.numpy()[:3])
    print(what, "rng same:", torch.equal(rng, torch.get_rng_state()))
