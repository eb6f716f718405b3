"""Healing under torchrun (issue #49): two CPU processes (gloo), each running its share of every step, with
DistributedDataParallel averaging the gradients, end with the weights of one process that adds up the same
global batch itself (``HealSettings.accumulate``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from conftest import random_batches, tiny_model, tiny_tokenizer, torchrun
from safetensors.torch import load_file
from test_heal import dense_text, prune_args
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.config.recipes import HealSettings
from ghostlayers.jobs.runs import heal_saved
from ghostlayers.repair import heal

TESTS = Path(__file__).parent
SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_heal_distributed import healed_by_api
from ghostlayers.calibration.distributed import distributed_rank, init_from_env
init_from_env()
model = healed_by_api({work!r}, accumulate=1)
if distributed_rank()[0] == 0:
    torch.save(dict(model.named_parameters()), {out!r})
"""


def healed_by_api(work: str, accumulate: int):
    """A tiny llama pruned with ghost in float64, healed (operator and LoRA, 6 steps of 2 batches) in place."""
    batches = random_batches(6, 2, 16)
    dense, model = tiny_model("llama").double(), tiny_model("llama").double()
    ghostlayers.prune(model, batches, layers="2:4", method="ghost", alpha=1.0, progress=False)
    settings = HealSettings(12 * batches[0].numel(), "operator,lora", 1e-2, 10, accumulate=accumulate)
    heal.heal_pruned(model, batches, settings, Path(work), lambda: contextlib.nullcontext(dense), progress=False)
    return model


def test_two_processes_heal_as_one_that_adds_up_their_batches(tmp_path):
    """Rank r runs every other batch of a step (its own stream, cached by itself): the trained weights equal one
    process's with ``accumulate=2`` (float64), and a one-batch-a-step heal differs (the test can fail)."""
    out = tmp_path / "two.pt"
    script = SCRIPT.format(tests=str(TESTS), work=str(tmp_path / "work"), out=str(out))
    (tmp_path / "run.py").write_text(script)
    done = torchrun([str(tmp_path / "run.py")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    two = torch.load(out, weights_only=True)
    one = dict(healed_by_api(str(tmp_path / "one"), accumulate=2).named_parameters())
    assert set(one) == set(two)
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight.detach(), rtol=1e-9, atol=1e-12, msg=name)
    single = dict(healed_by_api(str(tmp_path / "single"), accumulate=1).named_parameters())
    assert any(not torch.allclose(single[n], w) for n, w in one.items())
    assert not (tmp_path / "work").exists()


def test_ghostlayers_heal_under_torchrun_writes_one_processes_result(tmp_path):
    """``torchrun --nproc-per-node 2 -m ghostlayers heal`` on text the dense model wrote (so the heal is kept):
    rank 0 alone writes, and the folder's weights and report equal ``heal_saved`` in one process adding up two
    batches a step."""
    folder, runner, plain = tmp_path / "tiny-llama", CliRunner(), tmp_path / "plain"
    dense, tokenizer = tiny_model("llama"), tiny_tokenizer()
    dense.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(dense_text(dense, tokenizer))
    assert runner.invoke(app, prune_args(folder, "--method", "none", "--output", str(plain))).exit_code == 0
    two = tmp_path / "two"
    done = torchrun(["-m", "ghostlayers", "heal", str(plain), "--heal", "1600", "--heal-lr", "3e-3", "--output",
                     str(two)], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    one = tmp_path / "one"
    summary = heal_saved(plain, HealSettings(1600, "auto", 3e-3, 50, accumulate=2), one)
    written = json.loads((two / "report.json").read_text())["heal"]
    assert written["kept"] and summary["heal"]["kept"], written  # else both would be the unhealed folder
    assert written["steps"] == summary["heal"]["steps"] and written["tokens"] == summary["heal"]["tokens"]
    assert written["loss_after"] == pytest.approx(summary["heal"]["loss_after"], rel=1e-5)
    a, b = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not list(tmp_path.glob(".two.ghostlayers-*"))


def test_out_of_memory_while_healing_is_one_error_line(model_folder, tmp_path, monkeypatch):
    """A device too small for the model (torch's OutOfMemoryError, here raised by the teacher) is one ``error:``
    line saying what must fit and what to lower, not a traceback; no folder is written (the heal's work folder
    stays, for the same command to resume or clear)."""

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(heal, "cache_teacher", too_big)
    calib = str(model_folder.parent / "calib.txt")
    args = [
        "prune",
        "--model",
        str(model_folder),
        "--calibration",
        calib,
        "--layers",
        "2:4",
        "--num-samples",
        "8",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--heal",
        "64",
        "--output",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert "Out of memory" in result.output and "Tried to allocate" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.glob(".o.ghostlayers-*")] == [".o.ghostlayers-heal"]  # kept for a rerun
