"""The operator's orientation, pinned against numpy: the next kept layer receives ``X_pre @ W`` (row
vectors, ``W = I + M``), with ``M`` solved in float64 numpy from the dense model's own states.

A transposed operator, one applied after instead of before the host, or at the wrong host would all fit
and run, and only a comparison like this one tells them apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_batches, tiny_model

import ghostlayers
from ghostlayers.model.adapters import decoder_layers

PRE, POST = 2, 4  # remove layers 2 and 3: original layer 4 (new index 2) hosts the operator


def layer_inputs(model, batches, index: int) -> np.ndarray:
    """Tokens × C float64 input of decoder layer ``index`` (the state the operator, if any, handed it)."""
    captured = []

    def grab(module, args, kwargs):
        captured.append((args[0] if args else kwargs["hidden_states"]).reshape(-1, model.config.hidden_size))

    handle = decoder_layers(model)[index].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False)
    finally:
        handle.remove()
    return torch.cat(captured).double().numpy()


def ghost_operator(x: np.ndarray, y: np.ndarray, ridge: float = 1e-6) -> np.ndarray:
    """``I + M`` with ``(XᵀX + λI) M = Xᵀ(Y − X)``, ``λ = ridge · tr(XᵀX) / C`` (ghostlayers' relative ridge)."""
    gram = x.T @ x
    lam = ridge * np.trace(gram) / gram.shape[0]
    m = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), x.T @ (y - x))
    return np.eye(gram.shape[0]) + m


@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma3_text"])
def test_next_kept_layer_receives_x_pre_times_w(arch, alpha):
    """With shrinkage ``α`` the operator is ``I + αM``."""
    calibration, test = random_batches(num=4, seed=1), random_batches(num=2, seed=2)
    dense = tiny_model(arch)
    w = ghost_operator(layer_inputs(dense, calibration, PRE), layer_inputs(dense, calibration, POST))
    w = np.eye(w.shape[0]) + alpha * (w - np.eye(w.shape[0]))
    expected = layer_inputs(dense, test, PRE) @ w
    pruned = ghostlayers.prune(
        tiny_model(arch), calibration, layers=f"{PRE}:{POST}", method="ghost", alpha=alpha, progress=False
    )
    received = layer_inputs(pruned.model, test, PRE)  # original layer 4 now sits at index 2
    scale = np.abs(expected).max()
    assert np.abs(received - expected).max() <= 1e-4 * scale
    # and not the transpose: the two differ by far more than the tolerance
    assert np.abs(layer_inputs(dense, test, PRE) @ w.T - expected).max() > 1e-2 * scale
