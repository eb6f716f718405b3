"""Every choice held-out loss makes, apart from surgery: ``resolve(model, plan, settings, heldout)`` settles
the candidate removal (``select="loss"``), ``method="auto"``, ``ridge="auto"`` and, with several calibration
domains, ``alpha="auto"``, each repair scored on the dense model through ``surgery.patched_view`` (no copy).
``pipeline.apply`` then only fits and cuts. With one domain, ``alpha="auto"`` is the guard's, measured on
the pruned model itself (``guard.run_guard``).

The two ridge rules: ``loss_ridge`` (held-out perplexity over ``LOSS_RIDGE_GRID``, with held-out windows)
and ``fitting.fold_ridge`` (two-fold residual over ``fitting.RIDGE_GRID``, without them).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.calibration import selection
from ghostlayers.calibration.routing import Plan
from ghostlayers.config.settings import (
    DEFAULT_ALPHA,
    DEFAULT_BATCH_SIZE,
    DEFAULT_FIT,
    DEFAULT_METHOD,
    LEAVE_ONE_DOMAIN_OUT,
    ON_HELD_OUT,
    Settings,
    alpha_rule,
)
from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.model.surgery import patched_view
from ghostlayers.numerics import fitting
from ghostlayers.numerics.sums import HELD_OUT, Calibration
from ghostlayers.registry.methods import AUTO, DEFAULT_RIDGE, DEFAULT_RIDGE_MODE, PLAIN_PRUNING, REGISTRY
from ghostlayers.registry.methods import method as method_record
from ghostlayers.repair.guard import (
    ALPHA_GRID,
    best_safe,
    domain_perplexity,
    largest_safe,
    mean_log,
    run_guard,
    shared_depth,
)


@dataclass(frozen=True)
class FitSettings:
    """How a plan's runs are repaired: ``method``, ``ridge`` (relative, or absolute with ``ridge_mode``),
    ``alpha`` (share of the repair kept), ``fit`` (dense, sequential or chained), and the held-out scoring's
    ``batch_size``. ``"auto"`` leaves ``method``, ``ridge`` or ``alpha`` to held-out loss."""

    method: str = DEFAULT_METHOD
    ridge: float | str = DEFAULT_RIDGE
    ridge_mode: str = DEFAULT_RIDGE_MODE
    alpha: float | str = DEFAULT_ALPHA
    fit: str = DEFAULT_FIT
    batch_size: int = DEFAULT_BATCH_SIZE
    progress: bool = True
    prefix: SharedPrefix | None = field(default=None, compare=False, repr=False)
    """The dense layers before the cut, run once for every scoring at it (``prefix.SharedPrefix``: a sweep
    shares one per depth); None: each scoring makes its own."""

    def sharing(self, depth: int) -> contextlib.AbstractContextManager[SharedPrefix]:
        """``prefix`` when it serves layer ``depth``, else one of this scoring's own."""
        if self.prefix is not None and self.prefix.depth <= depth:
            return contextlib.nullcontext(self.prefix)
        return SharedPrefix(depth)

    @classmethod
    def of(cls, settings: Settings, batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True) -> FitSettings:
        """The fitting part of a run's ``config.settings.Settings``, with how held-out windows are scored."""
        fields = ("method", "ridge", "ridge_mode", "alpha", "fit")
        return cls(**{name: getattr(settings, name) for name in fields}, batch_size=batch_size, progress=progress)


@dataclass
class Resolved:
    """The choices ``resolve`` made: the plan with its removal, the settings with the method, ridge (as
    chosen by loss, or ``"auto"``: ``fitting.fold_ridge`` per run) and α (``ON_HELD_OUT``: left to the guard)
    settled, each run's ridge, and the held-out scores behind each choice."""

    plan: Plan
    settings: FitSettings
    ridges: dict[tuple[int, int], float]
    method_scores: dict[str, dict[str, float]] | None = None
    ridge_scores: dict[str, dict[str, float]] | None = None
    alpha_scores: dict[str, dict[str, float]] | None = None

    def recorded(self) -> dict:
        """How the repair was fitted, as the pruned model's record (``PruneRecord``) keeps it."""
        settings, plan = self.settings, self.plan
        auto = settings.ridge == "auto"
        return {
            "ridge": settings.ridge,
            "ridge_mode": settings.ridge_mode,
            "chosen_ridges": [self.ridges[p] for p in plan.pairs] if auto else None,
            "fit": settings.fit,
            "selection": plan.selection,
            "select_range": plan.select_range,
        }


def resolve(model: PreTrainedModel, plan: Plan, settings: FitSettings, heldout: dict[str, Tensor] | None) -> Resolved:
    """Settle every ``"auto"`` of ``settings`` (and a ``select="loss"`` plan's candidate) by held-out loss."""
    base_ridge = DEFAULT_RIDGE if settings.ridge == "auto" else float(settings.ridge)
    scoring = replace(settings, ridge=base_ridge)
    if plan.candidates and not plan.removed:
        if not heldout:
            raise GhostLayersError("This plan holds candidate removals, scored on held-out windows: pass heldout=.")
        plan = choose_candidate(model, plan, heldout, replace(scoring, method=_scored(settings.method)))
    method, method_scores = settings.method, None
    if method == AUTO:
        if not heldout:
            raise GhostLayersError("method='auto' is chosen on held-out windows: pass heldout= (the CLI draws them).")
        method_scores = score_methods(model, plan, heldout, scoring)
        method = best_safe(method_scores, PLAIN_PRUNING)
    ridge, ridge_scores = settings.ridge, None
    if ridge == "auto" and heldout:
        ridge, ridge_scores = loss_ridge(model, plan, heldout, replace(scoring, method=method))
    domains = [g for g in plan.calibration.groups if g != HELD_OUT]
    alpha, alpha_scores = alpha_rule(settings.alpha, bool(heldout), len(domains)), None
    if alpha == LEAVE_ONE_DOMAIN_OUT and method_record(method).repairs:
        alpha, alpha_scores = leave_one_domain_out_alpha(
            model, plan, heldout, replace(scoring, method=method, ridge=ridge)
        )
    elif alpha == LEAVE_ONE_DOMAIN_OUT:
        alpha = 1.0  # nothing to shrink
    chosen = replace(settings, method=method, ridge=ridge, alpha=alpha)
    ridges = boundary_ridges(plan, ridge, settings.ridge_mode)
    return Resolved(plan, chosen, ridges, method_scores, ridge_scores, alpha_scores)


def _scored(method: str) -> str:
    """The method candidates are scored with: ghost stands in for one still to be chosen."""
    return "ghost" if method == AUTO else method


def boundary_ridges(
    plan: Plan, ridge: float | str, ridge_mode: str = DEFAULT_RIDGE_MODE
) -> dict[tuple[int, int], float]:
    """Each removed run's ridge: ``ridge``, or for ``"auto"`` without held-out windows ``fitting.fold_ridge``."""
    if ridge != "auto":
        return dict.fromkeys(plan.pairs, float(ridge))
    if not plan.calibration.holdout:
        raise GhostLayersError("ridge='auto' needs held-out statistics: make the plan with holdout=True.")
    stats, holdout = plan.calibration.pairs, plan.calibration.holdout
    return {p: fitting.fold_ridge(stats[p], holdout[p], ridge_mode=ridge_mode)[0] for p in plan.pairs}


def _fits(plan: Plan, settings: FitSettings, pairs: list[tuple[int, int]] | None = None) -> dict:
    """``settings.method``'s operator for each of ``pairs`` (default: the plan's runs), fitted from its sums."""
    stats = plan.calibration.pairs
    fit = fitting.fit
    return {p: fit(settings.method, stats[p], settings.ridge, settings.ridge_mode) for p in pairs or plan.pairs}


def held_out_scores(
    model: PreTrainedModel,
    fits: dict[str, tuple[str, dict[tuple[int, int], Tensor]]],
    heldout: dict[str, Tensor],
    settings: FitSettings,
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of each labelled fit (a method and its operator per removed run), each
    run on the dense ``model`` through ``surgery.patched_view``: no copy, and the model is left as it was."""
    scores = {}
    with settings.sharing(shared_depth(p for _, fitted in fits.values() for p in fitted)) as prefix:
        for label, (method, fitted) in fits.items():
            with patched_view(model, fitted, method):
                scores[label] = domain_perplexity(model, heldout, settings.batch_size, settings.progress, label, prefix)
    return scores


def choose_candidate(model: PreTrainedModel, plan: Plan, heldout: dict[str, Tensor], settings: FitSettings) -> Plan:
    """The plan of the candidate removal (``select="loss"``) whose repaired model has the lowest mean
    log-perplexity over the held-out windows of every domain, each candidate fitted from the same
    statistics. All scores are kept."""
    fits = {
        selection.describe(removal): (settings.method, _fits(plan, settings, selection.runs(removal)))
        for removal in plan.candidates
    }
    scores = held_out_scores(model, fits, heldout, replace(settings, prefix=None))
    chosen = min(plan.candidates, key=lambda r: mean_log(scores[selection.describe(r)]))
    cal = copy.copy(plan.calibration)
    cal.keep(selection.runs(chosen))
    return Plan(chosen, selection.runs(chosen), cal, plan.selection, plan.passes, plan.route, plan.candidates, scores)


def score_methods(
    model: PreTrainedModel, plan: Plan, heldout: dict[str, Tensor], settings: FitSettings = FitSettings()
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of every method the plan's statistics allow (``none``: plain
    pruning), each fitted from the same statistics."""
    stats = plan.calibration.pairs
    fits = {
        name: (name, _fits(plan, replace(settings, method=name)))
        for name, record in REGISTRY.items()
        if all(stats[p].has(record.sums) for p in plan.pairs)
    }
    return held_out_scores(model, fits, heldout, settings)


LOSS_RIDGE_GRID = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1)


def score_ridges(
    model: PreTrainedModel, plan: Plan, heldout: dict[str, Tensor], settings: FitSettings = FitSettings()
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain of ``settings.method`` fitted at each relative ridge of ``LOSS_RIDGE_GRID``."""
    fits = {f"{r:g}": (settings.method, _fits(plan, replace(settings, ridge=r))) for r in LOSS_RIDGE_GRID}
    return held_out_scores(model, fits, heldout, settings)


def loss_ridge(
    model: PreTrainedModel, plan: Plan, heldout: dict[str, Tensor], settings: FitSettings
) -> tuple[float, dict[str, dict[str, float]] | None]:
    """``ridge="auto"`` with held-out windows: the ridge of ``LOSS_RIDGE_GRID`` of lowest held-out loss for a
    least-squares method (its scores too); the others keep ``settings.ridge``, unscored."""
    if not method_record(settings.method).least_squares:
        return float(settings.ridge), None
    scores = score_ridges(model, plan, heldout, settings)
    return float(min(scores, key=lambda r: mean_log(scores[r]))), scores


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
    model: PreTrainedModel, plan: Plan, heldout: dict[str, Tensor], settings: FitSettings
) -> tuple[float, dict[str, dict[str, float]]]:
    """α for a calibration of several domains (the plan's ``groups``, one per domain): for each domain,
    the repair is fitted without it (total sums less that domain's) and scored, shrunk to each α of
    ``guard.ALPHA_GRID``, on its held-out windows, so α is chosen on text the fit never saw, as the user's
    own text will be. Returns the largest α worse than plain pruning on no left-out domain
    (``largest_safe``: the lowest-loss one gave up in-domain gain, ``benchmarks/alpha.py``) and the table of
    scores, ``{α: {domain: perplexity}}``."""
    without = {domain: _fits(leave_out(plan, domain), settings, plan.pairs) for domain in heldout}
    scores: dict[str, dict[str, float]] = {f"{alpha:g}": {} for alpha in ALPHA_GRID}
    for domain, fitted in without.items():  # every α rescales the one fit: the guard's scoring, per domain
        with patched_view(model, fitted, settings.method) as unfolded, settings.sharing(shared_depth(fitted)) as prefix:
            guard = run_guard(
                model, {domain: heldout[domain]}, unfolded, ON_HELD_OUT, settings.batch_size, settings.progress, prefix
            )
        for alpha, score in guard.perplexity.items():
            scores[f"{alpha:g}"] |= score
    return float(largest_safe({float(a): p for a, p in scores.items()})), scores
