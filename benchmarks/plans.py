"""Calibration plans kept on disk between runs of the benchmark scripts.

A plan of the 1.5B model takes 10–30 minutes of calibration on 2 cores; a resumed script whose remaining
cells need a plan it already made reads it back instead (``torch.save`` of the ``Plan``, under
``$GHOSTLAYERS_CACHE/plans``). The name must say everything the plan depends on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import ghostlayers
from ghostlayers.sources.fetch import ghostlayers_cache_dir


def cached_plan(name: str, make: Callable[[], ghostlayers.Plan]) -> ghostlayers.Plan:
    """The plan stored under ``name``, else ``make()``, stored before it is returned."""
    stored = ghostlayers_cache_dir() / "plans" / (name.replace("/", "of").replace(" ", "-") + ".pt")
    if stored.is_file():
        return torch.load(stored, weights_only=False)
    made = make()
    stored.parent.mkdir(parents=True, exist_ok=True)
    torch.save(made, stored.with_suffix(".partial"))
    stored.with_suffix(".partial").replace(stored)
    return made
