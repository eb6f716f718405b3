"""benchmarks/neurons.py's operator (issue #14, 3a) against independent computations: the kept neurons with
their trained output rows rebuild the removed MLP's output, the energy ranking is numpy's, and the joint
fit of ``Y − X ≈ X M + φ(X) N`` is numpy's least-squares solution."""

from __future__ import annotations

import numpy as np
import torch
from conftest import benchmark, tiny_model

from ghostlayers.adapters import decoder_layers

neurons = benchmark("neurons")


def test_all_neurons_with_trained_rows_rebuild_the_mlp():
    model = tiny_model("llama")
    layer = decoder_layers(model)[2]
    width = layer.mlp.gate_proj.out_features
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    chosen = neurons.Neurons(model, [2, 3], [(2, n) for n in range(width)])
    with torch.no_grad():
        expected = layer.mlp(layer.post_attention_layernorm(x))
        torch.testing.assert_close(chosen(x) @ chosen.down(), expected, rtol=1e-5, atol=1e-5)


def test_energy_ranking_matches_numpy():
    model = tiny_model("llama")
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ranked = neurons.energies(model, [2, 3], x)
    expected = []
    for index in (2, 3):
        layer = decoder_layers(model)[index]
        mlp = layer.mlp
        with torch.no_grad():
            h = layer.post_attention_layernorm(x).double().numpy()
        gate = h @ mlp.gate_proj.weight.detach().double().numpy().T
        act = gate / (1 + np.exp(-gate)) * (h @ mlp.up_proj.weight.detach().double().numpy().T)
        score = (act**2).mean(0) * (mlp.down_proj.weight.detach().double().numpy() ** 2).sum(0)
        expected += [(s, index, n) for n, s in enumerate(score)]
    expected.sort(reverse=True)
    assert [(lay, n) for _, lay, n in ranked] == [(lay, n) for _, lay, n in expected]
    np.testing.assert_allclose([s for s, *_ in ranked], [s for s, *_ in expected], rtol=1e-4)


def test_joint_fit_is_the_least_squares_solution():
    """With a vanishing ridge the normal-equation solve over ``[X, φ(X)]`` is numpy's lstsq."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    size = model.config.hidden_size
    x = torch.randn(500, size, generator=g)
    chosen = neurons.Neurons(model, [2], [(2, n) for n in range(5)])
    with torch.no_grad():
        features = torch.cat([x, chosen(x)], dim=1).double()
    target = torch.randn(500, size, generator=g, dtype=torch.float64)
    solution = neurons.ridge_solve(features, target, 1e-12)
    expected, *_ = np.linalg.lstsq(features.numpy(), target.numpy(), rcond=None)
    np.testing.assert_allclose(solution.numpy(), expected, rtol=1e-6, atol=1e-8)
