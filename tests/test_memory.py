"""The statistics' memory budget read from the device, the route it picks, and ``--stats-memory`` over it."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import random_batches, tiny_model
from test_cli import base_args, run

import ghostlayers
from ghostlayers.calibration import memory
from ghostlayers.calibration.routing import pair_stats_bytes

PAIR = pair_stats_bytes(64, 1)  # one candidate block of the tiny models (C = 64): 65 KiB, XᵀX and XᵀY most of it


def free(monkeypatch, num_bytes: int | None) -> None:
    monkeypatch.setattr(memory, "free_memory", lambda device: None if num_bytes is None else (num_bytes, "free RAM"))


def test_free_ram_from_proc_meminfo_without_psutil(monkeypatch):
    pytest.importorskip("psutil")
    with open("/proc/meminfo") as info:
        available = next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    with_psutil, _ = memory.free_memory(memory.torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now fails
    without, what = memory.free_memory(memory.torch.device("cpu"))
    assert what == "free RAM"
    assert abs(without - available) < 2**28 and abs(with_psutil - available) < 2**28  # both read the kernel's figure


def test_budget_is_half_of_free_memory_unless_given(monkeypatch):
    cpu = memory.torch.device("cpu")
    free(monkeypatch, 6 * 2**30)
    assert memory.stats_budget(cpu, None) == (3 * 2**30, "half of free RAM")
    assert memory.stats_budget(cpu, 5) == (5, "given")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # three torchrun processes share this RAM
    assert memory.stats_budget(cpu, None) == (2**30, "half of free RAM, shared by 3 processes")
    free(monkeypatch, None)
    assert memory.stats_budget(cpu, None) == (memory.UNKNOWN_FREE_BUDGET, "the free memory could not be read")


@pytest.mark.parametrize(
    "free_bytes, budget, passes, route",
    [
        (2 * 5 * PAIR, None, 1, "single pass: {need} of the 325 KiB budget (half of free RAM)"),
        (2 * 4 * PAIR, None, 2, "two passes: {need}, over the 260 KiB budget (half of free RAM)"),
        (0, 5 * PAIR, 1, "single pass: {need} of the 325 KiB budget (given)"),
    ],
)
def test_route_follows_the_budget(monkeypatch, free_bytes, budget, passes, route):
    free(monkeypatch, free_bytes)
    plan = ghostlayers.plan(
        tiny_model("llama"), random_batches(), select="streamline", num_layers=2, memory_budget=budget, progress=False
    )
    assert (plan.passes, plan.route) == (passes, route.format(need="5 candidate blocks need 325 KiB"))


def test_cli_reports_the_route_and_stats_memory_wins(monkeypatch, model_folder, tmp_path):
    free(monkeypatch, 0)  # no free memory: the default budget sends streamline to two passes
    for flags, passes, why in (([], 2, "(half of free RAM)"), (["--stats-memory", "1"], 1, "(given)")):
        out = tmp_path / f"out{len(flags)}"
        result = run(*base_args(model_folder), "--num-layers", "2", "--output", str(out), *flags)
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        assert report["passes"] == passes and report["stats_route"].endswith(why)
        assert f"Calibration: {report['stats_route']}." in (out / "report.md").read_text()
