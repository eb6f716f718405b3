"""ghostlayers: remove decoder layers from a Hugging Face causal LM and repair them in closed form."""

from ghostlayers.calibration import Calibration, PairStats, calibrate
from ghostlayers.errors import GhostLayersError
from ghostlayers.operators import METHODS, fit, fit_quality
from ghostlayers.pipeline import Plan, PruneResult, apply_plan, leave_out, plan, prune
from ghostlayers.recipe import EvalRecipe, PruneRecipe, evaluate, run
from ghostlayers.saving import load, save
from ghostlayers.selection import CRITERIA

__version__ = "0.1.0"
__all__ = [
    "CRITERIA",
    "EvalRecipe",
    "METHODS",
    "Calibration",
    "GhostLayersError",
    "PairStats",
    "Plan",
    "PruneRecipe",
    "PruneResult",
    "calibrate",
    "apply_plan",
    "evaluate",
    "fit",
    "fit_quality",
    "leave_out",
    "load",
    "plan",
    "prune",
    "run",
    "save",
]
