"""The benchmarks' paired-difference statistics against closed forms worked by hand."""

import math

import numpy as np
import pytest

from benchmarks._stats import corrected_from_naive, paired, split_ratio
from benchmarks.bench_defaults import _row
from benchmarks.bench_defaults_ab import _worse


def test_paired_matches_the_hand_worked_corrected_variance():
    # Differences a - b = (1, 2, 3, 6): mean 3, squared deviations 4 + 1 + 0 + 9 = 14,
    # s^2 = 14 / 3; naive SE^2 = s^2 / 4 = 7 / 6; Nadeau & Bengio with n_test / n_train
    # = 1 / 3: (1 / 4 + 1 / 3) * 14 / 3 = (7 / 12) * (14 / 3) = 49 / 18.
    p = paired([2.0, 2.0, 3.0, 10.0], [1.0, 0.0, 0.0, 4.0], 1 / 3)
    assert p.mean == pytest.approx(3.0)
    assert p.naive_se == pytest.approx(math.sqrt(7 / 6))
    assert p.se == pytest.approx(7 / math.sqrt(18))
    assert p.splits == 4
    # 3 against 2 * 7 / sqrt(18) = 3.30: within noise, though beyond the naive 2 * 1.08.
    assert not p.beyond()
    assert abs(p.mean) > 2 * p.naive_se
    assert paired([2.0, 2.0, 3.0, 10.0], [1.0, 0.0, 0.0, 4.0], 0).se == pytest.approx(
        math.sqrt(7 / 6))


def test_corrected_from_naive_and_the_default_split():
    # iris: 150 rows, 38 test, 112 train.
    assert split_ratio(150) == pytest.approx(38 / 112)
    p = paired([0.3, 0.1, 0.7, 0.2, 0.9], [0.0] * 5, 38 / 112)
    assert corrected_from_naive(p.naive_se, 5, 38 / 112) == pytest.approx(p.se)
    assert np.isnan(paired([1.0], [0.0], 0.5).se)


def test_the_benchmarks_verdicts_use_the_corrected_standard_error():
    # The hand-worked differences (1, 2, 3, 6) / 100 with n_test / n_train = 1 / 3: mean
    # 0.03 is beyond the naive 2 SE (0.0216) but within the corrected one (0.0330).
    ref = [0.9, 0.9, 0.9, 0.9]
    ours = [0.89, 0.88, 0.87, 0.84]
    rec = {"score": ours, "fit": [1.0] * 4, "epochs": [1] * 4, "loss": [0.3, 0.3, 0.3, 0.3],
           "path": [1.0], "growth": [(1.0, 1.0)], "diverged": 0}
    peer = {"score": ref, "fit": [1.0] * 4, "epochs": [1] * 4, "loss": [0.29, 0.28, 0.27, 0.24]}
    row = _row("x", 300, 100, "ours", rec, "peer", peer, None)
    assert row["ours - sklearn's (+- 2 SE)"] == f"-0.030 (+-{2 * 0.07 / math.sqrt(18):.3f})"
    assert row["verdict"] == "below, within noise"
    assert row["log loss verdict"] == "above, within noise"
    assert _worse({"a": rec, "b": peer}, "a", "b", 1 / 3) == "none"
    # With no held-out term the same differences are beyond 2 SE, both ways.
    assert _worse({"a": rec, "b": peer}, "a", "b", 0.0) == "score, log loss"
