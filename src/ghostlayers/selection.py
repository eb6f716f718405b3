"""Which layers to remove: parsing manual indices and the similarity criteria.

All criteria read ``Similarity`` (per-token cosine over the hidden dimension, averaged over tokens):
- ``streamline`` (LLM-Streamline): the contiguous block of ``n`` layers whose input and output are most
  similar, argmaxᵢ cos(Xᵢ, Xᵢ₊ₙ);
- ``angular`` (Gromov et al.): the block minimising the angular distance arccos(cos)/π;
- ``shortgpt`` (ShortGPT): the ``n`` single layers of lowest block influence 1 − cos(Xₖ, Xₖ₊₁);
- ``ghost-aware``: the block the ghost operator repairs best, argminᵢ ‖Xᵢ W* − Xᵢ₊ₙ‖² / ‖Xᵢ₊ₙ‖², in
  closed form from the candidate blocks' ``PairStats`` (no extra pass). Normalising by ‖Xᵢ₊ₙ‖² keeps the
  score scale-free like the cosine criteria (hidden-state norms grow with depth).
- ``loss``: the candidate of lowest held-out language-model loss once repaired, among about eight:
  the best blocks by streamline cosine, angular distance and ghost residual, and the shortgpt set
  (``loss_candidates``; scored by ``pipeline.choose_candidate``). The boundary residual does not track
  perplexity (it is dominated by the attention-sink token), so the loss itself decides.
- ``ghost-aware-runs``: the non-contiguous variant: any set of runs of ``n`` layers in all (each run
  repaired by its own operator), minimising the sum of the runs' relative residuals, solved exactly by
  dynamic programming over the residuals of every run of at most ``n`` layers. The sum is a proxy: it
  ignores how one run's leftover error changes the next run's inputs.

Every criterion chooses among the layers of its ``select_range``: ``all``, or ``published`` (neither the
first nor the last layer, as in the published LinearPatch / Ghosted Layers selection code).
"""

from __future__ import annotations

from collections import Counter

from ghostlayers import operators
from ghostlayers.errors import GhostLayersError
from ghostlayers.options import CRITERIA, DEFAULT_SELECT_RANGE, check_select_range, read_layers
from ghostlayers.stats import PairStats, Similarity

CONTIGUOUS = ("streamline", "angular", "ghost-aware")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """``"12:18"`` (half-open, like a Python slice) or ``"3,7,9"``, in original layer indices."""
    indices = read_layers(spec)
    if isinstance(indices, range) and (indices.start < 0 or indices.stop > num_layers):
        raise GhostLayersError(
            f"--layers {spec} is out of range: this model has {num_layers} layers (0..{num_layers - 1})."
        )
    return validate_layers(list(indices), num_layers)


def validate_layers(indices: list[int], num_layers: int) -> list[int]:
    """Sorted indices, or a clear error for out-of-range, duplicate or all-layer selections."""
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise GhostLayersError(
            f"Layer indices {bad[:5]}{' …' if len(bad) > 5 else ''} are out of range: this model has {num_layers} "
            f"layers (0..{num_layers - 1})."
        )
    duplicates = sorted(i for i, n in Counter(indices).items() if n > 1)
    if duplicates:
        raise GhostLayersError(f"Layer indices {duplicates} are given more than once; list each layer once.")
    if not indices:
        raise GhostLayersError("No layers selected: give at least one layer index to remove.")
    if len(indices) >= num_layers:
        raise GhostLayersError(f"Cannot remove all {num_layers} layers: at least one decoder layer must remain.")
    return sorted(indices)


def validate_count(num_remove: int, num_layers: int, select_range: str = DEFAULT_SELECT_RANGE) -> None:
    allowed = selectable(num_layers, select_range)
    if not 0 < num_remove < num_layers or num_remove > len(allowed):
        within = f" within --select-range {select_range} (layers {allowed.start}..{allowed.stop - 1})"
        raise GhostLayersError(
            f"--num-layers {num_remove} is not possible for a model with {num_layers} layers"
            f"{within if select_range != 'all' else ''}: choose between 1 and "
            f"{min(num_layers - 1, len(allowed))}."
        )


def describe(removed: list[int]) -> str:
    """A removal as its runs, e.g. ``13..18`` or ``3, 7..8``."""
    return ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in runs(removed))


def selectable(num_layers: int, select_range: str = DEFAULT_SELECT_RANGE) -> range:
    """The layers a criterion may remove: all, or (``published``) all but the first and the last, as the
    published selection code, whose candidate blocks start at 1 and end before the last layer."""
    check_select_range(select_range)
    return range(1, num_layers - 1) if select_range == "published" else range(num_layers)


def runs(removed: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive removed layers as boundary pairs ``(first, last + 1)``."""
    out: list[tuple[int, int]] = []
    for i in sorted(removed):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def runs_within(length: int, num_layers: int, select_range: str = DEFAULT_SELECT_RANGE) -> list[tuple[int, int]]:
    """Every run of ``length`` consecutive layers inside the select range, as boundary pairs."""
    allowed = selectable(num_layers, select_range)
    return [(i, i + length) for i in range(allowed.start, allowed.stop - length + 1)]


def candidate_pairs(
    criterion: str, num_remove: int, num_layers: int, select_range: str = DEFAULT_SELECT_RANGE
) -> list[tuple[int, int]]:
    """Boundary pairs whose statistics let ``criterion`` choose in the same pass: every block of ``n``
    layers for the contiguous criteria, every run of at most ``n`` layers for ``ghost-aware-runs``, none
    for ``shortgpt`` (its runs are known only after selection)."""
    if criterion in (*CONTIGUOUS, "loss"):
        return runs_within(num_remove, num_layers, select_range)
    if criterion == "ghost-aware-runs":
        return [pair for m in range(1, num_remove + 1) for pair in runs_within(m, num_layers, select_range)]
    return []


def shortlist(
    criterion: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    size: int,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list:
    """At most ``size`` candidate pairs of a recovery-aware criterion, the most similar by cosine, when
    the statistics of all candidates do not fit in memory; ``ghost-aware-runs`` always keeps the single
    layers so that some selection exists."""
    pairs = candidate_pairs(criterion, num_remove, num_layers, select_range)
    ranked = sorted(pairs, key=lambda p: float(similarity.cosine[p]), reverse=True)
    if criterion == "ghost-aware":
        return ranked[: max(1, size)]
    singles = runs_within(1, num_layers, select_range)
    return singles + [p for p in ranked if p[1] - p[0] > 1][: max(0, size - len(singles))]


def ghost_error_share(stats: PairStats) -> float:
    """‖X_pre W* − X_post‖² / ‖X_post‖² of the ghost operator on the calibration tokens (scale-free, unlike
    ``operators.relative_residual``, whose unit is plain pruning's error)."""
    return float(stats.stream_error(operators.fit("ghost", stats)) / stats.yty)


def best_runs(costs: dict[tuple[int, int], float], num_remove: int, num_layers: int) -> list[int]:
    """Layers of the disjoint runs ``(pre, post)`` from ``costs``, ``num_remove`` layers in all and a kept
    layer between any two runs (else they would be one run), with the least summed cost. Exact dynamic
    programme: ``best[k][r]`` is the cheapest way to remove ``r`` layers from ``k..L-1`` when layer ``k``
    may start a run."""
    inf = float("inf")
    best = [[0.0] + [inf] * num_remove for _ in range(num_layers + 2)]
    choice: dict[tuple[int, int], tuple[int, int] | None] = {}
    for k in range(num_layers - 1, -1, -1):
        for r in range(1, num_remove + 1):
            best[k][r], choice[k, r] = best[k + 1][r], None  # keep layer k
            for m in range(1, r + 1):
                if (k, k + m) not in costs or k + m > num_layers:
                    continue
                rest = best[k + m + 1][r - m] if k + m < num_layers else (0.0 if r == m else inf)
                if costs[(k, k + m)] + rest < best[k][r]:
                    best[k][r], choice[k, r] = costs[(k, k + m)] + rest, (k, k + m)
    if best[0][num_remove] == inf:
        raise GhostLayersError(f"No set of candidate runs removes exactly {num_remove} layers.")
    removed, k, r = [], 0, num_remove
    while r:
        run = choice[k, r]
        if run is None:
            k += 1
        else:
            removed += range(*run)
            k, r = run[1] + 1, r - (run[1] - run[0])
    return removed


def block_scores(
    criterion: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> dict[int, float]:
    """Score of removing block ``i..i+n-1`` for each candidate start ``i`` in the select range (higher is
    better to remove); ``ghost-aware`` scores those of the blocks that have ``stats``."""
    starts = [pre for pre, _ in runs_within(num_remove, num_layers, select_range)]
    if criterion == "ghost-aware":
        blocks = {pre: (pre, pre + num_remove) for pre in starts}
        return {pre: -ghost_error_share(stats[block]) for pre, block in blocks.items() if block in (stats or {})}
    if criterion == "streamline":
        return {i: float(similarity.cosine[i, i + num_remove]) for i in starts}
    if criterion == "angular":
        return {i: -float(similarity.angular[i, i + num_remove]) for i in starts}
    raise GhostLayersError(f"'{criterion}' is not a contiguous-block criterion; use one of {CONTIGUOUS}.")


def loss_candidates(
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    count: int = 8,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list[list[int]]:
    """About ``count`` distinct removals within ``select_range`` to score by loss: the shortgpt set, then
    the best blocks by streamline, angular and (with ``stats``) ghost residual, taken in turn, best first."""
    rankings = []
    for criterion in ("streamline", "angular", "ghost-aware"):
        if criterion == "ghost-aware" and not stats:
            continue
        scores = block_scores(criterion, similarity, num_remove, num_layers, stats, select_range)
        rankings.append([list(range(i, i + num_remove)) for i in sorted(scores, key=scores.__getitem__, reverse=True)])
    candidates = [select("shortgpt", similarity, num_remove, num_layers, select_range=select_range)]
    for rank in range(max(map(len, rankings))):
        for ranking in rankings:
            if len(candidates) < count and rank < len(ranking) and ranking[rank] not in candidates:
                candidates.append(ranking[rank])
    return candidates


def select(
    criterion: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list[int]:
    """Layers to remove under ``criterion`` among those of ``select_range`` (the recovery-aware criteria
    also need the candidates' ``stats``)."""
    validate_count(num_remove, num_layers, select_range)
    allowed = selectable(num_layers, select_range)
    if criterion == "ghost-aware-runs":
        costs = {p: ghost_error_share(s) for p, s in (stats or {}).items() if p[0] in allowed and p[1] - 1 in allowed}
        return best_runs(costs, num_remove, num_layers)
    if criterion == "shortgpt":
        influence = {k: 1 - float(similarity.cosine[k, k + 1]) for k in allowed}
        return sorted(sorted(allowed, key=influence.__getitem__)[:num_remove])
    if criterion in CONTIGUOUS:
        scores = block_scores(criterion, similarity, num_remove, num_layers, stats, select_range)
        start = max(scores, key=scores.__getitem__)
        return list(range(start, start + num_remove))
    raise GhostLayersError(f"Unknown selection criterion '{criterion}'. Choose one of: {', '.join(CRITERIA)}.")
