"""Shrinkage ``W = I + αM``, the held-out guard against plain pruning, and mixed-domain calibration."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, random_batches, tiny_model
from test_cli import base_args, run

import ghostlayers
import ghostlayers.repair.choices
from ghostlayers.measure.perplexity import eval_windows, perplexity
from ghostlayers.model.record import PruneRecord
from ghostlayers.repair.choices import FitSettings
from ghostlayers.sources.corpora import calibration_sources
from ghostlayers.sources.windows import calibration_set, split_shared_text
from ghostlayers.store.saving import saved_record


def plain_pruning(model, removed: list[int]):
    """The dense model with ``removed`` deleted by hand: no operator, no folded map."""
    kept = [i for i in range(model.config.num_hidden_layers) if i not in removed]
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in kept])
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(kept)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("method", ["ghost", "linearpatch", "replaceme", "refit"])
def test_alpha_zero_is_plain_pruning_and_alpha_one_the_full_fit(method):
    batches, ids = random_batches(num=4, seed=1), random_batches(num=1, seed=5)[0]
    plain = logits(plain_pruning(tiny_model("llama"), [2, 3]), ids)
    shrunk = {
        a: ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", method=method, alpha=a, progress=False)
        for a in (0.0, 0.5, 1.0)
    }
    full = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", method=method, progress=False)
    torch.testing.assert_close(logits(shrunk[0.0].model, ids), plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(shrunk[1.0].model, ids), logits(full.model, ids))
    assert (logits(shrunk[0.5].model, ids) - plain).abs().max() > 1e-3  # in between: neither of the two
    assert shrunk[0.5].model.config.ghostlayers["alpha"] == 0.5


def test_guard_flags_a_repair_that_hurts_and_auto_falls_back(tmp_path):
    """Fitted on domain A (tokens 3..10 only), the operator meets states it never saw on domain B (tokens
    60..127). The guard's perplexities must equal ones computed here on hand-built models, it must flag the
    domains where the repair is worse, and --alpha auto must keep an α that hurts neither domain."""
    g = torch.Generator().manual_seed(0)
    calibration = list(torch.randint(3, 11, (8, 2, 16), generator=g))
    heldout = {"A": torch.randint(3, 11, (4, 16), generator=g), "B": torch.randint(60, VOCAB, (4, 16), generator=g)}
    plain = plain_pruning(tiny_model("llama"), [2, 3])
    full = ghostlayers.prune(tiny_model("llama"), calibration, layers="2:4", ridge=1e-9, progress=False).model
    expected = {
        0.0: {d: perplexity(plain, w, progress=False) for d, w in heldout.items()},
        1.0: {d: perplexity(full, w, progress=False) for d, w in heldout.items()},
    }
    hurt = [d for d in heldout if expected[1.0][d] > expected[0.0][d]]
    assert "B" in hurt  # the construction: the repair fitted on A makes B worse than plain pruning
    result = ghostlayers.prune(
        tiny_model("llama"), calibration, layers="2:4", ridge=1e-9, heldout=heldout, alpha="auto", progress=False
    )
    for a in (0.0, 1.0):
        for d in heldout:
            assert result.guard.perplexity[a][d] == pytest.approx(expected[a][d], rel=1e-5)
    assert result.guard.hurt(1.0) == hurt
    assert result.guard.hurt() == [] and result.alpha < 1.0
    kept = result.guard.perplexity[result.alpha]
    assert all(kept[d] <= expected[0.0][d] for d in heldout)
    # the saved folder's record carries the verdict and the α it settled, typed fields read back
    ghostlayers.save(result.model, None, tmp_path / "out")
    record = PruneRecord.from_dict(saved_record(tmp_path / "out"))
    assert record.alpha == result.alpha and record.guard["hurt"] == [] and record.ridge == 1e-9
    for a in (0.0, 1.0):
        assert record.guard["perplexity"][str(a)] == pytest.approx(expected[a], rel=1e-5)


def test_cli_warns_when_the_repair_hurts(model_folder, tmp_path):
    """The CLI prints the guard's table and says plainly when the kept repair loses on a source."""
    report_dir = tmp_path / "report"
    result = run(
        *base_args(model_folder), "--layers", "2:4", "--ridge", "1e-9", "--alpha", "1", "--report-dir", str(report_dir)
    )
    assert result.exit_code == 0, result.output
    guard = json.loads((report_dir / "report.json").read_text())["guard"]
    assert set(guard["perplexity"]) == {"0.0", "1.0"} and guard["windows"] == {
        str(model_folder.parent / "calib.txt"): 2
    }
    text = " ".join(result.output.split())
    assert "held-out perplexity" in text
    assert ("worse than plain pruning" in text) == bool(guard["hurt"])


def test_mix_is_wiki_web_and_code_and_files_may_be_added():
    assert calibration_sources("mix") == ["wiki", "web", "code"]
    assert calibration_sources("mix, notes.txt,wiki,austen") == ["wiki", "web", "code", "notes.txt", "austen"]


def test_calibration_shares_and_heldout_windows_are_disjoint_from_each_other_and_from_evaluation():
    """Token values are positions: three sources of different lengths, one of them also the evaluation
    text. Windows are shared 4/3/3, held-out windows never overlap calibration windows, and none overlaps
    the evaluation windows cut from the shared source's end."""
    texts = {"a": torch.arange(0, 1000), "b": torch.arange(1000, 3000), "c": torch.arange(3000, 3400)}
    texts["a"], test = split_shared_text(texts["a"], 20, 5)
    evaluation = set(eval_windows(test, 20).flatten().tolist())
    drawn = calibration_set(texts, 10, 20, seed=3, heldout=2)
    assert {k: v.shape[0] for k, v in drawn.windows.items()} == {"a": 4, "b": 3, "c": 3}
    assert {k: v.shape[0] for k, v in drawn.heldout.items()} == {"a": 2, "b": 2, "c": 2}
    for name in texts:
        calib, held = set(drawn.windows[name].flatten().tolist()), set(drawn.heldout[name].flatten().tolist())
        assert calib.isdisjoint(held) and calib.isdisjoint(evaluation) and held.isdisjoint(evaluation)
        assert calib | held <= set(texts[name].tolist())
    assert [b.shape[0] for b in drawn.batches(3)] == [3, 1, 3, 3] and drawn.batch_domains(3) == ["a", "a", "b", "c"]
    # the calibration windows do not depend on how many are held out
    assert torch.equal(calibration_set(texts, 10, 20, seed=3).windows["b"], drawn.windows["b"])


def test_method_auto_scores_every_method_on_the_untouched_model_and_keeps_the_best_safe_one():
    """Scores equal the held-out perplexity of models pruned the usual way with each method; scoring
    leaves the dense model exactly as it was; the kept method is the lowest mean log-perplexity among
    those worse than plain pruning nowhere (computed here from the independent perplexities)."""
    import math

    batches = random_batches(num=4, seed=1)
    g = torch.Generator().manual_seed(7)
    heldout = {"x": torch.randint(0, VOCAB, (2, 16), generator=g), "y": torch.randint(0, VOCAB, (2, 16), generator=g)}
    dense, ids = tiny_model("llama"), random_batches(num=1, seed=9)[0]
    before = logits(dense, ids)
    made = ghostlayers.plan(dense, batches, layers="2:4", replaceme=True, progress=False)
    scores = ghostlayers.repair.choices.score_methods(dense, made, heldout, FitSettings(progress=False))
    torch.testing.assert_close(logits(dense, ids), before, rtol=0, atol=0)
    expected = {}
    for method in scores:
        pruned = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", method=method, progress=False).model
        expected[method] = {d: perplexity(pruned, w, progress=False) for d, w in heldout.items()}
        for d in heldout:
            assert scores[method][d] == pytest.approx(expected[method][d], rel=1e-5)
    assert set(scores) == {"ghost", "linearpatch", "linearpatch-rotate", "replaceme", "none"}
    safe = [m for m in expected if all(expected[m][d] <= expected["none"][d] for d in heldout)]
    best = min(safe, key=lambda m: sum(math.log(v) for v in expected[m].values()))
    result = ghostlayers.prune(
        tiny_model("llama"), batches, layers="2:4", method="auto", heldout=heldout, progress=False
    )
    assert result.method == best and result.method_scores.keys() == scores.keys()


def test_ridge_auto_keeps_the_ridge_of_lowest_held_out_perplexity():
    """Each ridge's score equals the held-out perplexity of the model pruned at that ridge the usual way."""
    from ghostlayers.repair.choices import LOSS_RIDGE_GRID
    from ghostlayers.repair.guard import mean_log

    batches = random_batches(num=4, seed=1)
    heldout = {"x": torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(11))}
    result = ghostlayers.prune(
        tiny_model("llama"), batches, layers="2:4", ridge="auto", heldout=heldout, progress=False
    )
    expected = {}
    for ridge in LOSS_RIDGE_GRID:
        pruned = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", ridge=ridge, progress=False).model
        expected[f"{ridge:g}"] = {"x": perplexity(pruned, heldout["x"], progress=False)}
        assert result.ridge_scores[f"{ridge:g}"]["x"] == pytest.approx(expected[f"{ridge:g}"]["x"], rel=1e-5)
    best = min(expected, key=lambda r: mean_log(expected[r]))
    assert result.boundaries[0].ridge == float(best)


def test_group_sums_equal_separate_calibrations():
    """Each domain's sums kept apart in the one pass equal a calibration on that domain's batches alone."""
    from ghostlayers.calibration.passes import calibrate

    model, batches = tiny_model("llama"), random_batches(num=4, seed=3)
    together = calibrate(model, batches, [(2, 4)], groups=["a", "b", "a", "b"], progress=False)
    for group, indices in (("a", [0, 2]), ("b", [1, 3])):
        alone = calibrate(model, [batches[i] for i in indices], [(2, 4)], progress=False)
        for want, have in zip(alone.pairs[(2, 4)].tensors(), together.groups[group][(2, 4)].tensors(), strict=True):
            torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9)


def test_leave_out_equals_calibrating_without_that_domain():
    """A plan of three domains less one (``choices.leave_out``) holds the sums of a calibration on the other
    two alone, ReplaceMe's included, and the remaining domains' own sums; a fold of a leave-one-domain-out
    benchmark needs no calibration of its own. A plan without that domain's sums is refused."""
    from ghostlayers.errors import GhostLayersError
    from ghostlayers.repair.choices import leave_out

    model, batches = tiny_model("llama"), random_batches(num=6, seed=5)
    labels = ["a", "b", "c", "a", "b", "c"]
    made = ghostlayers.plan(model, batches, layers="2:4", replaceme=True, groups=labels, progress=False)
    fold = leave_out(made, "b")
    others = [b for b, label in zip(batches, labels, strict=True) if label != "b"]
    alone = ghostlayers.plan(
        model, others, layers="2:4", replaceme=True, groups=[g for g in labels if g != "b"], progress=False
    )
    assert sorted(fold.calibration.groups) == ["a", "c"] and fold.removed == alone.removed
    for sums, want in [(fold.calibration.pairs, alone.calibration.pairs)] + [
        (fold.calibration.groups[g], alone.calibration.groups[g]) for g in ("a", "c")
    ]:
        for have, expected in zip(sums[(2, 4)].tensors(), want[(2, 4)].tensors(), strict=True):
            torch.testing.assert_close(have, expected, rtol=1e-9, atol=1e-9)
    assert made.calibration.pairs[(2, 4)].count == 6 * 2 * 16  # the plan it came from is untouched
    with pytest.raises(GhostLayersError, match="groups="):
        leave_out(ghostlayers.plan(model, batches, layers="2:4", progress=False), "b")


def test_alpha_auto_leaves_each_domain_out_of_the_fit():
    """With two calibration domains, each α's score on a domain equals the held-out perplexity of a model
    calibrated on the other domain alone and shrunk to α (pruned here the usual way), and the kept α is the
    largest of those that hurt neither left-out domain."""

    g = torch.Generator().manual_seed(0)
    domains = {"A": (3, 11), "B": (60, VOCAB)}
    batches = {d: list(torch.randint(lo, hi, (3, 2, 16), generator=g)) for d, (lo, hi) in domains.items()}
    heldout = {d: torch.randint(lo, hi, (2, 16), generator=g) for d, (lo, hi) in domains.items()}
    result = ghostlayers.prune(
        tiny_model("llama"),
        batches["A"] + batches["B"],
        layers="2:4",
        alpha="auto",
        heldout=heldout,
        batch_domains=["A"] * 3 + ["B"] * 3,
        progress=False,
    )
    expected: dict[str, dict[str, float]] = {}
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        expected[f"{alpha:g}"] = {}
        for left_out, other in (("A", "B"), ("B", "A")):
            pruned = ghostlayers.prune(tiny_model("llama"), batches[other], layers="2:4", alpha=alpha, progress=False)
            expected[f"{alpha:g}"][left_out] = perplexity(pruned.model, heldout[left_out], progress=False)
            assert result.alpha_scores[f"{alpha:g}"][left_out] == pytest.approx(
                expected[f"{alpha:g}"][left_out], rel=1e-4
            )
    plain = expected["0"]
    safe = [float(a) for a, p in expected.items() if all(p[d] <= plain[d] for d in p)]
    assert result.alpha == max(safe)


def test_held_out_choices_score_the_fit_the_ridge_mode_asks_for():
    """With --ridge-mode absolute, --method auto scores ghost at λ = ridge (here 1.0, strong at this scale),
    the fit that is then applied: its score equals the perplexity of a model pruned that way."""
    batches = random_batches(num=4, seed=1)
    heldout = {"x": torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(13))}
    result = ghostlayers.prune(
        tiny_model("llama"), batches, layers="2:4", method="auto", ridge=1.0, ridge_mode="absolute",
        heldout=heldout, progress=False,
    )  # fmt: skip
    pruned = ghostlayers.prune(
        tiny_model("llama"), batches, layers="2:4", ridge=1.0, ridge_mode="absolute", progress=False
    ).model
    relative = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", ridge=1.0, progress=False).model
    expected = perplexity(pruned, heldout["x"], progress=False)
    assert expected != pytest.approx(perplexity(relative, heldout["x"], progress=False), rel=1e-4)
    assert result.method_scores["ghost"]["x"] == pytest.approx(expected, rel=1e-5)


def test_one_plan_serves_every_held_out_choice():
    """A plan made once with each domain's sums and the ReplaceMe statistics gives, applied to fresh copies,
    the same models as separate ``prune`` calls for α auto (left-out domains), method auto and replaceme α
    auto, and leaves the dense model untouched: a comparison of methods and α costs one calibration."""
    import copy

    g = torch.Generator().manual_seed(0)
    domains = {"A": (3, 11), "B": (60, VOCAB)}
    batches = [b for lo, hi in domains.values() for b in torch.randint(lo, hi, (3, 2, 16), generator=g)]
    heldout = {d: torch.randint(lo, hi, (2, 16), generator=g) for d, (lo, hi) in domains.items()}
    labels, ids = ["A"] * 3 + ["B"] * 3, random_batches(num=1, seed=9)[0]
    dense = tiny_model("llama")
    before = logits(dense, ids)
    made = ghostlayers.plan(dense, batches, layers="2:4", replaceme=True, groups=labels, progress=False)
    for method, alpha in (("ghost", "auto"), ("auto", 1.0), ("replaceme", "auto")):
        shared = ghostlayers.apply_plan(
            copy.deepcopy(dense), made, method, alpha=alpha, heldout=heldout, batch_size=2, progress=False
        )
        alone = ghostlayers.prune(
            tiny_model("llama"), batches, layers="2:4", method=method, alpha=alpha, heldout=heldout,
            batch_domains=labels, progress=False,
        )  # fmt: skip
        assert (shared.method, shared.alpha) == (alone.method, alone.alpha)
        assert (shared.alpha_scores is not None) == (alpha == "auto") and shared.alpha_scores == alone.alpha_scores
        torch.testing.assert_close(logits(shared.model, ids), logits(alone.model, ids))
    torch.testing.assert_close(logits(dense, ids), before, rtol=0, atol=0)


def test_alpha_rules_on_a_hand_made_score_table():
    """The three α rules on a table whose answers are worked out by hand: α = 1 hurts the left-out
    domain b, so no rule may keep it; the loss rule keeps the α best on the left-out text (0.5), the
    largest-safe rule the largest α that hurts nothing (0.75), and the blend counts the in-domain text,
    where α = 0.75 gains most: (log 9 + log 9.5 + 2 log 7) / 4 beats 0.5's (log 8.8 + log 9.4 + 2 log 8) / 4."""
    from ghostlayers.repair.guard import best_safe, blended_safe, largest_safe

    left_out = {
        0.0: {"a": 10.0, "b": 10.0},
        0.25: {"a": 9.5, "b": 9.8},
        0.5: {"a": 8.8, "b": 9.4},
        0.75: {"a": 9.0, "b": 9.5},
        1.0: {"a": 8.5, "b": 10.5},
    }
    in_domain = {0.0: {"c": 12.0}, 0.25: {"c": 10.0}, 0.5: {"c": 8.0}, 0.75: {"c": 7.0}, 1.0: {"c": 6.5}}
    assert best_safe(left_out, 0.0) == 0.5
    assert largest_safe(left_out) == 0.75
    assert blended_safe(left_out, in_domain) == 0.75
    everything_hurts = {0.0: {"a": 1.0}, 0.5: {"a": 1.1}, 1.0: {"a": 1.2}}
    assert largest_safe(everything_hurts) == 0.0
    assert blended_safe(everything_hurts, {0.0: {"c": 2.0}, 0.5: {"c": 1.0}, 1.0: {"c": 0.5}}) == 0.0
