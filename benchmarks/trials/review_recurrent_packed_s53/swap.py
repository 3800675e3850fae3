"""Prototype: the autograd check of the first two rows run in both orders catches the
data-dependent sorts of perm.py (a monkeypatch of layer_routes' check, not the engine)."""

import sys
from pathlib import Path

import torch

import skpathkernel._tangent._routes as R
from skpathkernel._tangent._capture import capture
from skpathkernel._tangent._gram import DEFAULT_MEMORY_BUDGET
from skpathkernel.rules import layer_routes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.argv = ["x", "zzzz"]
import perm  # noqa: E402  (runs its two BAD cases first, unpatched)

orig = R._numerical_misfits


def patched(module, params, x, cap, outputs):
    h = orig(module, params, x, cap, outputs)
    if x.shape[0] > 1:
        xs = x.flip(0)
        cap2 = capture(module, params, xs, outputs, memory_budget=DEFAULT_MEMORY_BUDGET,
                       dense_fallback=False)
        h = h | orig(module, params, xs, cap2, outputs)
    return h


R._numerical_misfits = patched
X = perm.padded([6, 5, 1, 3, 2, 6, 4])
X[:, 0, -1] = torch.tensor([6.0, 5, 1, 3, 2, 6, 4])
torch.manual_seed(1)
print("patched linear sort:", [(r.name, r.route) for r in layer_routes(perm.SortLin().double(), X)])
torch.manual_seed(1)
net = perm.SortPack2().double()
print("patched sortpack:", [(r.name, r.route)
                            for r in layer_routes(net, perm.padded([6, 5, 1, 3, 2, 6, 4]))])
