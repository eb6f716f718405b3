"""Fitting the recovery operators of removed runs from their ``PairStats``, in float64, and scoring them.

What each method solves is its record in ``methods`` (``methods.REGISTRY``); here are the ways of using
those records: one operator per run (``fit``), per removed layer and multiplied (``chain``, as the
published Ghosted Layers code does for non-contiguous removals), the relative residual of each method
(``fit_quality``) and ``fold_ridge``, the ridge chosen on a two-fold split of the calibration batches.

All residual-stream operators target ``‖X W − Y‖²`` (``X = X_pre``, ``Y = X_post``); ghost, unregularised,
is its minimiser, so every other stream operator scores at least as badly. ReplaceMe's ``Tᵀ W₀`` is one of
the down-projection weights refit searches, so its residual is at least refit's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics.sums import PairStats
from ghostlayers.registry.methods import DEFAULT_RIDGE, DEFAULT_RIDGE_MODE, METHODS, REGISTRY, check_chainable, method

CHAINABLE_METHODS = tuple(name for name, m in REGISTRY.items() if m.chainable)  # --fit chained multiplies these
RIDGE_GRID = tuple(10.0**k for k in range(-9, 1)) + (0.0,)


def fit(name: str, stats: PairStats, ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE) -> Tensor:
    """The operator of method ``name`` for one boundary pair."""
    return method(name).solve(stats, ridge, ridge_mode)


def fold_ridge(
    stats: PairStats,
    holdout: PairStats,
    grid: tuple[float, ...] = RIDGE_GRID,
    ridge_mode: str = DEFAULT_RIDGE_MODE,
) -> tuple[float, dict]:
    """The ridge of ``grid`` (read in ``ridge_mode``) with the lowest two-fold held-out error of the ghost
    fit: fit on every other batch, score ``‖X W − Y‖²`` on the rest, and the other way round. The rule
    for ``ridge="auto"`` without held-out windows (``choices.loss_ridge`` is the one with them). Returns
    it and each candidate's error."""
    rest = stats.without(holdout)
    errors = {}
    for ridge in grid:
        try:
            errors[ridge] = float(
                holdout.stream_error(fit("ghost", rest, ridge, ridge_mode))
                + rest.stream_error(fit("ghost", holdout, ridge, ridge_mode))
            )
        except GhostLayersError:  # ridge 0 on a rank-deficient fold
            continue
    return min(errors, key=errors.get), errors


def chain(
    name: str, layers: Sequence[PairStats], ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE
) -> Tensor:
    """One run's operator as the published Ghosted Layers code builds it for non-contiguous removals: one
    operator per removed layer ``k`` (in order), each fitted on the dense ``X_k → X_{k+1}``, applied one
    after the other to the row-vector stream, ``x W_k W_{k+1} …``: their product in layer order."""
    check_chainable(name)
    operator = fit(name, layers[0], ridge, ridge_mode)
    for stats in layers[1:]:
        operator = operator @ fit(name, stats, ridge, ridge_mode)
    return operator


def relative_residual(name: str, stats: PairStats, operator: Tensor) -> float:
    """``‖X_pre W − X_post‖ / ‖X_post − X_pre‖`` (1 for ``none``); for a folded method the same ratio with
    its rewritten stream (ReplaceMe's ``X_pre − Z + Z T``, refit's ``X_pre + A E``)."""
    return float((method(name).error(stats, operator) / stats.dense_gap()).sqrt())


def fit_quality(
    stats: PairStats,
    ridge: float = DEFAULT_RIDGE,
    ridge_mode: str = DEFAULT_RIDGE_MODE,
    layers: Sequence[PairStats] | None = None,
) -> dict[str, float]:
    """Relative residual on the run ``stats`` of every method the statistics allow, to compare before
    evaluating; with the run's per-layer ``layers``, of every chainable method's chained operator."""
    quality = {}
    for name in METHODS if layers is None else CHAINABLE_METHODS:
        if not stats.has(REGISTRY[name].sums):
            continue
        operator = fit(name, stats, ridge, ridge_mode) if layers is None else chain(name, layers, ridge, ridge_mode)
        quality[name] = relative_residual(name, stats, operator)
    return quality
