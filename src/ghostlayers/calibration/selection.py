"""Which layers to remove: parsing manual indices, and choosing them by a criterion of ``criteria`` (what
each criterion chooses, needs and scores is its record there; here is how each kind of choice is made).

All criteria read ``Similarity`` (per-token cosine over the hidden dimension, averaged over tokens), and
the recovery-aware ones the candidates' ``PairStats`` (no extra pass):
- ``streamline`` (LLM-Streamline), ``angular`` (Gromov et al.) and ``ghost-aware`` choose one block of
  ``n`` layers, the start of highest score (``block_scores``);
- ``shortgpt`` (ShortGPT) the ``n`` single layers of lowest block influence 1 − cos(Xₖ, Xₖ₊₁);
- ``ghost-aware-runs``: the non-contiguous variant: any set of runs of ``n`` layers in all (each run
  repaired by its own operator), minimising the sum of the runs' relative residuals, solved exactly by
  dynamic programming over the residuals of every run of at most ``n`` layers (``best_runs``). The sum is a
  proxy: it ignores how one run's leftover error changes the next run's inputs.
- ``loss``: the candidate of lowest held-out language-model loss once repaired, among about eight:
  the best blocks by streamline cosine, angular distance and ghost residual, and the shortgpt set
  (``loss_candidates``; scored by ``choices.choose_candidate``). The boundary residual does not track
  perplexity (it is dominated by the attention-sink token), so the loss itself decides.

Every criterion chooses among the layers of its ``select_range``: ``all``, or ``published`` (neither the
first nor the last layer, as in the published LinearPatch / Ghosted Layers selection code).
"""

from __future__ import annotations

from collections import Counter

from ghostlayers.config.settings import DEFAULT_SELECT_RANGE, check_select_range, read_layers
from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics.sums import PairStats, Similarity
from ghostlayers.registry.criteria import BLOCK, LAYERS, RUNS, Criterion, criterion, ghost_error_share

__all__ = ["ghost_error_share"]  # where the tests and benchmarks have found it


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
    name: str, num_remove: int, num_layers: int, select_range: str = DEFAULT_SELECT_RANGE
) -> list[tuple[int, int]]:
    """Boundary pairs whose statistics let criterion ``name`` choose in the same pass: every block of ``n``
    layers for a block criterion, every run of at most ``n`` layers for a runs one, none for single layers
    (their runs are known only after selection)."""
    chooses = criterion(name).chooses
    if chooses == BLOCK:
        return runs_within(num_remove, num_layers, select_range)
    if chooses == RUNS:
        return [pair for m in range(1, num_remove + 1) for pair in runs_within(m, num_layers, select_range)]
    return []


def shortlist(
    name: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    size: int,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list:
    """At most ``size`` candidate pairs of a criterion that reads their sums, the most similar by cosine,
    when the statistics of all candidates do not fit in memory; a runs criterion always keeps the single
    layers so that some selection exists."""
    pairs = candidate_pairs(name, num_remove, num_layers, select_range)
    ranked = sorted(pairs, key=lambda p: float(similarity.cosine[p]), reverse=True)
    if criterion(name).chooses == BLOCK:
        return ranked[: max(1, size)]
    singles = runs_within(1, num_layers, select_range)
    return singles + [p for p in ranked if p[1] - p[0] > 1][: max(0, size - len(singles))]


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


def scores(
    chosen: Criterion,
    similarity: Similarity,
    pairs: list[tuple[int, int]],
    stats: dict[tuple[int, int], PairStats] | None = None,
) -> dict[tuple[int, int], float]:
    """``chosen``'s score of each of ``pairs``; a criterion that reads the candidates' sums scores only the
    pairs that have them."""
    if chosen.candidate_stats:
        pairs = [p for p in pairs if p in (stats or {})]
    return {p: chosen.score(similarity, stats, p) for p in pairs}


def block_scores(
    name: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> dict[int, float]:
    """Score of removing block ``i..i+n-1`` for each candidate start ``i`` in the select range (higher is
    better to remove) under the block criterion ``name``."""
    chosen = criterion(name)
    if chosen.chooses != BLOCK or chosen.score is None:
        raise GhostLayersError(f"'{name}' does not score blocks of layers.")
    blocks = runs_within(num_remove, num_layers, select_range)
    return {pre: score for (pre, _), score in scores(chosen, similarity, blocks, stats).items()}


def loss_candidates(
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    count: int = 8,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list[list[int]]:
    """About ``count`` distinct removals within ``select_range`` to score by loss: the choice of each
    criterion ``loss`` names that chooses single layers (the shortgpt set), then the best blocks by each one
    that scores blocks (streamline, angular and, with ``stats``, ghost residual), taken in turn, best first."""
    pool = [criterion(name) for name in criterion("loss").by_loss]
    singles = [c for c in pool if c.chooses == LAYERS]
    candidates = [select(c.name, similarity, num_remove, num_layers, select_range=select_range) for c in singles]
    rankings = []
    for chosen in pool:
        if chosen.chooses != BLOCK or (chosen.candidate_stats and not stats):
            continue
        ranked = block_scores(chosen.name, similarity, num_remove, num_layers, stats, select_range)
        rankings.append([list(range(i, i + num_remove)) for i in sorted(ranked, key=ranked.__getitem__, reverse=True)])
    for rank in range(max(map(len, rankings))):
        for ranking in rankings:
            if len(candidates) < count and rank < len(ranking) and ranking[rank] not in candidates:
                candidates.append(ranking[rank])
    return candidates


def select(
    name: str,
    similarity: Similarity,
    num_remove: int,
    num_layers: int,
    stats: dict[tuple[int, int], PairStats] | None = None,
    select_range: str = DEFAULT_SELECT_RANGE,
) -> list[int]:
    """Layers to remove under criterion ``name`` among those of ``select_range`` (the recovery-aware criteria
    also need the candidates' ``stats``)."""
    chosen = criterion(name)
    validate_count(num_remove, num_layers, select_range)
    allowed = selectable(num_layers, select_range)
    if chosen.score is None:
        raise GhostLayersError(f"--select {name} is chosen by held-out loss among candidate removals, not here.")
    if chosen.chooses == RUNS:
        pairs = candidate_pairs(name, num_remove, num_layers, select_range)
        costs = {p: -score for p, score in scores(chosen, similarity, pairs, stats).items()}
        return best_runs(costs, num_remove, num_layers)
    if chosen.chooses == LAYERS:
        single = scores(chosen, similarity, [(k, k + 1) for k in allowed])
        influence = {k: -score for (k, _), score in single.items()}
        return sorted(sorted(allowed, key=influence.__getitem__)[:num_remove])
    ranked = block_scores(name, similarity, num_remove, num_layers, stats, select_range)
    start = max(ranked, key=ranked.__getitem__)
    return list(range(start, start + num_remove))
