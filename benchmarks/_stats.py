"""Paired differences over repeated random train / test splits, and their verdicts."""

from typing import NamedTuple

import numpy as np


class Paired(NamedTuple):
    """The mean paired difference, its naive and its corrected standard error, J."""

    mean: float
    naive_se: float
    se: float
    splits: int

    def beyond(self):
        """Whether the difference is beyond 2 (corrected) standard errors of zero."""
        return abs(self.mean) > 2 * self.se


def paired(a, b, test_train_ratio):
    """The mean of the per-split differences ``a - b`` and its standard errors.

    The J resampled splits overlap, so their differences are correlated and the naive
    standard error ``s / sqrt(J)`` is too small; ``se`` is the square root of Nadeau &
    Bengio's corrected resampled variance, ``(1 / J + n_test / n_train) * s**2`` (C. Nadeau
    and Y. Bengio, "Inference for the Generalization Error", Machine Learning 52, 2003),
    with ``s**2`` the sample variance (ddof=1) of the differences. ``test_train_ratio``
    is ``n_test / n_train``; 0 (no held-out set, the seeds draw no test rows) leaves the
    naive one. With fewer than 2 splits both are NaN.
    """
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if len(d) < 2:
        return Paired(float(d.mean()) if len(d) else float("nan"), float("nan"),
                      float("nan"), len(d))
    var = d.var(ddof=1)
    return Paired(float(d.mean()), float(np.sqrt(var / len(d))),
                  float(np.sqrt((1 / len(d) + test_train_ratio) * var)), len(d))


def corrected_from_naive(naive_se, splits, test_train_ratio):
    """The corrected standard error from the naive one (``s / sqrt(J)``) and J alone:
    ``sqrt(1 + J * n_test / n_train)`` times it, for results that kept only the naive."""
    return naive_se * np.sqrt(1 + splits * test_train_ratio)


def split_ratio(n):
    """``n_test / n_train`` of ``train_test_split``'s default 25 % test split of n rows."""
    n_test = int(np.ceil(0.25 * n))
    return n_test / (n - n_test)
