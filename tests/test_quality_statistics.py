"""The standard errors of benchmarks/quality.py's zero-shot tables, against numpy on random scores: the
average over tasks, and the paired difference of two models scored on the same examples."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import benchmark

quality = benchmark("quality")
cells = benchmark("harness")


def test_average_and_paired_difference_match_numpy():
    rng = np.random.default_rng(0)
    sizes = {"a": 300, "b": 250, "c": 120}
    first = {t: (rng.random(n) < 0.6).astype(float) for t, n in sizes.items()}
    # the second model agrees with the first on most examples: pairing shrinks the standard error
    second = {
        t: np.where(rng.random(n) < 0.85, s, 1 - s) for (t, n), s in zip(sizes.items(), first.values(), strict=True)
    }

    def cell(scores):
        return {t: {"examples": {"acc": list(map(float, v))}} for t, v in scores.items()}

    mean, se = quality.average(cell(first))
    assert mean == pytest.approx(100 * np.mean([v.mean() for v in first.values()]))
    per_task = [v.std(ddof=1) / np.sqrt(len(v)) for v in first.values()]
    assert se == pytest.approx(100 * np.sqrt(np.sum(np.square(per_task))) / len(sizes))
    diff, diff_se = quality.average(cell(first), cell(second))
    d = {t: first[t] - second[t] for t in sizes}
    assert diff == pytest.approx(100 * np.mean([v.mean() for v in d.values()]))
    paired = [v.std(ddof=1) / np.sqrt(len(v)) for v in d.values()]
    assert diff_se == pytest.approx(100 * np.sqrt(np.sum(np.square(paired))) / len(sizes))
    unpaired = np.sqrt(
        np.sum(
            [
                a**2 + b**2
                for a, b in zip(per_task, [v.std(ddof=1) / np.sqrt(len(v)) for v in second.values()], strict=True)
            ]
        )
    ) / len(sizes)
    assert diff_se < 100 * unpaired
    assert quality.difference(cell(first), cell(first)).startswith("+0.00 ± 0.00")
    assert cells.share(none=50.0, dense=20.0, value=35.0) == pytest.approx(0.5)
    assert cells.share(none=50.0, dense=20.0, value=56.0) == pytest.approx(-0.2)  # worse than plain pruning


def test_accuracy_gap_shares_against_known_answers():
    """A method that shifts all of an example's choices alike moves no margin: margin share 0, common part 1,
    and its likelihood share is the shift over dense's gap; dense itself has every share 1."""
    gap = benchmark("accuracy_gap")
    none = {"loglikelihoods": [[-1.0, -2.0], [-3.0, -1.0, -2.0]], "gold": [0, 2]}
    dense = {"loglikelihoods": [[-0.5, -2.5], [-2.0, -1.5, -0.5]], "gold": [0, 2]}
    shifted = {"loglikelihoods": [[-0.8, -1.8], [-2.5, -0.5, -1.5]], "gold": [0, 2]}
    parts = gap.gap_shares(shifted, none, dense)
    assert parts["margin share"] == pytest.approx(0.0, abs=1e-12)
    assert parts["common part"] == pytest.approx(1.0)
    # Σ shift = 2·0.2 + 3·0.5; Σ (dense − none) = 0.5 − 0.5 + 1 − 0.5 + 1.5
    assert parts["likelihood share"] == pytest.approx((2 * 0.2 + 3 * 0.5) / 2.0)
    # dense against none: example 1 moves [0.5, −0.5] (no common shift), example 2 [1, −0.5, 1.5] (3·(2/3)²)
    assert gap.gap_shares(dense, none, dense) == pytest.approx(
        {"likelihood share": 1.0, "margin share": 1.0, "common part": (3 * (2 / 3) ** 2) / (0.5 + 3.5)}
    )
    assert gap.margins(dense) == pytest.approx([2.0, -0.5 - (-2.0 - 1.5) / 2])
    # only the right choice moves, by 1 nat, in one example of two: common part 1/k of that example's
    lifted = {"loglikelihoods": [[0.0, -2.0], [-3.0, -1.0, -2.0]], "gold": [0, 2]}
    assert gap.gap_shares(lifted, none, dense)["common part"] == pytest.approx(2 * 0.5**2 / 1.0)
