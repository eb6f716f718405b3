"""``prune``: selection, calibration, fitting and surgery in one call — the API behind the CLI.

``plan`` runs the calibration passes ``routing.choose_route`` gives; ``choices.resolve`` settles every
choice held-out loss makes; ``apply`` fits and cuts. ``apply_plan`` is the last two, ``prune`` all three.
``applied`` is ``apply_plan`` undone on leaving its block: the one way a comparison (a sweep, a benchmark, a
user's script) makes each of its variants on the one model it loaded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.calibration import routing, selection
from ghostlayers.calibration.memory import size_text, stats_budget
from ghostlayers.calibration.offload import calibrate_layerwise
from ghostlayers.calibration.passes import calibrate, down_projection_widths
from ghostlayers.calibration.routing import Plan
from ghostlayers.calibration.sequential import sequential_stats
from ghostlayers.config.settings import (
    DEFAULT_ALPHA,
    DEFAULT_BATCH_SIZE,
    DEFAULT_METHOD,
    DEFAULT_SELECT_RANGE,
    LEAVE_ONE_DOMAIN_OUT,
    Settings,
    alpha_rule,
    check_route,
)
from ghostlayers.errors import GhostLayersError
from ghostlayers.model.adapters import adapter_for, decoder_layers
from ghostlayers.model.checkpoint import Checkpoint, materialize
from ghostlayers.model.record import Heal, PruneRecord
from ghostlayers.model.surgery import apply_pruning, drop_operators, pruning_undone, record_pruning, scale_repair
from ghostlayers.numerics import fitting
from ghostlayers.numerics.finite import check_finite, check_token_ids
from ghostlayers.numerics.sums import Calibration, PairStats
from ghostlayers.registry.criteria import criterion
from ghostlayers.registry.methods import AFTER_SELECTION, SUMS
from ghostlayers.registry.methods import method as method_record
from ghostlayers.repair.checks import check_method, check_model
from ghostlayers.repair.choices import FitSettings, Resolved, leave_out, resolve
from ghostlayers.repair.guard import Guard, run_guard, shared_depth

__all__ = [
    "Boundary", "FitSettings", "Plan", "PruneResult", "apply", "apply_plan", "applied", "leave_out", "plan",
    "plan_depths", "prune",
]  # fmt: skip


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
    heal: Heal | None = None  # what --heal did after the closed form (``heal.heal_pruned``)


def count_parameters(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def plan(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    methods: Sequence[str] = (),
    replaceme: bool = False,
    holdout: bool = False,
    groups: Sequence[Hashable] | None = None,
    chained: bool = False,
    select_range: str = DEFAULT_SELECT_RANGE,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int | None = None,
    offload: Checkpoint | None = None,
    progress: bool = True,
) -> Plan:
    """Select the layers (``layers``: original indices or a ``"12:18"`` / ``"3,7,9"`` string; or
    ``select``, a criterion of ``criteria.CRITERIA``, with ``num_layers``, among the layers of
    ``select_range``) and calibrate, in the passes ``routing.choose_route`` gives. ``chained`` also gathers
    each removed layer's own pair ``(k, k+1)`` in the same pass, for ``apply_plan(..., chained=True)``.

    Candidate statistics must fit in ``memory_budget`` bytes (default: half of the device's free memory,
    ``memory.stats_budget``). The sums of ``methods`` (names, ``auto`` too) are gathered for every candidate
    block, or for the chosen runs only where a method's are gathered after selection (refit's ``I × I``);
    ReplaceMe's are gathered for the chosen runs wherever the architecture allows, and for candidate blocks
    only when asked (``methods=["replaceme"]``, or ``replaceme=True``: they double the candidates'
    memory). ``holdout`` keeps every other batch's sums apart for ``ridge="auto"``; ``groups`` (a label per
    batch, e.g. its domain) keeps each group's sums apart for leave-one-domain-out fits. With ``offload``
    (``model`` is that checkpoint's skeleton) every pass runs layer by layer with weights read from the
    files, and similarity is kept for the compared distances.
    """
    batches, request, shape = _request(
        model, batches, layers, select, num_layers, (*methods, "replaceme") if replaceme else tuple(methods),
        holdout, groups, chained, select_range, offload is not None,
    )  # fmt: skip
    device = torch.device(offload.device) if offload is not None else model.device
    budget, why = stats_budget(device, memory_budget)
    route = routing.choose_route(request, shape, budget, why)
    gather = dict(holdout=holdout, groups=groups, stats_dtype=stats_dtype, progress=progress)
    return _run_route(model, batches, route, request, offload, (budget, why), gather)


def plan_depths(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    depths: Sequence[int],
    *,
    select: str,
    methods: Sequence[str] = (),
    holdout: bool = False,
    groups: Sequence[Hashable] | None = None,
    chained: bool = False,
    select_range: str = DEFAULT_SELECT_RANGE,
    stats_dtype: torch.dtype = torch.float64,
    memory_budget: int | None = None,
    progress: bool = True,
) -> dict[int, Plan]:
    """A plan for each number of layers to remove in ``depths`` (the sweep's), each the layers and sums
    ``plan(select=select, num_layers=n, ...)`` gives, from fewer passes: one to the last layer for the
    similarity of every pair up to the deepest cut (each depth's layers are chosen from it), then passes
    truncated at the chosen runs, as many depths to a pass as ``memory_budget`` (as ``plan``'s) holds. A
    criterion that reads its candidate blocks' sums needs ``plan``'s routes: plan its depths one at a time."""
    if criterion(select).candidate_stats:
        raise GhostLayersError(f"--select {select} reads its candidate blocks' sums: plan each depth with plan().")
    batches, request, shape = _request(
        model, batches, None, select, max(depths), tuple(methods), holdout, groups, chained, select_range, False
    )
    for n in depths:
        routing.check_request(replace(request, num_remove=n), shape)
    budget = stats_budget(model.device, memory_budget)
    gather = dict(holdout=holdout, groups=groups, stats_dtype=stats_dtype, progress=progress)
    band = max(criterion(select).band(n) for n in depths)
    first = _calibrate_pass(model, batches, [], routing.Pass("none", band, True), shape.num_layers, None, gather)
    removed = {n: selection.select(select, first.similarity, n, shape.num_layers, None, select_range) for n in depths}
    runs = routing.Pass("runs", None, sums=routing.pass_sums(request, shape, runs=True))
    together = _depths_per_pass(removed, request, shape, runs.sums, budget[0])
    route = (
        f"{1 + len(together)} passes for {len(depths)} depths: similarity to the last layer, then the chosen runs"
        + (f" in {len(together)} passes ({size_text(budget[0])} budget, {budget[1]})" if len(together) > 1 else "")
    )
    plans = {}
    for group in together:
        pairs = functools.reduce(routing.union, (routing.needed_pairs(removed[n], chained) for n in group), [])
        check_late_memory(model, pairs, runs.sums, budget, stats_dtype, request)
        cal = _calibrate_pass(model, batches, pairs, runs, None, None, gather)
        cal.similarity = first.similarity
        for n in group:
            own = replace(cal, pairs=dict(cal.pairs), groups={g: dict(s) for g, s in cal.groups.items()})
            own.keep(routing.needed_pairs(removed[n], chained))
            plans[n] = Plan(removed[n], selection.runs(removed[n]), own, select, 1 + len(together), route,
                            select_range=select_range)  # fmt: skip
    return plans


def _depths_per_pass(
    removed: dict[int, list[int]], request: routing.Request, shape: routing.Shape, sums: Sequence[str], budget: int
) -> list[list[int]]:
    """The depths, in order, grouped so that each group's runs' sums fit ``budget`` bytes together (a depth whose
    runs alone do not fit is a group of its own, as ``plan``'s pass over one removal's runs)."""
    groups: list[list[int]] = []
    pairs: routing.Pairs = []
    for n, layers in removed.items():
        more = routing.union(pairs, routing.needed_pairs(layers, request.chained))
        need = routing.pair_stats_bytes(shape.hidden_size, len(more), sums, request.kept_apart)
        if groups and need <= budget:
            groups[-1].append(n)
            pairs = more
        else:
            groups.append([n])
            pairs = routing.needed_pairs(layers, request.chained)
    return groups


def _request(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    layers: str | list[int] | None,
    select: str | None,
    num_layers: int | None,
    methods: tuple[str, ...],
    holdout: bool,
    groups: Sequence[Hashable] | None,
    chained: bool,
    select_range: str,
    offloaded: bool,
) -> tuple[Sequence[Tensor], routing.Request, routing.Shape]:
    """The checked batches, what the plan must hold and the model's shape: every check a plan makes before its
    first pass (``plan`` and ``plan_depths``)."""
    batches = check_token_ids(model, batches)
    total = len(decoder_layers(model))
    for name in methods:
        check_route(name, select, offloaded)
    if holdout and len(batches) < 2:
        raise GhostLayersError(
            f"--ridge auto without held-out windows holds every other calibration batch out, but there is "
            f"{len(batches)} batch: give --heldout-windows 1 or more, use more --num-samples than --batch-size, "
            "or give a number for --ridge."
        )
    kept_apart = len(set(groups) - {None}) if groups is not None else int(holdout)
    manual = _manual_layers(layers, total)
    request = routing.Request(manual, select, num_layers, methods, chained, select_range, kept_apart)
    shape = routing.Shape(total, model.config.hidden_size, adapter_for(model).down_proj is not None)
    return batches, request, shape


def _run_route(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    route: routing.Route,
    request: routing.Request,
    offload: Checkpoint | None,
    budget: tuple[int, str],
    gather: dict,
) -> Plan:
    """Run the passes of ``route`` in order, each over the pairs it names not yet gathered (a pass with
    none is skipped), choosing the layers or the candidate removals where it says."""
    total, n, chosen_range = len(decoder_layers(model)), request.num_remove, request.select_range
    removed, options, cal, ran = request.layers, [], None, 0
    for step in route.passes:
        named = _pass_pairs(step.pairs, route, request, removed, options, cal)
        pairs = [p for p in named if cal is None or p not in cal.pairs]
        if cal is not None and not pairs:
            continue
        check_late_memory(model, pairs, step.sums, budget, gather["stats_dtype"], request)
        done = _calibrate_pass(model, batches, pairs, step, total if step.full_depth else None, offload, gather)
        ran += 1
        cal = done if cal is None else cal.merge(done)
        if step.then == "select":
            removed = selection.select(request.select, cal.similarity, n, total, cal.pairs or None, chosen_range)
        elif step.then == "options":
            options = selection.loss_candidates(cal.similarity, n, total, cal.pairs or None, select_range=chosen_range)
    route_text = f"{'single pass' if ran == 1 else 'two passes'}: {route.reason}".replace(
        "{candidates}", str(len(options))
    )
    if request.select is not None and criterion(request.select).by_loss:
        pairs = _pass_pairs("options", route, request, removed, options, cal)
        cal.keep(pairs)
        return Plan([], pairs, cal, request.select, ran, route_text, candidates=options)
    cal.keep(routing.needed_pairs(removed, request.chained))
    if request.select is None:
        return Plan(removed, selection.runs(removed), cal, "manual", ran, route_text)
    return Plan(removed, selection.runs(removed), cal, request.select, ran, route_text, select_range=chosen_range)


def _pass_pairs(
    source: str,
    route: routing.Route,
    request: routing.Request,
    removed: list[int] | None,
    options: list[list[int]],
    cal: Calibration | None,
) -> list[tuple[int, int]]:
    """The boundary pairs a pass names (``routing.PAIR_SOURCES``), from what earlier passes found."""
    if source == "runs":
        return routing.needed_pairs(removed, request.chained)
    if source == "candidates":
        return route.candidates
    if source == "candidates+singles":
        return routing.union(route.candidates, route.singles)
    if source == "shortlist+singles":
        total, n, chosen_range = cal.num_layers, request.num_remove, request.select_range
        return routing.union(
            selection.shortlist(request.select, cal.similarity, n, total, route.affordable, chosen_range), route.singles
        )
    if source == "options":
        return sorted({run for removal in options for run in selection.runs(removal)})
    return []


def _calibrate_pass(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    pairs: list[tuple[int, int]],
    step: routing.Pass,
    depth: int | None,
    offload: Checkpoint | None,
    gather: dict,
) -> Calibration:
    """One pass, in memory or layer by layer, its sums checked finite."""
    options = dict(depth=depth, similarity=step.band is not None, sums=step.sums, **gather)
    if offload is None:
        cal = calibrate(model, batches, pairs, band=step.band, **options)
    else:
        cal = calibrate_layerwise(model, offload, batches, pairs, band=step.band, **options)
    for stats in (*cal.pairs.values(), *(s for sums in cal.groups.values() for s in sums.values())):
        check_stats_finite(stats)
    return cal


def check_late_memory(
    model: PreTrainedModel,
    pairs: list[tuple[int, int]],
    sums: Sequence[str],
    budget: tuple[int, str],
    dtype: torch.dtype,
    request: routing.Request,
) -> None:
    """Refuse, before the pass, the sums gathered after selection (``methods.AFTER_SELECTION``: refit's, ``I × I``)
    that would not fit the statistics budget (bytes, and why), for all of the request's groups."""
    late = [SUMS[name] for name in sums if SUMS[name].scope == AFTER_SELECTION]
    if not late or not pairs:
        return
    budget, why = budget
    widths = list(down_projection_widths(model, pairs).values())
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [{"C": model.config.hidden_size, "I": w} for w in widths]
    need = sum(s.nbytes(size, item) for size in sizes for s in late) * (1 + request.kept_apart)
    if need > budget:
        names = ", ".join(s.label for s in late)
        who = " and ".join(m for m in request.methods if routing.late(m))
        raise GhostLayersError(
            f"{who}'s sums for {len(widths)} removed run(s) need {size_text(need)} ({names} each, I = "
            f"{max(widths)}), more than the statistics budget of {size_text(budget)} ({why}). Raise "
            "--stats-memory if the memory is there, or use --method replaceme (C × C sums)."
        )


def check_stats_finite(stats: PairStats) -> None:
    """Stop when a boundary's sums are not finite: the model's hidden states overflowed or were NaN."""
    check_finite(
        {SUMS[name].label: value for name, value in stats.sums.items()},
        f"Calibration statistics of the block {stats.pre}..{stats.post - 1}",
        "The model's hidden states overflowed or are NaN on the calibration text (float16 overflows easily): "
        "run with --dtype float32 or bfloat16, and check that the source model's weights are finite.",
    )


def apply(
    model: PreTrainedModel,
    resolved: Resolved,
    *,
    heldout: dict[str, Tensor] | None = None,
    record: dict | None = None,
    sequential_batches: Sequence[Tensor] | None = None,
) -> PruneResult:
    """Fit the resolved method for every run of the plan and prune ``model`` in place; then the guard, with
    ``heldout``, compares the repair with plain pruning (``guard.run_guard``, which also picks α where
    ``resolve`` left it to the held-out windows: ``ON_HELD_OUT``), and the repair is shrunk to ``I + α M``."""
    plan, settings = resolved.plan, resolved.settings
    method, alpha = settings.method, settings.alpha
    _check_resolved(model, resolved, heldout)
    params_before = count_parameters(model)
    fitted, boundaries = _fit_runs(model, resolved, sequential_batches)
    base, total = model.config.model_type, model.config.num_hidden_layers
    specs, unfolded = apply_pruning(model, plan.removed, method, fitted)
    guard = None
    repairs = method_record(method).repairs
    if heldout and repairs:
        with settings.sharing(shared_depth(plan.pairs)) as prefix:
            guard = run_guard(model, heldout, unfolded, alpha, settings.batch_size, settings.progress, prefix)
        alpha = guard.alpha
    alpha = float(alpha) if repairs else 1.0
    if alpha != 1.0:
        scale_repair(model, alpha, unfolded)
    if alpha == 0.0:
        specs = drop_operators(model, specs)
    verdict = guard.verdict() if guard is not None else None
    record_pruning(model, PruneRecord(base, total, sorted(plan.removed), method, specs, alpha, **resolved.recorded(),
                                      guard=verdict, provenance=record or {}))  # fmt: skip
    return PruneResult(
        model=model,
        removed=plan.removed,
        method=method,
        boundaries=boundaries,
        calibration=plan.calibration,
        params_before=params_before,
        params_after=count_parameters(model),
        passes=plan.passes,
        alpha=alpha,
        guard=guard,
        unfolded=unfolded,
        candidate_scores=plan.candidate_scores,
        stats_route=plan.route,
        method_scores=resolved.method_scores,
        ridge_scores=resolved.ridge_scores,
        alpha_scores=resolved.alpha_scores,
    )


def _check_resolved(model: PreTrainedModel, resolved: Resolved, heldout: dict[str, Tensor] | None) -> None:
    """The resolved settings against the model and what the plan gathered."""
    plan, settings = resolved.plan, resolved.settings
    method, ridge = settings.method, settings.ridge
    check_method(model, method, plan.removed, ridge)  # the one auto chose, on the layers selection chose
    chosen, stats = method_record(method), plan.calibration.pairs
    if any(not stats[p].has(chosen.sums) for p in plan.pairs):
        raise GhostLayersError(f"This plan has no {method} statistics: make it with plan(..., methods=['{method}']).")
    if not chosen.fold_ridge and ridge == "auto" and not heldout:
        raise GhostLayersError(f"ridge='auto' for {method} is chosen on held-out windows: pass heldout=.")
    if settings.fit == "chained" and any((k, k + 1) not in stats for pre, post in plan.pairs for k in range(pre, post)):
        raise GhostLayersError("This plan has no per-layer statistics: make it with plan(..., chained=True).")


def _fit_runs(
    model: PreTrainedModel, resolved: Resolved, sequential_batches: Sequence[Tensor] | None
) -> tuple[dict[tuple[int, int], Tensor], list[Boundary]]:
    """Each run's operator (dense, chained, or sequential: runs after the first fitted on the patched
    model's inputs, two truncated passes per extra run), checked finite, and each run's fit quality."""
    plan, settings, ridges = resolved.plan, resolved.settings, resolved.ridges
    method, mode, stats = settings.method, settings.ridge_mode, plan.calibration.pairs
    layers = {(pre, post): [stats.get((k, k + 1)) for k in range(pre, post)] for pre, post in plan.pairs}
    chained = settings.fit == "chained"
    if sequential_batches is not None and len(plan.pairs) > 1:
        first = stats[plan.pairs[0]]
        stats = sequential_stats(
            model, sequential_batches, plan.pairs, first, method, ridges, mode, progress=settings.progress
        )
    if chained:
        fitted = {p: fitting.chain(method, layers[p], ridges[p], mode) for p in plan.pairs}
    else:
        fitted = {p: fitting.fit(method, stats[p], ridges[p], mode) for p in plan.pairs}
    for (pre, post), w in fitted.items():
        check_finite(
            {"its matrix": w},
            f"The {method} operator of the removed block {pre}..{post - 1}",
            "The fit is ill-conditioned: raise --ridge (e.g. 1e-4) or calibrate on more tokens.",
        )
    quality = {p: fitting.fit_quality(stats[p], ridges[p], mode, layers[p] if chained else None) for p in plan.pairs}
    boundaries = [Boundary(pre, post, quality[(pre, post)], ridges[(pre, post)]) for pre, post in plan.pairs]
    return fitted, boundaries


def apply_plan(
    model: PreTrainedModel,
    plan: Plan,
    method: str = DEFAULT_METHOD,
    ridge: float | str = fitting.DEFAULT_RIDGE,
    record: dict | None = None,
    sequential_batches: Sequence[Tensor] | None = None,
    progress: bool = True,
    alpha: float | str = DEFAULT_ALPHA,
    heldout: dict[str, Tensor] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    ridge_mode: str = fitting.DEFAULT_RIDGE_MODE,
    chained: bool = False,
) -> PruneResult:
    """``choices.resolve`` then ``apply``: fit ``method`` for every run of ``plan`` and prune ``model`` in
    place. Held-out loss (``heldout``: token windows per domain, never used in the fit) settles the
    candidate removal of a ``select="loss"`` plan, ``method="auto"``, ``ridge="auto"`` (without ``heldout``:
    ``fitting.fold_ridge`` on a plan made with ``holdout=True``) and ``alpha="auto"`` (leaving one domain
    out at a time when the plan keeps each domain's sums, ``plan(..., groups=...)``), and the guard compares
    the repair with plain pruning. ``sequential_batches``: later runs are fitted on the patched model;
    ``chained``: each run's operator is the product of its layers' own (a plan made with ``chained=True``).
    One plan serves every method and α of a comparison: ``applied`` makes each on the one loaded model."""
    if chained and sequential_batches is not None:
        raise GhostLayersError("A fit is either chained or sequential: pass chained=True or sequential_batches.")
    fit = "chained" if chained else "sequential" if sequential_batches is not None else "dense"
    settings = FitSettings(method, ridge, ridge_mode, alpha, fit, batch_size, progress)
    return _resolved_and_applied(model, plan, settings, heldout, sequential_batches, record)


def _resolved_and_applied(
    model: PreTrainedModel,
    plan: Plan,
    settings: FitSettings,
    heldout: dict[str, Tensor] | None,
    sequential_batches: Sequence[Tensor] | None,
    record: dict | None,
) -> PruneResult:
    """``resolve`` then ``apply``, the token ids given checked against the model first."""
    if sequential_batches is not None:
        sequential_batches = check_token_ids(model, sequential_batches, "sequential_batches")
    if heldout:
        check_token_ids(model, heldout, "heldout")
    resolved = resolve(model, plan, settings, heldout)
    return apply(model, resolved, heldout=heldout, record=record, sequential_batches=sequential_batches)


@contextlib.contextmanager
def applied(
    model: PreTrainedModel,
    plan: Plan,
    settings: FitSettings | None = None,
    heldout: dict[str, Tensor] | None = None,
    sequential_batches: Sequence[Tensor] | None = None,
) -> Iterator[PruneResult]:
    """``model`` pruned and repaired as ``apply_plan`` does (``settings``: the method, ridge, α and fit; held-out
    windows settle every ``auto``, the guard included) for the block inside, then the dense model again, exactly
    (``surgery.pruning_undone``), a kept layer a heal merged into included. Every variant of a comparison is
    made here on the one loaded model, nothing copied: the sweep's cells, the benchmarks', a user's loop."""
    with pruning_undone(model, plan.pairs):
        result = _resolved_and_applied(model, plan, settings or FitSettings(), heldout, sequential_batches, None)
        try:
            yield result
        finally:
            if result.heal is not None:  # a merged LoRA changed kept layers: their weights before it
                scale_repair(model, 0.0, result.unfolded)


def prune(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    settings: Settings | None = None,
    *,
    heldout: dict[str, Tensor] | None = None,
    batch_domains: Sequence[str] | None = None,
    record: dict | None = None,
    offload: Checkpoint | None = None,
    memory_budget: int | None = None,
    stats_dtype: torch.dtype = torch.float64,
    progress: bool = True,
    **changes: Any,
) -> PruneResult:
    """Remove layers from ``model`` in place and repair each removed run as ``settings`` say (an
    ``options.Settings``; ``changes`` are its fields by name, so ``prune(model, batches, layers="2:4")``
    reads as ``Settings(layers="2:4")``): ``plan`` then ``apply_plan`` (see both for the rest).
    ``heldout`` (windows per calibration domain, not in ``batches``) lets held-out loss decide
    ``select="loss"``, ``method="auto"``, ``ridge="auto"`` and ``alpha="auto"``; with ``batch_domains``
    (each batch's domain, several domains) ``alpha="auto"`` is chosen leaving one domain out at a time.
    With ``offload``, ``model`` is ``Checkpoint.skeleton()``: calibration streams one layer at a time and only
    the layers that stay are then read."""
    if settings is None or changes:
        settings = Settings(**changes) if settings is None else replace(settings, **changes)
    batches = check_token_ids(model, batches)
    if heldout:
        check_token_ids(model, heldout, "heldout")
    heldout_windows = min((len(w) for w in heldout.values()), default=0) if heldout else 0
    settings.check_data(heldout_windows, offload is not None)
    check_model(model, settings, tokens=sum(b.numel() for b in batches))
    made = plan(
        model,
        batches,
        layers=settings.layers,
        select=settings.select,
        num_layers=settings.num_layers,
        select_range=settings.select_range,
        stats_dtype=stats_dtype,
        memory_budget=memory_budget,
        offload=offload,
        progress=progress,
        **gathering(settings, heldout, batch_domains),
    )
    if offload is not None:
        materialize(model, offload, made.removed)
    fit = FitSettings.of(settings, batch_size=max(len(b) for b in batches), progress=progress)
    resolved = resolve(model, made, fit, heldout)
    sequential = batches if settings.fit == "sequential" else None
    return apply(model, resolved, heldout=heldout, record=record, sequential_batches=sequential)


def gathering(
    settings: Settings, heldout: dict[str, Tensor] | None, batch_domains: Sequence[Hashable] | None
) -> dict[str, Any]:
    """What a plan must gather for ``settings``: the method's sums, every other batch's apart for
    ``ridge="auto"`` without held-out windows, each domain's apart where ``options.alpha_rule`` leaves α to
    leaving one domain out, and each removed layer's pair for a chained fit (``prune`` and ``sweep``)."""
    domains = len(set(batch_domains)) if batch_domains is not None else 0
    lodo = alpha_rule(settings.alpha, bool(heldout), domains) == LEAVE_ONE_DOMAIN_OUT
    return {
        "methods": (settings.method,),
        "holdout": settings.ridge == "auto" and not heldout,
        "groups": batch_domains if lodo else None,
        "chained": settings.fit == "chained",
    }


def _manual_layers(layers: str | list[int] | None, total: int) -> list[int] | None:
    if layers is None:
        return None
    return (
        selection.parse_layers(layers, total)
        if isinstance(layers, str)
        else selection.validate_layers(list(layers), total)
    )
