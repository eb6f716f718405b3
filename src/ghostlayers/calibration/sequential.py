"""Sequential fitting: each operator is fitted on the inputs the pruned-and-patched model produces.

The paper fits every operator on the dense model's activations, so with several removed runs the later
operators see inputs that earlier removals have already changed, and errors compound. Here run ``k``'s
statistics pair the patched model's state at its start (runs ``< k`` removed, their operators applied)
with the dense model's state at its end, for every batch: two forward passes truncated at those
boundaries, on the one model, switched with ``surgery.patched_view``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.calibration.distributed import share_across_ranks
from ghostlayers.calibration.passes import Accumulator, boundary_state
from ghostlayers.model.surgery import patched_view
from ghostlayers.numerics import fitting
from ghostlayers.numerics.sums import PairStats


def sequential_stats(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    pairs: list[tuple[int, int]],
    first: PairStats,
    method: str,
    ridges: dict[tuple[int, int], float],
    ridge_mode: str = fitting.DEFAULT_RIDGE_MODE,
    stats_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> dict[tuple[int, int], PairStats]:
    """Statistics of every run in ``pairs`` (sorted) with earlier runs removed and patched by ``method`` (a
    stream operator: ``Method.sequential``); the first run's are ``first`` (nothing before it changes)."""
    stats = {pairs[0]: first}
    batches = share_across_ranks(list(batches))
    for k, (pre, post) in enumerate(pairs[1:], start=1):
        earlier = {p: fitting.fit(method, stats[p], ridges[p], ridge_mode) for p in pairs[:k]}
        shift = sum(b - a for a, b in pairs[:k])
        sums = Accumulator(model, [(pre, post)], dtype=stats_dtype)
        for t, batch in enumerate(
            tqdm(batches, desc=f"sequential fit {pre}..{post - 1}", unit="batch", disable=not progress)
        ):
            target = boundary_state(model, batch, post)
            with patched_view(model, earlier):
                sums.add(pre, boundary_state(model, batch, pre - shift), t)
            sums.add(post, target, t)
        stats[(pre, post)] = sums.result().pairs[(pre, post)]
    return stats
