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
from ghostlayers.offload import Checkpoint, calibrate_layerwise, materialize
from ghostlayers.sequential import sequential_stats
from ghostlayers.surgery import apply_pruning

DEFAULT_MEMORY_BUDGET = 2 * 2**30  # bytes of candidate statistics for single-pass block selection
FITS = ("dense", "sequential", "chained")


@dataclass
class Boundary:
    """One removed run ``pre..post-1`` and how well each method maps ``X_pre`` onto ``X_post``."""

    pre: int
    post: int
    fit_quality: dict[str, float]
    ridge: float


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


@dataclass
class Plan:
    """Which layers go and the calibration statistics of each removed run; any method can be fitted from
    it, so one calibration serves a comparison of methods (apply each to a fresh copy of the model)."""

    removed: list[int]
    pairs: list[tuple[int, int]]
    calibration: Calibration
    selection: str
    passes: int
    select_range: str | None = None  # None for manual layers


def plan(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    replaceme: bool = False,
    holdout: bool = False,
    chained: bool = False,
    select_range: str = selection.DEFAULT_SELECT_RANGE,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    offload: Checkpoint | None = None,
    progress: bool = True,
) -> Plan:
    """Select the layers (``layers``: original indices or a ``"12:18"`` / ``"3,7,9"`` string; or
    ``select``, a criterion of ``selection.CRITERIA``, with ``num_layers``, among the layers of
    ``select_range``) and calibrate. ``chained`` also gathers each removed layer's own pair ``(k, k+1)``
    in the same pass, for ``apply_plan(..., chained=True)``.

    Contiguous criteria gather every candidate block's statistics in the same single pass when they fit
    in ``memory_budget`` bytes; ``shortgpt`` needs a second, truncated pass (its runs are unknown before).
    ReplaceMe statistics are gathered wherever the architecture allows, for candidate blocks only with
    ``replaceme`` (they double the candidates' memory). ``holdout`` keeps every other batch's sums apart
    for ``ridge="auto"``. With ``offload`` (``model`` is that checkpoint's skeleton) every pass runs
    layer by layer with weights read from the files, and similarity is kept for the compared distances.
    """
    adapter = adapter_for(model)
    total = len(decoder_layers(model))
    if (layers is None) == (select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if not batches:
        raise GhostLayersError("No calibration batches were given.")
    with_replaceme = adapter.down_proj is not None
    calib = dict(holdout=holdout, stats_dtype=stats_dtype, progress=progress)

    def calibrate_pass(pairs: list[tuple[int, int]], band: int, **options) -> Calibration:
        if offload is None:
            return calibrate(model, batches, pairs, band=band, **options)
        return calibrate_layerwise(model, offload, batches, pairs, band=band, **options)

    if layers is not None:
        removed = _manual_layers(layers, total)
        pairs = selection.runs(removed)
        cal = calibrate_pass(
            _needed_pairs(removed, chained), max(b - a for a, b in pairs), replaceme=with_replaceme, **calib
        )
        return Plan(removed, pairs, cal, "manual", 1)
    if num_layers is None:
        raise GhostLayersError(f"--select {select} needs --num-layers N (how many layers to remove).")
    selection.validate_count(num_layers, total, select_range)
    if select not in selection.CRITERIA:
        raise GhostLayersError(
            f"Unknown selection criterion '{select}'. Choose one of: {', '.join(selection.CRITERIA)}."
        )
    candidates = selection.candidate_pairs(select, num_layers, total, select_range)
    singles = selection.runs_within(1, total, select_range) if chained else []  # any layer may be chosen
    replaceme = replaceme and with_replaceme
    affordable = memory_budget // pair_stats_bytes(model.config.hidden_size, 1, replaceme, holdout)
    if candidates and len(_union(candidates, singles)) <= affordable:
        cal = calibrate_pass(_union(candidates, singles), num_layers, depth=total, replaceme=replaceme, **calib)
        removed = selection.select(select, cal.similarity, num_layers, total, cal.pairs, select_range)
        _keep_pairs(cal, _needed_pairs(removed, chained))
        return Plan(removed, selection.runs(removed), cal, select, 1, select_range)
    similarity = calibrate_pass([], num_layers, depth=total, stats_dtype=stats_dtype, progress=progress).similarity
    if select in selection.RECOVERY_AWARE:  # too many candidates to hold: score the most similar ones
        shortlist = selection.shortlist(select, similarity, num_layers, total, affordable, select_range)
        cal = calibrate_pass(_union(shortlist, singles), num_layers, similarity=False, replaceme=replaceme, **calib)
        removed = selection.select(select, similarity, num_layers, total, cal.pairs, select_range)
        _keep_pairs(cal, _needed_pairs(removed, chained))
    else:
        removed = selection.select(select, similarity, num_layers, total, select_range=select_range)
        cal = calibrate_pass(
            _needed_pairs(removed, chained), num_layers, similarity=False, replaceme=with_replaceme, **calib
        )
    cal.similarity = similarity
    return Plan(removed, selection.runs(removed), cal, select, 2, select_range)


def _needed_pairs(removed: list[int], chained: bool) -> list[tuple[int, int]]:
    """The runs of ``removed`` and, for a chained fit, each removed layer's own pair ``(k, k+1)``."""
    return _union(selection.runs(removed), [(k, k + 1) for k in removed] if chained else [])


def _union(pairs: list[tuple[int, int]], more: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return pairs + [pair for pair in more if pair not in pairs]


def _keep_pairs(cal: Calibration, pairs: list[tuple[int, int]]) -> None:
    """Drop the candidate statistics that were not selected."""
    cal.pairs = {pair: cal.pairs[pair] for pair in pairs}
    cal.holdout = {pair: cal.holdout[pair] for pair in pairs if pair in cal.holdout}


def apply_plan(
    model: PreTrainedModel,
    plan: Plan,
    method: str = "ghost",
    ridge: float | str = operators.DEFAULT_RIDGE,
    record: dict | None = None,
    sequential_batches: Sequence[Tensor] | None = None,
    progress: bool = True,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    chained: bool = False,
) -> PruneResult:
    """Fit ``method`` for every run of ``plan`` and prune ``model`` in place. ``ridge="auto"`` picks each
    boundary's ridge on held-out batches (the plan must be made with ``holdout=True``); ``ridge_mode``
    reads the ridge as relative to ``tr(XᵀX)/C`` or absolute. With ``sequential_batches``, runs after the
    first are fitted on the patched model's inputs (``sequential.sequential_stats``: two truncated passes
    per extra run); ``chained`` makes each run's operator the product of its layers' own operators (the
    plan must be made with ``chained=True``)."""
    if chained and sequential_batches is not None:
        raise GhostLayersError("A fit is either chained or sequential: pass chained=True or sequential_batches.")
    fit = "chained" if chained else "sequential" if sequential_batches is not None else "dense"
    check_fit(model, method, fit, ridge, ridge_mode, plan.removed)
    stats = plan.calibration.pairs
    if method == "replaceme" and any(stats[p].ztz is None for p in plan.pairs):
        raise GhostLayersError("This plan has no replaceme statistics: make it with plan(..., replaceme=True).")
    layers = {(pre, post): [stats.get((k, k + 1)) for k in range(pre, post)] for pre, post in plan.pairs}
    if chained and any(s is None for run in layers.values() for s in run):
        raise GhostLayersError("This plan has no per-layer statistics: make it with plan(..., chained=True).")
    params_before = count_parameters(model)
    if ridge == "auto":
        if not plan.calibration.holdout:
            raise GhostLayersError("ridge='auto' needs held-out statistics: make the plan with holdout=True.")
        holdout = plan.calibration.holdout
        ridges = {p: operators.auto_ridge(stats[p], holdout[p], ridge_mode=ridge_mode)[0] for p in plan.pairs}
    else:
        ridges = dict.fromkeys(plan.pairs, float(ridge))
    if sequential_batches is not None and len(plan.pairs) > 1:
        stats = sequential_stats(
            model, sequential_batches, plan.pairs, stats[plan.pairs[0]], method, ridges, ridge_mode, progress=progress
        )
    if chained:
        fitted = {p: operators.chain(method, layers[p], ridges[p], ridge_mode) for p in plan.pairs}
    else:
        fitted = {p: operators.fit(method, stats[p], ridges[p], ridge_mode) for p in plan.pairs}
    boundaries = [
        Boundary(
            pre,
            post,
            operators.fit_quality(
                stats[(pre, post)], ridges[(pre, post)], ridge_mode, layers[(pre, post)] if chained else None
            ),
            ridges[(pre, post)],
        )
        for pre, post in plan.pairs
    ]
    record = {**(record or {}), "ridge": ridge, "ridge_mode": ridge_mode, "selection": plan.selection, "fit": fit}
    record["select_range"] = plan.select_range
    if ridge == "auto":
        record["chosen_ridges"] = [ridges[p] for p in plan.pairs]
    apply_pruning(model, plan.removed, method, fitted, record)
    return PruneResult(
        model=model,
        removed=plan.removed,
        method=method,
        boundaries=boundaries,
        calibration=plan.calibration,
        params_before=params_before,
        params_after=count_parameters(model),
        passes=plan.passes,
    )


def check_fit(
    model: PreTrainedModel,
    method: str,
    fit: str,
    ridge: float | str,
    ridge_mode: str,
    removed: list[int] | None = None,
    offload: Checkpoint | None = None,
) -> None:
    """Fail before any work for a method, fit or ridge that cannot apply: one check for ``prune`` (before
    calibrating) and ``apply_plan``."""
    check_method(model, method, removed)
    operators.check_ridge_mode(ridge_mode)
    if fit not in FITS:
        raise GhostLayersError(
            f"Unknown --fit '{fit}': use 'dense' (one operator per removed run), 'sequential' (later runs fit "
            "on the patched model) or 'chained' (one operator per removed layer, multiplied, as published)."
        )
    if offload is not None and fit == "sequential":
        raise GhostLayersError("--fit sequential runs the whole dense model per batch: use it without --offload.")
    if fit == "chained":
        operators.check_chainable(method)
        if ridge == "auto":
            raise GhostLayersError(
                "--ridge auto chooses one ridge per removed run, not per layer: give --fit chained a number "
                "(e.g. --ridge 1e-6)."
            )


def check_method(model: PreTrainedModel, method: str, removed: list[int] | None = None) -> None:
    """Fail before any work for an unknown method, or replaceme where it cannot apply."""
    if method not in operators.METHODS:
        raise GhostLayersError(f"Unknown recovery method '{method}'. Choose one of: {', '.join(operators.METHODS)}.")
    if method == "replaceme" and adapter_for(model).down_proj is None:
        raise GhostLayersError(
            f"replaceme is not available for {model.config.model_type}: its MLP output is normalized before the "
            "residual add, so no map can be folded into the down-projection. Use --method ghost."
        )
    if method == "replaceme" and removed and min(removed) == 0:
        raise GhostLayersError(
            "replaceme rewrites the MLP of the layer before the removed block, but the block starts at layer 0. "
            "Keep layer 0 or use --method ghost."
        )


def prune(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    method: str = "ghost",
    ridge: float | str = operators.DEFAULT_RIDGE,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    record: dict | None = None,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    fit: str = "dense",
    select_range: str = selection.DEFAULT_SELECT_RANGE,
    offload: Checkpoint | None = None,
    progress: bool = True,
) -> PruneResult:
    """Remove layers from ``model`` in place and repair each removed run with ``method``: ``plan`` then
    ``apply_plan`` (see both for the arguments). ``fit``: ``dense`` (one operator per run, fitted on the
    dense model), ``sequential`` (later runs fitted on the patched model) or ``chained`` (one operator per
    removed layer, multiplied over each run, as the published Ghosted Layers code). With ``offload``,
    ``model`` is ``offload.skeleton()``: calibration streams one layer at a time and only the layers that
    stay are then read."""
    removed = _manual_layers(layers, model.config.num_hidden_layers)
    check_fit(model, method, fit, ridge, ridge_mode, removed, offload)
    selection.check_select_range(select_range)
    made = plan(
        model,
        batches,
        layers=layers,
        select=select,
        num_layers=num_layers,
        replaceme=method == "replaceme",
        holdout=ridge == "auto",
        chained=fit == "chained",
        select_range=select_range,
        stats_dtype=stats_dtype,
        memory_budget=memory_budget,
        offload=offload,
        progress=progress,
    )
    if offload is not None:
        materialize(model, offload, made.removed)
    return apply_plan(
        model,
        made,
        method,
        ridge,
        record,
        sequential_batches=batches if fit == "sequential" else None,
        progress=progress,
        ridge_mode=ridge_mode,
        chained=fit == "chained",
    )


def _manual_layers(layers: str | list[int] | None, total: int) -> list[int] | None:
    if layers is None:
        return None
    return (
        selection.parse_layers(layers, total)
        if isinstance(layers, str)
        else selection.validate_layers(list(layers), total)
    )
