"""The benchmarks' paired-difference statistics against closed forms worked by hand."""

import math

import numpy as np
import pytest

from benchmarks._stats import corrected_from_naive, paired, split_ratio


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
