"""What every quality benchmark shares, written once: the dense model with its test windows and tokenized
training text (``Bench``, from ``open_bench``), calibration sets drawn from it, perplexity from the states
every pruned variant leaves alone (``Bench.perplexity``), zero-shot accuracy from the same kind of shared
states (``Bench.zeroshot``), calibration plans kept on disk between runs
(``cached_plan``), and the results file: cells of a JSON kept as each finishes (a run of hours on 2 cores
stops and resumes at will), labelled with the machine and dtype they ran on, and the share of the
none→dense perplexity gap each row recovers, ``(none − method) / (none − dense)``.

The model is reached only through ghostlayers (``ghostlayers.model.adapters.adapter_for`` for its parts).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import ghostlayers
from ghostlayers.measure.evaluation import perplexity_windows
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.measure.report import example_average, mean_se
from ghostlayers.measure.report import example_scores as scores
from ghostlayers.measure.zeroshot import evaluate_zeroshot
from ghostlayers.model.adapters import adapter_for
from ghostlayers.repair.guard import domain_perplexity
from ghostlayers.sources.corpora import OFFLINE, load_text
from ghostlayers.sources.fetch import ghostlayers_cache_dir
from ghostlayers.sources.windows import CalibrationSet, calibration_set, tokenize
from ghostlayers.store.loading import load_model_and_tokenizer


def share(none: float, dense: float, value: float) -> float:
    """Share of the none→dense perplexity gap a method recovers (1: dense, 0: plain pruning, negative: worse
    than plain pruning)."""
    return (none - value) / (none - dense)


def shares(ppl: dict[str, float], none: dict[str, float], dense: dict[str, float]) -> dict[str, float]:
    return {c: share(none[c], dense[c], ppl[c]) for c in ppl}


def model_arguments(
    parser: argparse.ArgumentParser, ppl_windows: int | None = 8, dtype: bool = False, seq_len: bool = True
) -> None:
    """The arguments every benchmark shares: the model, its window length, the perplexity windows per corpus
    (``None``: none) and, where the script runs in other dtypes, ``--dtype``."""
    parser.add_argument("--model", default="smollm2-135m", help="bundled name, folder or hub id")
    if dtype:
        parser.add_argument("--dtype", default="float32")
    if seq_len:
        parser.add_argument("--seq-len", type=int, default=512)
    if ppl_windows is not None:
        parser.add_argument("--ppl-windows", type=int, default=ppl_windows, help="test windows per corpus")


def machine(dtype: str = "float32") -> str:
    return f"{platform.machine()} CPU {torch.get_num_threads()} threads, {dtype}"


def ppl_share_header(corpora: list[str]) -> str:
    return " | ".join(f"{c} ppl | {c} share" for c in corpora)


def ppl_share_cells(ppl: dict[str, float], corpora: list[str], none: dict | None, dense: dict | None) -> str:
    """A row's perplexity and share columns; the shares are "–" without the none and dense references."""
    gap = none is not None and dense is not None
    return " | ".join(f"{ppl[c]:.2f} | " + (f"{share(none[c], dense[c], ppl[c]):.2f}" if gap else "–") for c in corpora)


class ResultsFile:
    """A benchmark's JSON, ``{"model": …, "cells": {key: measurements}, …}``, rewritten after every cell
    (with ``render``, also its markdown beside it, ``.md``)."""

    def __init__(self, path: Path, model: str, dtype: str, render: Callable[[dict], str] | None = None):
        self.path, self.dtype, self.render = path, dtype, render
        self.data = json.loads(path.read_text()) if path.is_file() else {"model": model, "cells": {}}
        self.cells: dict[str, dict] = self.data["cells"]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        if self.render is not None:
            self.path.with_suffix(".md").write_text(self.render(self.data) + "\n")

    def cell(self, key: str, compute: Callable[[], dict]) -> dict:
        """The cell ``key``: computed unless the file has it, then recorded at once with machine and time. The
        model copies a cell made are collected before the next (a 1.5B run of several such cells reached
        11 GB and was killed for memory)."""
        if key not in self.cells:
            start = time.perf_counter()
            self.cells[key] = {
                **compute(),
                "machine": machine(self.dtype),
                "seconds": round(time.perf_counter() - start, 1),
            }
            self.save()
            gc.collect()
            print(key, f"{self.cells[key]['seconds']} s", self.cells[key].get("ppl", ""), flush=True)
        return self.cells[key]


def cached_plan(name: str, make: Callable[[], ghostlayers.Plan]) -> ghostlayers.Plan:
    """The plan stored under ``name`` (under ``$GHOSTLAYERS_CACHE/plans``), else ``make()``, stored before it
    is returned: a plan of the 1.5B model takes 10–30 minutes on 2 cores, and a resumed script whose remaining
    cells need it reads it back. The name must say everything the plan depends on."""
    stored = ghostlayers_cache_dir() / "plans" / (name.replace("/", "of").replace(" ", "-") + ".pt")
    if stored.is_file():
        try:
            return torch.load(stored, weights_only=False)
        except (ModuleNotFoundError, AttributeError):  # pickled under a module path that has moved: made again
            pass
    made = make()
    stored.parent.mkdir(parents=True, exist_ok=True)
    torch.save(made, stored.with_suffix(".partial"))
    stored.with_suffix(".partial").replace(stored)
    return made


@dataclass
class Bench:
    """The dense model of a benchmark, its ``test`` windows (each offline corpus's held-out part) and the
    tokenized ``train`` part of each calibration corpus."""

    dense: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    seq_len: int
    test: dict[str, Tensor]
    train: dict[str, Tensor]
    prefixes: dict[int, SharedPrefix] = field(default_factory=dict)  # by depth: every batch's dense state there

    @property
    def hidden_size(self) -> int:
        return self.dense.config.hidden_size

    @property
    def folds(self) -> bool:
        """Whether a method that folds into the down-projection (ReplaceMe) applies: gemma3 has none to fold into."""
        return adapter_for(self.dense).down_proj is not None

    def windows(self, per_channel: float, sources: int = len(OFFLINE)) -> int:
        """Calibration windows for ``per_channel`` tokens per hidden channel, at least one per source."""
        return max(sources, round(per_channel * self.hidden_size / self.seq_len))

    def calibration(self, sources: list[str], num_samples: int, heldout: int = 0) -> CalibrationSet:
        """``num_samples`` windows shared among ``sources`` (seed 0), ``heldout`` windows of each kept out."""
        return calibration_set({c: self.train[c] for c in sources}, num_samples, self.seq_len, 0, heldout)

    def shared(self, depth: int) -> SharedPrefix:
        """The dense states entering layer ``depth``, made by the first variant scored there and shared by every
        later one (each leaves those layers as dense's)."""
        return self.prefixes.setdefault(depth, SharedPrefix(depth))

    def perplexity(self, model: PreTrainedModel, depth: int = 0) -> dict[str, float]:
        """``model``'s perplexity on each test corpus, its layers before ``depth`` run once for all variants."""
        return domain_perplexity(model, self.test, 4, False, "", self.shared(depth))

    def zeroshot(self, model: PreTrainedModel, tasks: list[str], limit: int | None, batch_size: int, depth: int = 0):
        """``evaluate_zeroshot`` of ``model`` with per-example results, its layers before ``depth`` run once for
        all variants."""
        with self.shared(depth).running(model):
            return evaluate_zeroshot(model, self.tokenizer, tasks, limit, batch_size, per_example=True)


def open_bench(args: argparse.Namespace, sources: list[str] | None = None) -> Bench:
    """Load ``args.model`` (in ``args.dtype``, on the CPU), its test windows (``args.ppl_windows`` of each
    offline corpus) and the training text of ``sources`` (default: every offline corpus)."""
    dense, tokenizer = load_model_and_tokenizer(args.model, args.dtype, device="cpu")
    test = perplexity_windows(tokenizer, list(OFFLINE), args.seq_len, args.ppl_windows)
    train = {c: tokenize(tokenizer, load_text(c, "train")) for c in sources or OFFLINE}
    return Bench(dense, tokenizer, args.seq_len, test, train)


def plan_name(args: argparse.Namespace, data: CalibrationSet, block: str) -> str:
    """What a plan of ``block`` on ``data`` depends on, as ``cached_plan`` stores it."""
    windows = sum(len(w) for w in data.windows.values())
    return f"{args.model}-{args.dtype}-{args.calibration}-{windows}x{args.seq_len}-{block}"


def block_plan(args: argparse.Namespace, bench: Bench, data: CalibrationSet, block: str) -> ghostlayers.Plan:
    """The plan of ``block`` ("criterion n/total", e.g. "streamline 7/28") on ``data``, drawn from
    ``args.calibration``, with ReplaceMe's sums where the model has a down-projection to fold into: kept on
    disk, so every script on the same calibration shares it."""
    criterion, n = block.split()[0], int(block.split()[1].split("/")[0])
    return cached_plan(
        plan_name(args, data, block),
        lambda: ghostlayers.plan(
            bench.dense, data.batches(4), select=criterion, num_layers=n, replaceme=bench.folds, progress=False
        ),
    )


# rows, and the order cells run in: what decides first
ORDER = ["none", "ghost", "refit-ghost", "refit", "replaceme", "linearpatch", "linearpatch-rotate"]


def rows(cells: dict, block: str, kind: str) -> list[str]:
    """The block's methods with a ``kind`` cell: ``ORDER``'s, then variants (``<method> ridge <r>``)."""
    found = [k[len(block) + 1 : -len(kind) - 1] for k in cells if k.startswith(f"{block} ") and k.endswith(f" {kind}")]
    return [m for m in ORDER if m in found] + sorted(m for m in found if m not in ORDER)


def average(zeroshot: dict, other: dict | None = None) -> tuple[float, float]:
    """``report.example_average`` in points: the mean accuracy over the tasks, or with ``other`` the mean
    paired difference, and its standard error."""
    mean, se = example_average(zeroshot, other)
    return 100 * mean, 100 * se


def difference(zeroshot: dict, other: dict) -> str:
    mean, se = average(zeroshot, other)
    return f"{mean:+.2f} ± {se:.2f}{' *' if abs(mean) > 2 * se else ''}"


def quality_tables(results: dict) -> str:
    """The markdown tables of docs/RESULTS.md from a quality.py results file, the JSON alone (tail.py's too)."""
    cells = results["cells"]
    dense_ppl = cells["dense ppl"]["ppl"]
    dtypes = sorted({c["machine"].rsplit(", ", 1)[-1] for c in cells.values()})
    lines = [f"## {results['label']}; the cells ran in {' and '.join(dtypes)}\n", results["description"]]
    for block in results["blocks"]:
        ppl_rows = {m: cells[f"{block} {m} ppl"] for m in rows(cells, block, "ppl")}
        if "none" not in ppl_rows:
            continue
        removed = ppl_rows["none"]["removed"]
        none = ppl_rows["none"]["ppl"]
        header = f"| method | {ppl_share_header(list(OFFLINE))} | fit residual |"
        lines += [f"\n### {block} (removed {removed}): perplexity\n", header, "|---" * (2 + 2 * len(OFFLINE)) + "|"]
        lines.append(f"| dense | {ppl_share_cells(dense_ppl, list(OFFLINE), None, None)} | – |")
        for method, cell in ppl_rows.items():
            gap = (none, dense_ppl) if method != "none" else (None, None)
            lines.append(
                f"| {method} | {ppl_share_cells(cell['ppl'], list(OFFLINE), *gap)} | {cell['fit residual']:.2f} |"
            )
        zeroshot = {m: cells[f"{block} {m} zeroshot"] for m in rows(cells, block, "zeroshot")}
        dense_zs = cells.get("dense zeroshot")
        if not dense_zs or "none" not in zeroshot:
            continue
        tasks = list(dense_zs["zeroshot"])
        n = dense_zs["zeroshot"][tasks[0]]["n"]
        lines += [
            f"\n### {block}: zero-shot accuracy (%, ± standard error, {n} examples a task)\n",
            "| method | " + " | ".join(tasks) + " | average | of dense | vs none (paired) | vs ghost (paired) |",
            "|---" * (5 + len(tasks)) + "|",
        ]
        dense_mean = average(dense_zs["zeroshot"])[0]
        for method, cell in {"dense": dense_zs, **zeroshot}.items():
            if cell is None:
                continue
            zs = cell["zeroshot"]
            accs = [f"{100 * mean_se(scores(zs[t]))[0]:.2f} ± {100 * mean_se(scores(zs[t]))[1]:.2f}" for t in tasks]
            mean, se = average(zs)
            vs = [
                difference(zs, ref["zeroshot"]) if ref is not None and ref is not cell else "–"
                for ref in (zeroshot["none"], zeroshot.get("ghost"))
            ]
            kept = f"{100 * mean / dense_mean:.1f}%"
            lines.append(
                f"| {method} | " + " | ".join(accs) + f" | {mean:.2f} ± {se:.2f} | {kept} | " + " | ".join(vs) + " |"
            )
    machines = sorted({c["machine"] for c in cells.values()})
    lines.append(f"\nMachine and dtype of the cells: {'; '.join(machines)}.")
    return "\n".join(lines)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def gguf_contents(path: Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """A GGUF file's metadata values (arrays as lists) and tensors."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, entry in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = entry.contents()
        fields[name] = value.tolist() if isinstance(value, np.ndarray) else value
    return fields, {t.name: np.array(t.data) for t in reader.tensors}
