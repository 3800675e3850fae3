"""The fixed row blocks of predictions and tangent features."""

import numpy as np
import pytest
import torch

from skpathkernel._memory import map_fixed_blocks


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [1, 5, 8, 13])
def test_map_fixed_blocks_pads_with_the_first_row(kind, n):
    X = np.random.RandomState(0).randn(n, 2, 3)
    if kind == "torch":
        X = torch.as_tensor(X)
    seen = []

    def fn(xb):
        xb = xb.numpy() if isinstance(xb, torch.Tensor) else xb
        seen.append(xb.copy())
        return xb.reshape(len(xb), -1).sum(axis=1, keepdims=True)

    out = map_fixed_blocks(fn, X, 4)
    Xn = X.numpy().copy() if kind == "torch" else X.copy()
    assert out.shape == (n, 1)
    np.testing.assert_array_equal(out[:, 0], Xn.reshape(n, -1).sum(axis=1))
    assert [len(b) for b in seen] == [4] * -(-n // 4)
    tail, rest = seen[-1], n % 4 or 4
    np.testing.assert_array_equal(tail[:rest], Xn[n - rest:])
    np.testing.assert_array_equal(tail[rest:], np.repeat(Xn[n - rest][None], 4 - rest, axis=0))
    # Padding writes nothing back into the caller's rows.
    np.testing.assert_array_equal(X.numpy() if kind == "torch" else X, Xn)
