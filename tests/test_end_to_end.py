"""Slow: the real default model (SmolLM2-135M, 30 layers), pruned by 4 layers, on held-out Wikipedia text."""

from __future__ import annotations

import copy

import pytest

import ghostlayers
from ghostlayers.measure.perplexity import eval_windows, perplexity
from ghostlayers.sources.corpora import load_text
from ghostlayers.sources.windows import batched, calibration_windows, tokenize
from ghostlayers.store.loading import load_model_and_tokenizer

pytestmark = pytest.mark.slow


def test_ghost_beats_plain_pruning_on_held_out_text():
    dense, tokenizer = load_model_and_tokenizer("smollm2-135m", device="cpu")
    assert dense.config.num_hidden_layers == 30
    calib = calibration_windows(tokenize(tokenizer, load_text("wiki", "train")), 16, 256, seed=0)
    test = eval_windows(tokenize(tokenizer, load_text("wiki", "test")), 256, max_windows=12)
    plan = ghostlayers.plan(dense, batched(calib, 4), select="streamline", num_layers=4, progress=False)
    ppl = {"dense": perplexity(dense, test, progress=False)}
    for method in ("none", "ghost"):
        pruned = ghostlayers.apply_plan(copy.deepcopy(dense), plan, method).model
        assert pruned.config.num_hidden_layers == 26
        ppl[method] = perplexity(pruned, test, progress=False)
    print(ppl)
    assert 10 < ppl["dense"] < 60  # a trained model on prose, not a random one
    assert ppl["dense"] < ppl["ghost"] < ppl["none"]
