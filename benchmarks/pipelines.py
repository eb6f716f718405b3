"""The paper's pipeline against ours, end to end, at the same number of removed layers, through the CLI.

    python benchmarks/pipelines.py [--model smollm2-135m] [--num-layers 6] [--json FILE]

Each pipeline is one ``ghostlayers prune --eval`` run (the product as users run it); its report gives the
perplexity of the dense model, of plain pruning and of the repaired model on the held-out parts of wiki,
web, code and austen. Pipelines:

- ``paper``: streamline selection, ghost at α = 1, 16 × 512 wiki calibration windows (the Ghosted Layers setting);
- ``paper, 32/C``: the same with ghostlayers' default calibration size (32 tokens per hidden channel);
- ``ours``: loss selection, ``--method auto``, ``--alpha auto``, ``--ridge auto``, ``mix`` calibration at
  the default size: every choice made by held-out loss, none of them allowed to hurt a calibration domain.

Every finished run is written to the JSON at once and skipped on a rerun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cells import ResultsFile, model_arguments

PIPELINES = {
    "paper": [
        "--select",
        "streamline",
        "--method",
        "ghost",
        "--alpha",
        "1",
        "--calibration",
        "wiki",
        "--num-samples",
        "16",
    ],
    "paper, 32/C": ["--select", "streamline", "--method", "ghost", "--alpha", "1", "--calibration", "wiki"],
    "ours": ["--select", "loss", "--method", "auto", "--alpha", "auto", "--ridge", "auto", "--calibration", "mix"],
}


def run(args: argparse.Namespace, options: list[str]) -> dict:
    """One ``ghostlayers prune --eval`` run and what its report says."""
    with tempfile.TemporaryDirectory() as work:
        command = [
            sys.executable, "-m", "ghostlayers", "prune", "--model", args.model, "--num-layers",
            str(args.num_layers), *options, "--eval", "--ppl", "wiki,web,code,austen", "--ppl-windows",
            str(args.ppl_windows), "--no-speed", "--report-dir", f"{work}/report",
        ]  # fmt: skip
        subprocess.run(command, check=True)
        report = json.loads(Path(f"{work}/report/report.json").read_text())
    return {
        "command": "ghostlayers prune " + " ".join(command[command.index("--model") :]),
        "removed": report["removed"],
        "method": report["method"],
        "alpha": report["alpha"],
        "ridge": [b["ridge"] for b in report["boundaries"]],
        "metrics": {k: v["ppl"] for k, v in report["metrics"].items()},
    }


def repaired(cell: dict) -> dict[str, float]:
    """The run's perplexity with the chosen method (``pruned + <method>``, ``none`` included)."""
    return cell["metrics"][f"pruned + {cell['method']}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, seq_len=False)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--json", help="default: benchmarks/results/pipelines-<model>.json")
    args = parser.parse_args()
    results = ResultsFile(Path(args.json or f"benchmarks/results/pipelines-{args.model}.json"), args.model, "float32")
    for name, options in PIPELINES.items():
        results.cell(name, lambda options=options: run(args, options))
    runs = results.cells
    paper = repaired(runs["paper"])
    for cell in runs.values():
        cell["ratio to paper"] = {c: repaired(cell)[c] / paper[c] for c in paper}
    results.save()
    corpora = list(paper)
    print("\n| pipeline | removed | method, α | " + " | ".join(f"{c} ppl | {c} ÷ paper" for c in corpora) + " |")
    print("|---" * (3 + 2 * len(corpora)) + "|")
    for name, cell in runs.items():
        cells = [f"{repaired(cell)[c]:.2f} | {cell['ratio to paper'][c]:.3f}" for c in corpora]
        print(f"| {name} | {cell['removed']} | {cell['method']}, {cell['alpha']:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
