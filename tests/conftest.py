import math

import numpy as np
import pytest
import torch
from hypothesis import settings

from skpathkernel._analysis import _unrolled


@pytest.fixture(autouse=True)
def _few_threads():
    # Two cores on CI: keep torch from oversubscribing when pytest-xdist runs workers, and
    # the tests' tiny networks gain nothing from intra-op threads. Restored after each test.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n_threads)


@pytest.fixture
def regression_data():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(24, 3))
    y = np.sin(X @ np.array([1.0, -2.0, 0.5]))
    return X, y


# One deterministic hypothesis profile for every run (local and CI): the same examples
# each time, no per-example deadline (first calls compile torch kernels), few examples.
settings.register_profile("skpathkernel", derandomize=True, deadline=None, max_examples=10,
                          print_blob=True)
settings.load_profile("skpathkernel")


@pytest.fixture(params=["forward", "double"])
def unrolled_route(request, monkeypatch):
    """Each route of the unrolled scores' tangent products, whatever the step's work:
    the tests' networks are small enough that the rule would pick the double backward,
    while forward over reverse is what the networks people train take. Checks after the
    test that the route asked for is the one that ran."""
    forward = request.param == "forward"
    monkeypatch.setattr(_unrolled, "FORWARD_WORK", 0 if forward else math.inf)
    calls = []
    double_backward = _unrolled._double_backward
    monkeypatch.setattr(_unrolled, "_double_backward",
                        lambda *a: calls.append(1) or double_backward(*a))
    yield request.param
    assert bool(calls) != forward, f"the {request.param} route did not run"
