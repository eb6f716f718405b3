"""Every selection criterion as one record: what it chooses (a block of ``n`` layers, runs of at most ``n``
layers, or ``n`` single layers), what it needs from the calibration pass (the similarity band, whether it
reads the candidates' sums) and how it scores. ``selection`` and ``routing`` ask this table; adding a
criterion is adding a record.

Light on purpose (no torch import), like ``methods``: the command line lists the criteria in its help and
refuses an unknown one before the heavy modules load. Scores are written with the tensor methods of the
``stats.Similarity`` and ``stats.PairStats`` they are given.

Every score is "higher is better to remove": a block's, a run's (``runs`` take the least summed
``-score``) or a single layer's (the ``n`` highest are removed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ghostlayers.errors import GhostLayersError
from ghostlayers.registry.methods import DEFAULT_RIDGE, DEFAULT_RIDGE_MODE
from ghostlayers.registry.methods import method as method_record

Similarity = Any  # a stats.Similarity, not imported: this module loads without torch
PairStats = Any  # a stats.PairStats
Score = Callable[[Similarity, PairStats | None, tuple[int, int]], float]

BLOCK, RUNS, LAYERS = "block", "runs", "layers"  # what a criterion chooses (Criterion.chooses)


def ghost_error_share(stats: PairStats) -> float:
    """‖X_pre W* − X_post‖² / ‖X_post‖² of the ghost operator on the calibration tokens (scale-free, unlike
    ``operators.relative_residual``, whose unit is plain pruning's error). Normalising by ‖X_post‖² keeps the
    score scale-free like the cosine criteria (hidden-state norms grow with depth)."""
    w = method_record("ghost").solve(stats, DEFAULT_RIDGE, DEFAULT_RIDGE_MODE)
    return float(stats.stream_error(w) / stats.yty)


@dataclass(frozen=True)
class Criterion:
    """A selection criterion. ``chooses``: a ``block`` of ``n`` layers (the start of highest ``score``),
    ``runs`` of at most ``n`` layers in all (the disjoint runs of highest summed score, by dynamic
    programming) or ``n`` single ``layers`` (the highest scores: its runs are known only after selection).
    ``score(similarity, stats, pair)`` scores the pair ``(pre, post)``, from the similarity of the pass, and
    with ``candidate_stats`` from the candidates' ``PairStats`` (gathered in the pass that selects, a
    shortlist of the most similar when they do not fit in memory; a pair without sums is not scored).
    ``band(n)``: the distance up to which the pass measures similarity. ``by_loss``: held-out loss chooses
    among the removals that the criteria it names choose (``selection.loss_candidates``)."""

    name: str
    chooses: str
    score: Score | None = None
    candidate_stats: bool = False
    band: Callable[[int], int] = lambda n: n
    by_loss: tuple[str, ...] = ()


REGISTRY: dict[str, Criterion] = {
    c.name: c
    for c in (
        # LLM-Streamline: the block whose input and output are most similar, argmaxᵢ cos(Xᵢ, Xᵢ₊ₙ)
        Criterion("streamline", BLOCK, lambda sim, stats, p: float(sim.cosine[p])),
        # Gromov et al.: the block of least angular distance arccos(cos)/π
        Criterion("angular", BLOCK, lambda sim, stats, p: -float(sim.angular[p])),
        # ShortGPT: the n single layers of lowest block influence 1 − cos(Xₖ, Xₖ₊₁)
        Criterion("shortgpt", LAYERS, lambda sim, stats, p: -(1 - float(sim.cosine[p]))),
        # the block the ghost operator repairs best, argminᵢ ‖Xᵢ W* − Xᵢ₊ₙ‖² / ‖Xᵢ₊ₙ‖²
        Criterion("ghost-aware", BLOCK, lambda sim, stats, p: -ghost_error_share(stats[p]), candidate_stats=True),
        # any runs of n layers in all, the least summed relative residual (each run its own operator)
        Criterion("ghost-aware-runs", RUNS, lambda sim, stats, p: -ghost_error_share(stats[p]), candidate_stats=True),
        # the lowest held-out loss once repaired, among the choices of the shortgpt set and the best blocks
        Criterion("loss", BLOCK, candidate_stats=True, by_loss=("shortgpt", "streamline", "angular", "ghost-aware")),
    )
}
CRITERIA = tuple(REGISTRY)


def criterion(name: str) -> Criterion:
    """The record of ``name``; an unknown name is refused with the list of criteria (the one such message)."""
    if name not in REGISTRY:
        raise GhostLayersError(f"Unknown selection criterion '{name}'. Choose one of: {', '.join(CRITERIA)}.")
    return REGISTRY[name]


def names(test: Callable[[Criterion], bool]) -> tuple[str, ...]:
    """The criteria whose record passes ``test``, in the table's order (for messages)."""
    return tuple(c.name for c in REGISTRY.values() if test(c))
