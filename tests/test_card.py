"""Every output folder has a model card a hub renders: its metadata names the source as ``base_model``, and
every number in it is one that the folder's report.json holds, as numpy computes it from the per-example scores."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from huggingface_hub import ModelCard
from test_zeroshot import fixture_tasks  # noqa: F401
from typer.testing import CliRunner

from ghostlayers.cli import app

runner = CliRunner()
TASKS = ["boolq", "copa", "arc_easy"]


def prune(model_folder, out, method: str, alpha: str) -> dict:
    text = str(model_folder.parent / "calib.txt")
    args = ["prune", "--model", str(model_folder), "--calibration", text, "--num-samples", "8", "--seq-len", "16",
            "--batch-size", "2", "--layers", "2:4", "--method", method, "--alpha", alpha, "--eval", "--ppl", text,
            "--ppl-windows", "2", "--tasks", ",".join(TASKS), "--no-speed", "--output", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text())


def average(zeroshot: dict) -> tuple[float, float]:
    """The task average (acc_norm where the task has it) and its standard error, from each task's own."""
    scores = [(t["acc_norm"], t["acc_norm_stderr"]) if "acc_norm" in t else (t["acc"], t["acc_stderr"])
              for t in zeroshot.values()]  # fmt: skip
    return float(np.mean([m for m, _ in scores])), float(np.sqrt(sum(s * s for _, s in scores)) / len(scores))


def paired(zeroshot: dict, plain: dict) -> tuple[float, float]:
    means, variances = [], []
    for task, values in zeroshot.items():
        key = "acc_norm" if "acc_norm" in values["examples"] else "acc"
        diff = np.array(values["examples"][key]) - np.array(plain[task]["examples"][key])
        means.append(diff.mean())
        variances.append(diff.var(ddof=1) / len(diff))
    return float(np.mean(means)), float(np.sqrt(sum(variances)) / len(means))


@pytest.mark.usefixtures("fixture_tasks")
@pytest.mark.parametrize("method,alpha", [("ghost", "1"), ("none", "auto")])
def test_the_card_names_the_source_and_holds_only_the_reports_numbers(model_folder, tmp_path, method, alpha):
    out = tmp_path / "pruned"
    summary = prune(model_folder, out, method, alpha)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == summary["model"]["checkpoint"]
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"ghostlayers", method} <= set(card.data.tags)
    assert "2 of 6 decoder layers (2..3) removed" in card.text
    custom = (out / "modeling_ghostlayers.py").is_file()  # an operator kept: the folder needs its module
    assert custom == (method == "ghost")
    assert ("trust_remote_code=True" in card.text) == custom
    rows = {line.split("|")[1].strip(): line for line in card.text.splitlines() if line.startswith("| ")}
    metrics = summary["metrics"]
    plain = metrics.get("pruned, no recovery", metrics[f"pruned + {method}"])["zeroshot"]
    for name, m in metrics.items():
        mean, se = average(m["zeroshot"])
        assert f"| {100 * mean:.2f} ± {100 * se:.2f} |" in rows[name], name
        for value in m["ppl"].values():
            assert f"{value:.4g}" in rows[name], name
        if name.startswith("pruned +") and method != "none":
            diff, diff_se = paired(m["zeroshot"], plain)
            assert f"{100 * diff:+.2f} ± {100 * diff_se:.2f}" in rows[name]
    # no number the report does not hold: each table number is one of report.json's (or ×100), to its digits
    held = [v for v in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", json.dumps(summary["metrics"]))]
    values = {float(v) * k for v in held for k in (1, 100)}
    for line in rows.values():
        for cell in line.strip("|").split("|")[1:]:
            for number in re.findall(r"[+-]?\d+\.\d+", cell):
                near = any(abs(float(number) - v) <= max(0.005, 5e-4 * abs(v)) for v in values)  # to its digits
                assert near or "±" in cell, (number, line)
