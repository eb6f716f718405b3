"""A normal run prints only ghostlayers' lines: each command, run as a user runs it (its own process, the
standard tasks scored), writes none of lm-eval's, transformers', datasets' or PEFT's log lines and warnings to
the terminal; ``--verbose`` lets them through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_zeroshot import fixture_tasks  # noqa: F401

# what other libraries write: logging's level names, warnings' categories, lm-eval's own notes
FOREIGN = ("WARNING", "INFO", "Warning:", "[Task:", "already-initialized model", "lm_eval", "transformers/")


def ghostlayers(*args: str, cwd: Path) -> str:
    """stderr and stdout of ``ghostlayers ARGS`` in a process of its own (the test's cache)."""
    done = subprocess.run(
        [sys.executable, "-m", "ghostlayers", *args], cwd=cwd, capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr + done.stdout


def foreign(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(mark in line for mark in FOREIGN)]


@pytest.mark.usefixtures("fixture_tasks")
def test_every_command_prints_only_our_lines_and_verbose_shows_the_rest(model_folder, tmp_path):
    text = str(model_folder.parent / "calib.txt")
    common = ["--calibration", text, "--num-samples", "8", "--seq-len", "16", "--batch-size", "2", "--device", "cpu"]
    scoring = ["--ppl", text, "--ppl-windows", "2", "--tasks", "boolq,copa,arc_easy", "--no-speed"]
    pruned = tmp_path / "pruned"
    runs = {
        "prune": ["prune", "--model", str(model_folder), *common, "--layers", "2:4", "--eval", *scoring,
                  "--output", str(pruned)],
        "eval": ["eval", str(pruned), "--ppl", text, "--ppl-windows", "2", "--tasks", "boolq", "--no-speed",
                 "--seq-len", "16", "--report-dir", str(tmp_path / "eval")],
        "sweep": ["sweep", "--model", str(model_folder), *common, "--num-layers", "2", "--methods", "none,ghost",
                  "--ppl", text, "--ppl-windows", "2", "--tasks", "copa", "--output", str(tmp_path / "sweep")],
        "heal": ["heal", str(pruned), "--heal", "64", "--output", str(tmp_path / "healed")],
    }  # fmt: skip
    for name, args in runs.items():
        output = ghostlayers(*args, cwd=tmp_path)
        assert not foreign(output), (name, foreign(output))
    loud = ghostlayers("--verbose", *runs["eval"][:-1], str(tmp_path / "eval-verbose"), cwd=tmp_path)
    assert foreign(loud)  # the same run, with --verbose: other libraries' lines show
