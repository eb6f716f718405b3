"""Numbers are checked where they are born: broken statistics, singular solves and non-finite weights stop
the run with a message instead of producing or saving a broken model; run folders that share a name keep
their own rows and bars."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import random_batches, tiny_model, tiny_tokenizer

import ghostlayers
from ghostlayers.errors import GhostLayersError
from ghostlayers.measure import report
from ghostlayers.numerics import fitting
from ghostlayers.numerics.sums import PairStats
from ghostlayers.store.saving import save


def test_non_finite_hidden_states_stop_calibration_naming_the_block():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    with pytest.raises(GhostLayersError, match=r"Calibration statistics of the block 2\.\.3.*--dtype float32"):
        ghostlayers.prune(model, random_batches(num=2), layers="2:4", progress=False)


def test_singular_solve_says_to_raise_the_ridge():
    """Every token's state lies in one plane: XᵀX has rank 2 of 8, so ridge 0 has no solution."""
    x = torch.randn(50, 2, dtype=torch.float64) @ torch.randn(2, 8, dtype=torch.float64)
    stats = PairStats.zeros(3, 5, {"xtx": (8, 8), "xty": (8, 8)}, torch.float64, "cpu")
    stats.xtx += x.T @ x
    stats.xty += x.T @ (2 * x)
    with pytest.raises(GhostLayersError, match=r"block 3\.\.4 is singular at ridge 0.*Raise --ridge"):
        fitting.fit("ghost", stats, ridge=0.0)
    assert torch.isfinite(fitting.fit("ghost", stats, ridge=1e-6)).all()  # any ridge > 0 makes it solvable


@pytest.mark.parametrize("ridge", ["nan", "inf", "-1e-3", float("nan")])
def test_non_finite_or_negative_ridge_is_refused_by_the_api(ridge):
    with pytest.raises(GhostLayersError, match="--ridge"):
        ghostlayers.prune(tiny_model("llama"), random_batches(num=2), layers="2:4", ridge=ridge, progress=False)


def test_non_finite_weights_are_never_saved(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[1, 2] = math.nan
    with pytest.raises(GhostLayersError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        save(model, tiny_tokenizer(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_runs_with_the_same_name_keep_every_row_and_bar(tmp_path):
    """Two run folders both called ``run`` (in a/ and b/), each with a dense and a pruned model: four rows,
    four distinct bar labels, none overwritten by another."""
    folders = []
    for parent, ppl in (("a", 10.0), ("b", 20.0)):
        folder = tmp_path / parent / "run"
        folder.mkdir(parents=True)
        metrics = {"dense": {"ppl": {"wiki": ppl}}, "pruned + ghost": {"ppl": {"wiki": ppl + 1}}}
        (folder / "report.json").write_text(json.dumps({"command": "prune", "method": "ghost", "metrics": metrics}))
        folders.append(folder)
    labels = [label for label, *_ in report._runs(folders)]
    assert labels == ["a/run: dense", "a/run: pruned + ghost", "b/run: dense", "b/run: pruned + ghost"]
    table = report.compare(folders)
    for label, value in zip(labels, ("10", "11", "20", "21"), strict=True):
        assert f"| {label} | " in table and f"| {value} |" in table
    report.perplexity_plot(folders, tmp_path / "plot.png")
    assert Path(tmp_path / "plot.png").stat().st_size > 0
