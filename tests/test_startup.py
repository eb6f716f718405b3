"""The command line answers at once (issue 30): importing it, its help and its refusals of bad options load
neither torch nor transformers nor lm-eval, which take seconds; the work imports them when it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ghostlayers

SRC = str(Path(ghostlayers.__file__).parents[1])
HEAVY = ("torch", "transformers", "lm_eval")
RUN = """
import json, sys
from ghostlayers.cli import app
try:
    app(sys.argv[1:], prog_name="ghostlayers")
except SystemExit as exit:
    code = exit.code
print(json.dumps([code, [m for m in {heavy} if m in sys.modules]]))
"""


def fresh(code: str, *args: str, cwd: Path | None = None) -> str:
    """The output of ``code`` run in a new interpreter on this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def test_importing_the_command_line_loads_no_heavy_module():
    loaded = fresh(f"import sys, ghostlayers.cli; print([m for m in {HEAVY} if m in sys.modules])")
    assert loaded == "[]"


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["prune", "--help"], 0),
        (["eval", "--help"], 0),
        (["prune", "--alpha", "7", "--output", "x"], 2),
        (["prune", "--layers", "two", "--output", "x"], 2),
        (["prune", "--method", "magic", "--output", "x"], 2),
        (["prune", "--select", "nearest", "--output", "x"], 2),
        (["prune", "--num-layers", "0", "--output", "x"], 2),
        (["prune", "--tasks", "gl_nope", "--eval", "--output", "x"], 2),
        (["prune", "--dtype", "int8", "--output", "x"], 2),
        (["prune", "--calibration", "no-such-corpus", "--output", "x"], 2),
        (["prune", "--layers", "2:4", "--output", "mine", "--overwrite"], 2),  # a folder ghostlayers did not write
        (["eval", "some-model", "--seq-len", "1"], 2),
    ],
)
def test_help_and_refusals_load_no_heavy_module(tmp_path, args, code):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    assert json.loads(fresh(RUN.format(heavy=HEAVY), *args, cwd=tmp_path)) == [code, []]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
