"""Every recovery method as one record: how it is solved and scored from the sums, which sums it needs, and
what it may be combined with; and every sum of the calibration statistics as one record (``SUMS``): its
shape, what one batch adds to it, which states it reads and for which pairs it is gathered. Every other
module asks these tables: adding a method is adding a record, and a method that needs a new sum adds that
sum's record beside it.

Light on purpose (no torch import): the command line builds its help and refuses bad combinations from
these records before the heavy modules load. Solves, residuals and terms are written with the algebra of
``stats.PairStats`` (``ridge_solve``, ``quadratic_error``, ...), of ``stats.Batch`` (``product``, ...) and
tensor methods, so they need no import of their own.

All residual-stream operators ``W`` (C×C) target the same objective, ``‖X W − Y‖²`` with ``X = X_pre`` and
``Y = X_post``; a method folded into the last kept layer's down-projection scores its own rewritten stream.
``λ`` is relative by default, ``ridge · tr(G) / n``; ``ridge_mode="absolute"`` takes ``λ = ridge`` as the
published Ghosted Layers (``1e-6 I``) and ReplaceMe (``alpha I``) code do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from ghostlayers.errors import GhostLayersError

if TYPE_CHECKING:
    from torch import Tensor

PairStats = Any  # a stats.PairStats, not imported: this module loads without torch
Batch = Any  # a stats.Batch: one batch's states, what a sum's term is computed from

DEFAULT_RIDGE = 1e-6
RIDGE_MODES = ("relative", "absolute")
DEFAULT_RIDGE_MODE = "relative"


def check_ridge_mode(ridge_mode: str) -> None:
    if ridge_mode not in RIDGE_MODES:
        raise GhostLayersError(
            f"Unknown --ridge-mode '{ridge_mode}': use 'relative' (λ = ridge · tr(XᵀX)/C, the default) or "
            "'absolute' (λ = ridge, as the published Ghosted Layers and ReplaceMe code)."
        )


EVERY_PAIR, REMOVED_RUNS, AFTER_SELECTION = "every", "runs", "asked"  # for which pairs a sum is gathered (Sum.scope)


@dataclass(frozen=True)
class Sum:
    """One sum of a boundary pair's ``PairStats``. ``shape`` is in ``C`` (the hidden size) and ``I`` (the
    width of the last kept layer's down-projection input), ``()`` for a number; ``term(batch)`` is what one
    batch adds (a ``stats.Batch``: ``x`` the pair's ``pre`` state, ``y`` its ``post`` state when ``closes``,
    the taps); ``taps`` the states beyond the stream it reads (``calibration.TAPS``: ``z``, ``a``), which
    the in-memory and the layer-by-layer pass both hook, and which need a kept layer before the run whose
    MLP ends in a plain Linear; ``rotated`` whether it needs the Hadamard matrix of the hidden size.
    ``scope``: gathered for ``every`` pair; for the removed ``runs`` whatever the method (one plan serves
    a comparison of methods), for candidate blocks when a method asks; or only when ``asked``, and then
    for the removed runs only (too large for every candidate). ``label`` names it in messages."""

    name: str
    label: str
    shape: tuple[str, ...]
    term: Callable[[Batch], Tensor]
    _: KW_ONLY
    closes: bool = False
    taps: tuple[str, ...] = ()
    rotated: bool = False
    scope: str = EVERY_PAIR

    def size(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] for d in self.shape)

    def nbytes(self, sizes: Mapping[str, int], item: int = 8) -> int:
        """Its memory, ``item`` bytes a value, for the sizes of ``C`` and ``I``."""
        return math.prod(self.size(sizes)) * item


SUMS: dict[str, Sum] = {
    s.name: s
    for s in (
        # the stream's own, every method's: X = X_pre, Y = X_post
        Sum("count", "the token count", (), lambda b: b.count()),
        Sum("xtx", "XᵀX", ("C", "C"), lambda b: b.product(b.x, b.x)),
        Sum("xty", "XᵀY", ("C", "C"), lambda b: b.product(b.x, b.y), closes=True),
        Sum("yty", "‖Y‖²", (), lambda b: b.post.yty, closes=True),
        Sum("sequences", "the sequence count", (), lambda b: b.sequences(), closes=True),
        # Σ over sequences of mean_t|Y| / mean_t|X|, per channel (LinearPatch's scale × sequences)
        Sum("ratio", "LinearPatch ratios", ("C",), lambda b: b.ratio(rotated=False), closes=True),
        # the same for X H and Y H, H the orthonormal Hadamard matrix (linearpatch-rotate)
        Sum(
            "ratio_h", "rotated LinearPatch ratios", ("C",), lambda b: b.ratio(rotated=True), closes=True, rotated=True
        ),
        # ReplaceMe's: z the last kept layer's down-projection output, d = Y − X + z what it should produce
        Sum("ztz", "ZᵀZ", ("C", "C"), lambda b: b.product(b.z, b.z), taps=("z",), scope=REMOVED_RUNS),
        Sum(
            "ztd",
            "ZᵀD",
            ("C", "C"),
            lambda b: b.product(b.z, (b.y, -b.x, b.z)),
            closes=True,
            taps=("z",),
            scope=REMOVED_RUNS,
        ),
        Sum(
            "dtd",
            "‖D‖²",
            (),
            lambda b: b.square(b.post.upcast - b.up(b.x) + b.up(b.z)),
            closes=True,
            taps=("z",),
            scope=REMOVED_RUNS,
        ),
        # refit's: a that projection's input (I × I: gathered for the chosen runs only)
        Sum("ata", "AᵀA", ("I", "I"), lambda b: b.product(b.a, b.a), taps=("a",), scope=AFTER_SELECTION),
        Sum(
            "atd",
            "Aᵀ(Y − X)",
            ("I", "C"),
            lambda b: b.product(b.a, (b.y, -b.x)),
            closes=True,
            taps=("a",),
            scope=AFTER_SELECTION,
        ),
        # refit-ghost's: with aᵀa and aᵀ(Y − X), the sums of the stream refit hands over
        Sum("atx", "AᵀX", ("I", "C"), lambda b: b.product(b.a, b.x), taps=("a",), scope=AFTER_SELECTION),
    )
}


@dataclass(frozen=True)
class Method:
    """A recovery method. ``solve(stats, ridge, ridge_mode)`` is its operator for one removed run;
    ``error(stats, operator)`` the squared residual it leaves, ``‖Y − X‖²`` for plain pruning. ``fold``
    (folded methods) rewrites the last kept layer's down-projection ``(weight, bias)`` in float64 with the
    operator; the others put it on the residual stream (``stream``), or do nothing (``none``: plain pruning,
    the one record that does not ``repair``)."""

    name: str
    solve: Callable[[PairStats, float, str], Tensor]
    error: Callable[[PairStats, Tensor], Tensor]
    sums: tuple[str, ...] = ()  # the SUMS it needs beyond the stream's
    least_squares: bool = False  # a ridge solve: the ridge (and its auto choice) applies, it needs tokens ≥ C at 0
    stream: bool = False  # its operator runs on the residual stream (a GhostOperator: remote code)
    fold: Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, Tensor | None]] | None = None
    chainable: bool = True  # per-layer operators multiply into one run's (--fit chained)
    sequential: bool = False  # a later run can be fitted on the stream it produces (--fit sequential)
    fold_ridge: bool = True  # ridge="auto" without held-out windows may take ghost's two-fold choice
    repairs: bool = True  # False for plain pruning (none): no guard, no α

    @property
    def after_selection(self) -> bool:
        """Its sums are too large for every candidate: gathered once the runs are known (``AFTER_SELECTION``)."""
        return any(SUMS[name].scope == AFTER_SELECTION for name in self.sums)

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
        if not stats.has((gram,)):
            raise GhostLayersError(
                f"{name} needs a kept layer before the removed block (it rewrites that layer's MLP down-projection) "
                f"and its statistics, but the block starts at layer {stats.pre} or the plan was made without "
                f"methods=['{name}']. Remove a later block or use --method ghost."
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
        Method("linearpatch-rotate", solve=_rotated, error=_stream, sums=("ratio_h",), stream=True, sequential=True),
        # T with (ZᵀZ + λI) T = ZᵀD, folded into the down-projection: weight ← Tᵀ W, bias ← b T (ReplaceMe)
        Method(
            "replaceme",
            solve=_solve_with("ztz", lambda s: s.ztd, "replaceme"),
            error=lambda s, t: s.quadratic_error(s.ztz, s.ztd, s.dtd, t),
            sums=("ztz", "ztd", "dtd"),
            least_squares=True,
            fold=lambda w, b, t: (t.T @ w, None if b is None else b @ t),
            chainable=False,
        ),
        # E with (AᵀA + λI) E = Aᵀ(Y − X): the projection's weight becomes W + Eᵀ, its least-squares rewrite
        Method(
            "refit",
            solve=_solve_with("ata", lambda s: s.atd, "refit"),
            error=lambda s, e: s.quadratic_error(s.ata, s.atd, s.dense_gap(), e),
            sums=("ata", "atd"),
            least_squares=True,
            fold=lambda w, b, e: (w + e.T, b),
            chainable=False,
            fold_ridge=False,
        ),
        # refit, then ghost on the stream refit hands over: E folded into the projection, W on the stream
        Method(
            "refit-ghost",
            solve=_refit_ghost,
            error=_refit_ghost_error,
            sums=("ata", "atd", "atx"),
            least_squares=True,
            stream=True,
            fold=lambda w, b, e: (w + e.T, b),
            chainable=False,
            fold_ridge=False,
        ),
        Method("none", solve=lambda s, r, mode: s.identity(), error=_stream, repairs=False),
    )
}
METHODS = tuple(REGISTRY)
PLAIN_PRUNING = next(m.name for m in REGISTRY.values() if not m.repairs)  # the baseline every repair is held to
AUTO = "auto"  # not a method: the choice among ``candidates(AUTO)`` by held-out loss (choices.resolve)
AUTO_TEXT = (
    "auto (the best on held-out windows among the methods that are worse than plain pruning on no calibration source)"
)


def method(name: str, auto: bool = False) -> Method:
    """The record of ``name``; an unknown name is refused with the list of methods (and ``auto`` where it may
    be given)."""
    if name not in REGISTRY:
        known = ", ".join(METHODS) + (f", or {AUTO_TEXT}" if auto else "")
        raise GhostLayersError(f"Unknown recovery method '{name}'. Choose one of: {known}.")
    return REGISTRY[name]


def candidates(name: str) -> tuple[Method, ...]:
    """The methods ``--method name`` may end up as: its record, or for ``auto`` every method whose sums a plan
    gathers for the candidate blocks (not those gathered after selection), plain pruning included. The one
    place that says what ``auto`` compares."""
    if name == AUTO:
        return tuple(m for m in REGISTRY.values() if not m.after_selection)
    return (method(name, auto=True),)


def gathered(names: Iterable[str] = (), runs: bool = False) -> tuple[str, ...]:
    """The sums a pass gathers for its pairs, in ``SUMS`` order: those of ``every`` pair, the removed runs'
    when its pairs are the ``runs``, and those the methods ``names`` (``auto`` too) need."""
    asked = {s for name in names for m in candidates(name) for s in m.sums}
    scopes = (EVERY_PAIR, REMOVED_RUNS) if runs else (EVERY_PAIR,)
    return tuple(s.name for s in SUMS.values() if s.scope in scopes or s.name in asked)


def names(test: Callable[[Method], bool]) -> tuple[str, ...]:
    """The methods whose record passes ``test``, in the table's order (for messages and help)."""
    return tuple(m.name for m in REGISTRY.values() if test(m))


def check_chainable(name: str) -> None:
    """Fail for a method whose per-layer operators cannot be multiplied into one."""
    if not method(name).chainable:
        chainable = ", ".join(names(lambda m: m.chainable and m.stream))
        raise GhostLayersError(
            f"--fit chained multiplies one stream operator per removed layer, but {name} folds its map into the MLP "
            "of the layer before a removed run, and inside a run that layer is removed too. Use --fit "
            f"dense with {name}, or --fit chained with {chainable}."
        )
