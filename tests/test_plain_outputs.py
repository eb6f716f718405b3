"""Outputs that serving stacks take: a result with no stream operator is a plain checkpoint of its base
architecture, loadable without remote code where ghostlayers is not even importable; and the versioned
pruning record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batches, tiny_model, tiny_tokenizer

import ghostlayers
from ghostlayers.errors import GhostLayersError
from ghostlayers.model.record import FORMAT_VERSION

# runs in a fresh interpreter where any import of ghostlayers fails
LOAD_WITHOUT_GHOSTLAYERS = """
import sys, torch
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ghostlayers":
            raise ImportError("ghostlayers is blocked in this process")
sys.meta_path.insert(0, Block())
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=False).eval()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
"""


def assert_reloads_without_ghostlayers(folder: Path, expected_model, tmp_path: Path) -> None:
    """``folder`` loads with transformers alone in a process where ghostlayers cannot be imported, and its
    logits equal ``expected_model``'s."""
    ids = random_batches(num=1, seed=4)[0]
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_GHOSTLAYERS, str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "l.pt")],
        check=True,
        capture_output=True,
    )
    with torch.no_grad():
        expected = expected_model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "l.pt"), expected)


@pytest.mark.parametrize("method", ["none", "replaceme", "refit"])
def test_plain_results_reload_without_ghostlayers_and_match(method, tmp_path):
    result = ghostlayers.prune(tiny_model("llama"), random_batches(num=3), layers="2:4", method=method, progress=False)
    out = tmp_path / "out"
    ghostlayers.save(result.model, tiny_tokenizer(), out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and "ghostlayers" not in config and config["num_hidden_layers"] == 4
    assert not (out / "modeling_ghostlayers.py").exists()
    record = json.loads((out / "ghostlayers.json").read_text())["record"]
    assert record["method"] == method and record["removed_layers"] == [2, 3]
    assert record["format_version"] == FORMAT_VERSION
    assert_reloads_without_ghostlayers(out, result.model, tmp_path)
    assert ghostlayers.load(out).config.ghostlayers["method"] == method  # the record is still found


def test_ghost_results_carry_the_custom_module_and_a_versioned_record(tmp_path):
    result = ghostlayers.prune(tiny_model("llama"), random_batches(num=3), layers="2:4", progress=False)
    out = tmp_path / "out"
    ghostlayers.save(result.model, tiny_tokenizer(), out)
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" in config and (out / "modeling_ghostlayers.py").is_file()
    assert config["ghostlayers"]["format_version"] == FORMAT_VERSION
    assert config["ghostlayers"]["ghostlayers_version"] not in ("", None)


def _set_format(folder: Path, version: int | None) -> None:
    config = json.loads((folder / "config.json").read_text())
    if version is None:
        del config["ghostlayers"]["format_version"]
    else:
        config["ghostlayers"]["format_version"] = version
    (folder / "config.json").write_text(json.dumps(config))


def test_newer_record_format_is_refused_and_unversioned_is_read(tmp_path):
    result = ghostlayers.prune(tiny_model("llama"), random_batches(num=3), layers="2:4", progress=False)
    out = tmp_path / "out"
    ghostlayers.save(result.model, tiny_tokenizer(), out)
    _set_format(out, FORMAT_VERSION + 1)
    with pytest.raises(GhostLayersError, match=f"record format {FORMAT_VERSION + 1}.*Upgrade ghostlayers"):
        ghostlayers.load(out)
    _set_format(out, None)  # written before the record had a version
    assert ghostlayers.load(out).config.num_hidden_layers == 4


@pytest.mark.parametrize("method", ["ghost", "linearpatch"])
def test_a_repair_shrunk_to_alpha_zero_saves_as_plain_pruning(method, tmp_path):
    """At α = 0 (as --alpha auto keeps when every repair hurts) the operators are gone: the folder is a plain
    checkpoint, reloaded without ghostlayers, whose logits equal plain pruning's (method none)."""
    batches = random_batches(num=3)
    shrunk = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", method=method, alpha=0.0, progress=False)
    plain = ghostlayers.prune(tiny_model("llama"), batches, layers="2:4", method="none", progress=False)
    out = tmp_path / "out"
    ghostlayers.save(shrunk.model, tiny_tokenizer(), out)
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == ["LlamaForCausalLM"]
    record = json.loads((out / "ghostlayers.json").read_text())["record"]
    assert record["method"] == method and record["alpha"] == 0.0
    assert_reloads_without_ghostlayers(out, plain.model, tmp_path)
