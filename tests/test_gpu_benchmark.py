"""benchmarks/gpu.py at the tiny shape on CPU: every step is measured and written."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("forward", "products", "plan", "similarity_pass", "reference", "summary", "fit", "prefill", "decode")
# a peak above the step's start can be 0 on CPU (reused heap), and so their ratio; the float64 route is exact
MAY_BE_ZERO = ("extra_peak_bytes", "extra_peak_plan_over_reference", "rel_error", "rel_error_unchunked")
# measured times and their ratios: on a busy machine a difference of two timings (decode's per-token cost) can be
# 0 or negative, so only that they are numbers is checked, never their sign or size
TIMED = re.compile(r"(_s|seconds|_s_per_token|ratio|plan_over_forward|plan_over_reference)$")


def numbers(entry: dict) -> dict[str, float]:
    return {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_tiny_shape_writes_every_measurement(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--shape", "tiny", "--rounds", "2"]
    subprocess.run(
        [*command, "--out", str(tmp_path)],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert results["device"] == "cpu"
    shape = results["shapes"]["tiny"]
    assert shape["model"]["weight_bytes"] > 0
    assert set(STEPS) <= set(shape)
    for step in ("forward", "plan", "similarity_pass", "reference", "fit"):
        assert {"seconds", "peak_bytes", "extra_peak_bytes", "peak_over_weights"} <= set(shape[step]), step
    assert {"float64_s", "route_s", "rel_error", "rel_error_unchunked"} <= set(shape["products"])
    assert {"plan_over_forward", "plan_over_reference", "extra_peak_plan_over_reference"} <= set(shape["summary"])
    assert shape["plan"]["passes"] == 1 and shape["plan"]["route"].startswith("single pass")
    assert {"with_operator_s", "without_operator_s", "ratio"} <= set(shape["prefill"])
    assert {"with_operator_s_per_token", "without_operator_s_per_token", "ratio"} <= set(shape["decode"])
    for step in STEPS:
        for key, value in numbers(shape[step]).items():
            assert math.isfinite(value), (step, key, value)
            if not TIMED.search(key):  # bytes, counts and errors have a sign whatever the machine is doing
                assert value >= 0 if key in MAY_BE_ZERO else value > 0, (step, key, value)
