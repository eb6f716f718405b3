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
import pytest
import torch
from conftest import random_batches, tiny_model
from test_operators import captured_states, rel

import ghostlayers
from ghostlayers.calibration.passes import calibrate
from ghostlayers.calibration.selection import select
from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics import fitting
from ghostlayers.numerics.hadamard import orthonormal_hadamard
from ghostlayers.numerics.sums import Similarity
from ghostlayers.registry.methods import gathered

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


def ghost_absolute(x: np.ndarray, y: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """The published ghost solve: ``W = I + M`` with ``(XᵀX + eps·I) M = Xᵀ(Y − X)`` over all tokens."""
    x, y = (a.reshape(-1, C) for a in (x, y))
    return np.eye(C) + np.linalg.solve(x.T @ x + eps * np.eye(C), x.T @ (y - x))


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
        assert rel(fitting.fit("linearpatch", stats), np.diag(published_scale(s[1], s[3]))) < 1e-6
        rotated = h @ np.diag(published_scale(s[1] @ h, s[3] @ h)) @ h.T
        assert rel(fitting.fit("linearpatch-rotate", stats), rotated) < 1e-6


def test_absolute_ridge_is_the_published_ghost_solve():
    """Ghosted Layers lib/recovery.py:112-127: X_pre and X_post over all calibration tokens, in float64,
    ``(XᵀX + 1e-6·I) M = Xᵀ(X_post − X_pre)`` (l.119-122), ``W = I + M`` (l.123)."""
    batches = random_batches(num=4, batch=1, seq=20)  # 80 tokens for C = 64: the ridge matters
    s = sequences(tiny_model("llama").double(), batches, [2, 4])
    expected = ghost_absolute(s[2], s[4])
    result = ghostlayers.prune(
        tiny_model("llama").double(), batches, layers="2:4", ridge=1e-6, ridge_mode="absolute", progress=False
    )
    assert rel(installed(result.model, 2), expected) < 1e-6
    assert result.model.config.ghostlayers["ridge_mode"] == "absolute"
    relative = ghostlayers.prune(tiny_model("llama").double(), batches, layers="2:4", ridge=1e-6, progress=False)
    assert rel(installed(relative.model, 2), expected) > 1e-5  # ghostlayers' default is another solve


def test_absolute_ridge_is_the_published_replaceme_solve():
    """ReplaceMe ReplaceMe/lstsq.py:154-222: with Z the MLP output of the layer before the block and
    D = X_post + Z − X_pre (l.202-203), ``T = (ZᵀZ + alpha·I)⁻¹ ZᵀD`` (l.221-222), alpha absolute."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=1, seq=20)
    zs = []
    hook = model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: zs.append(o.reshape(-1, C).numpy()))
    s = captured_states(model, batches, [2, 4])
    hook.remove()
    z, x, y = np.concatenate(zs), s[2], s[4]
    alpha = 1e-2
    expected = np.linalg.inv(z.T @ z + alpha * np.eye(C)) @ z.T @ (y + z - x)
    stats = calibrate(model, batches, [(2, 4)], sums=gathered(["replaceme"]), progress=False).pairs[(2, 4)]
    assert rel(fitting.fit("replaceme", stats, alpha, "absolute"), expected) < 1e-6
    assert rel(fitting.fit("replaceme", stats, alpha), expected) > 1e-5


def test_chained_ghost_is_the_product_of_per_layer_operators():
    """Ghosted Layers lib/recovery.py:170-181 fits one operator per removed layer k on the dense
    ``X_k → X_{k+1}`` (``_collect_boundary_activations(teacher, k, k + 1, ...)``); l.184-213 registers
    each as a forward hook on the same kept layer, in layer order, and each hook rewrites the output the
    previous one returned: the stream becomes ``x W_3 W_4``. main.py:207-210, 234-238 use it for ShortGPT's
    selections, consecutive layers included."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=2, seq=16)
    s = sequences(model, batches, [3, 4, 5])
    w3, w4 = ghost_absolute(s[3], s[4]), ghost_absolute(s[4], s[5])
    expected = w3 @ w4
    result = ghostlayers.prune(
        tiny_model("llama").double(),
        batches,
        layers=[3, 4],
        fit="chained",
        ridge=1e-6,
        ridge_mode="absolute",
        progress=False,
    )
    assert rel(installed(result.model, 3), expected) < 1e-6  # kept layer 5 is now layer 3
    assert result.model.config.ghostlayers["fit"] == "chained"
    # the pruned model hands its layer 3 exactly what the published hooks hand it: X_3 W_3 W_4
    seen = []
    handle = result.model.model.layers[3].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).numpy().copy()),
        with_kwargs=True,
    )
    with torch.no_grad():
        for batch in batches:
            result.model(input_ids=batch)
    handle.remove()
    assert rel(np.concatenate(seen), s[3] @ w3 @ w4) < 1e-6  # the operator multiplies in float32
    assert rel(ghost_absolute(s[3], s[5]), expected) > 1e-3  # the run's own fit (--fit dense) differs


def test_chained_linearpatch_is_the_product_of_per_layer_scales():
    """The Ghosted Layers repo chains LinearPatch the same way (lib/recovery.py:268-315); we chain the
    published per-sequence scale of each layer (that repo's per-layer scale is a ratio of token means,
    l.278, and measures the rotated variant's scale in the unrotated basis: see docs/DESIGN.md)."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=2, seq=16)
    s = sequences(model, batches, [3, 4, 5])
    h = orthonormal_hadamard(C).numpy()
    patch = {
        "linearpatch": lambda x, y: np.diag(published_scale(x, y)),
        "linearpatch-rotate": lambda x, y: h @ np.diag(published_scale(x @ h, y @ h)) @ h.T,
    }
    for method, one in patch.items():
        result = ghostlayers.prune(
            tiny_model("llama").double(), batches, layers="3:5", method=method, fit="chained", progress=False
        )
        expected = one(s[3], s[4]) @ one(s[4], s[5])
        assert rel(installed(result.model, 3), expected) < 1e-6, method
        assert rel(one(s[3], s[5]), expected) > 1e-3, method


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(method="replaceme", fit="chained"), "folds its map"),
        (dict(fit="chained", ridge="auto"), "per removed run"),
        (dict(ridge_mode="scaled"), "Unknown --ridge-mode"),
        (dict(select_range="middle"), "Unknown --select-range"),
    ],
)
def test_published_options_refuse_what_they_cannot_do(options, message):
    with pytest.raises(GhostLayersError, match=message):
        ghostlayers.prune(tiny_model("llama"), random_batches(num=2), layers="2:4", progress=False, **options)


def synthetic_similarity(num_layers: int, favourite: list[int]) -> Similarity:
    """Cosines that make the ``favourite`` layers (and blocks starting there) the most removable."""
    cos = torch.full((num_layers + 1, num_layers + 1), 0.5, dtype=torch.float64)
    for k in favourite:
        cos[k, k + 1] = cos[k + 1, k] = 0.99
        cos[k, k + 2 :] = cos[k + 2 :, k] = 0.9
    return Similarity(cos, torch.arccos(cos) / torch.pi, torch.tensor(1.0, dtype=torch.float64))


def test_published_select_range_never_removes_the_first_or_last_layer():
    """LinearPatch layer_select.py:80 and Ghosted Layers lib/pruning.py:96 score the blocks starting at
    1..L−n−1 only (``range(1, max_start)``, ``max_start = L − n``): never layer 0 nor layer L−1.
    (Ghosted Layers' ShortGPT, lib/pruning.py:136-149, scores layers 0..L−2: it never removes the last
    layer, and layer 0 only if it is among the most similar, which we exclude as well.)"""
    sim = synthetic_similarity(8, favourite=[0, 7])
    for criterion in ("streamline", "angular"):
        assert select(criterion, sim, 2, 8) == [0, 1]  # all: the favourite block at the start
        got = select(criterion, sim, 2, 8, select_range="published")
        assert 0 not in got and 7 not in got, criterion
    assert select("shortgpt", sim, 2, 8) == [0, 7]
    assert select("shortgpt", sim, 2, 8, select_range="published") == [1, 2]  # ties: lowest layer first
    assert select("shortgpt", sim, 6, 8, select_range="published") == [1, 2, 3, 4, 5, 6]
    with pytest.raises(GhostLayersError, match="between 1 and 6"):
        select("shortgpt", sim, 7, 8, select_range="published")
    result = ghostlayers.prune(
        tiny_model("llama", num_layers=8, seed=3), random_batches(num=2, seq=20), select="ghost-aware-runs",
        num_layers=3, select_range="published", progress=False,
    )  # fmt: skip
    assert min(result.removed) >= 1 and max(result.removed) <= 6
    assert result.model.config.ghostlayers["select_range"] == "published"
