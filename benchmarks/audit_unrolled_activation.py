"""Audit: how well the unrolled scores predict replays, by activation, at Adam's defaults.

``bench_attribution``'s Adam setting (``benchmarks/results/attribution-adam.md``) trains
its MLP with ``activation="tanh"``; the estimators' default is ``"gelu"``. This fits
``PathKernelClassifier(hidden_layer_sizes=(64, 64), activation=A, batch_size=128,
max_iter=30, tol=None, random_state=SEED)`` (Adam at ``learning_rate_init=1e-3``,
float32: the defaults but the activation, the batch and the epochs, which are the
benchmark's) on 1000 ``load_digits`` images scaled to [0, 1], and scores 50 held-out
queries' margins by ``attribute(method="unrolled")`` against 30 subsets per fraction
retrained with ``retrain_on_subsets(..., protocol="replay")``. Prints, per activation and
seed, the largest growth, whether an ``UnstablePathWarning`` fired, the test accuracy and
the LDS at each fraction (``metrics.linear_datamodeling_score``), the Spearman correlation
over the queries between each query's growth and its LDS at the first fraction, and the
step of largest ``scores.amplification`` with its factor.

Usage: ``python -m benchmarks.audit_unrolled_activation N_TRAIN N_TEST BATCH [SEED ...]``
(seeds 0 1 2 by default; the split, as the training, is seeded by SEED).
"""

import sys
import warnings

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from skpathkernel import PathKernelClassifier, UnstablePathWarning
from skpathkernel.metrics import linear_datamodeling_score, retrain_on_subsets

FRACTIONS = (0.5, 0.9, 0.98)


def main(n_train: int, n_test: int, batch_size: int, seeds) -> None:
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    print(f"{n_train} training images, {n_test} queries, batch {batch_size}\n")
    print("| activation | seed | test acc | growth (max) | UnstablePathWarning | "
          + " | ".join(f"LDS replay {f}" for f in FRACTIONS)
          + f" | Spearman(query growth, query LDS {FRACTIONS[0]}) | most amplifying step |")
    print("|---|---|---|---|---|" + "---|" * (len(FRACTIONS) + 2))
    for activation in ("tanh", "gelu"):
        for seed in seeds:
            X_train, X_test, y_train, y_test = train_test_split(
                X / 16, y, train_size=n_train, test_size=n_test, random_state=seed)
            clf = PathKernelClassifier(hidden_layer_sizes=(64, 64), activation=activation,
                                       batch_size=batch_size, max_iter=30, tol=None,
                                       random_state=seed).fit(X_train, y_train)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scores = clf.attribute(X_test, y_test, method="unrolled")
            unstable = any(issubclass(w.category, UnstablePathWarning) for w in caught)
            lds, per_query = [], None
            for fraction in FRACTIONS:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = retrain_on_subsets(clf, X_train, y_train, X_test, y_test,
                                             n_subsets=30, subset_fraction=fraction,
                                             protocol="replay", random_state=seed,
                                             n_jobs=2)
                lds.append(linear_datamodeling_score(scores, res.subsets, res.outputs))
                if per_query is None:
                    per_query = linear_datamodeling_score(scores, res.subsets, res.outputs,
                                                          multioutput="raw_values")
            # A path whose queries all grew by the same factor (1.0) has no rank order.
            rho = (spearmanr(scores.growth, per_query, nan_policy="omit")[0]
                   if np.ptp(scores.growth) > 0 else float("nan"))
            step = int(np.argmax(scores.amplification))
            print(f"| {activation} | {seed} | {clf.score(X_test, y_test):.3f} | "
                  f"{scores.growth.max():.2f} | {'yes' if unstable else 'no'} | "
                  + " | ".join(f"{v:.3f}" for v in lds)
                  + f" | {rho:.3f} | {step} ({scores.amplification[step]:.2f}x) |", flush=True)


if __name__ == "__main__":
    n_train, n_test, batch_size, *seeds = (int(s) for s in sys.argv[1:])
    main(n_train, n_test, batch_size, seeds or [0, 1, 2])
