"""``ghostlayers sweep``: every depth and method fitted and scored on the one model it loaded, equal to what
``prune`` gives for that depth and method; the recommended depth checked by hand on a constructed table."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batches, tiny_model

import ghostlayers
from ghostlayers.surgery import pruning_undone

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "arch,method", [("llama", "ghost"), ("llama", "replaceme"), ("llama", "refit"), ("llama", "none"),
                    ("gemma3_text", "linearpatch")]
)  # fmt: skip
def test_a_pruned_model_is_the_dense_one_again_after_the_block(arch, method):
    model = tiny_model(arch)
    with torch.no_grad():
        dense = model(IDS).logits
    classes = (type(model), type(model.config))
    with pruning_undone(model, [(2, 4)]):
        result = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
        with torch.no_grad():
            pruned = result.model(IDS).logits
    with torch.no_grad():
        again = model(IDS).logits
    assert not torch.allclose(pruned, dense, atol=1e-3)
    torch.testing.assert_close(again, dense, rtol=0, atol=0)
    assert (type(model), type(model.config)) == classes
    assert model.config.num_hidden_layers == 6 and not hasattr(model.config, "ghostlayers")
    assert not [m for m in model.modules() if hasattr(m, "ghost_operator")]
    # and it prunes again as the first time
    second = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(second.model(IDS).logits, pruned)
