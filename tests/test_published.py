"""The baselines as their authors' code computes them, re-derived in numpy float64 from hidden states
captured here (``output_hidden_states``, not ghostlayers' sums), against the operators ghostlayers installs.

Published code read for these tests (files and lines at the commit named):

- LinearPatch: github.com/chenxinrui-tsinghua/LinearPatch @ d1274e8782676d13f1f006cae4405db5d0f96721
- Ghosted Layers: github.com/daniel-eai/ghosted_layers_official_repository @ 680c8a75199f23b6ce6cc8a20b08ec73860fea30
- ReplaceMe: github.com/mts-ai/ReplaceMe @ 5bb71d99da40c8b0ba0df488589e14d77ced7fee

Each test also checks that the published formula and the one it replaced (or ghostlayers' default) differ
by far more than the tolerance on the same data, so it can fail.
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import random_batches, tiny_model
from test_operators import captured_states, rel

import ghostlayers
from ghostlayers import operators
from ghostlayers.calibration import calibrate
from ghostlayers.hadamard import orthonormal_hadamard

C = 64  # tiny_model's hidden size


def installed(model, host: int) -> np.ndarray:
    """``W = I + delta`` of the operator in front of (new) decoder layer ``host``."""
    return np.eye(C) + model.state_dict()[f"model.layers.{host}.ghost_operator.delta"].double().numpy()


def sequences(model, batches, boundaries) -> dict[int, np.ndarray]:
    """``[sequences, seq, C]`` hidden states (entry b is the input of layer b)."""
    return captured_states(model, batches, boundaries, per_sequence=True)


def published_scale(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """LinearPatch's scale: for each calibration sequence, the per-channel mean over its tokens of |Y| over
    that of |X|; then the mean of these ratios over sequences."""
    return (np.abs(y).mean(axis=1) / np.abs(x).mean(axis=1)).mean(axis=0)


def ratio_of_sums(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The estimator ghostlayers used before: one ratio of the abs-sums over all tokens."""
    return np.abs(y).sum(axis=(0, 1)) / np.abs(x).sum(axis=(0, 1))


def test_linearpatch_scale_is_the_mean_of_per_sequence_ratios():
    """LinearPatch layer_select.py:6-52 (``get_scale_params``): hooks keep the inputs of layers i and j
    (l.11-15); each loader item is one sequence (datautils_block.py:27-33 slices ``[1, seqlen]`` windows
    from the tokenized corpus, so every position is included and BOS only where the corpus starts); per
    item the channel means of |X_j| and |X_i| over batch and tokens are divided (l.33-34) and summed
    (l.35); the sum is divided by a hard-coded 128 (l.24, l.46), the number of items only when 128 are
    used. The Ghosted Layers repo copies it (lib/pruning.py:25-69). We divide by the actual count."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=2, seq=16)  # 8 sequences of different content
    s = sequences(model, batches, [2, 4])
    expected = np.diag(published_scale(s[2], s[4]))
    result = ghostlayers.prune(
        tiny_model("llama").double(), batches, layers="2:4", method="linearpatch", progress=False
    )
    assert rel(installed(result.model, 2), expected) < 1e-6
    assert rel(np.diag(ratio_of_sums(s[2], s[4])), expected) > 1e-3  # the old estimator would fail


def test_linearpatch_rotate_measures_the_scale_in_the_hadamard_basis():
    """Same estimator on ``X H`` and ``Y H`` (layer_select.py:12-13 multiplies the hooked input by the
    Hadamard matrix), fused as ``H diag(s) Hᵀ`` (block_scaling.py:6-10, applied ``x @ W`` l.23)."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=2, seq=16)
    s = sequences(model, batches, [2, 4])
    h = orthonormal_hadamard(C).numpy()
    expected = h @ np.diag(published_scale(s[2] @ h, s[4] @ h)) @ h.T
    result = ghostlayers.prune(
        tiny_model("llama").double(), batches, layers="2:4", method="linearpatch-rotate", progress=False
    )
    assert rel(installed(result.model, 2), expected) < 1e-6
    old = h @ np.diag(ratio_of_sums(s[2] @ h, s[4] @ h)) @ h.T
    assert rel(old, expected) > 1e-3


def test_linearpatch_scale_does_not_depend_on_the_batch_size():
    """The published loop sees one sequence per batch; ghostlayers takes the ratio per sequence inside each
    batch, so the same 12 sequences batched 1 or 3 at a time give the same scales."""
    model = tiny_model("llama").double()
    rows = torch.cat(random_batches(num=4, batch=3, seq=16))
    s = sequences(model, list(rows.split(1)), [1, 3])
    h = orthonormal_hadamard(C).numpy()
    for size in (1, 3):
        stats = calibrate(model, list(rows.split(size)), [(1, 3)], similarity=False, progress=False).pairs[(1, 3)]
        assert float(stats.sequences) == 12
        assert rel(operators.linearpatch(stats), np.diag(published_scale(s[1], s[3]))) < 1e-6
        rotated = h @ np.diag(published_scale(s[1] @ h, s[3] @ h)) @ h.T
        assert rel(operators.linearpatch_rotate(stats), rotated) < 1e-6
