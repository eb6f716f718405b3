"""Which calibration passes a plan takes, as data: ``choose_route(request, shape, budget)`` is pure (no
model, no forward pass), so every route can be tested on its own; ``pipeline.plan`` runs the passes.

The routes: layers given, one pass over their runs. A criterion with candidate blocks whose statistics
fit the memory budget selects and gathers in a single pass; over the budget (or for ``shortgpt``, whose
runs are known only after selection, or a method whose sums are gathered after selection), a similarity
pass and then a pass truncated at the chosen runs, or at a shortlist for the criteria that read the
candidates' sums. ``loss`` gathers its candidate removals' runs, in a second pass for those the first
could not hold. Which sums each pass gathers is ``pass_sums``: those of the requested methods, and on a
pass over the removed runs those every plan keeps for them (``methods.gathered``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ghostlayers.calibration.memory import size_text
from ghostlayers.calibration.selection import candidate_pairs, runs, runs_within, validate_count
from ghostlayers.config.settings import DEFAULT_SELECT_RANGE
from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics.sums import Calibration
from ghostlayers.registry.criteria import criterion
from ghostlayers.registry.methods import SUMS, candidates, gathered

Pairs = list[tuple[int, int]]


@dataclass(frozen=True)
class Shape:
    """What of the model a route depends on."""

    num_layers: int  # all of the model's decoder layers
    hidden_size: int
    foldable: bool = True  # its MLPs end in a plain down-projection: the sums that tap it exist


@dataclass(frozen=True)
class Request:
    """What the plan must hold: the removal (``layers``, or ``select`` with ``num_remove``), the ``methods``
    it must serve (names, ``auto`` too: their sums gathered for every candidate, or for the chosen runs
    only where a method's are gathered after selection), per-layer pairs for a ``chained`` fit, and how
    many groups of batches keep their sums apart besides the totals."""

    layers: list[int] | None = None
    select: str | None = None
    num_remove: int | None = None  # layers to remove; ``Shape.num_layers`` is the model's total
    methods: tuple[str, ...] = ()
    chained: bool = False
    select_range: str = DEFAULT_SELECT_RANGE
    kept_apart: int = 0


@dataclass(frozen=True)
class Pass:
    """One forward pass. ``pairs`` names the boundary pairs it gathers (``PAIR_SOURCES``), ``band`` the
    distance up to which similarity is measured (None: none), ``full_depth`` whether it runs to the last
    layer, ``sums`` the sums each pair gathers (``methods.SUMS``); ``then`` is what follows it:
    ``"select"`` the layers, ``"options"`` the candidate removals."""

    pairs: str
    band: int | None
    full_depth: bool = False
    sums: tuple[str, ...] = ()
    then: str = ""


PAIR_SOURCES = ("none", "runs", "candidates", "candidates+singles", "shortlist+singles", "options")


@dataclass(frozen=True)
class Route:
    """The passes, in order, and why (``reason``; ``{candidates}``: the count of candidate removals).
    ``candidates``/``singles`` are the pairs the passes name, ``affordable`` how many pairs the budget holds
    (a shortlist's length). A pass whose pairs are all gathered already is skipped."""

    passes: tuple[Pass, ...]
    reason: str
    candidates: Pairs
    singles: Pairs
    affordable: int


@dataclass
class Plan:
    """Which layers go and the calibration statistics of each removed run; any method can be fitted from
    it, so one calibration serves a comparison of methods (``pipeline.applied`` makes each on one model)."""

    removed: list[int]
    pairs: list[tuple[int, int]]
    calibration: Calibration
    selection: str
    passes: int
    route: str = ""  # the passes taken and why, for the report
    candidates: list[list[int]] = field(default_factory=list)  # select="loss": removals to score
    candidate_scores: dict[str, dict[str, float]] | None = None  # held-out perplexity of each, once scored
    select_range: str | None = None  # None for manual layers


def needed_pairs(removed: list[int], chained: bool) -> Pairs:
    """The runs of ``removed`` and, for a chained fit, each removed layer's own pair ``(k, k+1)``."""
    return union(runs(removed), [(k, k + 1) for k in removed] if chained else [])


def union(pairs: Pairs, more: Pairs) -> Pairs:
    return pairs + [pair for pair in more if pair not in pairs]


def pair_stats_bytes(
    hidden_size: int, num_pairs: int, sums: Sequence[str] = gathered(), groups: int = 0, width: int = 0
) -> int:
    """Memory of the float64 ``sums`` (``methods.SUMS``) of ``num_pairs`` pairs, once for the totals and once
    per group kept apart (``width``: the down-projection input width ``I`` of the sums that have it)."""
    sizes = {"C": hidden_size, "I": width}
    return num_pairs * (1 + groups) * sum(SUMS[name].nbytes(sizes) for name in sums)


def late(name: str) -> bool:
    """Whether ``--method name`` needs sums gathered for the chosen runs only (``Method.after_selection``)."""
    return any(m.after_selection for m in candidates(name))


def pass_sums(request: Request, shape: Shape, runs: bool) -> tuple[str, ...]:
    """The sums a pass gathers for its pairs: those the requested methods need (on a pass over candidates,
    not those gathered after selection) and, on a pass over the removed ``runs``, those every plan keeps
    for them; none that reads a down-projection the architecture lacks."""
    asked = [m for m in request.methods if runs or not late(m)]
    return tuple(name for name in gathered(asked, runs) if shape.foldable or not SUMS[name].taps)


def check_request(request: Request, shape: Shape) -> None:
    """The removal is named one way, and a criterion is known and can remove ``num_remove`` of them."""
    if (request.layers is None) == (request.select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if request.select is None:
        return
    if request.num_remove is None:
        raise GhostLayersError(f"--select {request.select} needs --num-layers N (how many layers to remove).")
    validate_count(request.num_remove, shape.num_layers, request.select_range)
    criterion(request.select)


def choose_route(request: Request, shape: Shape, budget: int, why: str) -> Route:
    """The passes for ``request`` on a model of ``shape`` with ``budget`` bytes for the statistics one pass
    may hold (``why``: where that figure comes from, for the report)."""
    check_request(request, shape)
    late_method = next((m for m in request.methods if late(m)), None)
    if request.layers is not None:
        band = max(b - a for a, b in runs(request.layers))
        only = Pass("runs", band, sums=pass_sums(request, shape, runs=True))
        return Route((only,), "the layers to remove were given", [], [], 0)
    n, total, chosen = request.num_remove, shape.num_layers, criterion(request.select)
    candidates = candidate_pairs(chosen.name, n, total, request.select_range)
    singles = runs_within(1, total, request.select_range) if request.chained else []  # any layer may be chosen
    sums, band = pass_sums(request, shape, runs=False), chosen.band(n)
    affordable = budget // pair_stats_bytes(shape.hidden_size, 1, sums, request.kept_apart)
    need = pair_stats_bytes(shape.hidden_size, len(candidates), sums, request.kept_apart)
    blocks = f"{len(candidates)} candidate blocks need {size_text(need)}"
    if chosen.by_loss:
        first = Pass("candidates" if len(candidates) <= affordable else "none", band, True, sums, then="options")
        rest = Pass("options", None, sums=sums)
        return Route((first, rest), "{candidates} candidate removals", candidates, singles, affordable)
    if candidates and len(union(candidates, singles)) <= affordable and late_method is None:
        only = Pass("candidates+singles", band, True, sums, then="select")
        return Route((only,), f"{blocks} of the {size_text(budget)} budget ({why})", candidates, singles, affordable)
    if late_method is not None:
        reason = f"{late_method}'s statistics are gathered for the selected layers only"
    elif candidates:
        reason = f"{blocks}, over the {size_text(budget)} budget ({why})"
    else:
        reason = f"{chosen.name} knows its runs only after selection"
    if chosen.candidate_stats:  # too many candidates to hold: score the most similar ones
        shortlist = Pass("shortlist+singles", None, sums=sums, then="select")
        return Route((Pass("none", band, True), shortlist), reason, candidates, singles, affordable)
    chosen_runs = Pass("runs", None, sums=pass_sums(request, shape, runs=True))
    return Route((Pass("none", band, True, then="select"), chosen_runs), reason, candidates, singles, affordable)
