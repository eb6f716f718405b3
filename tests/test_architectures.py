"""Per architecture: prune + ghost, save, reload without ghostlayers, same logits; cache-consistent generation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ARCHITECTURES, random_batches, tiny_model, tiny_tokenizer

import ghostlayers
from ghostlayers.model.adapters import decoder_layers

# Reload in a fresh interpreter where importing ghostlayers is impossible, so only the shipped file is used.
RELOAD = textwrap.dedent(
    """
    import sys, torch
    sys.modules["ghostlayers"] = None
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save({"logits": model(input_ids=ids).logits, "layers": model.config.num_hidden_layers}, sys.argv[3])
    """
)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_prune_save_reload_generate(model_type, tmp_path):
    model = tiny_model(model_type, num_layers=6)
    dense_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense_logits = model(input_ids=ids).logits
    result = ghostlayers.prune(model, random_batches(), layers=[1, 2, 4], method="ghost", progress=False)
    assert len(decoder_layers(model)) == 3 and model.config.num_hidden_layers == 3
    assert result.params_before == dense_params
    assert [(b.pre, b.post) for b in result.boundaries] == [(1, 3), (4, 5)]
    operators = [k for k in model.state_dict() if k.endswith("ghost_operator.delta")]
    assert len(operators) == 2
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert not torch.allclose(logits, dense_logits, atol=1e-3)  # the surgery changed the function

    out = tmp_path / "pruned"
    ghostlayers.save(model, tiny_tokenizer(), out)
    config = json.loads((out / "config.json").read_text())["ghostlayers"]
    assert config["removed_layers"] == [1, 2, 4] and config["original_num_hidden_layers"] == 6
    assert [op["removed"] for op in config["operators"]] == [[1, 2], [4]]

    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run(
        [sys.executable, "-c", RELOAD, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        check=True,
        cwd=tmp_path,
    )
    remote = torch.load(tmp_path / "out.pt")
    assert remote["layers"] == 3
    torch.testing.assert_close(remote["logits"], logits, rtol=0, atol=1e-5)

    local = ghostlayers.load(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(local(input_ids=ids).logits, logits, rtol=0, atol=1e-5)
        cached = local.generate(ids[:1], max_new_tokens=10, do_sample=False, use_cache=True)
        uncached = local.generate(ids[:1], max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("method", ["none", "linearpatch", "linearpatch-rotate", "replaceme", "refit"])
def test_every_method_saves_and_reloads(method, tmp_path):
    model = tiny_model("llama", num_layers=6)
    ghostlayers.prune(model, random_batches(), layers="3:6", method=method, progress=False)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ghostlayers.save(model, None, tmp_path / "m")
        torch.testing.assert_close(ghostlayers.load(tmp_path / "m")(input_ids=ids).logits, logits, rtol=0, atol=1e-5)
    hosts = [op["host"] for op in model.config.ghostlayers["operators"]]
    # the block ends the stack: stream operators run before the final norm; replaceme/none add nothing
    assert hosts == ([None] if method in ("none", "replaceme", "refit") else ["model.norm"])


def test_half_precision_operator_keeps_model_dtype():
    model = tiny_model("llama").to(torch.bfloat16)
    ghostlayers.prune(model, random_batches(), layers="2:4", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(input_ids=torch.randint(0, 128, (1, 5))).logits.dtype == torch.bfloat16
