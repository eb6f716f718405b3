"""ghostlayers: remove decoder layers from a Hugging Face causal LM and repair them in closed form.

The API is imported on first use (module ``__getattr__``), so that ``import ghostlayers.cli`` (and with it
``ghostlayers --help``) does not pay for torch and transformers."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_HOMES = {
    "calibration.passes": ("calibrate",),
    "config.recipes": ("EvalRecipe", "PruneRecipe"),
    "config.settings": ("CRITERIA", "Settings"),
    "errors": ("GhostLayersError",),
    "jobs.runs": ("evaluate", "run"),
    "numerics.fitting": ("fit", "fit_quality"),
    "numerics.sums": ("Calibration", "PairStats"),
    "registry.methods": ("METHODS", "Method"),
    "repair.pipeline": (
        "FitSettings",
        "Plan",
        "PruneResult",
        "apply_plan",
        "applied",
        "leave_out",
        "plan",
        "plan_depths",
        "prune",
    ),
    "store.saving": ("load", "save"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> object:
    if name not in _HOME:
        raise AttributeError(f"module 'ghostlayers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ghostlayers.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
