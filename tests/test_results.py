"""Every number in docs/RESULTS.md's tables comes from a file under benchmarks/results/ (to 2 decimals):
a table typed by hand, or left over from a run whose file was not kept, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")
NUMERIC_CELL = re.compile(r"^[\s\d.,%×±/+\-−e()*]+$")


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)] + [n for k in value for n in _numbers(k)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    if isinstance(value, str):
        return [float(m.replace(",", "")) for m in NUMBER.findall(value)]
    return []


OTHER_DOCUMENTS = {"retired-bigbench"}  # subfolders holding another document's results


def recorded(folder: Path) -> set[float]:
    """Every number in the results files (a sweep's folder included), rounded to 2 decimals (and ×100, for
    shares shown as percent)."""
    values: list[float] = []
    for path in folder.rglob("*"):
        if set(path.relative_to(folder).parts[:-1]) & OTHER_DOCUMENTS:
            continue
        if path.suffix == ".json":
            values += _numbers(json.loads(path.read_text()))
        elif path.suffix == ".md":
            values += _numbers(path.read_text())
    return {round(v, 2) for v in values} | {round(100 * v, 2) for v in values} | {round(v, 1) for v in values}


def table_numbers(markdown: str) -> list[tuple[int, str, float]]:
    """``(line, cell, number)`` for every number in a numbers-only cell of a markdown table (the first
    column, the row's label, is skipped)."""
    out = []
    for index, line in enumerate(markdown.splitlines(), start=1):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        for cell in line.strip().strip("|").split("|")[1:]:
            cell = cell.strip().replace("**", "")
            if cell and NUMERIC_CELL.match(cell):
                out += [(index, cell, float(m.replace(",", ""))) for m in NUMBER.findall(cell)]
    return out


@pytest.mark.parametrize(
    "doc, folder",
    [("RESULTS.md", "benchmarks/results"), ("RESULTS-retired-bigbench.md", "benchmarks/results/retired-bigbench")],
)
def test_every_table_number_in_results_md_is_in_a_results_file(doc, folder):
    known = recorded(ROOT / folder)
    missing = [
        (line, cell)
        for line, cell, value in table_numbers((ROOT / "docs" / doc).read_text())
        if round(value, 2) not in known and round(value, 1) not in known
    ]
    assert not missing, f"{len(missing)} numbers of docs/{doc} are in no file of {folder}, e.g. {missing[:10]}"


def test_the_check_can_fail(tmp_path):
    """A table with a number no file holds is caught; one whose numbers are all recorded passes."""
    known = {1.23, 4.56}
    rows = "| model | a | b |\n|---|---|---|\n| x | 1.23 | 7.89 |\n"
    assert [v for _, _, v in table_numbers(rows) if round(v, 2) not in known] == [7.89]


def test_zeroshot_summary_averages_acc_norm_where_present_and_gives_the_share_of_dense():
    from ghostlayers.measure.report import zeroshot_summary

    dense = {
        "a": {"acc": 0.5, "acc_stderr": 0.03, "acc_norm": 0.6, "acc_norm_stderr": 0.04},
        "b": {"acc": 0.8, "acc_stderr": 0.03},
    }
    pruned = {
        "a": {"acc": 0.4, "acc_stderr": 0.03, "acc_norm": 0.45, "acc_norm_stderr": 0.04},
        "b": {"acc": 0.6, "acc_stderr": 0.05},
    }
    lines = zeroshot_summary({"dense": {"zeroshot": dense}, "pruned": {"zeroshot": pruned}, "speed only": {}})
    # dense (0.6 + 0.8) / 2 = 70 %, se √(0.04² + 0.03²) / 2 = 2.5 %; pruned 52.5 % ± √(0.04² + 0.05²) / 2
    assert "| dense | 70.00 ± 2.50 | 100.0% |" in lines
    assert f"| pruned | 52.50 ± {100 * (0.04**2 + 0.05**2) ** 0.5 / 2:.2f} | 75.0% |" in lines
    assert "over 2 tasks" in " ".join(lines) and not any("speed only" in line for line in lines)


def test_zeroshot_summary_pairs_each_model_with_plain_pruning_example_by_example():
    from ghostlayers.measure.report import PLAIN_ROW, metric_rows, zeroshot_summary

    def task(norm: list[int] | None, acc: list[int]) -> dict:
        stats = {"acc": sum(acc) / len(acc), "acc_stderr": 0.1, "examples": {"acc": acc}}
        if norm is not None:
            stats |= {"acc_norm": sum(norm) / len(norm), "acc_norm_stderr": 0.1}
            stats["examples"]["acc_norm"] = norm
        return stats

    metrics = {
        "dense": {"zeroshot": {"a": task([1, 1, 0, 1], [0, 0, 0, 0]), "b": task(None, [1, 0])}},
        PLAIN_ROW: {"zeroshot": {"a": task([1, 0, 0, 1], [1, 1, 1, 1]), "b": task(None, [0, 0])}},
        "pruned + ghost": {"zeroshot": {"a": task([1, 1, 1, 1], [0, 0, 0, 0]), "b": task(None, [1, 0])}},
    }
    lines = zeroshot_summary(metrics)
    # ghost − plain: task a (acc_norm) [0, 1, 1, 0]: mean 1/2, se √(1/3 / 4); task b [1, 0]: 1/2, se √(1/2 / 2)
    # average 1/2, se √(1/12 + 1/4) / 2 = 0.2887; dense − plain: a [0, 1, 0, 0] 1/4 ± 1/4, b 1/2 ± 1/2
    assert any(line.startswith("| pruned + ghost |") and line.endswith("| +50.00 ± 28.87 |") for line in lines)
    assert any(line.startswith("| dense |") and line.endswith("| +37.50 ± 27.95 |") for line in lines)
    assert any(line.startswith(f"| {PLAIN_ROW} |") and line.endswith("| – |") for line in lines)
    assert not any("examples" in line for line in metric_rows(metrics))  # per-example lists stay out of tables
    del metrics["dense"]["zeroshot"]["b"]["examples"]  # a model without them: no paired column
    assert not any("paired" in line for line in zeroshot_summary(metrics))


def test_a_runs_metrics_are_one_row_per_metric_and_several_runs_one_row_per_model():
    from ghostlayers.measure.report import metric_rows, metrics_table

    metrics = {
        "dense": {"ppl": {"wiki": 10.0}, "zeroshot": {"piqa": {"acc": 0.7, "acc_stderr": 0.02, "n": 100}}},
        "ghost": {"ppl": {"wiki": 12.5}, "zeroshot": {"piqa": {"acc": 0.65, "acc_stderr": 0.02, "n": 100}}},
    }
    assert metric_rows(metrics) == [
        "| metric | dense | ghost |",
        "|---|---|---|",
        "| ppl wiki | 10 | 12.5 |",
        "| piqa acc | 0.7 | 0.65 |",
    ]
    assert metrics_table(metrics)[2] == "| dense | 10 | 0.7 |"
