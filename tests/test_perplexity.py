"""Perplexity against a token-by-token log-softmax computation."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from ghostlayers.errors import GhostLayersError
from ghostlayers.perplexity import eval_windows, perplexity


def test_perplexity_is_exp_mean_token_nll():
    model = tiny_model("llama", num_layers=2)
    tokens = torch.randint(0, 128, (103,), generator=torch.Generator().manual_seed(0))
    windows = eval_windows(tokens, 20)
    assert windows.shape == (5, 20) and torch.equal(windows.flatten(), tokens[:100])
    nll = []
    with torch.no_grad():
        for w in windows:  # one window at a time, each position separately
            logp = torch.log_softmax(model(input_ids=w[None]).logits[0], -1)
            nll += [-float(logp[t, w[t + 1]]) for t in range(19)]
    expected = math.exp(sum(nll) / len(nll))
    assert perplexity(model, windows, batch_size=2, progress=False) == pytest.approx(expected, rel=1e-5)
    assert eval_windows(tokens, 20, max_windows=2).shape == (2, 20)


def test_text_shorter_than_a_window_is_a_clear_error():
    with pytest.raises(GhostLayersError, match="10 tokens, fewer than one window of --seq-len 64"):
        eval_windows(torch.arange(10), 64)
