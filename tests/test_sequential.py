"""Sequential fitting against numpy least squares on a separately pruned-and-patched model."""

from __future__ import annotations

import numpy as np
import torch
from conftest import random_batches, tiny_model
from test_operators import captured_states, rel

import ghostlayers
from ghostlayers.model.surgery import patched_view


def delta_of(model, key: str) -> np.ndarray:
    return model.state_dict()[key].double().numpy()


def test_second_operator_is_fitted_on_the_patched_inputs():
    batches = random_batches(num=4, seq=20)
    dense = tiny_model("llama", seed=5).double()
    target = captured_states(dense, batches, [5])[5]  # dense input of original layer 5
    # independent route: prune only the first run (its operator is fitted on dense inputs either way) ...
    first = ghostlayers.prune(tiny_model("llama", seed=5).double(), batches, layers=[1], ridge=0.0, progress=False)
    x = captured_states(first.model, batches, [3])[3]  # ... and read the input of original layer 4 (new index 3)
    m, *_ = np.linalg.lstsq(x, target - x, rcond=None)

    seq = ghostlayers.prune(
        tiny_model("llama", seed=5).double(), batches, layers=[1, 4], ridge=0.0, fit="sequential", progress=False
    )
    par = ghostlayers.prune(tiny_model("llama", seed=5).double(), batches, layers=[1, 4], ridge=0.0, progress=False)
    key2 = "model.layers.3.ghost_operator.delta"  # host of run (4, 5): original layer 5, new index 3
    assert rel(delta_of(seq.model, key2), m) < 1e-6
    assert rel(delta_of(par.model, key2), m) > 1e-3  # the paper's dense fit is a different operator
    key1 = "model.layers.1.ghost_operator.delta"
    np.testing.assert_allclose(delta_of(seq.model, key1), delta_of(first.model, key1), atol=1e-12)
    assert seq.model.config.ghostlayers["fit"] == "sequential"


def test_patched_view_restores_the_dense_model():
    model = tiny_model("gemma3_text").double()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with patched_view(model, {(1, 3): torch.eye(64, dtype=torch.float64) * 1.5}):
            assert model.config.num_hidden_layers == 4
            assert not torch.allclose(model(input_ids=ids).logits, before)
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.state_dict().keys() == state.keys() and model.config.num_hidden_layers == 6
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(6))


def test_sequential_linearpatch_takes_per_sequence_ratios_of_the_patched_inputs():
    """The sequential driver gathers LinearPatch's per-sequence ratios too: the second run's scale is the
    mean over sequences of mean|dense target| / mean|patched input|, per channel."""
    batches = random_batches(num=4, seq=20)
    target = captured_states(tiny_model("llama", seed=5).double(), batches, [5], per_sequence=True)[5]
    first = ghostlayers.prune(
        tiny_model("llama", seed=5).double(), batches, layers=[1], method="linearpatch", progress=False
    )
    x = captured_states(first.model, batches, [3], per_sequence=True)[3]
    scale = (np.abs(target).mean(1) / np.abs(x).mean(1)).mean(0)
    seq = ghostlayers.prune(
        tiny_model("llama", seed=5).double(),
        batches,
        layers=[1, 4],
        method="linearpatch",
        fit="sequential",
        progress=False,
    )
    w = np.eye(64) + delta_of(seq.model, "model.layers.3.ghost_operator.delta")
    assert rel(w, np.diag(scale)) < 1e-6
