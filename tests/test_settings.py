"""One source of settings: every default of ``ghostlayers prune`` is the recipe's own (``spec.PruneRecipe``
and ``spec.EvalSettings``), so the command line and the API cannot drift apart."""

from __future__ import annotations

import inspect
import json
from dataclasses import MISSING, fields

import typer
from typer.testing import CliRunner

from ghostlayers import cli
from ghostlayers.config.recipes import EvalSettings, PruneRecipe


def test_every_prune_option_defaults_to_the_recipe_field():
    options = inspect.signature(cli.prune).parameters
    defaults = {
        f.name: f.default for cls in (PruneRecipe, EvalSettings) for f in fields(cls) if f.default is not MISSING
    }
    checked = [name for name in cli.RECIPE_OPTIONS if name in defaults]
    assert len(checked) >= 25
    for name in checked:
        assert options[name].default == defaults[name], name


def test_every_prune_option_says_the_recipe_field_help():
    """The options are made from the fields (``spec.setting``): each option's help is its field's."""
    command = typer.main.get_command(cli.app).commands["prune"]
    helps = {p.name: p.help for p in command.params}
    for cls in (PruneRecipe, EvalSettings):
        for f in fields(cls):
            if f.name != "eval" and f.init:
                assert helps[f.name] == f.metadata["help"], f.name


def test_the_api_and_the_command_line_share_every_default():
    """``ghostlayers prune`` (the recipe), ``ghostlayers.prune`` (``settings.Settings``), ``apply_plan`` and
    ``choices.FitSettings`` default every shared setting alike (alpha was "auto" on the command line and 1.0
    in the API)."""
    from ghostlayers.config.settings import Settings
    from ghostlayers.repair.choices import FitSettings
    from ghostlayers.repair.pipeline import apply_plan

    recipe = {f.name: f.default for f in fields(PruneRecipe)}
    settings = {f.name: f.default for f in fields(Settings) if not f.name.startswith("_")}
    fit = {f.name: f.default for f in fields(FitSettings)}
    plan_api = {n: p.default for n, p in inspect.signature(apply_plan).parameters.items() if p.default is not p.empty}
    options = inspect.signature(cli.prune).parameters
    shared = ("method", "ridge", "ridge_mode", "alpha", "fit", "select_range")
    for name in shared:
        assert settings[name] == recipe[name] == options[name].default, name
        for api in (fit, plan_api):
            if name in api:
                assert api[name] == recipe[name], name
    assert recipe["alpha"] == "auto" and plan_api["alpha"] == "auto" and fit["alpha"] == "auto"


def test_prune_by_default_chooses_alpha_on_held_out_windows_as_the_command_line(model_folder, tmp_path):
    """With held-out windows, the API's default α is the guard's choice over its grid, as the CLI's; without
    them it is the full fit (``settings.alpha_rule``)."""
    from conftest import random_batches, tiny_model

    import ghostlayers
    from ghostlayers.repair.guard import ALPHA_GRID

    heldout = {"a": random_batches(num=1, seed=7)[0], "b": random_batches(num=1, seed=8)[0]}
    guarded = ghostlayers.prune(
        tiny_model("llama"), random_batches(num=3), layers="2:4", heldout=heldout, progress=False
    )
    assert set(map(float, guarded.guard.perplexity)) == set(ALPHA_GRID)
    assert guarded.alpha in ALPHA_GRID
    plain = ghostlayers.prune(tiny_model("llama"), random_batches(num=3), layers="2:4", progress=False)
    assert plain.alpha == 1.0 and plain.guard is None
    out = tmp_path / "report"
    args = ["prune", "--model", str(model_folder), "--calibration", str(model_folder.parent / "calib.txt"),
            "--num-samples", "6", "--seq-len", "32", "--batch-size", "3", "--layers", "2:4",
            "--report-dir", str(out)]  # fmt: skip
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    report = json.loads((out / "report.json").read_text())
    assert set(map(float, report["guard"]["perplexity"])) == set(ALPHA_GRID)


def test_each_check_of_the_settings_runs_once_per_command_line_run(model_folder, tmp_path, monkeypatch):
    """The recipe checks the data's needs when made and the model's once it is loaded; ``pipeline.prune``,
    which checks for API callers, does not check the same settings again."""
    from ghostlayers.config import settings
    from ghostlayers.repair import checks

    counts = {"data": 0, "model": 0}
    real_data, real_model = settings.Settings._check_data, checks._check_model

    def data(self, *args):
        counts["data"] += 1
        return real_data(self, *args)

    def model(*args):
        counts["model"] += 1
        return real_model(*args)

    monkeypatch.setattr(settings.Settings, "_check_data", data)
    monkeypatch.setattr(checks, "_check_model", model)
    args = ["prune", "--model", str(model_folder), "--calibration", str(model_folder.parent / "calib.txt"),
            "--num-samples", "6", "--seq-len", "32", "--batch-size", "3", "--select", "streamline",
            "--num-layers", "2", "--output", str(tmp_path / "out")]  # fmt: skip
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert counts == {"data": 1, "model": 1}
