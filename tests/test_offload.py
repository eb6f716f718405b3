"""Layer-by-layer calibration with weights read from the files: the same sums as the batch-by-batch pass
(itself checked against numpy in test_operators), and the same pruned model."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batches, tiny_model
from transformers import AutoModelForCausalLM

import ghostlayers
from ghostlayers.calibration.offload import calibrate_layerwise
from ghostlayers.calibration.passes import calibrate
from ghostlayers.errors import GhostLayersError
from ghostlayers.model.checkpoint import Checkpoint
from ghostlayers.registry.methods import gathered

ARCHS = ["llama", "gemma3_text", "opt", "gpt_neox"]  # per-layer-type masks (gemma3), other layouts


def saved(model_type: str, tmp_path, num_layers: int = 6):
    folder = tmp_path / model_type
    tiny_model(model_type, num_layers=num_layers, seed=1).save_pretrained(folder)
    return folder


def batches():  # the last batch is smaller, so each batch's recorded layer arguments matter
    return random_batches(num=3, batch=2, seq=12) + random_batches(num=1, batch=1, seq=12, seed=7)


@pytest.mark.parametrize("model_type", ARCHS)
def test_layerwise_sums_equal_the_batchwise_pass(model_type, tmp_path):
    folder = saved(model_type, tmp_path)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    checkpoint = Checkpoint(folder, dtype=torch.float64)
    skeleton = checkpoint.skeleton()
    assert all(p.is_meta for p in skeleton.parameters())
    pairs = [(1, 3), (2, 5), (4, 6)]
    replaceme = model_type != "gemma3_text"
    options = dict(sums=gathered(["replaceme"] if replaceme else []), holdout=True, progress=False)
    expected = calibrate(dense, batches(), pairs, **options)
    got = calibrate_layerwise(skeleton, checkpoint, batches(), pairs, band=2, **options)
    assert set(got.pairs) == set(expected.pairs) and set(got.holdout) == set(expected.holdout)
    for part in ("pairs", "holdout"):
        for pair, stats in getattr(expected, part).items():
            for want, have in zip(stats.tensors(), getattr(got, part)[pair].tensors(), strict=True):
                torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9)
    distance = (torch.arange(7)[:, None] - torch.arange(7)[None, :]).abs()
    near = distance <= 2
    torch.testing.assert_close(got.similarity.cosine[near], expected.similarity.cosine[near], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.similarity.angular[near], expected.similarity.angular[near], rtol=1e-9, atol=1e-9)
    assert got.similarity.cosine[~near].isnan().all()
    assert all(p.is_meta for n, p in skeleton.named_parameters() if ".layers." in n)  # each freed after its use


@pytest.mark.parametrize("select", ["streamline", "shortgpt"])
def test_offloaded_prune_gives_the_same_model(select, tmp_path):
    folder = saved("llama", tmp_path, num_layers=8)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    reference = ghostlayers.prune(dense, batches(), select=select, num_layers=3, progress=False)
    checkpoint = Checkpoint(folder, dtype=torch.float64)
    result = ghostlayers.prune(
        checkpoint.skeleton(), batches(), select=select, num_layers=3, offload=checkpoint, progress=False
    )
    assert result.removed == reference.removed
    assert not any(p.is_meta for p in result.model.parameters())
    ids = random_batches(num=1, batch=2, seq=10, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(result.model(ids).logits, reference.model(ids).logits, rtol=1e-9, atol=1e-9)


def test_removed_layers_are_not_read_again(tmp_path):
    """Calibration reads layers 0..3 once each (the run 2..3 and what precedes it); afterwards only the
    layers that stay are read, so no removed layer is read twice and layers 4, 5 once."""
    folder = saved("llama", tmp_path, num_layers=6)
    checkpoint = Checkpoint(folder)
    read: list[str] = []
    load = checkpoint.load
    checkpoint.load = lambda model, names: (read.extend(names), load(model, names))[1]
    ghostlayers.prune(checkpoint.skeleton(), batches(), layers="2:4", offload=checkpoint, progress=False)
    times = {layer: read.count(f"model.layers.{layer}.mlp.down_proj.weight") for layer in range(6)}
    assert times == {0: 2, 1: 2, 2: 1, 3: 1, 4: 1, 5: 1}


def test_offload_errors_name_the_fix(tmp_path):
    with pytest.raises(GhostLayersError, match="no.*safetensors|has none"):
        Checkpoint(tmp_path)
    folder = saved("llama", tmp_path)
    checkpoint = Checkpoint(folder)
    with pytest.raises(GhostLayersError, match="without --offload"):
        ghostlayers.prune(
            checkpoint.skeleton(), batches(), layers="1,3", fit="sequential", offload=checkpoint, progress=False
        )
