"""Which calibration passes a plan takes, as data: ``choose_route(request, shape, budget)`` is pure (no
model, no forward pass), so every route can be tested on its own; ``pipeline.plan`` runs the passes.

The routes: layers given, one pass over their runs. A criterion with candidate blocks whose statistics
fit the memory budget selects and gathers in a single pass; over the budget (or for ``shortgpt``, whose
runs are known only after selection, or a method whose sums are gathered after selection), a similarity
pass and then a pass truncated at the chosen runs, or at a shortlist for the recovery-aware criteria.
``loss`` gathers its candidate removals' runs, in a second pass for those the first could not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ghostlayers.errors import GhostLayersError
from ghostlayers.memory import size_text
from ghostlayers.options import CRITERIA, DEFAULT_SELECT_RANGE, RECOVERY_AWARE
from ghostlayers.selection import candidate_pairs, runs, runs_within, validate_count
from ghostlayers.stats import Calibration, pair_stats_bytes

Pairs = list[tuple[int, int]]


@dataclass(frozen=True)
class Shape:
    """What of the model a route depends on."""

    num_layers: int
    hidden_size: int
    foldable: bool = True  # its MLPs end in a plain down-projection: ReplaceMe's and refit's sums exist


@dataclass(frozen=True)
class Request:
    """What the plan must hold: the removal (``layers``, or ``select`` with ``num_layers``), the sums asked
    for (``replaceme``: ReplaceMe's for every candidate too; ``after_selection``: the method whose sums are
    gathered for the chosen runs only), per-layer pairs for a ``chained`` fit, and how many groups of
    batches keep their sums apart besides the totals."""

    layers: list[int] | None = None
    select: str | None = None
    num_layers: int | None = None
    replaceme: bool = False
    after_selection: str | None = None
    chained: bool = False
    select_range: str = DEFAULT_SELECT_RANGE
    kept_apart: int = 0


@dataclass(frozen=True)
class Pass:
    """One forward pass. ``pairs`` names the boundary pairs it gathers (``PAIR_SOURCES``), ``band`` the
    distance up to which similarity is measured (None: none), ``full_depth`` whether it runs to the last
    layer; ``then`` is what follows it: ``"select"`` the layers, ``"options"`` the candidate removals."""

    pairs: str
    band: int | None
    full_depth: bool = False
    replaceme: bool = False
    refit: bool = False
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


def needed_pairs(removed: list[int], chained: bool) -> Pairs:
    """The runs of ``removed`` and, for a chained fit, each removed layer's own pair ``(k, k+1)``."""
    return union(runs(removed), [(k, k + 1) for k in removed] if chained else [])


def union(pairs: Pairs, more: Pairs) -> Pairs:
    return pairs + [pair for pair in more if pair not in pairs]


def check_request(request: Request, shape: Shape) -> None:
    """The removal is named one way, and a criterion is known and can remove ``num_layers``."""
    if (request.layers is None) == (request.select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if request.select is None:
        return
    if request.num_layers is None:
        raise GhostLayersError(f"--select {request.select} needs --num-layers N (how many layers to remove).")
    validate_count(request.num_layers, shape.num_layers, request.select_range)
    if request.select not in CRITERIA:
        raise GhostLayersError(f"Unknown selection criterion '{request.select}'. Choose one of: {', '.join(CRITERIA)}.")


def choose_route(request: Request, shape: Shape, budget: int, why: str) -> Route:
    """The passes for ``request`` on a model of ``shape`` with ``budget`` bytes for the statistics one pass
    may hold (``why``: where that figure comes from, for the report)."""
    check_request(request, shape)
    late = request.after_selection
    if request.layers is not None:
        band = max(b - a for a, b in runs(request.layers))
        only = Pass("runs", band, replaceme=shape.foldable, refit=late is not None)
        return Route((only,), "the layers to remove were given", [], [], 0)
    n, total, select = request.num_layers, shape.num_layers, request.select
    candidates = candidate_pairs(select, n, total, request.select_range)
    singles = runs_within(1, total, request.select_range) if request.chained else []  # any layer may be chosen
    replaceme = request.replaceme and shape.foldable
    affordable = budget // pair_stats_bytes(shape.hidden_size, 1, replaceme, request.kept_apart)
    need = pair_stats_bytes(shape.hidden_size, len(candidates), replaceme, request.kept_apart)
    blocks = f"{len(candidates)} candidate blocks need {size_text(need)}"
    if select == "loss":
        first = Pass("candidates" if len(candidates) <= affordable else "none", n, True, replaceme, then="options")
        rest = Pass("options", None, replaceme=replaceme)
        return Route((first, rest), "{candidates} candidate removals", candidates, singles, affordable)
    if candidates and len(union(candidates, singles)) <= affordable and late is None:
        only = Pass("candidates+singles", n, True, replaceme, then="select")
        return Route((only,), f"{blocks} of the {size_text(budget)} budget ({why})", candidates, singles, affordable)
    if late is not None:
        reason = f"{late}'s statistics are gathered for the selected layers only"
    elif candidates:
        reason = f"{blocks}, over the {size_text(budget)} budget ({why})"
    else:
        reason = f"{select} knows its runs only after selection"
    similarity = Pass("none", n, True)
    if select in RECOVERY_AWARE:  # too many candidates to hold: score the most similar ones
        shortlist = Pass("shortlist+singles", None, replaceme=replaceme, then="select")
        return Route((similarity, shortlist), reason, candidates, singles, affordable)
    chosen = Pass("runs", None, replaceme=shape.foldable, refit=late is not None)
    return Route((Pass("none", n, True, then="select"), chosen), reason, candidates, singles, affordable)
