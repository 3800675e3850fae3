"""Max relative error of tangent_features and of the Gram against the float64 per-sample
loop where X's last row repeats x0 or x1 (wrap-around padding) and a sort's key ties on
x0, x1: tests/test_tangent.py::test_the_check_takes_a_last_sample_unlike_the_first_two's
case. Run from the root of a tree holding tests/ (PYTHONPATH=<tree>) to measure that
tree's package (benchmarks/results/reorder_check-s55.md, section 3b)."""

import sys

import torch

sys.path.insert(0, "tests")

from test_tangent import _loop_jacobian, _sorted_by_score

from skpathkernel._tangent import tangent_features, tangent_gram

for descending in (True, False):
    for repeated in (0, 1):
        module, params, X = _sorted_by_score(descending)
        X[:, 0] = torch.tensor([5, 5, 1, 7, 2, 8, 3, 6, 4], dtype=X.dtype) * (
            1 if descending else -1)
        X[-1] = X[repeated]
        J = _loop_jacobian(module, params, X)
        F = tangent_features(module, params, X, output="full")
        K = tangent_gram(module, params, X, output="full")
        K_ref = torch.einsum("ncp,mdp->ncmd", J, J)
        print(descending, repeated, float((F - J).abs().max() / J.abs().max()),
              float((K - K_ref).abs().max() / K_ref.abs().max()))
