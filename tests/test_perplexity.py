"""Perplexity against a token-by-token log-softmax computation."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model

from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.perplexity import eval_windows, perplexity
from ghostlayers.measure.prefix import DEFAULT_MEMORY, FOLDER_PREFIX, SharedPrefix
from ghostlayers.model.adapters import decoder_layers


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


@pytest.mark.parametrize("eval_count", [3, None])
def test_shared_text_calibration_and_evaluation_windows_do_not_overlap(eval_count):
    """Token values are positions, so each window names the positions it covers: the calibration windows
    (drawn at random) and the evaluation windows must cover disjoint positions, the latter at the end."""
    from ghostlayers.sources.windows import calibration_windows, split_shared_text

    tokens = torch.arange(1000)
    calib, test = split_shared_text(tokens, 20, eval_count)
    evaluation = eval_windows(test, 20)
    drawn = calibration_windows(calib, calib.numel() // 20, 20, seed=1)
    assert set(drawn.flatten().tolist()).isdisjoint(evaluation.flatten().tolist())
    count = eval_count or 5  # a tenth of the 50 windows
    assert evaluation.shape == (count, 20) and evaluation[-1, -1] == 999
    with pytest.raises(GhostLayersError, match="leave nothing to calibrate"):
        split_shared_text(tokens, 20, 50)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("memory", [DEFAULT_MEMORY, 0], ids=["in-memory", "on-disk"])
def test_scoring_from_a_shared_prefix_skips_its_layers_and_changes_nothing(arch, memory, tmp_path):
    """Variants of a model that share their first layers are scored from the state entering layer 3: the first
    scoring makes the states, the next reads them and runs layers 3..5 only; both equal the full forward's
    perplexity, and the model is left whole. States past the memory bound go to files, removed on close."""
    model = tiny_model(arch)
    windows = torch.randint(0, 128, (5, 16), generator=torch.Generator().manual_seed(1))
    full = perplexity(model, windows, batch_size=2, progress=False)
    layers = list(decoder_layers(model))
    with SharedPrefix(3, memory=memory, folder=tmp_path) as prefix:
        first = perplexity(model, windows, batch_size=2, progress=False, prefix=prefix)
        calls = []
        handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(layers)]
        try:
            shared = perplexity(model, windows, batch_size=2, progress=False, prefix=prefix)
        finally:
            for handle in handles:
                handle.remove()
        assert prefix.made == 3 and bool(list(tmp_path.iterdir())) == (memory == 0)
    assert first == pytest.approx(full, rel=1e-6) and shared == pytest.approx(full, rel=1e-6)
    assert sorted(set(calls)) == [3, 4, 5] and len(calls) == 3 * 3  # three batches, layers 3..5 only
    assert list(decoder_layers(model)) == layers and model.config.num_hidden_layers == 6
    assert perplexity(model, windows, batch_size=2, progress=False) == full
    assert not list(tmp_path.iterdir())  # the spilled states are gone


def test_a_killed_runs_state_folder_is_removed_by_the_next(tmp_path):
    """A process killed before ``close`` leaves its folder of states; the next one to spill removes it."""
    orphan = tmp_path / f"{FOLDER_PREFIX}999999999-abc"
    orphan.mkdir()
    (orphan / "x.pt").write_bytes(b"0" * 10)
    mine = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-abc"
    mine.mkdir()
    with SharedPrefix(1, memory=0, folder=tmp_path) as prefix:
        prefix.put(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, 4))
        assert not orphan.exists() and mine.exists()
        assert torch.equal(prefix.get(torch.zeros(1, 2, dtype=torch.long)), torch.ones(1, 2, 4))
