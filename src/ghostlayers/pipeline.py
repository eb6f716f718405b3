"""``prune``: selection, calibration, fitting and surgery in one call — the API behind the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers import operators, selection
from ghostlayers.adapters import adapter_for, decoder_layers
from ghostlayers.calibration import Calibration, PairStats, calibrate, pair_stats_bytes
from ghostlayers.checks import check_finite, check_settings
from ghostlayers.errors import GhostLayersError
from ghostlayers.guard import Guard, run_guard
from ghostlayers.memory import size_text, stats_budget
from ghostlayers.offload import Checkpoint, calibrate_layerwise, materialize
from ghostlayers.sequential import sequential_stats
from ghostlayers.surgery import apply_pruning, scale_repair


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
    alpha: float = 1.0
    guard: Guard | None = None  # held-out comparison with plain pruning, when held-out windows were given
    unfolded: dict[str, Tensor] = field(default_factory=dict)  # weights ReplaceMe replaced (scale_repair)
    stats_route: str = ""  # how many calibration passes, and why (Plan.route)


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
    route: str  # the passes taken and why, for the report


def plan(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    replaceme: bool = False,
    holdout: bool = False,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int | None = None,
    offload: Checkpoint | None = None,
    progress: bool = True,
) -> Plan:
    """Select the layers (``layers``: original indices or a ``"12:18"`` / ``"3,7,9"`` string; or
    ``select``, a criterion of ``selection.CRITERIA``, with ``num_layers``) and calibrate.

    Contiguous criteria gather every candidate block's statistics in the same single pass when they fit
    in ``memory_budget`` bytes (default: half of the device's free memory, ``memory.stats_budget``);
    ``shortgpt`` needs a second, truncated pass (its runs are unknown before).
    ReplaceMe statistics are gathered wherever the architecture allows, for candidate blocks only with
    ``replaceme`` (they double the candidates' memory). ``holdout`` keeps every other batch's sums apart
    for ``ridge="auto"``. With ``offload`` (``model`` is that checkpoint's skeleton) every pass runs
    layer by layer with weights read from the files, and similarity is kept for the compared distances.
    """
    total = len(decoder_layers(model))
    if (layers is None) == (select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if not batches:
        raise GhostLayersError("No calibration batches were given.")
    with_replaceme = adapter_for(model).down_proj is not None
    calib = dict(holdout=holdout, stats_dtype=stats_dtype, progress=progress)

    def calibrate_pass(pairs: list[tuple[int, int]], band: int, **options) -> Calibration:
        if offload is None:
            cal = calibrate(model, batches, pairs, band=band, **options)
        else:
            cal = calibrate_layerwise(model, offload, batches, pairs, band=band, **options)
        for stats in (*cal.pairs.values(), *cal.holdout.values()):
            check_stats_finite(stats)
        return cal

    if layers is not None:
        removed = _manual_layers(layers, total)
        pairs = selection.runs(removed)
        cal = calibrate_pass(pairs, max(b - a for a, b in pairs), replaceme=with_replaceme, **calib)
        return Plan(removed, pairs, cal, "manual", 1, "single pass: the layers to remove were given")
    if num_layers is None:
        raise GhostLayersError(f"--select {select} needs --num-layers N (how many layers to remove).")
    selection.validate_count(num_layers, total)
    if select not in selection.CRITERIA:
        raise GhostLayersError(
            f"Unknown selection criterion '{select}'. Choose one of: {', '.join(selection.CRITERIA)}."
        )
    candidates = selection.candidate_pairs(select, num_layers, total)
    replaceme = replaceme and with_replaceme
    budget, why = stats_budget(torch.device(offload.device) if offload is not None else model.device, memory_budget)
    affordable = budget // pair_stats_bytes(model.config.hidden_size, 1, replaceme, holdout)
    need = pair_stats_bytes(model.config.hidden_size, len(candidates), replaceme, holdout)
    blocks = f"{len(candidates)} candidate blocks need {size_text(need)}"
    if candidates and len(candidates) <= affordable:
        cal = calibrate_pass(candidates, num_layers, depth=total, replaceme=replaceme, **calib)
        removed = selection.select(select, cal.similarity, num_layers, total, cal.pairs)
        pairs = selection.runs(removed)
        _keep_pairs(cal, pairs)
        return Plan(removed, pairs, cal, select, 1, f"single pass: {blocks} of the {size_text(budget)} budget ({why})")
    similarity = calibrate_pass([], num_layers, depth=total, stats_dtype=stats_dtype, progress=progress).similarity
    if select in selection.RECOVERY_AWARE:  # too many candidates to hold: score the most similar ones
        shortlist = selection.shortlist(select, similarity, num_layers, total, affordable)
        cal = calibrate_pass(shortlist, num_layers, similarity=False, replaceme=replaceme, **calib)
        removed = selection.select(select, similarity, num_layers, total, cal.pairs)
        _keep_pairs(cal, selection.runs(removed))
    else:
        removed = selection.select(select, similarity, num_layers, total)
        cal = calibrate_pass(selection.runs(removed), num_layers, similarity=False, replaceme=with_replaceme, **calib)
    cal.similarity = similarity
    if candidates:
        route = f"two passes: {blocks}, over the {size_text(budget)} budget ({why})"
    else:
        route = f"two passes: {select} knows its runs only after selection"
    return Plan(removed, selection.runs(removed), cal, select, 2, route)


def check_stats_finite(stats: PairStats) -> None:
    """Stop when a boundary's sums are not finite: the model's hidden states overflowed or were NaN."""
    check_finite(
        {"XᵀX": stats.xtx, "XᵀY": stats.xty, "|X| sums": stats.abs_x, "|Y| sums": stats.abs_y, "ZᵀZ": stats.ztz},
        f"Calibration statistics of the block {stats.pre}..{stats.post - 1}",
        "The model's hidden states overflowed or are NaN on the calibration text (float16 overflows easily): "
        "run with --dtype float32 or bfloat16, and check that the source model's weights are finite.",
    )


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
    alpha: float | str = 1.0,
    heldout: dict[str, Tensor] | None = None,
    batch_size: int = 4,
) -> PruneResult:
    """Fit ``method`` for every run of ``plan`` and prune ``model`` in place. ``ridge="auto"`` picks each
    boundary's ridge on held-out batches (the plan must be made with ``holdout=True``). With
    ``sequential_batches``, runs after the first are fitted on the patched model's inputs
    (``sequential.sequential_stats``: two truncated passes per extra run). Every repair is then shrunk to
    ``I + alpha·M`` (``surgery.scale_repair``). With ``heldout`` (token windows per domain, never used in
    the fit) the guard compares the repaired model with plain pruning on them (``guard.run_guard``), and
    ``alpha="auto"`` keeps the α with the lowest held-out loss among those that hurt no domain."""
    check_settings(model, layers=plan.removed, method=method, ridge=ridge, alpha=alpha)
    if alpha == "auto" and not heldout and method != "none":
        raise GhostLayersError("alpha='auto' is chosen on held-out windows: pass heldout= (the CLI draws them).")
    stats = plan.calibration.pairs
    if method == "replaceme" and any(stats[p].ztz is None for p in plan.pairs):
        raise GhostLayersError("This plan has no replaceme statistics: make it with plan(..., replaceme=True).")
    params_before = count_parameters(model)
    if ridge == "auto":
        if not plan.calibration.holdout:
            raise GhostLayersError("ridge='auto' needs held-out statistics: make the plan with holdout=True.")
        ridges = {p: operators.auto_ridge(stats[p], plan.calibration.holdout[p])[0] for p in plan.pairs}
    else:
        ridges = dict.fromkeys(plan.pairs, float(ridge))
    if sequential_batches is not None and len(plan.pairs) > 1:
        stats = sequential_stats(
            model, sequential_batches, plan.pairs, stats[plan.pairs[0]], method, ridges, progress=progress
        )
    fitted = {pair: operators.fit(method, stats[pair], ridges[pair]) for pair in plan.pairs}
    for (pre, post), w in fitted.items():
        check_finite(
            {"its matrix": w},
            f"The {method} operator of the removed block {pre}..{post - 1}",
            "The fit is ill-conditioned: raise --ridge (e.g. 1e-4) or calibrate on more tokens.",
        )
    boundaries = [
        Boundary(pre, post, operators.fit_quality(stats[(pre, post)], ridges[(pre, post)]), ridges[(pre, post)])
        for pre, post in plan.pairs
    ]
    record = {**(record or {}), "ridge": ridge, "selection": plan.selection}
    record["fit"] = "sequential" if sequential_batches is not None else "dense"
    if ridge == "auto":
        record["chosen_ridges"] = [ridges[p] for p in plan.pairs]
    unfolded = apply_pruning(model, plan.removed, method, fitted, record)
    guard = None
    if heldout and method != "none":
        guard = run_guard(model, heldout, unfolded, alpha, batch_size, progress)
        alpha = guard.alpha
    alpha = 1.0 if method == "none" else alpha
    if alpha != 1.0:
        scale_repair(model, float(alpha), unfolded)
    model.config.ghostlayers["alpha"] = float(alpha)
    return PruneResult(
        model=model,
        removed=plan.removed,
        method=method,
        boundaries=boundaries,
        calibration=plan.calibration,
        params_before=params_before,
        params_after=count_parameters(model),
        passes=plan.passes,
        alpha=float(alpha),
        guard=guard,
        unfolded=unfolded,
        stats_route=plan.route,
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
    record: dict | None = None,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int | None = None,
    fit: str = "dense",
    offload: Checkpoint | None = None,
    progress: bool = True,
    alpha: float | str = 1.0,
    heldout: dict[str, Tensor] | None = None,
) -> PruneResult:
    """Remove layers from ``model`` in place and repair each removed run with ``method``: ``plan`` then
    ``apply_plan`` (see both for the arguments). ``fit="sequential"`` fits later runs on the patched model.
    With ``offload``, ``model`` is ``offload.skeleton()``: calibration streams one layer at a time and only
    the layers that stay are then read."""
    check_settings(
        model,
        layers=layers,
        select=select,
        num_layers=num_layers,
        method=method,
        ridge=ridge,
        alpha=alpha,
        fit=fit,
        num_batches=len(batches),
        tokens=sum(b.numel() for b in batches),
        offload=offload is not None,
    )
    made = plan(
        model,
        batches,
        layers=layers,
        select=select,
        num_layers=num_layers,
        replaceme=method == "replaceme",
        holdout=ridge == "auto",
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
        alpha=alpha,
        heldout=heldout,
        batch_size=max(len(b) for b in batches),
    )


def _manual_layers(layers: str | list[int] | None, total: int) -> list[int] | None:
    if layers is None:
        return None
    return (
        selection.parse_layers(layers, total)
        if isinstance(layers, str)
        else selection.validate_layers(list(layers), total)
    )
