"""Recovery operators: pure functions from ``PairStats`` to a matrix, solved in float64.

All residual-stream operators ``W`` (C×C) target the same objective, ``‖X W − Y‖²`` with
``X = X_pre`` and ``Y = X_post``, so one formula scores them all from the sums alone:
``‖X W − Y‖² = tr(Wᵀ XᵀX W) − 2 tr(Wᵀ XᵀY) + tr(YᵀY)``.

- ``ghost``: ``W = I + M``, ``(XᵀX + λI) M = XᵀΔ`` with ``Δ = Y − X`` (Ghosted Layers). Unregularised,
  it is the minimiser of the objective, so every other operator here scores at least as badly.
- ``linearpatch``: ``W = diag(s)``, ``s`` the mean over calibration sequences of each sequence's
  per-channel ``mean_t|Y| / mean_t|X|`` (LinearPatch without rotation, its published estimator).
- ``linearpatch-rotate``: ``W = H diag(s) Hᵀ`` with ``s`` measured in the Hadamard basis.
- ``replaceme``: ``T`` with ``(ZᵀZ + λI) T = ZᵀD``, mapping the last kept layer's down-projection
  output ``Z`` onto ``D = Y − X + Z``; it is folded into that projection, not applied to the stream.
- ``refit``: ``E`` with ``(AᵀA + λI) E = AᵀΔ``, ``A`` that projection's input (the MLP's ``I`` hidden
  activations): its weight becomes ``W₀ + Eᵀ``, the least-squares rewrite of the whole projection (ridge
  toward the trained weight). ReplaceMe's ``Tᵀ W₀`` is one of those weights, so its residual is at least
  refit's; like ReplaceMe it adds no parameters and leaves a plain checkpoint.
- ``none``: ``W = I``.

``λ`` is relative by default, ``ridge · tr(XᵀX) / C``, so one default suits every model scale;
``ridge_mode="absolute"`` takes ``λ = ridge`` as the published Ghosted Layers (``1e-6 I``) and ReplaceMe
(``alpha I``) code do.

A run of removed layers gets one operator fitted on the whole run (``X_pre → X_post``), or, ``chained``
as the published Ghosted Layers code does for non-contiguous removals, the product of one operator per
removed layer, each fitted on ``X_k → X_{k+1}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ghostlayers.calibration import PairStats
from ghostlayers.errors import GhostLayersError
from ghostlayers.hadamard import orthonormal_hadamard
from ghostlayers.options import DEFAULT_RIDGE, DEFAULT_RIDGE_MODE, METHODS, check_chainable, check_ridge_mode

STREAM_METHODS = ("none", "linearpatch", "linearpatch-rotate", "ghost")


def _ridge_solve(gram: Tensor, rhs: Tensor, ridge: float, ridge_mode: str, stats: PairStats) -> Tensor:
    """``(G + λI)⁻¹ R``. Without a ridge a rank-deficient ``G`` rarely fails the solve outright (rounding
    makes it barely invertible) but gives a meaningless map, so its smallest eigenvalue is checked first."""
    check_ridge_mode(ridge_mode)
    gram = gram.double()
    lam = ridge * torch.trace(gram) / gram.shape[0] if ridge_mode == "relative" else ridge
    system = gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    singular = False
    if lam == 0:
        eigenvalues = torch.linalg.eigvalsh(system)
        singular = bool(eigenvalues[0] <= eigenvalues[-1] * gram.shape[0] * torch.finfo(gram.dtype).eps)
    solution, info = torch.linalg.solve_ex(system, rhs.double())
    if singular or bool(info.any()):
        raise GhostLayersError(
            f"The least-squares system of removed block {stats.pre}..{stats.post - 1} is singular at ridge {ridge:g} "
            "(the calibration states do not span every channel). Raise --ridge (e.g. 1e-6) or calibrate on more "
            "tokens."
        )
    return solution


def ghost(stats: PairStats, ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE) -> Tensor:
    """``I + M*`` with ``M*`` the ridge least-squares map from ``X_pre`` to ``X_post − X_pre``."""
    m = _ridge_solve(stats.xtx, stats.xty - stats.xtx, ridge, ridge_mode, stats)
    return torch.eye(m.shape[0], dtype=m.dtype, device=m.device) + m


def linearpatch(stats: PairStats) -> Tensor:
    return torch.diag(stats.ratio.double() / stats.sequences.double())


def linearpatch_rotate(stats: PairStats) -> Tensor:
    h = orthonormal_hadamard(stats.xtx.shape[0]).to(stats.xtx.device)
    scale = stats.ratio_h.double() / stats.sequences.double()
    return h @ torch.diag(scale) @ h.T


def identity(stats: PairStats) -> Tensor:
    return torch.eye(stats.xtx.shape[0], dtype=torch.float64, device=stats.xtx.device)


def _down_projection_solve(
    method: str, gram: Tensor | None, rhs: Tensor | None, ridge: float, ridge_mode: str, stats: PairStats
) -> Tensor:
    """The ridge solve of a method that rewrites the last kept layer's down-projection, from its sums."""
    if gram is None:
        raise GhostLayersError(
            f"{method} needs a kept layer before the removed block (it rewrites that layer's MLP down-projection) "
            f"and its statistics, but the block starts at layer {stats.pre} or the plan was made without "
            f"{method}=True. Remove a later block or use --method ghost."
        )
    return _ridge_solve(gram, rhs, ridge, ridge_mode, stats)


def replaceme(stats: PairStats, ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE) -> Tensor:
    """The map ``T`` folded into the last kept layer's down-projection (``weight ← Tᵀ weight``)."""
    return _down_projection_solve("replaceme", stats.ztz, stats.ztd, ridge, ridge_mode, stats)


def refit(stats: PairStats, ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE) -> Tensor:
    """The change ``E`` (``I × C``) of the last kept layer's down-projection, ``weight ← weight + Eᵀ``."""
    return _down_projection_solve("refit", stats.ata, stats.atd, ridge, ridge_mode, stats)


RIDGE_GRID = tuple(10.0**k for k in range(-9, 1)) + (0.0,)


def auto_ridge(
    stats: PairStats,
    holdout: PairStats,
    grid: tuple[float, ...] = RIDGE_GRID,
    ridge_mode: str = DEFAULT_RIDGE_MODE,
) -> tuple[float, dict]:
    """The ridge of ``grid`` (read in ``ridge_mode``) with the lowest two-fold held-out error: fit on every
    other batch, score ``‖X W − Y‖²`` on the rest, and the other way round. Returns it and each
    candidate's error."""
    rest = stats.without(holdout)
    errors = {}
    for ridge in grid:
        try:
            errors[ridge] = float(
                stream_error(holdout, ghost(rest, ridge, ridge_mode))
                + stream_error(rest, ghost(holdout, ridge, ridge_mode))
            )
        except GhostLayersError:  # ridge 0 on a rank-deficient fold
            continue
    return min(errors, key=errors.get), errors


def fit(method: str, stats: PairStats, ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE) -> Tensor:
    """The operator of ``method`` for one boundary pair."""
    if method == "ghost":
        return ghost(stats, ridge, ridge_mode)
    if method == "replaceme":
        return replaceme(stats, ridge, ridge_mode)
    if method == "refit":
        return refit(stats, ridge, ridge_mode)
    if method == "linearpatch":
        return linearpatch(stats)
    if method == "linearpatch-rotate":
        return linearpatch_rotate(stats)
    if method == "none":
        return identity(stats)
    raise GhostLayersError(f"Unknown recovery method '{method}'. Choose one of: {', '.join(METHODS)}.")


def chain(
    method: str, layers: Sequence[PairStats], ridge: float = DEFAULT_RIDGE, ridge_mode: str = DEFAULT_RIDGE_MODE
) -> Tensor:
    """One run's operator as the published Ghosted Layers code builds it for non-contiguous removals: one
    operator per removed layer ``k`` (in order), each fitted on the dense ``X_k → X_{k+1}``, applied one
    after the other to the row-vector stream, ``x W_k W_{k+1} …``: their product in layer order."""
    check_chainable(method)
    operator = fit(method, layers[0], ridge, ridge_mode)
    for stats in layers[1:]:
        operator = operator @ fit(method, stats, ridge, ridge_mode)
    return operator


def stream_error(stats: PairStats, w: Tensor) -> Tensor:
    """``‖X W − Y‖²`` from the sums."""
    g, c = stats.xtx.double(), stats.xty.double()
    return (torch.trace(w.T @ g @ w) - 2 * torch.trace(w.T @ c) + stats.yty.double()).clamp_min(0)


def relative_residual(method: str, stats: PairStats, operator: Tensor) -> float:
    """``‖X_pre W − X_post‖ / ‖X_post − X_pre‖`` (1 for ``none``); for ReplaceMe the same ratio with
    its rewritten stream ``X_pre − Z + Z T``, for refit with ``X_pre + A E``."""
    dense_gap = stream_error(stats, identity(stats))
    if method == "refit":
        e = operator.double()
        err = torch.trace(e.T @ stats.ata.double() @ e) - 2 * torch.trace(e.T @ stats.atd.double())
        err = (err + dense_gap).clamp_min(0)
    elif method == "replaceme":
        t = operator.double()
        err = torch.trace(t.T @ stats.ztz.double() @ t) - 2 * torch.trace(t.T @ stats.ztd.double())
        err = (err + stats.dtd.double()).clamp_min(0)
    else:
        err = stream_error(stats, operator)
    return float((err / dense_gap).sqrt())


def fit_quality(
    stats: PairStats,
    ridge: float = DEFAULT_RIDGE,
    ridge_mode: str = DEFAULT_RIDGE_MODE,
    layers: Sequence[PairStats] | None = None,
) -> dict[str, float]:
    """Relative residual on the run ``stats`` of every method the statistics allow, to compare before
    evaluating; with the run's per-layer ``layers``, of every method's chained operator."""
    quality = {}
    for method in METHODS if layers is None else STREAM_METHODS:
        if (
            (method == "replaceme" and stats.ztz is None)
            or (method == "refit" and stats.ata is None)
            or (method == "linearpatch-rotate" and stats.ratio_h is None)
        ):
            continue
        operator = fit(method, stats, ridge, ridge_mode) if layers is None else chain(method, layers, ridge, ridge_mode)
        quality[method] = relative_residual(method, stats, operator)
    return quality
