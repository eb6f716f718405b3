"""ghostlayers: remove decoder layers from a Hugging Face causal LM and repair them in closed form."""

from ghostlayers.calibration import Calibration, PairStats, calibrate
from ghostlayers.errors import GhostLayersError
from ghostlayers.operators import METHODS, fit, fit_quality
from ghostlayers.pipeline import Plan, PruneResult, apply_plan, plan, prune
from ghostlayers.saving import load, save
from ghostlayers.selection import CRITERIA

__version__ = "0.1.0"
__all__ = [
    "CRITERIA",
    "METHODS",
    "Calibration",
    "GhostLayersError",
    "PairStats",
    "Plan",
    "PruneResult",
    "calibrate",
    "apply_plan",
    "fit",
    "fit_quality",
    "load",
    "plan",
    "prune",
    "save",
]
