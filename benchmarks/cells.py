"""What every quality benchmark writes: cells of a results JSON kept as each finishes (a run of hours on 2
cores stops and resumes at will), labelled with the machine and dtype they ran on, and the share of the
none→dense perplexity gap each row recovers, ``(none − method) / (none − dense)``."""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch


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
        """The cell ``key``: computed unless the file has it, then recorded at once with machine and time."""
        if key not in self.cells:
            start = time.perf_counter()
            self.cells[key] = {
                **compute(),
                "machine": machine(self.dtype),
                "seconds": round(time.perf_counter() - start, 1),
            }
            self.save()
            print(key, f"{self.cells[key]['seconds']} s", self.cells[key].get("ppl", ""), flush=True)
        return self.cells[key]
