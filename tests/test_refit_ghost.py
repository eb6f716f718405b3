"""The composed repair refit-ghost against an independent float64 numpy computation on captured activations:
refit's least-squares change ``E`` of the last kept layer's down-projection, then ghost fitted on the stream
``X' = X + A E`` it hands over, and the pruned model's next layer receiving exactly ``(X + A E) W``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_batches, tiny_model
from test_operators import captured_states, rel

from ghostlayers.calibration.passes import calibrate
from ghostlayers.model.surgery import apply_pruning, scale_repair
from ghostlayers.numerics import fitting
from ghostlayers.registry.methods import gathered, method


def captured(model, batches):
    """``A`` (down-projection input of layer 1, the last kept one), ``X`` (input of layer 2) and ``Y``
    (input of layer 4) as float64 numpy arrays."""
    activations = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: activations.append(a[0].reshape(-1, a[0].shape[-1]).numpy().copy())
    )
    states = captured_states(model, batches, [2, 4])
    hook.remove()
    return np.concatenate(activations), states[2], states[4]


def host_input(model, batches) -> np.ndarray:
    """What the kept layer after the removed block computes on: its input norm's input, the stream once the
    operator (a pre-hook of that layer) has run."""
    seen = []
    hook = model.model.layers[2].input_layernorm.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).numpy().copy())
    )
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    hook.remove()
    return np.concatenate(seen)


def test_refit_ghost_matches_numpy_and_the_next_layer_receives_the_refitted_stream_times_w():
    model = tiny_model("llama").double()
    batches = random_batches(num=8)  # 256 tokens: more than the MLP's 128 hidden activations
    a, x, y = captured(model, batches)
    e_np, *_ = np.linalg.lstsq(a, y - x, rcond=None)
    refitted = x + a @ e_np
    m_np, *_ = np.linalg.lstsq(refitted, y - refitted, rcond=None)
    w_np = np.eye(x.shape[1]) + m_np

    stats = calibrate(model, batches, [(2, 4)], sums=gathered(["refit-ghost"]), progress=False).pairs[(2, 4)]
    assert rel(stats.atx, a.T @ x) < 1e-10
    operator = fitting.fit("refit-ghost", stats, ridge=0.0)
    e, w = method("refit-ghost").parts(operator)
    assert rel(e, e_np) < 1e-6
    assert rel(w, w_np) < 1e-6
    residual = np.linalg.norm(refitted @ w_np - y) / np.linalg.norm(y - x)
    assert fitting.relative_residual("refit-ghost", stats, operator) == pytest.approx(residual, rel=1e-6)
    # ghost on the refitted stream can always keep W = I: never worse than refit alone
    assert residual <= fitting.relative_residual("refit", stats, fitting.fit("refit", stats, ridge=0.0)) + 1e-9

    _, unfolded = apply_pruning(model, [2, 3], "refit-ghost", {(2, 4): operator})
    assert rel(host_input(model, batches), refitted @ w_np) < 1e-8
    # α shrinks both parts: (X + α A E)(I + α M)
    scale_repair(model, 0.5, unfolded)
    assert rel(host_input(model, batches), (x + 0.5 * a @ e_np) @ (np.eye(x.shape[1]) + 0.5 * m_np)) < 1e-8


def test_prune_refit_ghost_writes_a_folder_that_reloads_with_both_parts(model_folder, tmp_path):
    """End to end: the chosen run's down-projection rewritten exactly as refit alone rewrites it (the same
    sums and ridge), and an operator on the stream after it, which changes the logits."""
    from test_cli import base_args, run

    import ghostlayers

    logits, down = {}, {}
    for name in ("refit", "refit-ghost"):
        out = tmp_path / name
        args = [*base_args(model_folder), "--layers", "2:4", "--method", name, "--alpha", "1"]
        result = run(*args, "--output", str(out))
        assert result.exit_code == 0, result.output
        model = ghostlayers.load(out)
        ids = torch.arange(1, 17)[None]
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
        down[name] = model.model.layers[1].mlp.down_proj.weight
        record = model.config.ghostlayers
        assert record["method"] == name and record["removed_layers"] == [2, 3]
        (spec,) = record["operators"]
        assert spec["merged_into"].endswith("1.mlp.down_proj")
        assert (spec["host"] is not None) == (name == "refit-ghost")
    torch.testing.assert_close(down["refit"], down["refit-ghost"])
    assert not torch.allclose(logits["refit"], logits["refit-ghost"])
