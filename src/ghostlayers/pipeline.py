"""``prune``: selection, calibration, fitting and surgery in one call — the API behind the CLI."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers import operators, selection
from ghostlayers.adapters import adapter_for, decoder_layers
from ghostlayers.calibration import calibrate, down_projection_widths
from ghostlayers.checks import check_finite, check_settings
from ghostlayers.errors import GhostLayersError
from ghostlayers.guard import (
    ALPHA_GRID,
    Guard,
    best_safe,
    domain_perplexity,
    mean_log,
    prefix_states,
    run_guard,
    shared_depth,
)
from ghostlayers.memory import size_text, stats_budget
from ghostlayers.methods import REGISTRY
from ghostlayers.methods import method as method_record
from ghostlayers.offload import Checkpoint, calibrate_layerwise, materialize
from ghostlayers.options import RECOVERY_AWARE, check_route
from ghostlayers.sequential import sequential_stats
from ghostlayers.stats import HELD_OUT, Calibration, PairStats, pair_stats_bytes
from ghostlayers.surgery import apply_pruning, drop_operators, patched_view, scale_repair


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
    method_scores: dict[str, dict[str, float]] | None = None  # method="auto": held-out perplexity of each
    candidate_scores: dict[str, dict[str, float]] | None = None  # select="loss": held-out perplexity of each
    ridge_scores: dict[str, dict[str, float]] | None = None  # ridge="auto": held-out perplexity at each ridge
    alpha_scores: dict[str, dict[str, float]] | None = None  # alpha="auto", several domains: left-out perplexity
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
    route: str = ""  # the passes taken and why, for the report
    candidates: list[list[int]] = field(default_factory=list)  # select="loss": removals to score
    candidate_scores: dict[str, dict[str, float]] | None = None  # held-out perplexity of each, once scored
    select_range: str | None = None  # None for manual layers


def plan(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    replaceme: bool = False,
    refit: bool = False,
    holdout: bool = False,
    groups: Sequence[Hashable] | None = None,
    chained: bool = False,
    select_range: str = selection.DEFAULT_SELECT_RANGE,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int | None = None,
    offload: Checkpoint | None = None,
    progress: bool = True,
) -> Plan:
    """Select the layers (``layers``: original indices or a ``"12:18"`` / ``"3,7,9"`` string; or
    ``select``, a criterion of ``selection.CRITERIA``, with ``num_layers``, among the layers of
    ``select_range``) and calibrate. ``chained`` also gathers each removed layer's own pair ``(k, k+1)``
    in the same pass, for ``apply_plan(..., chained=True)``.

    Contiguous criteria gather every candidate block's statistics in the same single pass when they fit
    in ``memory_budget`` bytes (default: half of the device's free memory, ``memory.stats_budget``);
    ``shortgpt`` needs a second, truncated pass (its runs are unknown before).
    ReplaceMe statistics are gathered wherever the architecture allows, for candidate blocks only with
    ``replaceme`` (they double the candidates' memory). ``refit`` gathers the statistics of the last kept
    layers' down-projection inputs (``I × I`` each) for the removed runs only: the layers are selected
    first (criteria that need no statistics), then a second, truncated pass gathers them. ``holdout`` keeps
    every other batch's sums apart for ``ridge="auto"``; ``groups`` (a label per batch, e.g. its domain)
    keeps each group's sums apart for leave-one-domain-out fits. With ``offload`` (``model`` is that
    checkpoint's skeleton) every pass runs layer by layer with weights read from the files, and similarity
    is kept for the compared distances.
    """
    total = len(decoder_layers(model))
    if (layers is None) == (select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if not batches:
        raise GhostLayersError("No calibration batches were given.")
    with_replaceme = adapter_for(model).down_proj is not None
    if refit:
        check_route("refit", select, offload is not None)
    calib = dict(holdout=holdout, groups=groups, stats_dtype=stats_dtype, progress=progress)
    kept_apart = len(set(groups) - {None}) if groups is not None else int(holdout)

    def calibrate_pass(pairs: list[tuple[int, int]], band: int, refit: bool = False, **options) -> Calibration:
        if offload is None:
            cal = calibrate(model, batches, pairs, band=band, refit=refit, **options)
        else:
            cal = calibrate_layerwise(model, offload, batches, pairs, band=band, **options)
        for stats in (*cal.pairs.values(), *(s for sums in cal.groups.values() for s in sums.values())):
            check_stats_finite(stats)
        return cal

    device = torch.device(offload.device) if offload is not None else model.device

    def check_refit_memory(pairs: list[tuple[int, int]]) -> None:
        """Refuse, before the pass, refit sums that would not fit the statistics budget."""
        widths = list(down_projection_widths(model, pairs).values())
        item = torch.empty((), dtype=stats_dtype).element_size()
        need = sum(w * (w + model.config.hidden_size) for w in widths) * item * (1 + kept_apart)
        budget, why = stats_budget(device, memory_budget)
        if need > budget:
            raise GhostLayersError(
                f"refit's sums for {len(widths)} removed run(s) need {size_text(need)} (I × I each, I = "
                f"{max(widths)}), more than the statistics budget of {size_text(budget)} ({why}). Raise "
                "--stats-memory if the memory is there, or use --method replaceme (C × C sums)."
            )

    if layers is not None:
        removed = _manual_layers(layers, total)
        pairs = selection.runs(removed)
        if refit:
            check_refit_memory(pairs)
        cal = calibrate_pass(
            _needed_pairs(removed, chained),
            max(b - a for a, b in pairs),
            replaceme=with_replaceme,
            refit=refit,
            **calib,
        )
        return Plan(removed, pairs, cal, "manual", 1, "single pass: the layers to remove were given")
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
    singles = selection.runs_within(1, total, select_range) if chained else []  # any layer may be chosen
    budget, why = stats_budget(device, memory_budget)
    affordable = budget // pair_stats_bytes(model.config.hidden_size, 1, replaceme, kept_apart)
    need = pair_stats_bytes(model.config.hidden_size, len(candidates), replaceme, kept_apart)
    blocks = f"{len(candidates)} candidate blocks need {size_text(need)}"
    if select == "loss":
        held = len(candidates) <= affordable
        cal = calibrate_pass(candidates if held else [], num_layers, depth=total, replaceme=replaceme, **calib)
        options = selection.loss_candidates(
            cal.similarity, num_layers, total, cal.pairs if held else None, select_range=select_range
        )
        pairs = sorted({run for removal in options for run in selection.runs(removal)})
        if missing := [p for p in pairs if p not in cal.pairs]:
            extra = calibrate_pass(missing, num_layers, similarity=False, replaceme=replaceme, **calib)
            cal.pairs.update(extra.pairs)
            for group, sums in extra.groups.items():
                cal.groups.setdefault(group, {}).update(sums)
        cal.keep(pairs)
        route = f"{'two passes' if missing else 'single pass'}: {len(options)} candidate removals"
        return Plan([], pairs, cal, select, 2 if missing else 1, route, candidates=options)
    if candidates and len(_union(candidates, singles)) <= affordable and not refit:
        cal = calibrate_pass(_union(candidates, singles), num_layers, depth=total, replaceme=replaceme, **calib)
        removed = selection.select(select, cal.similarity, num_layers, total, cal.pairs, select_range)
        cal.keep(_needed_pairs(removed, chained))
        route = f"single pass: {blocks} of the {size_text(budget)} budget ({why})"
        return Plan(removed, selection.runs(removed), cal, select, 1, route, select_range=select_range)
    similarity = calibrate_pass([], num_layers, depth=total, stats_dtype=stats_dtype, progress=progress).similarity
    if select in RECOVERY_AWARE:  # too many candidates to hold: score the most similar ones
        shortlist = selection.shortlist(select, similarity, num_layers, total, affordable, select_range)
        cal = calibrate_pass(_union(shortlist, singles), num_layers, similarity=False, replaceme=replaceme, **calib)
        removed = selection.select(select, similarity, num_layers, total, cal.pairs, select_range)
        cal.keep(_needed_pairs(removed, chained))
    else:
        removed = selection.select(select, similarity, num_layers, total, select_range=select_range)
        if refit:
            check_refit_memory(selection.runs(removed))
        cal = calibrate_pass(
            _needed_pairs(removed, chained),
            num_layers,
            similarity=False,
            replaceme=with_replaceme,
            refit=refit,
            **calib,
        )
    cal.similarity = similarity
    if refit:
        route = "two passes: refit's statistics are gathered for the selected layers only"
    elif candidates:
        route = f"two passes: {blocks}, over the {size_text(budget)} budget ({why})"
    else:
        route = f"two passes: {select} knows its runs only after selection"
    return Plan(removed, selection.runs(removed), cal, select, 2, route, select_range=select_range)


def _needed_pairs(removed: list[int], chained: bool) -> list[tuple[int, int]]:
    """The runs of ``removed`` and, for a chained fit, each removed layer's own pair ``(k, k+1)``."""
    return _union(selection.runs(removed), [(k, k + 1) for k in removed] if chained else [])


def _union(pairs: list[tuple[int, int]], more: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return pairs + [pair for pair in more if pair not in pairs]


def check_stats_finite(stats: PairStats) -> None:
    """Stop when a boundary's sums are not finite: the model's hidden states overflowed or were NaN."""
    check_finite(
        {"XᵀX": stats.xtx, "XᵀY": stats.xty, "LinearPatch ratios": stats.ratio, "ZᵀZ": stats.ztz, "AᵀA": stats.ata},
        f"Calibration statistics of the block {stats.pre}..{stats.post - 1}",
        "The model's hidden states overflowed or are NaN on the calibration text (float16 overflows easily): "
        "run with --dtype float32 or bfloat16, and check that the source model's weights are finite.",
    )


def boundary_ridges(
    plan: Plan, ridge: float | str, ridge_mode: str = operators.DEFAULT_RIDGE_MODE
) -> dict[tuple[int, int], float]:
    """Each removed run's ridge: ``ridge``, or for ``"auto"`` the one of lowest held-out residual."""
    if ridge != "auto":
        return dict.fromkeys(plan.pairs, float(ridge))
    if not plan.calibration.holdout:
        raise GhostLayersError("ridge='auto' needs held-out statistics: make the plan with holdout=True.")
    stats, holdout = plan.calibration.pairs, plan.calibration.holdout
    return {p: operators.fold_ridge(stats[p], holdout[p], ridge_mode=ridge_mode)[0] for p in plan.pairs}


def held_out_scores(
    model: PreTrainedModel,
    fits: dict[str, tuple[str, dict[tuple[int, int], Tensor]]],
    heldout: dict[str, Tensor],
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of each labelled fit (a method and its operator per removed run), each
    run on the dense ``model`` through ``surgery.patched_view``: no copy, and the model is left as it was."""
    prefix = prefix_states(model, heldout, shared_depth(p for _, fitted in fits.values() for p in fitted), batch_size)
    scores = {}
    for label, (method, fitted) in fits.items():
        with patched_view(model, fitted, method):
            scores[label] = domain_perplexity(model, heldout, batch_size, progress, label, prefix)
    return scores


def choose_candidate(
    model: PreTrainedModel,
    plan: Plan,
    heldout: dict[str, Tensor],
    method: str = "ghost",
    ridge: float = operators.DEFAULT_RIDGE,
    batch_size: int = 4,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    progress: bool = True,
) -> Plan:
    """The plan of the candidate removal (``select="loss"``) whose ``method``-repaired model has the lowest
    mean log-perplexity over the held-out windows of every domain, each candidate fitted from the same
    statistics. All scores are kept."""
    stats = plan.calibration.pairs
    fits = {
        selection.describe(removal): (
            method,
            {p: operators.fit(method, stats[p], ridge, ridge_mode) for p in selection.runs(removal)},
        )
        for removal in plan.candidates
    }
    scores = held_out_scores(model, fits, heldout, batch_size, progress)
    chosen = min(plan.candidates, key=lambda r: mean_log(scores[selection.describe(r)]))
    cal = copy.copy(plan.calibration)
    cal.keep(selection.runs(chosen))
    return Plan(chosen, selection.runs(chosen), cal, plan.selection, plan.passes, plan.route, plan.candidates, scores)


def score_methods(
    model: PreTrainedModel,
    plan: Plan,
    heldout: dict[str, Tensor],
    ridge: float = operators.DEFAULT_RIDGE,
    batch_size: int = 4,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of every method the plan's statistics allow (``none``: plain
    pruning), each fitted from the same statistics."""
    stats = plan.calibration.pairs
    fits = {
        name: (name, {p: operators.fit(name, stats[p], ridge, ridge_mode) for p in plan.pairs})
        for name, record in REGISTRY.items()
        if all(stats[p].has(record.sums) for p in plan.pairs)
    }
    return held_out_scores(model, fits, heldout, batch_size, progress)


LOSS_RIDGE_GRID = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1)


def score_ridges(
    model: PreTrainedModel,
    plan: Plan,
    heldout: dict[str, Tensor],
    method: str = "ghost",
    batch_size: int = 4,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of ``method`` fitted at each relative ridge of ``LOSS_RIDGE_GRID``."""
    stats = plan.calibration.pairs
    fits = {
        f"{r:g}": (method, {p: operators.fit(method, stats[p], r, ridge_mode) for p in plan.pairs})
        for r in LOSS_RIDGE_GRID
    }
    return held_out_scores(model, fits, heldout, batch_size, progress)


def leave_out(plan: Plan, domain: Hashable) -> Plan:
    """The plan as if ``domain``'s calibration batches had never been drawn: every sum less that domain's
    (kept apart by ``plan(..., groups=...)``), the domain's group dropped. So one calibration over several
    domains gives every leave-one-domain-out fit; the similarity, which still counts the domain, is dropped."""
    groups = plan.calibration.groups
    if domain not in groups or HELD_OUT in groups:
        raise GhostLayersError(
            f"Cannot leave '{domain}' out: the plan keeps apart the sums of {sorted(map(str, groups)) or 'no group'}."
            " Make it with plan(..., groups=<the domain of each batch>) and without holdout."
        )
    kept = groups[domain]
    calibration = Calibration(
        num_layers=plan.calibration.num_layers,
        depth=plan.calibration.depth,
        pairs={p: stats.without(kept[p]) for p, stats in plan.calibration.pairs.items() if p in kept},
        groups={g: sums for g, sums in groups.items() if g != domain},
    )
    return replace(plan, calibration=calibration)


def leave_one_domain_out_alpha(
    model: PreTrainedModel,
    plan: Plan,
    heldout: dict[str, Tensor],
    method: str = "ghost",
    ridge: float = operators.DEFAULT_RIDGE,
    batch_size: int = 4,
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    progress: bool = True,
) -> tuple[float, dict[str, dict[str, float]]]:
    """α for a calibration of several domains (the plan's ``groups``, one per domain): for each domain,
    the repair is fitted without it (total sums less that domain's) and scored, shrunk to each α of
    ``guard.ALPHA_GRID``, on its held-out windows, so α is chosen on text the fit never saw, as the user's
    own text will be. Returns the α ``best_safe`` keeps (worse than plain pruning on no left-out domain)
    and the table of scores, ``{α: {domain: perplexity}}``."""
    without: dict[str, dict[tuple[int, int], Tensor]] = {}
    for domain in heldout:
        stats = leave_out(plan, domain).calibration.pairs
        without[domain] = {p: operators.fit(method, stats[p], ridge, ridge_mode) for p in plan.pairs}
    scores: dict[str, dict[str, float]] = {f"{alpha:g}": {} for alpha in ALPHA_GRID}
    for domain, fitted in without.items():  # every α rescales the one fit: the guard's scoring, per domain
        with patched_view(model, fitted, method) as unfolded:
            guard = run_guard(
                model, {domain: heldout[domain]}, unfolded, "auto", batch_size, progress, shared_depth(fitted)
            )
        for alpha, score in guard.perplexity.items():
            scores[f"{alpha:g}"] |= score
    return float(best_safe(scores, "0")), scores


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
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE,
    chained: bool = False,
) -> PruneResult:
    """Fit ``method`` for every run of ``plan`` and prune ``model`` in place. ``ridge="auto"`` picks each
    boundary's ridge on held-out batches (the plan must be made with ``holdout=True``); ``ridge_mode``
    reads the ridge as relative to ``tr(XᵀX)/C`` or absolute. With ``sequential_batches``, runs after the
    first are fitted on the patched model's inputs (``sequential.sequential_stats``: two truncated passes
    per extra run); ``chained`` makes each run's operator the product of its layers' own operators (the
    plan must be made with ``chained=True``). Every repair is then shrunk to ``I + alpha·M``
    (``surgery.scale_repair``). With ``heldout`` (token windows per domain, never used in the fit) the guard
    compares the repaired model with plain pruning on them (``guard.run_guard``), and ``alpha="auto"`` keeps
    the α with the lowest held-out loss among those that hurt no domain.

    Held-out loss first makes the choices the arguments leave open: the candidate removal of a plan made
    with ``select="loss"``, ``method="auto"``, ``ridge="auto"`` (ghost, replaceme), and ``alpha="auto"``
    leaving one domain out at a time when the plan keeps each domain's sums (``plan(..., groups=...)``).
    So one plan serves every method and α of a comparison, each applied to a fresh copy of the model."""
    base_ridge = operators.DEFAULT_RIDGE if ridge == "auto" else float(ridge)
    if plan.candidates and not plan.removed:
        if not heldout:
            raise GhostLayersError("This plan holds candidate removals, scored on held-out windows: pass heldout=.")
        scored = "ghost" if method == "auto" else method
        plan = choose_candidate(model, plan, heldout, scored, base_ridge, batch_size, ridge_mode, progress)
    method_scores = ridge_scores = alpha_scores = None
    if method == "auto":
        if not heldout:
            raise GhostLayersError("method='auto' is chosen on held-out windows: pass heldout= (the CLI draws them).")
        method_scores = score_methods(model, plan, heldout, base_ridge, batch_size, ridge_mode, progress)
        method = best_safe(method_scores, "none")
    if ridge == "auto" and heldout:
        if method_record(method).least_squares:
            ridge_scores = score_ridges(model, plan, heldout, method, batch_size, ridge_mode, progress)
        ridge = float(min(ridge_scores, key=lambda r: mean_log(ridge_scores[r]))) if ridge_scores else base_ridge
    domains = [g for g in plan.calibration.groups if g != HELD_OUT]
    if alpha == "auto" and heldout and len(domains) > 1 and method != "none":
        alpha, alpha_scores = leave_one_domain_out_alpha(
            model, plan, heldout, method, ridge, batch_size, ridge_mode, progress
        )
    if chained and sequential_batches is not None:
        raise GhostLayersError("A fit is either chained or sequential: pass chained=True or sequential_batches.")
    fit = "chained" if chained else "sequential" if sequential_batches is not None else "dense"
    check_settings(model, layers=plan.removed, method=method, ridge=ridge, alpha=alpha, fit=fit, ridge_mode=ridge_mode)
    if alpha == "auto" and not heldout and method != "none":
        raise GhostLayersError("alpha='auto' is chosen on held-out windows: pass heldout= (the CLI draws them).")
    stats = plan.calibration.pairs
    chosen = method_record(method)
    if any(not stats[p].has(chosen.sums) for p in plan.pairs):
        raise GhostLayersError(f"This plan has no {method} statistics: make it with plan(..., {method}=True).")
    if not chosen.fold_ridge and ridge == "auto" and not heldout:
        raise GhostLayersError(f"ridge='auto' for {method} is chosen on held-out windows: pass heldout=.")
    layers = {(pre, post): [stats.get((k, k + 1)) for k in range(pre, post)] for pre, post in plan.pairs}
    if chained and any(s is None for run in layers.values() for s in run):
        raise GhostLayersError("This plan has no per-layer statistics: make it with plan(..., chained=True).")
    params_before = count_parameters(model)
    ridges = boundary_ridges(plan, ridge, ridge_mode)
    if sequential_batches is not None and len(plan.pairs) > 1:
        stats = sequential_stats(
            model, sequential_batches, plan.pairs, stats[plan.pairs[0]], method, ridges, ridge_mode, progress=progress
        )
    if chained:
        fitted = {p: operators.chain(method, layers[p], ridges[p], ridge_mode) for p in plan.pairs}
    else:
        fitted = {p: operators.fit(method, stats[p], ridges[p], ridge_mode) for p in plan.pairs}
    for (pre, post), w in fitted.items():
        check_finite(
            {"its matrix": w},
            f"The {method} operator of the removed block {pre}..{post - 1}",
            "The fit is ill-conditioned: raise --ridge (e.g. 1e-4) or calibrate on more tokens.",
        )
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
    unfolded = apply_pruning(model, plan.removed, method, fitted, record)
    guard = None
    if heldout and method != "none":
        guard = run_guard(model, heldout, unfolded, alpha, batch_size, progress, shared_depth(plan.pairs))
        alpha = guard.alpha
    alpha = 1.0 if method == "none" else alpha
    if alpha != 1.0:
        scale_repair(model, float(alpha), unfolded)
    if alpha == 0.0:
        drop_operators(model)
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
        candidate_scores=plan.candidate_scores,
        stats_route=plan.route,
        method_scores=method_scores,
        ridge_scores=ridge_scores,
        alpha_scores=alpha_scores,
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
    memory_budget: int | None = None,
    fit: str = "dense",
    select_range: str = selection.DEFAULT_SELECT_RANGE,
    offload: Checkpoint | None = None,
    progress: bool = True,
    alpha: float | str = 1.0,
    heldout: dict[str, Tensor] | None = None,
    batch_domains: Sequence[str] | None = None,
) -> PruneResult:
    """Remove layers from ``model`` in place and repair each removed run with ``method``: ``plan`` then
    ``apply_plan`` (see both for the arguments). ``fit="sequential"`` fits later runs on the patched model.
    ``heldout`` (windows per calibration domain, not in ``batches``) lets held-out loss decide
    ``select="loss"``, ``method="auto"``, ``ridge="auto"`` and ``alpha="auto"``; with ``batch_domains``
    (each batch's domain, several domains) ``alpha="auto"`` is chosen leaving one domain out at a time.
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
        ridge_mode=ridge_mode,
        select_range=select_range,
        num_batches=len(batches),
        tokens=sum(b.numel() for b in batches),
        heldout_windows=min((len(w) for w in heldout.values()), default=0) if heldout else 0,
        offload=offload is not None,
    )
    lodo = alpha == "auto" and bool(heldout) and batch_domains is not None and len(set(batch_domains)) > 1
    made = plan(
        model,
        batches,
        layers=layers,
        select=select,
        num_layers=num_layers,
        replaceme=method in ("replaceme", "auto"),
        refit=method == "refit",
        holdout=ridge == "auto" and not heldout,
        groups=batch_domains if lodo else None,
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
        alpha=alpha,
        heldout=heldout,
        batch_size=max(len(b) for b in batches),
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
