"""The guard: the repaired model against plain pruning on held-out windows of every calibration domain,
and the shrinkage ``α`` (``W = I + αM``) chosen by that loss.

A repair fitted on one domain can make text of another worse than no repair at all (the 1.5B measurements
of issue #19). The boundary residual the fit minimises cannot see that; the language-model loss on windows
the fit never saw can. Every α is a rescaling of the same fitted repair (``surgery.scale_repair``), so
scoring one costs a forward pass of the pruned model over the held-out windows and no new statistics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.config.settings import DEFAULT_BATCH_SIZE, ON_HELD_OUT
from ghostlayers.measure.perplexity import perplexity
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.model.surgery import repair_scaled

ALPHA_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Guard:
    """Held-out perplexity of each domain at each α tried (α = 0 is plain pruning) and the α kept."""

    alpha: float
    perplexity: dict[float, dict[str, float]]
    seconds: float = 0.0
    windows: dict[str, int] = field(default_factory=dict)

    @property
    def plain(self) -> dict[str, float]:
        return self.perplexity[0.0]

    def hurt(self, alpha: float | None = None) -> list[str]:
        """Domains where the repair at ``alpha`` (default: the kept one) is worse than plain pruning."""
        return worse(self.perplexity[self.alpha if alpha is None else alpha], self.plain)

    def verdict(self) -> dict:
        """What the guard found, as a pruned model's record keeps it: each α's held-out perplexity per domain,
        the windows scored, the α kept and the domains it is worse than plain pruning on."""
        return {
            "alpha": self.alpha,
            "perplexity": {str(a): p for a, p in self.perplexity.items()},
            "windows": self.windows,
            "hurt": self.hurt(),
        }

    def to_dict(self) -> dict:
        """The verdict and what it cost (a run's report)."""
        return {**self.verdict(), "seconds": self.seconds}


def mean_log(perplexity: dict[str, float]) -> float:
    """Mean log-perplexity over domains: the mean held-out loss, each domain weighted alike."""
    return sum(math.log(v) for v in perplexity.values()) / len(perplexity)


def worse(scores: dict[str, float], than: dict[str, float]) -> list[str]:
    """The domains where ``scores`` (held-out perplexity) are above ``than``'s: the one rule by which a repair
    or a heal is said to hurt."""
    return [d for d, value in scores.items() if value > than[d]]


def safe_keys(scores: dict, baseline) -> list:
    """The keys of ``scores`` (α values, or methods) worse than ``baseline`` (plain pruning: α = 0, or
    ``none``) on no domain: a repair may help some text less, never hurt it. ``baseline`` is always one."""
    return [k for k, p in scores.items() if not worse(p, scores[baseline])]


def best_safe(scores: dict, baseline):
    """The key of ``scores`` with the lowest mean log-perplexity over domains among ``safe_keys``;
    ``baseline`` itself when every other choice hurts somewhere."""
    return min(safe_keys(scores, baseline), key=lambda k: mean_log(scores[k]))


def largest_safe(scores: dict[float, dict[str, float]]) -> float:
    """The largest α of ``scores`` (``{α: {domain: perplexity}}``) worse than α = 0 on no domain: the repair
    shrunk only as far as the left-out text needs, not to where that text is best."""
    return max(safe_keys(scores, 0.0))


def blended_safe(left_out: dict[float, dict[str, float]], in_domain: dict[float, dict[str, float]]) -> float:
    """The safe α (on the left-out domains) with the lowest mean of the left-out and the in-domain held-out
    mean log-perplexity: text like the calibration counts as much as text unlike it."""
    return min(safe_keys(left_out, 0.0), key=lambda a: (mean_log(left_out[a]) + mean_log(in_domain[a])) / 2)


def shared_depth(pairs: Iterable[tuple[int, int]]) -> int:
    """How many leading decoder layers every repair of the runs ``pairs`` leaves as they are: those before
    the first removed layer, less the one whose down-projection ReplaceMe rewrites."""
    return max(0, min(pre for pre, _ in pairs) - 1)


def domain_perplexity(
    model: PreTrainedModel,
    heldout: dict[str, Tensor],
    batch_size: int,
    progress: bool,
    label: str,
    prefix: SharedPrefix | None = None,
) -> dict[str, float]:
    """Perplexity of ``model`` on each domain's held-out windows, from the shared ``prefix`` when given."""
    return {
        domain: perplexity(model, windows, batch_size, progress, f"{label} {domain}", prefix)
        for domain, windows in heldout.items()
    }


def run_guard(
    model: PreTrainedModel,
    heldout: dict[str, Tensor],
    unfolded: dict[str, Tensor],
    alpha: float | str = 1.0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    prefix: SharedPrefix | None = None,
) -> Guard:
    """Score the pruned, repaired ``model`` on each domain's held-out windows at α = 0 (plain pruning) and
    at ``alpha``, or at every α of ``ALPHA_GRID`` for ``ON_HELD_OUT`` (``alpha_rule``'s "chosen on these
    windows"), which keeps ``best_safe``'s.
    The model is left as it was (α = 1). The layers before ``prefix``'s depth (``shared_depth``) run once."""
    start = time.perf_counter()
    alphas = ALPHA_GRID if alpha == ON_HELD_OUT else tuple(sorted({0.0, float(alpha)}))
    scores = {}
    for a in alphas:
        with repair_scaled(model, a, unfolded):
            scores[a] = domain_perplexity(model, heldout, batch_size, progress, f"guard α={a}", prefix)
    kept = best_safe(scores, 0.0) if alpha == ON_HELD_OUT else float(alpha)
    windows = {domain: int(w.shape[0]) for domain, w in heldout.items()}
    return Guard(kept, scores, time.perf_counter() - start, windows)
