"""The standard errors of quality.py's zero-shot tables (benchmarks/harness.py), against numpy on random scores: the
average over tasks, and the paired difference of two models scored on the same examples."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import benchmark

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

    mean, se = cells.average(cell(first))
    assert mean == pytest.approx(100 * np.mean([v.mean() for v in first.values()]))
    per_task = [v.std(ddof=1) / np.sqrt(len(v)) for v in first.values()]
    assert se == pytest.approx(100 * np.sqrt(np.sum(np.square(per_task))) / len(sizes))
    diff, diff_se = cells.average(cell(first), cell(second))
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
    assert cells.difference(cell(first), cell(first)).startswith("+0.00 ± 0.00")
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


def test_alpha_ridge_rule_against_known_answers():
    """alpha.py's ridge rule takes, per fold, the largest ridge whose fit keeps 95% of the default fit's
    held-out gain (in mean log-perplexity), and is judged on the test part like the α rules."""
    alpha = benchmark("alpha")
    corpora = list(alpha.OFFLINE)
    grid = [f"{a:g}" for a in alpha.ALPHA_GRID]

    def table(at_zero: float, at_one: float, names: list[str]) -> dict:
        return {a: {c: at_zero + float(a) * (at_one - at_zero) for c in names} for a in grid}

    cells = {}
    for out in corpora:
        kept = [c for c in corpora if c != out]
        test = table(20.0, 10.0, corpora)
        test["1"][out] = 25.0  # the default fit hurts the corpus it never saw
        cells[f"fold {out}"] = {"left_out": table(20.0, 10.0, kept), "in_domain": table(20.0, 10.0, kept), "test": test}
        # held-out gain kept: log(20/10.2)/log 2 = 0.97 (kept), log(20/10.5)/log 2 = 0.93 (too much shrinkage)
        cells[f"fold {out} ridge 0.001"] = {
            "in_domain": dict.fromkeys(kept, 10.2),
            "test": {**dict.fromkeys(kept, 11.0), out: 19.0},
        }
        cells[f"fold {out} ridge 0.01"] = {
            "in_domain": dict.fromkeys(kept, 10.5),
            "test": {**dict.fromkeys(kept, 12.0), out: 18.0},
        }
    assert alpha.in_domain_gain(cells["fold wiki"], dict.fromkeys(corpora[1:], 10.2)) == pytest.approx(
        np.log(20 / 10.2) / np.log(2)
    )
    text = alpha.tables({"description": "", "cells": cells, "ridges": [0.001, 0.01]})
    row = next(line for line in text.splitlines() if line.startswith("| ridge: largest"))
    # every fold takes ridge 0.001: its unseen corpus at 19/20 of plain pruning, 90% of the test gain kept
    expected = [", ".join(["1 (ridge 0.001)"] * 4), "0.9500", "90.0%", "90.0%", "no"]
    assert row.removesuffix(" |").split(" | ")[1:6] == expected
    fixed = next(line for line in text.splitlines() if line.startswith("| ridge 0.01, α = 1"))
    assert fixed.split(" | ")[2:5] == ["0.9000", "80.0%", "80.0%"]
