"""``ghostlayers sweep``: the depth curve of one model. For every depth, the block the criterion picks; every
method fitted from shared statistics, α and the guard as ``prune`` has them; held-out perplexity on each text
and, optionally, zero-shot accuracy with per-example scores (any two cells compare paired); and, per method,
the deepest cut that keeps a given share of dense.

Calibration is two passes whatever the number of depths: one to the last layer for the similarity of every
boundary pair up to the deepest cut, then one truncated at the deepest chosen block for the sums of every
depth's block. Each cell is fitted and scored on the one loaded model, made dense again after it
(``surgery.pruning_undone``). The output folder is rewritten whole (``folders.Claim``: built aside, swapped
in) after every cell, so it is always complete, and the same command on it goes on where a killed sweep
stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers import report, routing, selection
from ghostlayers.adapters import adapter_for, decoder_layers
from ghostlayers.calibration import calibrate
from ghostlayers.checks import check_model
from ghostlayers.choices import FitSettings, resolve
from ghostlayers.criteria import criterion
from ghostlayers.distributed import init_from_env
from ghostlayers.evaluation import evaluate
from ghostlayers.folders import Claim
from ghostlayers.loading import resolve_device
from ghostlayers.methods import PLAIN_PRUNING
from ghostlayers.pipeline import apply, gathering
from ghostlayers.reading import read_json
from ghostlayers.recipe import Prepared, prepare
from ghostlayers.routing import Plan
from ghostlayers.sources.models import describe
from ghostlayers.spec import PruneRecipe, SweepSettings, split
from ghostlayers.surgery import pruning_undone

RESULTS = "sweep.json"


def plan_depths(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    depths: Sequence[int],
    select: str,
    methods: Sequence[str],
    *,
    select_range: str = selection.DEFAULT_SELECT_RANGE,
    groups: Sequence | None = None,
    holdout: bool = False,
    chained: bool = False,
    stats_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> dict[int, Plan]:
    """A plan per depth from two passes: the similarity of every pair up to the deepest cut (the criterion
    picks each depth's layers from it), then the sums ``methods`` need for every depth's runs, in one pass
    truncated at the deepest of them. ``groups``, ``holdout`` and ``chained`` as ``pipeline.plan``."""
    total, chosen = len(decoder_layers(model)), criterion(select)
    for n in depths:
        selection.validate_count(n, total, select_range)
    gather = dict(holdout=holdout, groups=groups, stats_dtype=stats_dtype, progress=progress)
    band = max(chosen.band(n) for n in depths)
    first = calibrate(model, batches, [], depth=total, band=band, sums=(), holdout=False, groups=None,
                      stats_dtype=stats_dtype, progress=progress)  # fmt: skip
    removed = {n: selection.select(select, first.similarity, n, total, None, select_range) for n in depths}
    pairs: list[tuple[int, int]] = []
    for layers in removed.values():
        pairs = routing.union(pairs, routing.needed_pairs(layers, chained))
    request = routing.Request(None, select, max(depths), tuple(methods), chained, select_range)
    shape = routing.Shape(total, model.config.hidden_size, adapter_for(model).down_proj is not None)
    sums = routing.pass_sums(request, shape, runs=True)
    second = calibrate(model, batches, pairs, similarity=False, sums=sums, **gather)
    second.similarity = first.similarity
    route = f"two passes for {len(depths)} depths: similarity to the last layer, then every depth's runs"
    plans = {}
    for n, layers in removed.items():
        cal = replace(second, pairs=dict(second.pairs), groups={g: dict(s) for g, s in second.groups.items()})
        cal.keep(routing.needed_pairs(layers, chained))
        plans[n] = Plan(layers, selection.runs(layers), cal, select, 2, route, select_range=select_range)
    return plans


def kept_share(cell: dict, dense: dict) -> dict[str, float]:
    """The share of dense a cell keeps: perplexity as dense's over the cell's on the worst text, zero-shot
    as the ratio of the task averages (acc_norm where the task has it), with its standard error."""
    out = {}
    if cell.get("ppl") and dense.get("ppl"):
        out["ppl"] = min(dense["ppl"][name] / value for name, value in cell["ppl"].items())
    if cell.get("zeroshot") and dense.get("zeroshot"):
        mean, se = report.zeroshot_average(cell["zeroshot"])
        base = report.zeroshot_average(dense["zeroshot"])[0]
        out["zeroshot"], out["zeroshot_se"] = mean / base, se / base
    return out


def recommend(shares: dict[int, dict[str, float]], keep: float) -> int | None:
    """The deepest of the depths whose share of dense is at least ``keep`` (None if none is)."""
    deep_enough = [depth for depth, share in shares.items() if share >= keep]
    return max(deep_enough, default=None)


def metric_of(results: dict) -> str:
    """What the recommendation reads: zero-shot accuracy when the sweep scored it, else perplexity."""
    return "zeroshot" if results["settings"]["tasks"] else "ppl"


def recommendations(results: dict) -> dict[str, int | None]:
    """Per method, the deepest cut that keeps ``keep`` of dense on ``metric_of(results)``."""
    metric, keep = metric_of(results), results["settings"]["keep"]
    shares: dict[str, dict[int, float]] = {}
    for depth, row in results["depths"].items():
        for method, cell in row["cells"].items():
            shares.setdefault(method, {})[int(depth)] = cell["share"][metric]
    return {method: recommend(by_depth, keep) for method, by_depth in shares.items()}


def _cell(lm: PreTrainedModel, plan: Plan, method: str, ready: Prepared, recipe: PruneRecipe, dense: dict) -> dict:
    """One depth and method: fitted and guarded as ``prune`` does, scored, and the model made dense again."""
    calib, tasks = ready.calib, split(recipe.eval.tasks)
    heldout = calib.heldout if recipe.heldout_windows else None
    fit = replace(FitSettings.of(recipe.settings, recipe.batch_size, progress=False), method=method)
    sequential = calib.batches(recipe.batch_size) if fit.fit == "sequential" else None
    with pruning_undone(lm, plan.pairs):  # prune's own path: resolve the choices, then fit, cut and guard
        result = apply(lm, resolve(lm, plan, fit, heldout), heldout=heldout, sequential_batches=sequential)
        label = f"{len(plan.removed)} {method}"
        metrics = evaluate(lm, ready.tokenizer, ready.eval_windows, tasks, recipe.eval.limit, recipe.batch_size, label)
    return {
        "alpha": result.alpha,
        "hurt": result.guard.hurt() if result.guard is not None else [],
        "fit_quality": {f"{b.pre}..{b.post - 1}": b.fit_quality.get(method) for b in result.boundaries},
        "metrics": metrics,
        "share": kept_share(metrics, dense),
    }


def _resumed(folder: Path, fresh: dict) -> dict:
    """The results a killed sweep with the same recipe left in ``folder`` (its cells kept), else ``fresh``."""
    if not (folder / RESULTS).is_file():
        return fresh
    done = read_json(folder / RESULTS, "the sweep's results")
    same = all(done.get(key) == fresh[key] for key in ("recipe", "settings"))
    return {**fresh, "dense": done.get("dense"), "depths": done.get("depths", {})} if same else fresh


def run_sweep(recipe: PruneRecipe, sweep: SweepSettings, output: Path, overwrite: bool = False,
              console: Console | None = None) -> dict:  # fmt: skip
    """Sweep as ``recipe`` (its selection, calibration, α, ridge, evaluation) and ``sweep`` (depths, methods,
    the share to keep) say, into ``output``; the same call on a folder a killed sweep left goes on there."""
    console = console or Console()
    depths, methods = sweep.depth_list(), split(sweep.methods)
    fresh = {
        "command": "sweep",
        "recipe": recipe.to_dict(),
        "settings": {**sweep.to_dict(), "tasks": recipe.eval.tasks, "limit": recipe.eval.limit},
        "dense": None,
        "depths": {},
    }
    results = _resumed(output, fresh)
    overwrite = overwrite or results is not fresh  # our own folder, from the same recipe: go on in it
    sweep.check_run(recipe, output, overwrite)
    init_from_env()
    with Claim(output, overwrite, [recipe.model], "--output", report=True) as claim:
        ready = prepare(recipe, resolve_device(recipe.device), console, evaluate=True)
        results["model"] = describe(recipe.model)
        lm, tasks = ready.lm, split(recipe.eval.tasks)
        for method in methods:  # each against the model (ReplaceMe needs a plain down-projection, ...)
            check_model(lm, replace(recipe, method=method).settings)
        if results["dense"] is None:
            results["dense"] = evaluate(lm, ready.tokenizer, ready.eval_windows, tasks, recipe.eval.limit,
                                        recipe.batch_size, "dense")  # fmt: skip
            _write(results, claim)
        clock = time.perf_counter()
        plans = _plans(lm, ready, recipe, depths, methods)
        results["calibration_seconds"] = time.perf_counter() - clock
        for n in depths:
            row = results["depths"].setdefault(str(n), {"removed": plans[n].removed, "cells": {}})
            for method in methods:
                if method in row["cells"]:
                    continue
                console.print(f"sweep: {n} layers removed ({selection.describe(plans[n].removed)}), {method}")
                row["cells"][method] = _cell(lm, plans[n], method, ready, recipe, results["dense"])
                _write(results, claim)
        _write(results, claim)
    return results


def _plans(lm: PreTrainedModel, ready: Prepared, recipe: PruneRecipe, depths: list[int], methods: list[str]):
    """``plan_depths`` gathering what ``pipeline.prune`` gathers for these settings, for every method."""
    calib = ready.calib
    heldout = calib.heldout if recipe.heldout_windows else None
    gather = gathering(recipe.settings, heldout, calib.batch_domains(recipe.batch_size))
    return plan_depths(
        lm,
        calib.batches(recipe.batch_size),
        depths,
        recipe.select or "streamline",
        methods,
        select_range=recipe.select_range,
        groups=gather["groups"],
        holdout=gather["holdout"],
        chained=gather["chained"],
    )


def _write(results: dict, claim: Claim) -> None:
    """The whole output folder, built aside and swapped in: sweep.json, sweep.md and sweep.png."""
    results["recommended"] = recommendations(results) if results["depths"] else {}
    with claim.folder() as where:
        (where / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
        (where / "sweep.md").write_text(markdown(results))
        if results["depths"]:
            plot(results, where / "sweep.png")


def markdown(results: dict) -> str:
    """One row per depth and method: the block removed, α kept, perplexity per text and accuracy, each with
    the share of dense it keeps; then the recommended depth per method."""
    dense, metric = results["dense"], metric_of(results)
    texts = list(dense.get("ppl", {}))
    zeroshot = bool(dense.get("zeroshot"))
    head = ["layers removed", "block", "method", "α", *(f"ppl {t}" for t in texts), "ppl kept (worst)"]
    head += ["accuracy", "kept", "vs none (paired)"] if zeroshot else []
    lines = [f"# ghostlayers sweep: {results['recipe']['model']}", ""]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    dense_cells = ["0", "–", "dense", "–", *(f"{dense['ppl'][t]:.4g}" for t in texts), "100%"]
    if zeroshot:
        mean, se = report.zeroshot_average(dense["zeroshot"])
        dense_cells += [f"{100 * mean:.2f} ± {100 * se:.2f}", "100%", "–"]
    lines.append("| " + " | ".join(dense_cells) + " |")
    for depth, row in sorted(results["depths"].items(), key=lambda item: int(item[0])):
        plain = row["cells"].get(PLAIN_PRUNING)
        for method, cell in row["cells"].items():
            m = cell["metrics"]
            alpha = "–" if method == PLAIN_PRUNING else f"{cell['alpha']:g}"
            cells = [depth, selection.describe(row["removed"]), method, alpha]
            cells += [f"{m['ppl'][t]:.4g}" for t in texts] + [f"{100 * cell['share']['ppl']:.1f}%"]
            if zeroshot:
                mean, se = report.zeroshot_average(m["zeroshot"])
                paired = "–"
                if plain is not None and method != PLAIN_PRUNING:
                    diff, diff_se = report.example_average(m["zeroshot"], plain["metrics"]["zeroshot"])
                    paired = f"{100 * diff:+.2f} ± {100 * diff_se:.2f}"
                cells += [f"{100 * mean:.2f} ± {100 * se:.2f}", f"{100 * cell['share']['zeroshot']:.1f}%", paired]
            lines.append("| " + " | ".join(cells) + " |")
    keep = results["settings"]["keep"]
    what = "the 9-task average" if metric == "zeroshot" else "perplexity on the worst text"
    lines += ["", f"Deepest cut keeping at least {100 * keep:g}% of dense ({what}):", ""]
    for method, depth in results.get("recommended", {}).items():
        lines.append(f"- {method}: {'none of the depths swept' if depth is None else f'{depth} layers'}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Share of dense kept against layers removed, one line per method: perplexity (dense's over the cell's,
    worst text) and, when scored, zero-shot accuracy with ±1 standard error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["ppl"] + (["zeroshot"] if results["dense"].get("zeroshot") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    rows = sorted(results["depths"].items(), key=lambda item: int(item[0]))
    methods = list(dict.fromkeys(m for _, row in rows for m in row["cells"]))
    for ax, panel in zip(axes[0], panels, strict=True):
        for method in methods:
            points = [(int(d), row["cells"][method]["share"]) for d, row in rows if method in row["cells"]]
            xs, ys = [x for x, _ in points], [s[panel] for _, s in points]
            errors = [s.get(f"{panel}_se", 0.0) for _, s in points]
            ax.errorbar(xs, ys, yerr=errors if panel == "zeroshot" else None, marker="o", capsize=3, label=method)
        ax.axhline(results["settings"]["keep"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("layers removed")
        ax.set_ylabel("share of dense kept")
        ax.set_title("perplexity (dense / pruned, worst text)" if panel == "ppl" else "zero-shot accuracy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
