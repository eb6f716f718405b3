"""``ghostlayers sweep``: the depth curve of one model. For every depth, the block the criterion picks; every
method fitted from shared statistics, α and the guard as ``prune`` has them; held-out perplexity on each text
and, optionally, zero-shot accuracy with per-example scores (any two cells compare paired); and, per method,
the deepest cut that keeps a given share of dense.

Calibration is ``pipeline.plan_depths``, ``prune``'s checks and statistics budget: one pass to the last layer
for the similarity of every boundary pair up to the deepest cut, then one truncated at the deepest chosen
block for the sums of every depth's block (more when ``--stats-memory`` cannot hold them all). Each cell is
fitted and scored on the one loaded model, made dense again after it (``pipeline.applied``). The output
folder is rewritten whole (``folders.Claim``: built aside, swapped in) after every cell, so it is always
complete, and the same command on it goes on where a killed sweep stopped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from transformers import PreTrainedModel

from ghostlayers.calibration import selection
from ghostlayers.calibration.distributed import init_from_env, world_size_from_env
from ghostlayers.calibration.routing import Plan
from ghostlayers.config.recipes import HEALED, HealSettings, PruneRecipe, SweepSettings, split
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import Claim, save_figure, write_text_nofollow
from ghostlayers.files.reading import open_regular, read_json
from ghostlayers.jobs.runs import Prepared, heal_fitted, prepare
from ghostlayers.measure import report
from ghostlayers.measure.evaluation import dense_scores, evaluate, malformed_scores
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.model.surgery import DenseLayers
from ghostlayers.registry.methods import PLAIN_PRUNING
from ghostlayers.repair.checks import check_model
from ghostlayers.repair.choices import FitSettings
from ghostlayers.repair.guard import shared_depth
from ghostlayers.repair.heal import work_folder
from ghostlayers.repair.pipeline import applied, gathering, plan_depths
from ghostlayers.sources.fetch import cache_folder
from ghostlayers.sources.models import describe, weights_digest
from ghostlayers.sources.tasks import CHANCE
from ghostlayers.store.loading import resolve_device

RESULTS = "sweep.json"


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


def _cell(
    lm: PreTrainedModel,
    plan: Plan,
    method: str,
    ready: Prepared,
    recipe: PruneRecipe,
    dense: dict,
    prefix: SharedPrefix | None,
    heal: tuple[HealSettings, Path, dict] | None = None,
) -> dict:
    """One depth and method: fitted and guarded as ``prune`` does, healed as ``prune --heal`` does when ``heal``
    (the settings, the work folder and the inputs that name the teacher's cache) is given, scored, and the model
    made dense again. Every held-out and test score of the depth runs from ``prefix``, the dense states before its
    cut (None: from layer 0, each scoring on its own)."""
    clock = time.perf_counter()
    calib, tasks = ready.calib, split(recipe.eval.tasks)
    heldout = calib.heldout if recipe.heldout_windows else None
    fit = FitSettings.of(recipe, recipe.batch_size, progress=False)
    fit = replace(fit, method=method, prefix=prefix)
    sequential = calib.batches(recipe.batch_size) if fit.fit == "sequential" else None
    layers = DenseLayers.of(lm) if heal is not None else None  # the teacher: the dense layers, by reference
    with applied(lm, plan, fit, heldout, sequential) as result:  # prune's own path: resolve, fit, cut and guard
        if heal is not None:
            result.heal = heal_fitted(lm, layers, result, recipe, calib, *heal, keep_cache=True)
        fitted = time.perf_counter() - clock
        label = f"{len(plan.removed)} {method}" + (f"{HEALED}{heal[0].tokens}" if heal is not None else "")
        metrics = evaluate(lm, ready.tokenizer, ready.eval_windows, tasks, recipe.eval.limit, recipe.batch_size,
                           label, prefix=prefix)  # fmt: skip
    total, healing = time.perf_counter() - clock, result.heal.seconds if result.heal is not None else 0.0
    return {
        "alpha": result.alpha,
        "heal": result.heal.to_dict() if result.heal is not None else None,
        "hurt": result.guard.hurt() if result.guard is not None else [],
        "guard": result.guard.to_dict() if result.guard is not None else None,
        "alpha_scores": result.alpha_scores,
        "fit_quality": {f"{b.pre}..{b.post - 1}": b.fit_quality.get(method) for b in result.boundaries},
        "metrics": metrics,
        "share": kept_share(metrics, dense),
        "seconds": {
            "fit and guard": round(fitted - healing, 3),
            **({"heal": round(healing, 3)} if result.heal is not None else {}),
            "score": round(total - fitted, 3),
            "total": round(total, 3),
        },
    }


def _healing(
    recipe: PruneRecipe, tokens: int | None, output: Path, identity: dict
) -> tuple[HealSettings, Path, dict] | None:
    """What a healed cell trains, where its teacher cache and checkpoint live (beside the output, under its lock:
    a killed sweep's heal goes on where it stopped), and the inputs that name the cache: the model and recipe,
    not the cell, so every method and budget of a depth heals from one run of the teacher. None for a closed
    form."""
    if tokens is None:
        return None
    return (
        recipe.healing(tokens),
        work_folder(output),
        identity,
    )


IDENTITY = ("recipe", "weights", "scoring")


def _identity(recipe: PruneRecipe, weights: str) -> dict:
    """What a cell depends on: the recipe (selection, calibration, α, ridge, evaluation), the model's weights by
    content, and what is scored. The depths, methods and ``--keep`` are not: a folder takes new ones."""
    scoring = {"tasks": recipe.eval.tasks, "limit": recipe.eval.limit}
    return {"recipe": recipe.to_dict(), "weights": weights, "scoring": scoring}


def _resumed(folder: Path, fresh: dict) -> dict:
    """The results a sweep of the same identity left in ``folder`` (its cells kept, new depths and methods
    added to them), ``fresh`` when there is none; a folder of another identity is refused, saying what differs."""
    if not (folder / RESULTS).is_file():
        return fresh
    done = read_json(folder / RESULTS, "the sweep's results")
    if (wrong := malformed(done)) is not None:
        raise GhostLayersError(
            f"{folder / RESULTS} is not a sweep's results ({wrong}): choose a new --output, or pass --overwrite to "
            "start again."
        )
    differ = [key for key in IDENTITY if key != "recipe" and done.get(key) != fresh[key]]
    differ = (["recipe"] if not _same_recipe(done.get("recipe"), fresh["recipe"]) else []) + differ
    if differ:
        what = {"recipe": "the recipe", "weights": "the model's weights", "scoring": "the tasks or --limit"}
        cells = sum(len(row.get("cells", {})) for row in done.get("depths", {}).values())
        raise GhostLayersError(
            f"{folder} holds a sweep of other inputs ({', '.join(what[k] for k in differ)} differ): choose a new "
            f"--output to keep both, or pass --overwrite to discard its {cells} cells and start again."
        )
    kept = ("dense", "depths", "calibration_seconds")
    return {**fresh, **{key: done[key] for key in kept if key in done}}


def _same_recipe(stored: object, fresh: dict) -> bool:
    """Whether a folder's recipe is today's, read through ``PruneRecipe.from_dict``: a setting added to ghostlayers
    since, at its default, does not make a folder of the same inputs another sweep's. ``num_layers`` is the
    deepest depth asked for, not an input of any cell: a folder takes other depths."""
    try:
        stored = PruneRecipe.from_dict(stored, "sweep.json").to_dict() if isinstance(stored, dict) else None
    except (GhostLayersError, TypeError, ValueError):
        return False
    return stored is not None and {**stored, "num_layers": None} == {**fresh, "num_layers": None}


def malformed(done: object) -> str | None:
    """What is wrong with the shape of a sweep.json read back (edited by hand, or damaged), None if nothing: its
    cells are resumed into the table, and a wrong type would surface as a traceback halfway through."""
    if not isinstance(done, dict):
        return "not an object"
    dense, depths = done.get("dense"), done.get("depths", {})
    if not isinstance(depths, dict) or not isinstance(dense, dict | None) or (dense is None and depths):
        return "'dense' or 'depths' of the wrong type, or cells without dense scores"
    texts, tasks = _scored(dense or {})
    if dense is not None and (wrong := malformed_scores(dense, texts, tasks)) is not None:
        return f"the dense scores: {wrong}"
    sizes = {name: task["n"] for name, task in dense["zeroshot"].items()} if tasks else {}
    for depth, row in depths.items():
        if not depth.isdigit() or not isinstance(row, dict) or not isinstance(row.get("cells"), dict):
            return f"depth {depth!r} is not a row of cells"
        if not isinstance(row.get("removed"), list) or not all(type(i) is int for i in row["removed"]):
            return f"depth {depth}'s removed layers are not a list of layer indices"
        for method, cell in row["cells"].items():
            if not isinstance(cell, dict) or not all(isinstance(cell.get(k), dict) for k in ("metrics", "share")):
                return f"the cell {depth} {method} is not a scored cell"
            if (wrong := malformed_scores(cell["metrics"], texts, tasks, sizes)) is not None:
                return f"the cell {depth} {method}: {wrong}"
            shares = ["ppl", *(["zeroshot"] if tasks else [])]
            if not all(type(cell["share"].get(k)) is float for k in shares) or type(cell.get("alpha")) not in (
                int,
                float,
            ):
                return f"the cell {depth} {method} has no share of dense or α"
    return None


def _scored(dense: dict) -> tuple[list[str], list[str]]:
    """The texts and tasks a sweep's dense scores hold (what each of its cells must hold too)."""
    ppl, zeroshot = dense.get("ppl"), dense.get("zeroshot")
    return list(ppl) if isinstance(ppl, dict) else [], list(zeroshot) if isinstance(zeroshot, dict) else []


def run_sweep(recipe: PruneRecipe, sweep: SweepSettings, output: Path, overwrite: bool = False,
              console: Console | None = None) -> dict | None:  # fmt: skip
    """Sweep as ``recipe`` (its selection, calibration, α, ridge, evaluation) and ``sweep`` (depths, methods,
    the share to keep) say, into ``output``. The same inputs on a folder an earlier sweep left go on there
    (adding depths and methods not in it); ``overwrite`` starts again. Under ``torchrun`` every rank adds its
    share of the calibration sums, and rank 0 alone scores and writes (the others return None)."""
    console = console or Console()
    depths, methods, cells = sweep.depth_list(), split(sweep.methods), sweep.cells()
    weights = weights_digest(recipe.model)
    fresh = {
        "command": "sweep",
        **_identity(recipe, weights),
        "settings": {**sweep.to_dict(), "tasks": recipe.eval.tasks, "limit": recipe.eval.limit},
        "dense": None,
        "depths": {},
    }
    results = fresh if overwrite else _resumed(output, fresh)
    replaces = overwrite or results is not fresh  # our own folder, from the same inputs: go on in it
    sweep.check_run(recipe, output, replaces)
    rank, world = init_from_env()[0], world_size_from_env()
    if world > 1 and recipe.fit == "sequential":
        raise GhostLayersError("--fit sequential fits on rank 0 alone: sweep it in one process, without torchrun.")
    if world > 1 and sweep.heal_budgets():
        raise GhostLayersError(
            "sweep --heal heals its cells on rank 0 alone: sweep it in one process, without torchrun."
        )
    claim = Claim(output, replaces, [recipe.model], "--output", report=True) if rank == 0 else None
    with claim or contextlib.nullcontext():
        ready = prepare(recipe, resolve_device(recipe.device), console, evaluate=True)  # the same windows on all
        results["model"] = describe(recipe.model)
        lm = ready.lm
        for method in methods:  # each against the model (ReplaceMe needs a plain down-projection, ...)
            check_model(lm, replace(recipe, method=method))
        todo = {n: [c for c in cells if c not in results["depths"].get(str(n), {}).get("cells", {})] for n in depths}
        if any(todo.values()):  # every rank calibrates its share of the batches (all in step: no cached plans)
            clock = time.perf_counter()
            stored = plans_file(results, ready, depths, methods)  # the same command finds them again
            make = functools.partial(_plans, lm, ready, recipe, depths, methods)
            plans = make() if world > 1 else cached_plans(stored, make, depths)
            results["calibration_seconds"] = [*_seconds(results.get("calibration_seconds")),
                                              round(time.perf_counter() - clock, 1)]  # fmt: skip
        if claim is None:
            return None  # under torchrun, rank 0 alone scores the cells and writes the folder
        if results["dense"] is None:
            results["dense"] = dense_scores(lm, ready.tokenizer, ready.eval_windows, split(recipe.eval.tasks),
                                            recipe.eval.limit, recipe.batch_size, (weights, recipe.dtype))  # fmt: skip
            _write(results, claim)
        for n in (n for n in depths if todo[n]):
            row = results["depths"].setdefault(str(n), {"removed": plans[n].removed, "cells": {}})
            with SharedPrefix(shared_depth(plans[n].pairs)) as prefix:  # the layers before the cut run once
                for name in todo[n]:
                    console.print(f"sweep: {n} layers removed ({selection.describe(plans[n].removed)}), {name}")
                    method, tokens = cells[name]
                    heal = _healing(recipe, tokens, output, {"model": weights, "recipe": recipe.to_dict()})
                    row["cells"][name] = _cell(lm, plans[n], method, ready, recipe, results["dense"], prefix, heal)
                    _write(results, claim)
            shutil.rmtree(work_folder(output), ignore_errors=True)  # the depth's teacher cache: the next cut's differs
        if any(todo.values()):
            stored.unlink(missing_ok=True)  # every cell is in the folder: the plans are not needed again
        _write(results, claim)
    return results


def _seconds(earlier: object) -> list:
    """The calibration times of the earlier runs of a folder (one number in folders of older sweeps)."""
    return earlier if isinstance(earlier, list) else [earlier] if isinstance(earlier, int | float) else []


def _plans(lm: PreTrainedModel, ready: Prepared, recipe: PruneRecipe, depths: list[int], methods: list[str]):
    """``plan_depths`` gathering what ``pipeline.prune`` gathers for these settings, for every method."""
    calib = ready.calib
    heldout = calib.heldout if recipe.heldout_windows else None
    gather = gathering(recipe, heldout, calib.batch_domains(recipe.batch_size))
    return plan_depths(
        lm,
        calib.batches(recipe.batch_size),
        depths,
        select=recipe.select or "streamline",
        methods=methods,
        select_range=recipe.select_range,
        groups=gather["groups"],
        holdout=gather["holdout"],
        chained=gather["chained"],
        memory_budget=recipe.memory_budget,
    )


def plans_file(results: dict, ready: Prepared, depths: list[int], methods: list[str]) -> Path:
    """Where the plans of an unfinished sweep are kept between runs (calibrating a 1.5B model is two passes of
    many minutes): named by the sweep's inputs, depths, methods and the calibration windows' token ids."""
    key = hashlib.sha256(json.dumps([results["recipe"], results["weights"], depths, methods]).encode())
    for windows in [*ready.calib.windows.values(), *(ready.calib.heldout or {}).values()]:
        key.update(windows.numpy().tobytes())
    return cache_folder("plans") / f"sweep-{key.hexdigest()[:32]}.pt"


def cached_plans(stored: Path, make: Callable[[], dict[int, Plan]], depths: list[int]) -> dict[int, Plan]:
    """The plans of ``depths`` kept in ``stored`` by a sweep that did not finish, else ``make()``, kept there
    before use."""
    with contextlib.suppress(Exception):  # unreadable (whatever torch's reader raises), or no plans: made again
        with open_regular(stored) as handle:  # never a FIFO or device (a link to /dev/zero would never end)
            plans = torch.load(handle, weights_only=False)
        if (
            isinstance(plans, dict)
            and sorted(plans) == sorted(depths)
            and all(isinstance(p, Plan) for p in plans.values())
        ):
            return plans
    plans = make()
    partial = stored.with_name(f".{stored.name}.{os.getpid()}.partial")
    try:
        torch.save(plans, partial)
        partial.replace(stored)
    except OSError:  # no room to keep them: this run still has them
        partial.unlink(missing_ok=True)
    return plans


def _write(results: dict, claim: Claim) -> None:
    """The whole output folder, built aside and swapped in: sweep.json, sweep.md and sweep.png."""
    results["recommended"] = recommendations(results) if results["depths"] else {}
    with claim.folder() as where:
        write_text_nofollow(where / RESULTS, json.dumps(results, indent=2) + "\n")
        write_text_nofollow(where / "sweep.md", markdown(results))
        if results["depths"]:
            plot(results, where / "sweep.png")


ACCURACIES = {"acc_norm": "acc_norm where the task has it", "acc": "acc"}


def _accuracy_cells(cell: dict, dense: dict, plain: dict | None, metric: str) -> list[str]:
    """A cell's task average in ``metric`` with its standard error, its share of dense's and its paired
    difference from plain pruning on the same examples."""
    mean, se = report.zeroshot_average(cell["zeroshot"], metric)
    base = report.zeroshot_average(dense["zeroshot"], metric)[0]
    paired = "–"
    if plain is not None and plain is not cell:
        diff, diff_se = report.example_average(cell["zeroshot"], plain["zeroshot"], metric)
        paired = f"{100 * diff:+.2f} ± {100 * diff_se:.2f}"
    return [f"{100 * mean:.2f} ± {100 * se:.2f}", f"{100 * mean / base:.1f}%", paired]


def markdown(results: dict) -> str:
    """One row per depth and method: the block removed, α kept, perplexity per text and the task average in
    acc_norm and in acc (each with the share of dense it keeps and its paired difference from plain pruning),
    the cell's wall time; then the chance level and the recommended depth per method."""
    dense, metric = results["dense"], metric_of(results)
    texts = list(dense.get("ppl", {}))
    zeroshot = dense.get("zeroshot") or {}
    head = ["layers removed", "block", "method", "α", *(f"ppl {t}" for t in texts), "ppl kept (worst)"]
    for name in ACCURACIES:
        head += [f"{name} (%)", "kept", "vs none (paired)"] if zeroshot else []
    head.append("seconds")
    lines = [f"# ghostlayers sweep: {results['recipe']['model']}", ""]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    dense_cells = ["0", "–", "dense", "–", *(f"{dense['ppl'][t]:.4g}" for t in texts), "100%"]
    for name in ACCURACIES:
        dense_cells += _accuracy_cells(dense, dense, None, name) if zeroshot else []
    lines.append("| " + " | ".join([*dense_cells, "–"]) + " |")
    for depth, row in sorted(results["depths"].items(), key=lambda item: int(item[0])):
        plain = row["cells"].get(PLAIN_PRUNING)
        for method, cell in row["cells"].items():
            m = cell["metrics"]
            alpha = "–" if method == PLAIN_PRUNING else f"{cell['alpha']:g}"
            cells = [depth, selection.describe(row["removed"]), method, alpha]
            cells += [f"{m['ppl'][t]:.4g}" for t in texts] + [f"{100 * cell['share']['ppl']:.1f}%"]
            for name in ACCURACIES:
                cells += _accuracy_cells(m, dense, plain and plain["metrics"], name) if zeroshot else []
            seconds = cell.get("seconds", {}).get("total")
            lines.append("| " + " | ".join([*cells, "–" if seconds is None else f"{seconds:.0f}"]) + " |")
    if zeroshot:
        chance = [CHANCE[t] for t in zeroshot if t in CHANCE]
        if len(chance) == len(zeroshot):
            lines += ["", f"Chance (a uniform guess): {100 * sum(chance) / len(chance):.1f}% on these tasks' average."]
    lines += _healed_lines(results, zeroshot)
    keep = results["settings"]["keep"]
    what = f"the {len(zeroshot)}-task average, {ACCURACIES['acc_norm']}" if metric == "zeroshot" else None
    lines += ["", f"Deepest cut keeping at least {100 * keep:g}% of dense ({what or 'perplexity on the worst text'}):"]
    lines.append("")
    for method, depth in results.get("recommended", {}).items():
        lines.append(f"- {method}: {'none of the depths swept' if depth is None else f'{depth} layers'}")
    return "\n".join(lines) + "\n"


def _healed_lines(results: dict, zeroshot: dict) -> list[str]:
    """Each healed cell against the closed form it healed (``M + heal N`` against ``M``): what trained, on how
    many tokens, whether the guard kept it, the training loss before and after, and the paired differences."""
    rows = []
    for depth, row in sorted(results["depths"].items(), key=lambda item: int(item[0])):
        for name, cell in row["cells"].items():
            method, healed, _ = name.partition(HEALED)
            if not healed or method not in row["cells"] or not cell.get("heal"):
                continue
            heal, unhealed = cell["heal"], row["cells"][method]["metrics"]
            cells = [depth, name, ", ".join(heal["params"]), f"{heal['tokens']:,}", "yes" if heal["kept"] else "no"]
            cells.append(f"{heal['loss_before']:.4f} → {heal['loss_after']:.4f}")
            for metric in ACCURACIES if zeroshot else ():
                diff, se = report.example_average(cell["metrics"]["zeroshot"], unhealed["zeroshot"], metric)
                cells.append(f"{100 * diff:+.2f} ± {100 * se:.2f}")
            rows.append("| " + " | ".join([*cells, f"{heal['seconds']:.0f}"]) + " |")
    if not rows:
        return []
    head = ["layers removed", "cell", "trained", "tokens", "kept", "train loss (KL)"]
    head += [f"{name} vs closed form (paired)" for name in ACCURACIES] if zeroshot else []
    head.append("heal seconds")
    title = "Healed cells against the closed form they started from (kept no: the guard undid a heal that was worse "
    title += "on a held-out domain)."
    return ["", title, "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|", *rows]


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
    save_figure(fig, path, dpi=110)
