"""benchmarks/compensate.py (issue #14, 3c) against independent computations: the captured MLP activations
and stream rebuild the dense model's next hidden state, and the refitted down projection is numpy's
least-squares solution."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import VOCAB, benchmark, tiny_model

from ghostlayers.adapters import decoder_layers

compensate = benchmark("compensate")


def test_captured_activations_rebuild_the_next_hidden_state():
    """``h`` is the stream the MLP reads (its activations recomputed from ``h`` are ``a``), and
    ``h + a Dᵀ`` is the dense model's state after the layer."""
    model = tiny_model("llama")
    batch = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    layer = decoder_layers(model)[3]
    a, h = compensate.layer_inputs(model, batch, layer)
    with torch.no_grad():
        after = model(input_ids=batch, output_hidden_states=True).hidden_states[4].reshape(-1, h.shape[1])
        z = layer.post_attention_layernorm(h)
        recomputed = F.silu(layer.mlp.gate_proj(z)) * layer.mlp.up_proj(z)
        torch.testing.assert_close(a, recomputed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h + a @ layer.mlp.down_proj.weight.T, after, rtol=1e-5, atol=1e-5)


def test_refit_is_the_least_squares_solution():
    g = torch.Generator().manual_seed(1)
    a, h, target = torch.randn(300, 24, generator=g), torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g)
    w, residual = compensate.refit_down_proj(a, h, target, ridge=1e-12)
    expected, *_ = np.linalg.lstsq(a.double().numpy(), (target - h).double().numpy(), rcond=None)
    np.testing.assert_allclose(w.T.double().numpy(), expected, rtol=1e-4, atol=1e-5)
    rhs = (target - h).double().numpy()
    np.testing.assert_allclose(residual, np.linalg.norm(a.double().numpy() @ expected - rhs) / np.linalg.norm(rhs))


def test_ridge_pulls_the_refit_toward_its_start():
    """A huge ridge leaves the weight it starts from; a vanishing one gives the least-squares solution from
    any start."""
    g = torch.Generator().manual_seed(2)
    a, h, target = torch.randn(300, 24, generator=g), torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g)
    start = torch.randn(8, 24, generator=g)
    kept, _ = compensate.refit_down_proj(a, h, target, ridge=1e12, start=start)
    torch.testing.assert_close(kept, start, rtol=1e-6, atol=1e-6)
    free, _ = compensate.refit_down_proj(a, h, target, ridge=1e-12, start=start)
    expected, *_ = np.linalg.lstsq(a.double().numpy(), (target - h).double().numpy(), rcond=None)
    np.testing.assert_allclose(free.T.double().numpy(), expected, rtol=1e-4, atol=1e-5)
