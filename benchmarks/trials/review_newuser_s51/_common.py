# s51 review probes: what they share (benchmarks/results/review-newuser-s51.md).
import numpy as np

# The small sgd MLP of tests/test_kernels.py's _fit.
SMALL_MLP = dict(
    hidden_layer_sizes=(6, 5),
    solver="sgd",
    learning_rate_init=0.05,
    max_iter=6,
    device="cpu",
    random_state=0,
)


def data(n=14, d=2, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, d))
    return X, np.sin(2 * X[:, 0]) + X[:, 1] ** 2


def err(a, b):
    """Largest difference relative to the reference's largest entry."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)
