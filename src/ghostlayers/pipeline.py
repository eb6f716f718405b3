"""``prune``: selection, calibration, fitting and surgery in one call — the API behind the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers import operators, selection
from ghostlayers.adapters import adapter_for, decoder_layers
from ghostlayers.calibration import Calibration, calibrate, pair_stats_bytes
from ghostlayers.errors import GhostLayersError
from ghostlayers.surgery import apply_pruning

DEFAULT_MEMORY_BUDGET = 2 * 2**30  # bytes of candidate statistics for single-pass block selection


@dataclass
class Boundary:
    """One removed run ``pre..post-1`` and how well each method maps ``X_pre`` onto ``X_post``."""

    pre: int
    post: int
    fit_quality: dict[str, float]


@dataclass
class PruneResult:
    model: PreTrainedModel
    removed: list[int]
    method: str
    boundaries: list[Boundary]
    calibration: Calibration
    params_before: int
    params_after: int
    passes: int


def count_parameters(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def prune(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    method: str = "ghost",
    ridge: float = operators.DEFAULT_RIDGE,
    record: dict | None = None,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = True,
) -> PruneResult:
    """Remove layers from ``model`` in place and repair each removed run with ``method``.

    Give either ``layers`` (original indices, or a ``"12:18"`` / ``"3,7,9"`` string) or ``select``
    (a criterion of ``selection.CRITERIA``) with ``num_layers``. ``batches`` are token-id tensors.
    Contiguous criteria gather every candidate block's statistics in the same single pass when they fit
    in ``memory_budget`` bytes; ``shortgpt`` needs a second, truncated pass (its runs are unknown before).
    """
    adapter = adapter_for(model)
    total = len(decoder_layers(model))
    if method not in operators.METHODS:
        raise GhostLayersError(f"Unknown recovery method '{method}'. Choose one of: {', '.join(operators.METHODS)}.")
    if method == "replaceme" and adapter.down_proj is None:
        raise GhostLayersError(
            f"replaceme is not available for {model.config.model_type}: its MLP output is normalized before the "
            "residual add, so no map can be folded into the down-projection. Use --method ghost."
        )
    if (layers is None) == (select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if not batches:
        raise GhostLayersError("No calibration batches were given.")
    with_replaceme = adapter.down_proj is not None
    calib = dict(stats_dtype=stats_dtype, progress=progress)
    params_before = count_parameters(model)
    passes = 1

    if layers is not None:
        removed = (
            selection.parse_layers(layers, total)
            if isinstance(layers, str)
            else selection.validate_layers(list(layers), total)
        )
        pairs = selection.runs(removed)
        _check_replaceme_blocks(method, pairs)
        cal = calibrate(model, batches, pairs, replaceme=with_replaceme, **calib)
    else:
        if num_layers is None:
            raise GhostLayersError(f"--select {select} needs --num-layers N (how many layers to remove).")
        selection.validate_count(num_layers, total)
        if select not in selection.CRITERIA:
            raise GhostLayersError(
                f"Unknown selection criterion '{select}'. Choose one of: {', '.join(selection.CRITERIA)}."
            )
        candidates = [(i, i + num_layers) for i in range(total - num_layers + 1)]
        one_pass = (
            select in selection.CONTIGUOUS
            and pair_stats_bytes(model.config.hidden_size, len(candidates), method == "replaceme") <= memory_budget
        )
        if one_pass:
            cal = calibrate(model, batches, candidates, depth=total, replaceme=method == "replaceme", **calib)
            removed = selection.select(select, cal.similarity, num_layers, total)
            pairs = selection.runs(removed)
            cal.pairs = {pair: cal.pairs[pair] for pair in pairs}
        else:
            sim = calibrate(model, batches, depth=total, **calib).similarity
            removed = selection.select(select, sim, num_layers, total)
            pairs = selection.runs(removed)
            _check_replaceme_blocks(method, pairs)
            cal = calibrate(model, batches, pairs, similarity=False, replaceme=with_replaceme, **calib)
            cal.similarity = sim
            passes = 2
    _check_replaceme_blocks(method, pairs)

    fitted = {pair: operators.fit(method, cal.pairs[pair], ridge) for pair in pairs}
    boundaries = [Boundary(pre, post, operators.fit_quality(cal.pairs[(pre, post)], ridge)) for pre, post in pairs]
    record = {**(record or {}), "ridge": ridge, "selection": select or "manual"}
    apply_pruning(model, removed, method, fitted, record)
    return PruneResult(
        model=model,
        removed=removed,
        method=method,
        boundaries=boundaries,
        calibration=cal,
        params_before=params_before,
        params_after=count_parameters(model),
        passes=passes,
    )


def _check_replaceme_blocks(method: str, pairs: list[tuple[int, int]]) -> None:
    if method == "replaceme" and pairs[0][0] == 0:
        raise GhostLayersError(
            "replaceme rewrites the MLP of the layer before the removed block, but the block starts at layer 0. "
            "Keep layer 0 or use --method ghost."
        )
