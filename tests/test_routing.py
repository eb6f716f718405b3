"""The calibration route is data: ``routing.choose_route`` decides the passes from the request, the model's
shape and the memory budget alone, so every route is checked here without a model or a forward pass."""

from __future__ import annotations

import pytest

from ghostlayers.calibration.routing import Request, Shape, choose_route, pair_stats_bytes
from ghostlayers.errors import GhostLayersError

SHAPE = Shape(num_layers=8, hidden_size=64)
PLENTY = 2**40


def route(budget: int = PLENTY, shape: Shape = SHAPE, **request):
    return choose_route(Request(**request), shape, budget, "test budget")


def test_given_layers_take_one_pass_over_their_runs():
    chosen = route(layers=[2, 3, 6])
    assert [(p.pairs, p.band, "ztz" in p.sums) for p in chosen.passes] == [("runs", 2, True)]
    assert chosen.reason == "the layers to remove were given"


def test_a_block_criterion_within_the_budget_selects_in_the_single_pass():
    chosen = route(select="streamline", num_remove=2)
    assert [(p.pairs, p.full_depth, p.then) for p in chosen.passes] == [("candidates+singles", True, "select")]
    assert len(chosen.candidates) == 7 and "of the" in chosen.reason


def test_over_the_budget_a_similarity_pass_then_the_chosen_runs():
    chosen = route(budget=pair_stats_bytes(64, 1), select="angular", num_remove=2)
    assert [(p.pairs, p.band, p.then) for p in chosen.passes] == [("none", 2, "select"), ("runs", None, "")]
    assert "over the" in chosen.reason


def test_shortgpt_and_sums_gathered_after_selection_take_two_passes():
    assert route(select="shortgpt", num_remove=2).reason == "shortgpt knows its runs only after selection"
    refit = route(select="streamline", num_remove=2, methods=("refit",))
    assert ["ata" in p.sums for p in refit.passes] == [False, True]
    assert refit.reason == "refit's statistics are gathered for the selected layers only"


def test_recovery_aware_over_the_budget_scores_a_shortlist():
    chosen = route(budget=3 * pair_stats_bytes(64, 1), select="ghost-aware", num_remove=2)
    assert [(p.pairs, p.then) for p in chosen.passes] == [("none", ""), ("shortlist+singles", "select")]
    assert chosen.affordable == 3


def test_loss_gathers_held_candidates_first_and_the_rest_after():
    held = route(select="loss", num_remove=2)
    assert [(p.pairs, p.then) for p in held.passes] == [("candidates", "options"), ("options", "")]
    over = route(budget=0, select="loss", num_remove=2)
    assert over.passes[0].pairs == "none"


def test_replaceme_sums_for_candidates_only_when_asked_and_possible():
    assert "ztz" in route(select="streamline", num_remove=2, methods=("replaceme",)).passes[0].sums
    assert "ztz" in route(select="streamline", num_remove=2, methods=("auto",)).passes[0].sums
    assert "ztz" not in route(select="streamline", num_remove=2).passes[0].sums
    gemma = Shape(num_layers=8, hidden_size=64, foldable=False)
    assert "ztz" not in route(shape=gemma, select="streamline", num_remove=2, methods=("replaceme",)).passes[0].sums
    assert "ztz" not in route(shape=gemma, layers=[2, 3]).passes[0].sums


def test_kept_apart_groups_count_against_the_budget():
    one = pair_stats_bytes(64, 7)
    assert route(budget=one, select="streamline", num_remove=2).passes[0].pairs == "candidates+singles"
    assert route(budget=one, select="streamline", num_remove=2, kept_apart=1).passes[0].pairs == "none"


@pytest.mark.parametrize(
    "request_, message",
    [
        (dict(), "Give either --layers"),
        (dict(layers=[1], select="streamline", num_remove=1), "Give either --layers"),
        (dict(select="streamline"), "needs --num-layers"),
        (dict(select="nearest", num_remove=2), "Unknown selection criterion"),
    ],
)
def test_bad_requests_are_refused(request_, message):
    with pytest.raises(GhostLayersError, match=message):
        route(**request_)
