"""``ghostlayers sweep``: every depth and method fitted and scored on the one model it loaded, equal to what
``prune`` gives for that depth and method; the recommended depth checked by hand on a constructed table."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_batches, tiny_model
from typer.testing import CliRunner

import ghostlayers
from ghostlayers import sweep
from ghostlayers.cli import app
from ghostlayers.surgery import pruning_undone

runner = CliRunner()

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "arch,method", [("llama", "ghost"), ("llama", "replaceme"), ("llama", "refit"), ("llama", "none"),
                    ("gemma3_text", "linearpatch")]
)  # fmt: skip
def test_a_pruned_model_is_the_dense_one_again_after_the_block(arch, method):
    model = tiny_model(arch)
    with torch.no_grad():
        dense = model(IDS).logits
    classes = (type(model), type(model.config))
    with pruning_undone(model, [(2, 4)]):
        result = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
        with torch.no_grad():
            pruned = result.model(IDS).logits
    with torch.no_grad():
        again = model(IDS).logits
    assert not torch.allclose(pruned, dense, atol=1e-3)
    torch.testing.assert_close(again, dense, rtol=0, atol=0)
    assert (type(model), type(model.config)) == classes
    assert model.config.num_hidden_layers == 6 and not hasattr(model.config, "ghostlayers")
    assert not [m for m in model.modules() if hasattr(m, "ghost_operator")]
    # and it prunes again as the first time
    second = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(second.model(IDS).logits, pruned)


def sweep_args(folder, out, depths: str = "2:4", methods: str = "none,ghost,replaceme") -> list[str]:
    text = str(folder.parent / "calib.txt")
    common = ["--model", str(folder), "--calibration", text, "--num-samples", "6", "--seq-len", "32"]
    return [
        "sweep", *common, "--batch-size", "3", "--ppl", text, "--ppl-windows", "2",
        "--num-layers", depths, "--methods", methods, "--output", str(out),
    ]  # fmt: skip


def test_each_cell_equals_what_prune_gives_for_its_depth_and_method(model_folder, tmp_path):
    """The sweep shares two passes among the depths; ``prune`` calibrates each depth on its own. Both pick the
    same block, choose the same α, and score the same perplexity on the same windows."""
    result = runner.invoke(app, sweep_args(model_folder, tmp_path / "sweep"))
    assert result.exit_code == 0, result.output
    swept = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    text = str(model_folder.parent / "calib.txt")
    for depth in (2, 3):
        for method in ("none", "ghost", "replaceme"):
            report_dir = tmp_path / f"prune-{depth}-{method}"
            args = [*sweep_args(model_folder, report_dir)[1:11], "--select", "streamline", "--num-layers", str(depth)]
            args += ["--method", method, "--eval", "--ppl", text, "--ppl-windows", "2", "--tasks", "", "--no-speed"]
            done = runner.invoke(app, ["prune", *args, "--report-dir", str(report_dir)])
            assert done.exit_code == 0, done.output
            pruned = json.loads((report_dir / "report.json").read_text())
            cell = swept["depths"][str(depth)]["cells"][method]
            assert swept["depths"][str(depth)]["removed"] == pruned["removed"]
            assert cell["alpha"] == pruned["alpha"], (depth, method)
            row = pruned["metrics"][f"pruned + {method}"]
            assert cell["metrics"]["ppl"][text] == pytest.approx(row["ppl"][text], rel=1e-5), (depth, method)
            assert swept["dense"]["ppl"][text] == pytest.approx(pruned["metrics"]["dense"]["ppl"][text], rel=1e-6)


def test_calibration_is_two_passes_whatever_the_number_of_depths(model_folder, tmp_path, monkeypatch):
    passes = []
    real = sweep.calibrate

    def counted(model, batches, pairs=(), **kwargs):
        passes.append((list(pairs), kwargs.get("depth")))
        return real(model, batches, pairs, **kwargs)

    monkeypatch.setattr(sweep, "calibrate", counted)
    result = runner.invoke(app, sweep_args(model_folder, tmp_path / "sweep", depths="1:5", methods="none,ghost"))
    assert result.exit_code == 0, result.output
    removed = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["depths"]
    assert len(passes) == 2 and passes[0] == ([], 6)  # the similarity to the last layer, then every depth's runs
    runs = {(r[0], r[-1] + 1) for r in (row["removed"] for row in removed.values())}
    assert set(passes[1][0]) == runs and len(runs) == 4


def test_a_killed_sweep_resumes_where_it_stopped(model_folder, tmp_path, monkeypatch):
    out, real, calls = tmp_path / "sweep", sweep._cell, []

    def dies_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(sweep, "_cell", dies_after_three)
    assert runner.invoke(app, sweep_args(model_folder, out)).exit_code == 130  # Ctrl-C: "aborted"
    partial = json.loads((out / "sweep.json").read_text())
    assert [list(row["cells"]) for row in partial["depths"].values()] == [["none", "ghost", "replaceme"]]
    assert not list(tmp_path.glob(".sweep.ghostlayers-*"))  # no lock, no half-written folder
    calls.clear()
    monkeypatch.setattr(sweep, "_cell", lambda *args: calls.append(args[2]) or real(*args))
    assert runner.invoke(app, sweep_args(model_folder, out)).exit_code == 0
    assert calls == ["none", "ghost", "replaceme"]  # depth 3 only: depth 2 was kept
    resumed = json.loads((out / "sweep.json").read_text())
    fresh = runner.invoke(app, sweep_args(model_folder, tmp_path / "fresh"))
    assert fresh.exit_code == 0
    again = json.loads((tmp_path / "fresh" / "sweep.json").read_text())
    for depth in ("2", "3"):
        for method, cell in again["depths"][depth]["cells"].items():
            got = resumed["depths"][depth]["cells"][method]["metrics"]["ppl"]
            assert got == pytest.approx(cell["metrics"]["ppl"]), (depth, method)


def test_the_recommended_depth_by_hand():
    shares = {2: 0.97, 4: 0.93, 6: 0.91, 8: 0.86, 10: 0.92}  # not monotone: the deepest that keeps enough
    assert sweep.recommend(shares, 0.9) == 10
    assert sweep.recommend(shares, 0.95) == 2
    assert sweep.recommend(shares, 0.99) is None
    results = {
        "settings": {"keep": 0.9, "tasks": ""},
        "depths": {
            "2": {"cells": {"none": {"share": {"ppl": 0.95}}, "ghost": {"share": {"ppl": 0.97}}}},
            "4": {"cells": {"none": {"share": {"ppl": 0.85}}, "ghost": {"share": {"ppl": 0.91}}}},
        },
    }
    assert sweep.recommendations(results) == {"none": 2, "ghost": 4}
    dense = {"ppl": {"a": 10.0, "b": 20.0}}
    assert sweep.kept_share({"ppl": {"a": 12.5, "b": 21.0}}, dense) == {"ppl": pytest.approx(0.8)}


@pytest.mark.parametrize(
    "change,message",
    [
        (("--num-layers", "5:2"), "is not a set of depths"),
        (("--num-layers", "0:3"), "is not a set of depths"),
        (("--methods", "none,magic"), "unknown method(s) magic"),
        (("--keep", "1.5"), "is not a share"),
        (("--keep", "0"), "is not a share"),
        (("--select", "ghost-aware"), "from the similarity pass"),
        (("--num-layers", "2:7"), "not possible for a model with 6 layers"),
    ],
)
def test_bad_sweeps_are_one_error_line_before_any_work(model_folder, tmp_path, change, message):
    args = sweep_args(model_folder, tmp_path / "sweep")
    args += list(change)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("error:") == 1, result.output
    assert not (tmp_path / "sweep").exists()
