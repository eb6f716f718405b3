"""Selection criteria against cosines computed independently from ``output_hidden_states``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import random_batches, tiny_model
from test_operators import captured_states

import ghostlayers
from ghostlayers.calibration.passes import calibrate
from ghostlayers.calibration.selection import best_runs, parse_layers, runs, select
from ghostlayers.errors import GhostLayersError


def numpy_cosines(states: dict[int, np.ndarray], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Means over tokens of the per-token cosine over the hidden dimension, and of arccos(cos)/π."""
    unit = {b: s / np.linalg.norm(s, axis=1, keepdims=True) for b, s in states.items()}
    per_token = np.array(
        [[np.clip(np.sum(unit[a] * unit[b], axis=1), -1, 1) for b in range(size)] for a in range(size)]
    )
    return per_token.mean(-1), (np.arccos(per_token) / np.pi).mean(-1)


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama", num_layers=8, seed=3).double()
    batches = random_batches(num=2, seq=20)
    # boundaries 0..7 from output_hidden_states (hidden_states[8] is after the final norm: not a boundary)
    cos, angle = numpy_cosines(captured_states(model, batches, range(8)), 8)
    sim = calibrate(model, batches, depth=7, progress=False).similarity
    return cos, angle, sim


def test_similarity_equals_per_token_cosine(setting):
    cos, angle, sim = setting
    np.testing.assert_allclose(sim.cosine[:8, :8].numpy(), cos, atol=1e-10)
    np.testing.assert_allclose(sim.angular[:8, :8].numpy(), angle, atol=1e-7)


def test_banded_pass_keeps_the_near_cosines_and_the_pair_sums(setting):
    """With ``band``, states are dropped as soon as nothing later reads them: the cosines of boundaries at
    most ``band`` apart and every pair's sums are still those of the captured states."""
    cos, _, _ = setting
    model = tiny_model("llama", num_layers=8, seed=3).double()
    batches = random_batches(num=2, seq=20)
    pairs = [(1, 6), (2, 4), (5, 7)]  # one pair longer than the band: its pre must be kept meanwhile
    cal = calibrate(model, batches, pairs, depth=7, band=2, progress=False)
    distance = np.abs(np.arange(8)[:, None] - np.arange(8)[None, :])
    banded = cal.similarity.cosine[:8, :8].numpy()
    np.testing.assert_allclose(banded[distance <= 2], cos[distance <= 2], atol=1e-10)
    assert np.isnan(banded[distance > 2]).all()
    states = captured_states(model, batches, range(8))
    for pre, post in pairs:
        x, y = states[pre], states[post]
        np.testing.assert_allclose(cal.pairs[(pre, post)].xty.numpy(), x.T @ y, rtol=1e-10, atol=1e-9)
        np.testing.assert_allclose(cal.pairs[(pre, post)].xtx.numpy(), x.T @ x, rtol=1e-10, atol=1e-9)


def test_criteria_pick_what_the_numpy_cosines_say(setting):
    cos, angle, sim = setting
    n = 2
    # restrict to blocks that end at boundary ≤ 7, where the numpy reference is defined
    best_block = max(range(8 - n), key=lambda i: cos[i, i + n])
    assert select("streamline", _truncated(sim, 7), n, 7) == list(range(best_block, best_block + n))
    influence = [1 - cos[k, k + 1] for k in range(7)]
    assert select("shortgpt", _truncated(sim, 7), 3, 7) == sorted(np.argsort(influence)[:3].tolist())
    closest = min(range(8 - n), key=lambda i: angle[i, i + n])
    assert select("angular", _truncated(sim, 7), n, 7) == list(range(closest, closest + n))


def _truncated(sim, size):
    from ghostlayers.numerics.sums import Similarity

    return Similarity(sim.cos_sum[: size + 1, : size + 1], sim.angle_sum[: size + 1, : size + 1], sim.count)


@pytest.mark.parametrize("criterion", ["streamline", "angular", "shortgpt"])
def test_prune_with_criterion_uses_its_selection(criterion):
    model = tiny_model("llama", num_layers=8, seed=3)
    batches = random_batches(num=2, seq=20)
    sim = calibrate(model, batches, progress=False).similarity
    result = ghostlayers.prune(model, batches, select=criterion, num_layers=3, progress=False)
    assert result.removed == select(criterion, sim, 3, 8)
    assert result.passes == (2 if criterion == "shortgpt" else 1)
    assert [(b.pre, b.post) for b in result.boundaries] == runs(result.removed)


def test_two_pass_fallback_gives_the_same_operator():
    """Single-pass candidate statistics and the low-memory two-pass route agree exactly."""
    batches = random_batches(num=2, seq=20)
    weights = []
    for budget in (2**40, 0):
        model = tiny_model("llama", num_layers=8, seed=3).double()
        result = ghostlayers.prune(
            model, batches, select="streamline", num_layers=2, memory_budget=budget, progress=False
        )
        weights.append(next(v for k, v in model.state_dict().items() if k.endswith("delta")))
        assert result.passes == (1 if budget else 2)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-12)


def test_parse_layers():
    assert parse_layers("12:18", 30) == [12, 13, 14, 15, 16, 17]
    assert parse_layers("9,3,7", 30) == [3, 7, 9]
    assert runs([3, 4, 5, 9, 11, 12]) == [(3, 6), (9, 10), (11, 13)]
    for bad, word in [
        ("3:40", "out of range"),
        ("3,3", "more than once"),
        ("0:30", "all 30"),
        ("a:b", "Cannot read"),
        ("5:5", "empty"),
    ]:
        with pytest.raises(GhostLayersError, match=word):
            parse_layers(bad, 30)


def every_boundary(model, batches, num_layers: int) -> dict[int, np.ndarray]:
    """Boundaries 0..L as numpy arrays; boundary L is the last layer's output, before the final norm."""
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, o: last.append(o.reshape(-1, 64).numpy()))
    states = captured_states(model, batches, range(num_layers))
    hook.remove()
    states[num_layers] = np.concatenate(last)
    return states


def numpy_residual(x: np.ndarray, y: np.ndarray) -> float:
    """‖x W* − y‖² / ‖y‖² with W* = I + the least-squares map of x onto y − x."""
    m, *_ = np.linalg.lstsq(x, y - x, rcond=None)
    return np.linalg.norm(x + x @ m - y) ** 2 / np.linalg.norm(y) ** 2


def mean_cosine(x: np.ndarray, y: np.ndarray) -> float:
    return np.mean(np.sum(x * y, 1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1))


def test_ghost_aware_picks_the_block_ghost_repairs_best():
    """Independent reference: numpy least squares per candidate block on captured hidden states."""
    from ghostlayers.calibration.routing import pair_stats_bytes

    batches = random_batches(num=3, seq=20)
    states = every_boundary(tiny_model("llama", num_layers=8, seed=3).double(), batches, 8)
    n = 2
    residual = {i: numpy_residual(states[i], states[i + n]) for i in range(9 - n)}
    cos = {i: mean_cosine(states[i], states[i + n]) for i in range(9 - n)}
    result = ghostlayers.prune(
        tiny_model("llama", num_layers=8, seed=3).double(), batches, select="ghost-aware", num_layers=n, progress=False
    )
    best = min(residual, key=residual.get)
    assert result.removed == list(range(best, best + n))
    assert result.passes == 1
    # low memory: only the two most cosine-similar blocks are scored (two passes)
    top2 = sorted(cos, key=lambda i: -cos[i])[:2]
    short = ghostlayers.prune(
        tiny_model("llama", num_layers=8, seed=3).double(),
        batches,
        select="ghost-aware",
        num_layers=n,
        memory_budget=2 * pair_stats_bytes(64, 1),
        progress=False,
    )
    assert short.passes == 2
    assert short.removed[0] == min(top2, key=residual.get)


def brute_force_runs(costs: dict, n: int, num_layers: int) -> tuple[float, list[int]]:
    """Every set of ``n`` layers, scored as the summed cost of its maximal runs (the definition)."""
    scored = []
    for subset in itertools.combinations(range(num_layers), n):
        total = sum(costs.get(run, float("inf")) for run in runs(list(subset)))
        scored.append((total, list(subset)))
    return min(scored)


@pytest.mark.parametrize("seed", range(5))
def test_best_runs_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    num_layers, n = 9, 4
    pairs = [(i, i + m) for m in range(1, n + 1) for i in range(num_layers - m + 1)]
    costs = {p: float(rng.uniform(0.1, 1.0)) * (p[1] - p[0]) ** rng.uniform(0.5, 1.5) for p in pairs}
    if seed % 2:  # a shortlist: some runs unknown
        costs = {p: c for p, c in costs.items() if p[1] - p[0] == 1 or rng.random() < 0.5}
    total, expected = brute_force_runs(costs, n, num_layers)
    chosen = best_runs(costs, n, num_layers)
    assert chosen == expected
    assert sum(costs[r] for r in runs(chosen)) == pytest.approx(total)


def test_best_runs_reports_an_impossible_request():
    with pytest.raises(GhostLayersError, match="exactly 3"):
        best_runs({(0, 1): 0.1, (2, 3): 0.2}, 3, 4)


def test_ghost_aware_runs_minimises_the_summed_residual():
    """Independent reference: numpy least squares for every run of at most n layers, then every subset."""
    batches = random_batches(num=3, seq=20)
    states = every_boundary(tiny_model("llama", num_layers=7, seed=5).double(), batches, 7)
    n = 3
    residual = {(i, i + m): numpy_residual(states[i], states[i + m]) for m in range(1, n + 1) for i in range(8 - m)}
    result = ghostlayers.prune(
        tiny_model("llama", num_layers=7, seed=5).double(),
        batches,
        select="ghost-aware-runs",
        num_layers=n,
        progress=False,
    )
    assert result.removed == brute_force_runs(residual, n, 7)[1]
    assert result.passes == 1
    contiguous = min(residual[(i, i + n)] for i in range(8 - n))
    assert sum(residual[r] for r in runs(result.removed)) <= contiguous + 1e-12
    # low memory: the single layers and the two most cosine-similar longer runs are scored (two passes)
    from ghostlayers.calibration.routing import pair_stats_bytes

    longer = sorted((p for p in residual if p[1] - p[0] > 1), key=lambda p: -mean_cosine(*map(states.get, p)))[:2]
    allowed = {p: r for p, r in residual.items() if p[1] - p[0] == 1 or p in longer}
    short = ghostlayers.prune(
        tiny_model("llama", num_layers=7, seed=5).double(),
        batches,
        select="ghost-aware-runs",
        num_layers=n,
        memory_budget=9 * pair_stats_bytes(64, 1),
        progress=False,
    )
    assert short.passes == 2
    assert short.removed == brute_force_runs(allowed, n, 7)[1]


def test_loss_selection_keeps_the_candidate_of_lowest_held_out_perplexity():
    """Every candidate's score equals the held-out perplexity of the model pruned there and repaired with
    ghost the usual way (computed here), the kept one is their argmin, and on this model it differs from
    (and beats) streamline's pick: the criterion the loss corrects."""
    import torch
    from conftest import VOCAB, random_batches, tiny_model

    import ghostlayers
    from ghostlayers.measure.perplexity import perplexity

    batches = random_batches(num=4, seed=0)
    heldout = {"x": torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(100))}
    result = ghostlayers.prune(
        tiny_model("llama", num_layers=8), batches, select="loss", num_layers=2, heldout=heldout, progress=False
    )
    expected = {}
    for label in result.candidate_scores:
        start = int(label.split("..")[0])
        pruned = ghostlayers.prune(
            tiny_model("llama", num_layers=8), batches, layers=f"{start}:{start + 2}", progress=False
        ).model
        expected[label] = perplexity(pruned, heldout["x"], progress=False)
        assert result.candidate_scores[label]["x"] == pytest.approx(expected[label], rel=1e-5)
    assert len(expected) >= 5
    best = min(expected, key=expected.get)
    assert result.removed == [int(best.split("..")[0]), int(best.split("..")[0]) + 1]
    streamline = ghostlayers.prune(
        tiny_model("llama", num_layers=8), batches, select="streamline", num_layers=2, progress=False
    )
    assert streamline.removed != result.removed
    assert expected[best] < expected[f"{streamline.removed[0]}..{streamline.removed[1]}"]


def test_loss_candidates_respect_the_published_range():
    """With --select-range published no candidate removes the first or the last layer."""
    import torch
    from conftest import VOCAB, random_batches, tiny_model

    import ghostlayers

    heldout = {"x": torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))}
    result = ghostlayers.prune(
        tiny_model("llama", num_layers=8), random_batches(num=3), select="loss", num_layers=2, heldout=heldout,
        select_range="published", progress=False,
    )  # fmt: skip
    starts = [int(label.split("..")[0]) for label in result.candidate_scores]
    assert starts and min(starts) >= 1 and max(starts) + 1 <= 6
