"""One source of settings: every default of ``ghostlayers prune`` is the recipe's own (``spec.PruneRecipe``
and ``spec.EvalSettings``), so the command line and the API cannot drift apart."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields

import typer

from ghostlayers import cli
from ghostlayers.spec import EvalSettings, PruneRecipe


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
            if f.name != "eval":
                assert helps[f.name] == f.metadata["help"], f.name
