"""``ghostlayers sweep``: every depth and method fitted and scored on the one model it loaded, equal to what
``prune`` gives for that depth and method; the recommended depth checked by hand on a constructed table."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    plant_hostile,
    random_batches,
    random_text,
    tiny_model,
    tiny_tokenizer,
    torch_bytes,
    torchrun,
)
from test_zeroshot import fixture_tasks  # noqa: F401
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.jobs import runs, sweep
from ghostlayers.measure import evaluation
from ghostlayers.model.surgery import pruning_undone
from ghostlayers.repair import pipeline
from ghostlayers.sources.fetch import ghostlayers_cache_dir as cache_dir

runner = CliRunner()

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test's own cache: the dense scores and plans a sweep keeps there are its alone."""
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))


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


@pytest.mark.parametrize(
    "method,alpha", [("ghost", "auto"), ("replaceme", 1.0), ("refit", "auto"), ("none", 1.0), ("linearpatch", 0.5)]
)  # fmt: skip
def test_a_variant_applied_in_place_is_a_pruned_copys_and_leaves_the_dense_model(method, alpha):
    """``applied``, the one way the sweep and the benchmarks make a variant, against the independent way: a
    deep copy of the dense model pruned by ``apply_plan``. Inside, the same logits and α; after, every tensor of
    the model bit-equal to before, also when the block raises."""
    model = tiny_model()
    heldout = {"a": random_batches(num=1, seed=7)[0], "b": random_batches(num=1, seed=8)[0]}
    methods = ["none", "ghost", "replaceme", "refit", "linearpatch"]
    made = ghostlayers.plan(model, random_batches(num=4), layers="2:4", methods=methods, groups=["a", "b"] * 2)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    copied = ghostlayers.apply_plan(copy.deepcopy(model), made, method, alpha=alpha, heldout=heldout, progress=False)
    settings = ghostlayers.FitSettings(method, alpha=alpha, progress=False)
    with ghostlayers.applied(model, made, settings, heldout) as result, torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, copied.model(IDS).logits, rtol=0, atol=0)
        assert (result.alpha, result.removed) == (copied.alpha, copied.removed)
    with pytest.raises(RuntimeError), ghostlayers.applied(model, made, settings, heldout):
        raise RuntimeError("a scoring that fails halfway")
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not hasattr(model.config, "ghostlayers")


def sweep_args(folder, out, depths: str = "2:4", methods: str = "none,ghost,replaceme", calibration=None) -> list[str]:
    text = str(folder.parent / "calib.txt")
    common = ["--model", str(folder), "--calibration", calibration or text, "--num-samples", "6", "--seq-len", "32"]
    return [
        "sweep", *common, "--batch-size", "3", "--ppl", text, "--ppl-windows", "2",
        "--depths", depths, "--methods", methods, "--output", str(out),
    ]  # fmt: skip


@pytest.mark.parametrize("sources", [1, 2], ids=["one-source", "two-sources"])
def test_each_cell_equals_what_prune_gives_for_its_depth_and_method(model_folder, tmp_path, sources):
    """The sweep shares two passes among the depths and the dense layers before each cut among its methods;
    ``prune`` calibrates each depth on its own. Both pick the same block, choose the same α (with two sources,
    each left out of the fit in turn: the per-domain sums must reach the sweep's plans), and score the same
    perplexity on the same windows."""
    calibration = None
    if sources == 2:
        (tmp_path / "calib2.txt").write_text(random_text(4000, seed=7))
        calibration = f"{model_folder.parent / 'calib.txt'},{tmp_path / 'calib2.txt'}"
    result = runner.invoke(app, sweep_args(model_folder, tmp_path / "sweep", calibration=calibration))
    assert result.exit_code == 0, result.output
    swept = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    text = str(model_folder.parent / "calib.txt")
    for depth in (2, 3):
        for method in ("none", "ghost", "replaceme"):
            report_dir = tmp_path / f"prune-{depth}-{method}"
            args = [*sweep_args(model_folder, report_dir, calibration=calibration)[1:11]]
            args += ["--select", "streamline", "--num-layers", str(depth)]
            args += ["--method", method, "--eval", "--ppl", text, "--ppl-windows", "2", "--tasks", "", "--no-speed"]
            done = runner.invoke(app, ["prune", *args, "--report-dir", str(report_dir)])
            assert done.exit_code == 0, done.output
            pruned = json.loads((report_dir / "report.json").read_text())
            cell = swept["depths"][str(depth)]["cells"][method]
            assert swept["depths"][str(depth)]["removed"] == pruned["removed"]
            assert cell["alpha"] == pruned["alpha"], (depth, method)
            if sources == 2 and method == "ghost":  # the left-out scores behind α, kept in the file
                for alpha, scores in pruned["alpha_scores"].items():
                    assert cell["alpha_scores"][alpha] == pytest.approx(scores, rel=1e-5), alpha
            row = pruned["metrics"][f"pruned + {method}"]
            assert cell["metrics"]["ppl"][text] == pytest.approx(row["ppl"][text], rel=1e-5), (depth, method)
            assert swept["dense"]["ppl"][text] == pytest.approx(pruned["metrics"]["dense"]["ppl"][text], rel=1e-6)


def test_calibration_is_two_passes_whatever_the_number_of_depths(model_folder, tmp_path, monkeypatch):
    passes = counted_passes(monkeypatch)
    result = runner.invoke(app, sweep_args(model_folder, tmp_path / "sweep", depths="1:5", methods="none,ghost"))
    assert result.exit_code == 0, result.output
    removed = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["depths"]
    assert len(passes) == 2 and passes[0] == ([], 6)  # the similarity to the last layer, then every depth's runs
    runs = {(r[0], r[-1] + 1) for r in (row["removed"] for row in removed.values())}
    assert set(passes[1][0]) == runs and len(runs) == 4


def test_stats_memory_bounds_the_sweep_as_it_bounds_prune(model_folder, tmp_path, monkeypatch):
    """``--stats-memory 0`` holds no depth's sums beside another's: a truncated pass per depth, and the same
    cells as the sweep that gathered every depth's sums in one pass."""
    together = runner.invoke(app, sweep_args(model_folder, tmp_path / "one", depths="1:4", methods="none,ghost"))
    assert together.exit_code == 0, together.output
    passes = counted_passes(monkeypatch)
    args = [*sweep_args(model_folder, tmp_path / "apart", depths="1:4", methods="none,ghost"), "--stats-memory", "0"]
    apart = runner.invoke(app, args)
    assert apart.exit_code == 0, apart.output
    assert len(passes) == 4 and passes[0] == ([], 6) and all(len(pairs) == 1 for pairs, _ in passes[1:])
    one, each = (json.loads((tmp_path / name / "sweep.json").read_text())["depths"] for name in ("one", "apart"))
    for depth, row in one.items():
        assert each[depth]["removed"] == row["removed"]
        for method, cell in row["cells"].items():
            ppl = cell["metrics"]["ppl"]
            assert each[depth]["cells"][method]["metrics"]["ppl"] == pytest.approx(ppl, rel=1e-9), (depth, method)


def counted_passes(monkeypatch) -> list[tuple[list, int | None]]:
    """Every calibration pass the planner makes from now on: its pairs and its depth."""
    passes = []
    real = pipeline.calibrate

    def counted(model, batches, pairs=(), **kwargs):
        passes.append((list(pairs), kwargs.get("depth")))
        return real(model, batches, pairs, **kwargs)

    monkeypatch.setattr(pipeline, "calibrate", counted)
    return passes


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
    kept = list((cache_dir() / "plans").glob("sweep-*.pt"))
    assert len(kept) == 1  # the killed sweep's plans, kept for the next run
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "calibrate", lambda *a, **k: pytest.fail("a resumed sweep calibrated again"))
        assert runner.invoke(app, sweep_args(model_folder, out)).exit_code == 0
    assert calls == ["none", "ghost", "replaceme"]  # depth 3 only: depth 2 was kept
    assert not kept[0].exists()  # every cell done: the plans are removed
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
        (("--num-layers", "1:60000000"), "no model has 100,000 layers"),  # checked before the range is built
        (("--num-layers", "1:1e22"), "is not a set of depths"),
        (("--num-layers", "1:99999999999999999999999"), "no model has 100,000 layers"),
        (("--heal", "abc"), "give token counts"),
        (("--heal", "0"), "give token counts"),
        (("--heal", "9" * 5000), "give token counts"),
        (("--heal", "10" + "0" * 16), "past the"),
        (("--heal", "100", "--heal-params", "operator"), "operator"),  # the methods include none
    ],
)
def test_bad_sweeps_are_one_error_line_before_any_work(model_folder, tmp_path, change, message):
    args = sweep_args(model_folder, tmp_path / "sweep")
    args += list(change)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("error:") == 1, result.output
    assert not (tmp_path / "sweep").exists()


def scored(monkeypatch) -> list[str]:
    """The labels of every evaluation the sweep runs (``dense``, or ``<depth> <method>``)."""
    labels, real = [], evaluation.evaluate

    def counted(*args, **kwargs):
        labels.append(args[6] if len(args) > 6 else kwargs.get("label", ""))
        return real(*args, **kwargs)

    for module in (sweep, evaluation, runs):  # the cells, dense's cached scoring and prune's job
        monkeypatch.setattr(module, "evaluate_model" if module is runs else "evaluate", counted)
    return labels


def test_new_methods_join_a_folder_and_dense_is_never_scored_again(model_folder, tmp_path, monkeypatch):
    """The same inputs on a finished folder with one more method: only that method's cells are computed, dense
    is read back, and each run's calibration time is kept. A second folder of the same inputs reads dense's
    scores from the cache."""
    labels, out = scored(monkeypatch), tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, methods="none,ghost")).exit_code == 0
    assert labels == ["dense", "2 none", "2 ghost", "3 none", "3 ghost"]
    labels.clear()
    more = runner.invoke(app, sweep_args(model_folder, out, methods="none,ghost,linearpatch"))
    assert more.exit_code == 0, more.output
    assert labels == ["2 linearpatch", "3 linearpatch"]
    results = json.loads((out / "sweep.json").read_text())
    assert [list(row["cells"]) for row in results["depths"].values()] == [["none", "ghost", "linearpatch"]] * 2
    assert len(results["calibration_seconds"]) == 2
    assert all(
        set(cell["seconds"]) == {"fit and guard", "score", "total"}
        for row in results["depths"].values()
        for cell in row["cells"].values()
    )
    labels.clear()
    elsewhere = runner.invoke(app, sweep_args(model_folder, tmp_path / "other", depths="2", methods="none"))
    assert elsewhere.exit_code == 0 and labels == ["2 none"]
    again = json.loads((tmp_path / "other" / "sweep.json").read_text())
    assert again["dense"] == results["dense"]


def test_a_folder_takes_a_shallower_set_of_depths(model_folder, tmp_path, monkeypatch):
    """The recipe records the deepest depth asked for (its ``num_layers``), which no cell depends on: the same
    inputs with depths 2,3 and then 2 alone with a new method go on in one folder (this was refused as another
    recipe), computing only the new cell."""
    labels, out = scored(monkeypatch), tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, depths="2,3", methods="none")).exit_code == 0
    labels.clear()
    more = runner.invoke(app, sweep_args(model_folder, out, depths="2", methods="none,ghost"))
    assert more.exit_code == 0, more.output
    assert labels == ["2 ghost"]
    results = json.loads((out / "sweep.json").read_text())
    assert {d: list(row["cells"]) for d, row in results["depths"].items()} == {"2": ["none", "ghost"], "3": ["none"]}


def test_other_weights_under_the_same_path_are_refused_and_overwrite_recomputes(model_folder, tmp_path, monkeypatch):
    """A resume reads the model's weights by content, not its path: new weights saved over the folder make the
    same command one error line (what differs, and the two ways out) with the folder untouched; --overwrite
    recomputes every cell and dense."""
    labels, out = scored(monkeypatch), tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, methods="none,ghost")).exit_code == 0
    before = (out / "sweep.json").read_bytes()
    tiny_model("llama", seed=3).save_pretrained(model_folder)
    refused = runner.invoke(app, sweep_args(model_folder, out, methods="none,ghost"))
    assert refused.exit_code == 2 and refused.output.count("error:") == 1, refused.output
    flat = " ".join(refused.output.split())
    assert "the model's weights" in flat and "new --output" in flat and "--overwrite" in flat, flat
    assert (out / "sweep.json").read_bytes() == before
    labels.clear()
    redone = runner.invoke(app, [*sweep_args(model_folder, out, methods="none,ghost"), "--overwrite"])
    assert redone.exit_code == 0, redone.output
    assert labels == ["dense", "2 none", "2 ghost", "3 none", "3 ghost"]
    old, new = json.loads(before), json.loads((out / "sweep.json").read_text())
    text = str(model_folder.parent / "calib.txt")
    assert new["dense"]["ppl"][text] != pytest.approx(old["dense"]["ppl"][text], rel=1e-3)


def test_a_resume_with_another_recipe_is_refused_saying_what_differs(model_folder, tmp_path):
    out = tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, depths="2", methods="none")).exit_code == 0
    args = sweep_args(model_folder, out, depths="2", methods="none")
    args[args.index("--num-samples") + 1] = "8"
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and refused.output.count("error:") == 1, refused.output
    flat = " ".join(refused.output.split())
    assert "the recipe" in flat and "1 cells" in flat and "new --output" in flat, flat


def test_a_folder_from_before_a_setting_was_added_resumes(model_folder, tmp_path, monkeypatch):
    """A sweep.json whose recipe lacks a setting ghostlayers added since (at its default today) is the same
    sweep: the same command resumes it and computes nothing, where comparing the raw dicts would refuse it."""
    labels, out = scored(monkeypatch), tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, depths="2", methods="none")).exit_code == 0
    results = json.loads((out / "sweep.json").read_text())
    del results["recipe"]["heal_topk"]  # as a folder written before --heal-topk existed
    (out / "sweep.json").write_text(json.dumps(results))
    labels.clear()
    again = runner.invoke(app, sweep_args(model_folder, out, depths="2", methods="none"))
    assert again.exit_code == 0, again.output
    assert labels == []


@pytest.mark.usefixtures("fixture_tasks")
def test_a_sweep_with_tasks_pairs_every_cell_with_plain_pruning(model_folder, tmp_path):
    """With --tasks: each cell's paired difference from plain pruning (acc_norm where the task has it, and acc)
    as numpy computes it from the per-example scores in sweep.json, the recommendation read from the task
    average, the number of tasks named as given, the chance level, and a plot with an accuracy panel."""
    out, tasks = tmp_path / "sweep", ["arc_easy", "boolq", "piqa"]
    args = [*sweep_args(model_folder, out, methods="none,ghost"), "--tasks", ",".join(tasks), "--keep", "0.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    results, md = json.loads((out / "sweep.json").read_text()), (out / "sweep.md").read_text()
    for depth, row in results["depths"].items():
        plain, ghost = (row["cells"][m]["metrics"]["zeroshot"] for m in ("none", "ghost"))
        for metric in ("acc_norm", "acc"):
            means, variances = [], []
            for task in tasks:
                examples = plain[task]["examples"]
                key = metric if metric in examples else "acc"
                diff = np.array(ghost[task]["examples"][key]) - np.array(examples[key])
                means.append(diff.mean())
                variances.append(diff.var(ddof=1) / len(diff))
            mean, se = np.mean(means), np.sqrt(np.sum(variances)) / len(tasks)
            assert f"| {depth} | " in md and f"{100 * mean:+.2f} ± {100 * se:.2f}" in md, (depth, metric)
    shares = {
        int(d): {m: c["share"]["zeroshot"] for m, c in row["cells"].items()} for d, row in results["depths"].items()
    }
    for method in ("none", "ghost"):
        deep = [d for d, share in shares.items() if share[method] >= 0.5]
        assert results["recommended"][method] == max(deep, default=None)
    assert "the 3-task average" in md and "9-task" not in md
    assert "Chance (a uniform guess): 41.7%" in md  # (0.25 + 0.5 + 0.5) / 3
    width = int.from_bytes((out / "sweep.png").read_bytes()[16:20], "big")
    assert width > 1000  # two panels: perplexity and zero-shot accuracy


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d["depths"]["2"]["cells"].update(none="a string"),
        lambda d: d.update(depths=[1, 2]),
        lambda d: d["depths"]["2"].update(removed="2..3"),
        lambda d: d.update(dense=7),
        lambda d: d["dense"]["ppl"].clear(),
        lambda d: d["depths"]["2"]["cells"]["none"]["metrics"]["ppl"].update({"other": 3.0}),
        lambda d: d["depths"]["2"]["cells"]["none"]["metrics"].update(ppl={k: "x" for k in d["dense"]["ppl"]}),
        lambda d: d["depths"]["2"]["cells"]["none"].update(alpha="one"),
        lambda d: d["depths"]["2"]["cells"]["none"]["share"].update(ppl=None),
    ],
    ids=[
        "cell-a-string",
        "depths-a-list",
        "removed-a-string",
        "dense-a-number",
        "dense-without-ppl",
        "cell-ppl-of-another-text",
        "cell-ppl-a-string",
        "alpha-a-string",
        "share-missing",
    ],  # fmt: skip
)
def test_a_damaged_sweep_json_is_one_error_line(model_folder, tmp_path, damage):
    """A sweep.json damaged or edited to the wrong shape, down to a cell's scores, share and α, is refused when
    resumed and left as it is (its table would be a traceback halfway through)."""
    out = tmp_path / "sweep"
    assert runner.invoke(app, sweep_args(model_folder, out, depths="2", methods="none")).exit_code == 0
    results = json.loads((out / "sweep.json").read_text())
    damage(results)
    (out / "sweep.json").write_text(json.dumps(results))
    result = runner.invoke(app, sweep_args(model_folder, out, depths="2,3", methods="none"))
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert "is not a sweep's results" in " ".join(result.output.split())
    assert json.loads((out / "sweep.json").read_text()) == results


def test_two_torchrun_processes_sweep_as_one(model_folder, tmp_path):
    """Under torchrun (2 CPU processes, gloo) every rank adds its share of the calibration sums and rank 0 alone
    scores and writes: the same blocks, α and perplexities as one process, within float tolerance."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert runner.invoke(app, sweep_args(model_folder, one, methods="none,ghost")).exit_code == 0
    done = torchrun(["-m", "ghostlayers", *sweep_args(model_folder, two, methods="none,ghost")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (json.loads((folder / "sweep.json").read_text()) for folder in (one, two))
    text = str(model_folder.parent / "calib.txt")
    for depth, row in a["depths"].items():
        assert b["depths"][depth]["removed"] == row["removed"]
        for method, cell in row["cells"].items():
            other = b["depths"][depth]["cells"][method]
            assert other["alpha"] == cell["alpha"], (depth, method)
            assert other["metrics"]["ppl"][text] == pytest.approx(cell["metrics"]["ppl"][text], rel=1e-5)
    assert not list(tmp_path.glob(".two.ghostlayers-*"))


CACHE_VARIANTS = ["fifo", "link to /dev/zero", "folder", "empty", "truncated", "mistyped"]


@pytest.mark.parametrize("variant", CACHE_VARIANTS)
def test_kept_plans_made_hostile_are_made_again(tmp_path, within_seconds, variant):
    """The plans an unfinished sweep keeps, replaced by anything: read as no plans (never a hang on a FIFO or
    /dev/zero, never another sweep's depths or a traceback), made again, and kept in their place."""
    plan = pipeline.plan_depths(tiny_model("llama"), random_batches(2, 2, 16), [2], select="streamline", progress=False)
    stored = tmp_path / "plans.pt"
    torch.save(plan, stored)
    assert sweep.cached_plans(stored, lambda: None, [2])[2].removed == plan[2].removed  # read back whole
    plant_hostile(stored, variant, {"mistyped": torch_bytes({3: ["a", "list"]})})  # another sweep's depths
    within_seconds(10)
    assert sweep.cached_plans(stored, lambda: plan, [2]) is plan
    if variant != "folder":  # a folder at its name is left, and the plans used without being kept
        assert torch.load(stored, weights_only=False)[2].removed == plan[2].removed


@pytest.mark.parametrize("variant", CACHE_VARIANTS)
def test_cached_dense_scores_made_hostile_are_scored_again(
    model_folder, tmp_path, monkeypatch, within_seconds, variant
):
    """The dense scores kept in the cache, replaced by anything (scores of another shape among them): scored
    again and equal to the first, never read as they are."""
    labels = scored(monkeypatch)
    assert runner.invoke(app, sweep_args(model_folder, tmp_path / "a", depths="2", methods="none")).exit_code == 0
    first = json.loads((tmp_path / "a" / "sweep.json").read_text())["dense"]
    (kept,) = [p for p in (cache_dir() / "dense").iterdir() if json.loads(p.read_text()) == first]
    plant_hostile(kept, variant, {"mistyped": b'{"ppl": {"wiki": "x"}}'})  # scores of another shape
    labels.clear()
    within_seconds(20)
    again = runner.invoke(app, sweep_args(model_folder, tmp_path / "b", depths="2", methods="none"))
    assert again.exit_code == 0, again.output
    assert labels == ["dense", "2 none"]
    assert json.loads((tmp_path / "b" / "sweep.json").read_text())["dense"]["ppl"] == pytest.approx(first["ppl"])


def test_prune_eval_reads_the_dense_scores_a_sweep_kept_and_a_sweep_reads_prunes(model_folder, tmp_path, monkeypatch):
    """Dense is scored once per model, windows and tasks, whichever job comes first: ``prune --eval`` of the
    sweep's model and windows reads the sweep's dense scores back (and a sweep after a ``prune --eval``, its);
    other windows are scored afresh."""
    labels = scored(monkeypatch)
    assert runner.invoke(app, sweep_args(model_folder, tmp_path / "a", depths="2", methods="none")).exit_code == 0
    swept = json.loads((tmp_path / "a" / "sweep.json").read_text())["dense"]
    text = str(tmp_path / "calib.txt")
    prune = ["prune", "--model", str(model_folder), "--calibration", text, "--num-samples", "6", "--seq-len", "32",
             "--batch-size", "3", "--ppl", text, "--tasks", "", "--layers", "2:4", "--eval", "--no-speed"]  # fmt: skip
    for windows, fresh in (("2", False), ("3", True)):
        labels.clear()
        out = tmp_path / f"pruned-{windows}"
        pruned = runner.invoke(app, [*prune, "--ppl-windows", windows, "--output", str(out)])
        assert pruned.exit_code == 0, pruned.output
        assert ("dense" in labels) == fresh and labels.count("pruned") == 1, labels
        if not fresh:
            assert json.loads((out / "report.json").read_text())["metrics"]["dense"] == swept
    labels.clear()
    args = sweep_args(model_folder, tmp_path / "b", depths="2", methods="none")
    args[args.index("--ppl-windows") + 1] = "3"
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert labels == ["2 none"]  # dense of 3 windows: prune --eval's, read back


def test_plans_pickled_under_a_module_path_that_moved_are_made_again(tmp_path, monkeypatch):
    """Plans kept by a sweep before the package's modules moved into subpackages name classes by their old
    path (``ghostlayers.routing.Plan``): reading them is a cache miss, not a crash. The benchmarks' cache too."""
    import sys
    import types

    old = types.ModuleType("ghostlayers.routing")

    class Plan:
        pass

    Plan.__module__, Plan.__qualname__ = old.__name__, "Plan"
    old.Plan = Plan
    monkeypatch.setitem(sys.modules, old.__name__, old)
    stored = tmp_path / "plans.pt"
    torch.save({4: Plan()}, stored)
    torch.save(Plan(), tmp_path / "old-plan.pt")
    monkeypatch.delitem(sys.modules, old.__name__)
    assert sweep.cached_plans(stored, lambda: {4: "made"}, [4]) == {4: "made"}
    assert torch.load(stored, weights_only=False) == {4: "made"}  # and kept in place of the old one

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import harness

    monkeypatch.setattr(harness, "ghostlayers_cache_dir", lambda: tmp_path / "cache")
    (tmp_path / "cache" / "plans").mkdir(parents=True)
    (tmp_path / "old-plan.pt").rename(tmp_path / "cache" / "plans" / "old-plan.pt")
    assert harness.cached_plan("old-plan", lambda: "made") == "made"


def test_healed_cells_are_prune_heal_and_leave_the_model_dense(tmp_path, monkeypatch):
    """``--heal N`` adds, per method, a cell healed on N tokens after its closed form: the same perplexity as
    ``prune --heal N`` of that depth and method (whose teacher runs afresh, where the sweep's methods share one
    run of the teacher per depth); and the depth swept after the healed cells (LoRA merged into the kept layers,
    then undone) scores as in a sweep that healed nothing."""
    from test_heal import dense_text

    from ghostlayers.repair import heal as healing

    teacher_runs = []
    real_cache_teacher = healing.cache_teacher

    def counted(*args, **kwargs):
        teacher_runs.append(args[2])  # the layer whose entering state is cached
        return real_cache_teacher(*args, **kwargs)

    monkeypatch.setattr(healing, "cache_teacher", counted)

    folder = tmp_path / "tiny-llama"
    dense, tokenizer = tiny_model("llama"), tiny_tokenizer()
    dense.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = str(tmp_path / "calib.txt")
    (tmp_path / "calib.txt").write_text(dense_text(dense, tokenizer))
    common = ["--model", str(folder), "--calibration", text, "--num-samples", "40", "--seq-len", "32",
              "--batch-size", "4", "--ppl", text, "--ppl-windows", "2", "--methods", "none,ghost"]  # fmt: skip
    heal = ["--heal-lr", "3e-3"]
    healed = runner.invoke(
        app, ["sweep", *common, *heal, "--depths", "2,3", "--heal", "1280", "--output", tmp_path / "h"]
    )
    assert healed.exit_code == 0, healed.output
    assert len(teacher_runs) == 2 and not (tmp_path / ".h.ghostlayers-heal").exists()  # once per depth, cleared
    plain = runner.invoke(app, ["sweep", *common, "--depths", "3", "--output", str(tmp_path / "p")])
    assert plain.exit_code == 0, plain.output
    swept, fresh = (json.loads((tmp_path / name / "sweep.json").read_text())["depths"] for name in ("h", "p"))
    cells = swept["2"]["cells"]
    assert list(cells) == ["none", "ghost", "none + heal 1280", "ghost + heal 1280"]
    assert cells["none + heal 1280"]["heal"]["params"] == ["lora"] and cells["none + heal 1280"]["heal"]["kept"]
    assert cells["ghost + heal 1280"]["heal"]["params"] == ["operator"]
    for method, cell in fresh["3"]["cells"].items():  # after depth 2's heals, the model was dense again
        assert swept["3"]["cells"][method]["metrics"]["ppl"] == pytest.approx(cell["metrics"]["ppl"], rel=1e-6)
    layers = ",".join(map(str, swept["2"]["removed"]))
    args = ["prune", *common[:10], "--layers", layers, "--method", "ghost", "--heal", "1280", *heal, "--eval", "--ppl",
            text, "--ppl-windows", "2", "--tasks", "", "--no-speed", "--report-dir", str(tmp_path / "r")]  # fmt: skip
    pruned = runner.invoke(app, args)
    assert pruned.exit_code == 0, pruned.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["heal"]["kept"] == cells["ghost + heal 1280"]["heal"]["kept"]
    got = cells["ghost + heal 1280"]["metrics"]["ppl"][text]
    assert got == pytest.approx(report["metrics"]["pruned + ghost"]["ppl"][text], rel=1e-5)


def test_sweep_md_pairs_each_healed_cell_with_the_closed_form_it_started_from():
    """sweep.md's healed table: per healed cell, the mean over tasks of the per-example differences from its
    closed form (not from plain pruning) and the standard error, checked against numpy on random scores."""
    rng = np.random.default_rng(0)
    n = {"copa": 40, "piqa": 30}

    def zeroshot(p: float) -> dict:
        tasks = {}
        for task, count in n.items():
            acc, norm = (rng.random(count) < p).astype(float), (rng.random(count) < p).astype(float)
            tasks[task] = {"acc": acc.mean(), "acc_stderr": 0.05, "examples": {"acc": list(acc)}, "n": count}
            if task == "piqa":
                tasks[task] |= {"acc_norm": norm.mean(), "acc_norm_stderr": 0.05}
                tasks[task]["examples"]["acc_norm"] = list(norm)
        return tasks

    def cell(p: float, heal: dict | None = None) -> dict:
        return {"alpha": 1.0, "metrics": {"ppl": {"t": 10.0}, "zeroshot": zeroshot(p)}, "share": {"ppl": 0.9},
                "seconds": {"total": 5.0}, "heal": heal}  # fmt: skip

    heal = {"params": ["operator"], "tokens": 4096, "steps": 2, "loss_before": 0.5, "loss_after": 0.25,
            "kept": True, "scores": {}, "hurt": [], "seconds": 12.0}  # fmt: skip
    cells = {"none": cell(0.5), "ghost": cell(0.6), "ghost + heal 4096": cell(0.7, heal)}
    results = {"recipe": {"model": "m"}, "settings": {"keep": 0.9, "tasks": "copa,piqa"}, "recommended": {},
               "dense": {"ppl": {"t": 9.0}, "zeroshot": zeroshot(0.8)},
               "depths": {"3": {"removed": [4, 5, 6], "cells": cells}}}  # fmt: skip
    row = next(line for line in sweep.markdown(results).splitlines() if line.startswith("| 3 | ghost + heal 4096 |"))
    columns = [c.strip() for c in row.strip("|").split("|")]
    assert columns[2:6] == ["operator", "4,096", "yes", "0.5000 → 0.2500"]
    for column, metric in zip(columns[6:8], ("acc_norm", "acc"), strict=True):
        means, variances = [], []
        for task in n:
            scores = [cells[c]["metrics"]["zeroshot"][task]["examples"] for c in ("ghost + heal 4096", "ghost")]
            diff = np.subtract(*(s.get(metric, s["acc"]) for s in scores))
            means.append(diff.mean())
            variances.append(diff.var(ddof=1) / len(diff))
        assert column == f"{100 * np.mean(means):+.2f} ± {100 * np.sqrt(sum(variances)) / len(n):.2f}"
    assert columns[8] == "12"
