"""Every recovery method as one record: how it is solved and scored from the sums, which sums it needs, and
what it may be combined with. Every other module asks this table; adding a method is adding a record.

Light on purpose (no torch import): the command line builds its help and refuses bad combinations from
these records before the heavy modules load. Solves and residuals are written with the algebra of
``stats.PairStats`` (``ridge_solve``, ``quadratic_error``, ...) and tensor methods, so they need no
import of their own.

All residual-stream operators ``W`` (C×C) target the same objective, ``‖X W − Y‖²`` with ``X = X_pre`` and
``Y = X_post``; a method folded into the last kept layer's down-projection scores its own rewritten stream.
``λ`` is relative by default, ``ridge · tr(G) / n``; ``ridge_mode="absolute"`` takes ``λ = ridge`` as the
published Ghosted Layers (``1e-6 I``) and ReplaceMe (``alpha I``) code do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ghostlayers.errors import GhostLayersError

if TYPE_CHECKING:
    from torch import Tensor

PairStats = Any  # a stats.PairStats, not imported: this module loads without torch

Z = ("ztz", "ztd", "dtd")  # ReplaceMe's sums: the last kept layer's down-projection output
A = ("ata", "atd")  # refit's sums: that projection's input (I × I: gathered for the chosen runs only)
AX = (*A, "atx")  # refit-ghost's: refit's and aᵀX, from which the refitted stream's sums follow
ROTATED = ("ratio_h",)  # per-channel ratios in the Hadamard basis


@dataclass(frozen=True)
class Method:
    """A recovery method. ``solve(stats, ridge, ridge_mode)`` is its operator for one removed run;
    ``error(stats, operator)`` the squared residual it leaves, ``‖Y − X‖²`` for plain pruning. ``fold``
    (folded methods) rewrites the last kept layer's down-projection ``(weight, bias)`` in float64 with the
    operator; the others put it on the residual stream (``stream``), or do nothing (``none``)."""

    name: str
    solve: Callable[[PairStats, float, str], Tensor]
    error: Callable[[PairStats, Tensor], Tensor]
    sums: tuple[str, ...] = ()  # the optional PairStats sums it needs, beyond the stream's
    least_squares: bool = False  # a ridge solve: the ridge (and its auto choice) applies, it needs tokens ≥ C at 0
    stream: bool = False  # its operator runs on the residual stream (a GhostOperator: remote code)
    fold: Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, Tensor | None]] | None = None
    chainable: bool = True  # per-layer operators multiply into one run's (--fit chained)
    sequential: bool = False  # a later run can be fitted on the stream it produces (--fit sequential)
    after_selection: bool = False  # its sums are too large for every candidate: gathered once the runs are known
    fold_ridge: bool = True  # ridge="auto" without held-out windows may take ghost's two-fold choice

    @property
    def folded(self) -> bool:
        """Rewrites the down-projection of the layer before each run: it needs a kept layer there whose MLP
        ends in a plain Linear, which architectures with a normalized MLP output (gemma3) lack."""
        return self.fold is not None

    @property
    def plain(self) -> bool:
        """Its result is a plain checkpoint of the base architecture (no operator on the stream)."""
        return not self.stream

    def parts(self, operator: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """``(folded part, stream part)`` of one run's operator. A method that does both (refit-ghost)
        solves to its fold's rows stacked over its ``C × C`` stream operator."""
        if self.folded and self.stream:
            return operator[: -operator.shape[1]], operator[-operator.shape[1] :]
        return (operator, None) if self.folded else (None, operator if self.stream else None)


def _solve_with(gram: str, rhs: Callable[[PairStats], Tensor], name: str) -> Callable[[PairStats, float, str], Tensor]:
    """The ridge solve of a folded method from its sums, refused when they were not gathered."""

    def solve(stats: PairStats, ridge: float, ridge_mode: str) -> Tensor:
        if getattr(stats, gram) is None:
            raise GhostLayersError(
                f"{name} needs a kept layer before the removed block (it rewrites that layer's MLP down-projection) "
                f"and its statistics, but the block starts at layer {stats.pre} or the plan was made without "
                f"{name}=True. Remove a later block or use --method ghost."
            )
        return stats.ridge_solve(getattr(stats, gram), rhs(stats), ridge, ridge_mode)

    return solve


def _refit_ghost(stats: PairStats, ridge: float, ridge_mode: str) -> Tensor:
    """Refit, then ghost fitted on the stream refit hands over (``X' = X + A E``): ``E`` stacked over
    ``W = I + M``, ``(X'ᵀX' + λI) M = X'ᵀ(Y − X')``."""
    e = _solve_with("ata", lambda s: s.atd, "refit-ghost")(stats, ridge, ridge_mode)
    gram, cross = stats.refitted(e)
    return stats.stack(e, stats.identity() + stats.ridge_solve(gram, cross - gram, ridge, ridge_mode))


def _refit_ghost_error(stats: PairStats, operator: Tensor) -> Tensor:
    """``‖(X + A E) W − Y‖²`` for the ``E`` and ``W`` the operator stacks."""
    c = operator.shape[1]
    return stats.quadratic_error(*stats.refitted(operator[:-c]), stats.yty, operator[-c:])


def _stream(stats: PairStats, w: Tensor) -> Tensor:
    return stats.stream_error(w)


def _scale(stats: PairStats, ratio: Tensor) -> Tensor:
    return ratio.double() / stats.sequences.double()


def _rotated(stats: PairStats, ridge: float, ridge_mode: str) -> Tensor:
    h = stats.hadamard()
    return h @ _scale(stats, stats.ratio_h).diag() @ h.T


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        # W = I + M, (XᵀX + λI) M = Xᵀ(Y − X): the minimiser of the stream objective (Ghosted Layers)
        Method(
            "ghost",
            solve=lambda s, r, mode: s.identity() + s.ridge_solve(s.xtx, s.xty - s.xtx, r, mode),
            error=_stream,
            least_squares=True,
            stream=True,
            sequential=True,
        ),
        # W = diag(s), s the mean over sequences of each one's mean_t|Y| / mean_t|X| (LinearPatch, unrotated)
        Method(
            "linearpatch",
            solve=lambda s, r, mode: _scale(s, s.ratio).diag(),
            error=_stream,
            stream=True,
            sequential=True,
        ),
        # W = H diag(s) Hᵀ with s measured in the Hadamard basis (LinearPatch)
        Method("linearpatch-rotate", solve=_rotated, error=_stream, sums=ROTATED, stream=True, sequential=True),
        # T with (ZᵀZ + λI) T = ZᵀD, folded into the down-projection: weight ← Tᵀ W, bias ← b T (ReplaceMe)
        Method(
            "replaceme",
            solve=_solve_with("ztz", lambda s: s.ztd, "replaceme"),
            error=lambda s, t: s.quadratic_error(s.ztz, s.ztd, s.dtd, t),
            sums=Z,
            least_squares=True,
            fold=lambda w, b, t: (t.T @ w, None if b is None else b @ t),
            chainable=False,
        ),
        # E with (AᵀA + λI) E = Aᵀ(Y − X): the projection's weight becomes W + Eᵀ, its least-squares rewrite
        Method(
            "refit",
            solve=_solve_with("ata", lambda s: s.atd, "refit"),
            error=lambda s, e: s.quadratic_error(s.ata, s.atd, s.dense_gap(), e),
            sums=A,
            least_squares=True,
            fold=lambda w, b, e: (w + e.T, b),
            chainable=False,
            after_selection=True,
            fold_ridge=False,
        ),
        # refit, then ghost on the stream refit hands over: E folded into the projection, W on the stream
        Method(
            "refit-ghost",
            solve=_refit_ghost,
            error=_refit_ghost_error,
            sums=AX,
            least_squares=True,
            stream=True,
            fold=lambda w, b, e: (w + e.T, b),
            chainable=False,
            after_selection=True,
            fold_ridge=False,
        ),
        Method("none", solve=lambda s, r, mode: s.identity(), error=_stream),
    )
}
METHODS = tuple(REGISTRY)


def method(name: str) -> Method:
    """The record of ``name``; an unknown name is refused with the list of methods."""
    if name not in REGISTRY:
        raise GhostLayersError(f"Unknown recovery method '{name}'. Choose one of: {', '.join(METHODS)}.")
    return REGISTRY[name]


def names(test: Callable[[Method], bool]) -> tuple[str, ...]:
    """The methods whose record passes ``test``, in the table's order (for messages and help)."""
    return tuple(m.name for m in REGISTRY.values() if test(m))
