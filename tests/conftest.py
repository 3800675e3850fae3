import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from threadpoolctl import threadpool_limits

from skpathkernel._analysis import _unrolled
from skpathkernel._estimators import _base
from skpathkernel._tangent import RULES, _capture, register_rule

# NumPy's and SciPy's OpenBLAS on one thread per test process, as torch is
# (``_few_threads``): two pytest-xdist workers each running OpenBLAS's two threads on CI's
# two cores spin on each other. test_ood.py's leave-one-out brute force (a thousand small
# SVDs) took 474 s of a 48-minute suite under a load of 7, 5 s on one thread. Set once
# for the process, from a thread that then ends: threadpoolctl 3.8+ lets a live thread
# that set OpenBLAS's limit keep control of it, and tests/test_path_stacked.py sets its
# own limits from other threads. Subprocesses are untouched (no environment variable).
_blas = threading.Thread(target=lambda: threadpool_limits(limits=1, user_api="blas"))
_blas.start()
_blas.join()


@pytest.fixture(autouse=True)
def _few_threads():
    # Two cores on CI: keep torch from oversubscribing when pytest-xdist runs workers, and
    # the tests' tiny networks gain nothing from intra-op threads. Restored after each test.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n_threads)


@pytest.fixture
def feature_row_blocks(monkeypatch):
    """The row counts of the joblib blocks of every tangent-feature call that fanned out
    (``n_jobs``): one list per call."""
    calls = []
    real = _base.map_row_blocks

    def spy(*args, **kwargs):
        parts = real(*args, **kwargs)
        calls.append([len(part) for part in parts])
        return parts

    monkeypatch.setattr(_base, "map_row_blocks", spy)
    return calls


@pytest.fixture
def batched_backprops(monkeypatch):
    """The GPU's batched backward pass over the outputs (``is_grads_batched``) taken on
    the CPU too; yields the list of every batched pass's gradients (None where autograd
    could not batch it and the loop ran instead)."""
    monkeypatch.setattr(_capture, "_batches_backprops", lambda device: True)
    passes = []
    real = _capture._batched_grads
    monkeypatch.setattr(_capture, "_batched_grads",
                        lambda *a: passes.append(real(*a)) or passes[-1])
    return passes


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


@pytest.fixture(params=["mlp", "forward", "double"])
def unrolled_route(request, monkeypatch):
    """Each route of the unrolled scores' tangent products, whatever the step's work and
    network: the tests' networks are small enough that the rule would pick the double
    backward, while forward over reverse is what the networks people train take, and
    plain MLPs take their products by hand. Checks after the test that the route asked
    for is the one that ran."""
    route = request.param
    monkeypatch.setattr(_unrolled, "MLP_PRODUCTS", route == "mlp")
    monkeypatch.setattr(_unrolled, "FORWARD_WORK", 0 if route == "forward" else math.inf)
    calls = {"double": [], "mlp": []}
    double_backward, mlp_products = _unrolled._double_backward, _unrolled.MLPStep.products
    monkeypatch.setattr(_unrolled, "_double_backward",
                        lambda *a: calls["double"].append(1) or double_backward(*a))
    monkeypatch.setattr(_unrolled.MLPStep, "products",
                        lambda *a: calls["mlp"].append(1) or mlp_products(*a))
    yield route
    ran = "mlp" if calls["mlp"] else "double" if calls["double"] else "forward"
    assert ran == route and not (calls["mlp"] and calls["double"]), \
        f"the {route} route did not run ({ran} did)"


@pytest.fixture
def registered():
    """register_rule, undone after the test (the table is global)."""
    saved = dict(RULES)
    yield register_rule
    RULES.clear()
    RULES.update(saved)
