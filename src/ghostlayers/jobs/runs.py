"""The whole pruning job: ``run(recipe)`` (a ``config.recipes.PruneRecipe``, imported from here too), which loads
the model, draws the calibration windows, prunes and repairs (``pipeline.prune``), evaluates, and writes the folder and
its report. The command line only parses its options into a recipe (``ghostlayers prune --recipe FILE``
reads one, options override its fields); the recipe is saved in the report so that a run can be repeated.
``EvalRecipe`` and ``evaluate`` do the same for ``ghostlayers eval``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.calibration.distributed import init_from_env
from ghostlayers.config.recipes import EvalRecipe, HealSettings, PruneRecipe, default_report_dir, split
from ghostlayers.config.settings import check_seq_len
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import write_text_nofollow
from ghostlayers.measure import report
from ghostlayers.measure.evaluation import (
    calibration_and_perplexity_tokens,
    dense_scores,
    evaluation_bar,
    fetch_sources,
    perplexity_windows,
)
from ghostlayers.measure.evaluation import evaluate as evaluate_model
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.measure.speed import measure_speed, measure_speeds
from ghostlayers.model.checkpoint import Checkpoint
from ghostlayers.model.record import Heal
from ghostlayers.model.surgery import DenseLayers, dense_view, repair_scaled
from ghostlayers.registry.methods import method as method_record
from ghostlayers.repair.checks import check_model, default_num_samples, few_tokens_warning
from ghostlayers.repair.guard import shared_depth
from ghostlayers.repair.heal import check_teacher, dense_teacher, folded_weights, heal_pruned, what_trains, work_folder
from ghostlayers.repair.pipeline import PruneResult
from ghostlayers.repair.pipeline import prune as prune_model
from ghostlayers.sources.corpora import split_sources
from ghostlayers.sources.models import describe, stale_conversions, weights_digest
from ghostlayers.sources.windows import CalibrationSet, calibration_set
from ghostlayers.store.loading import check_config, load_for_offload, load_model_and_tokenizer, resolve_device
from ghostlayers.store.saving import Claim, saved_record, write_model


@dataclass
class Outcome:
    """What ``run`` did: the pruned model, its report (as written to report.json) and where it went."""

    result: PruneResult
    report: dict
    folder: Path | None


def run(
    recipe: PruneRecipe,
    output: Path | None = None,
    overwrite: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
) -> Outcome:
    """Prune as ``recipe`` says; save the model folder with its report to ``output``, or only the report to
    ``report_dir`` (default ``runs/<model>-<select>-<method>``), claimed before the model is loaded. Under
    ``torchrun`` every rank calibrates its share of the batches and only rank 0 evaluates and writes."""
    console = console or Console()
    recipe.check_run(output, overwrite, report_dir)
    resolve_device(recipe.device)
    rank, rank_device = init_from_env()  # under torchrun: calibration batches are split across ranks
    folder = output or report_dir or default_report_dir(recipe)
    option = "--output" if output is not None else "--report-dir"
    claim = Claim(folder, overwrite, [recipe.model], option, report=output is None) if rank == 0 else None
    with claim or contextlib.nullcontext():
        work = work_folder(folder)  # --heal's cache and checkpoint, found again by the same command after a kill
        result, summary, tokenizer = _prune_and_evaluate(recipe, rank, rank_device or recipe.device, console, work)
        if claim is None:
            return Outcome(result, summary, None)

        def write_report(where: Path) -> None:
            report.write(summary, where)  # the heal's section too
            report.similarity_plot(
                result.calibration.similarity.cosine, result.calibration.depth, result.removed, where / "similarity.png"
            )

        with console.status(f"writing {folder}"):
            if output is not None:
                write_model(claim, result.model, tokenizer, extra=write_report, summary=summary)
            else:
                with claim.folder() as where:
                    write_report(where)
    return Outcome(result, summary, Path(folder))


@dataclass
class Prepared:
    """What a job works on once its sources are read: the model (or, with ``--offload``, its skeleton and
    checkpoint), the tokenizer, the calibration windows, the perplexity windows and the notes to report."""

    lm: PreTrainedModel
    tokenizer: object
    calib: CalibrationSet
    eval_windows: dict
    notes: list[str]
    num_samples: int
    checkpoint: Checkpoint | None


def prepare(recipe: PruneRecipe, device: str, console: Console, evaluate: bool) -> Prepared:
    """Fetch the sources, load the model and draw the windows as ``recipe`` says (``prune`` and ``sweep``)."""
    fetch_sources(
        recipe.calibration,
        split_sources(recipe.eval.ppl) if evaluate else [],
        split(recipe.eval.tasks) if evaluate else [],
    )
    checkpoint = None
    with console.status(f"loading {recipe.model}"):
        if recipe.offload:
            checkpoint, tokenizer = load_for_offload(recipe.model, recipe.dtype, device)
            lm = checkpoint.skeleton()
        else:
            lm, tokenizer = load_model_and_tokenizer(recipe.model, recipe.dtype, device)
        check_seq_len(recipe.seq_len, lm.config)
        num_samples = recipe.num_samples or default_num_samples(lm.config.hidden_size, recipe.seq_len)
        check_model(lm, recipe, tokens=num_samples * recipe.seq_len)  # before the text is read
        texts, eval_windows, notes = calibration_and_perplexity_tokens(
            tokenizer,
            recipe.calibration,
            split_sources(recipe.eval.ppl) if evaluate else [],
            recipe.seq_len,
            recipe.eval.ppl_windows,
            recipe.encoding,
        )
        calib = calibration_set(texts, num_samples, recipe.seq_len, recipe.seed, recipe.heldout_windows)
    for note in notes:
        console.print(note)
    for folder, size in stale_conversions(recipe.model):
        console.print(
            f"note: {folder} ({size / 2**30:.1f} GiB) holds an earlier ghostlayers' conversion of {recipe.model}, "
            "no longer read: delete it to free the space."
        )
    if warning := few_tokens_warning(calib.tokens, lm.config.hidden_size, recipe.method, recipe.seq_len):
        console.print(f"[bold yellow]warning:[/] {warning}")
    return Prepared(lm, tokenizer, calib, eval_windows, notes, num_samples, checkpoint)


def _prune_and_evaluate(
    recipe: PruneRecipe, rank: int, device: str, console: Console, work: Path
) -> tuple[PruneResult, dict, object]:
    """The work of ``run``: load, calibrate, prune and repair, evaluate; the result, its report and the tokenizer."""
    evaluate = recipe.evaluate and rank == 0
    clock = time.perf_counter()
    ready = prepare(recipe, device, console, recipe.evaluate)  # every rank splits a shared text alike
    lm, tokenizer, calib, eval_windows = ready.lm, ready.tokenizer, ready.calib, ready.eval_windows
    notes, num_samples, checkpoint = ready.notes, ready.num_samples, ready.checkpoint
    timings: dict[str, float] = {}
    timings["load"] = time.perf_counter() - clock
    if not evaluate:
        result = _prune(recipe, lm, calib, _record(recipe, num_samples, calib, notes), checkpoint, work)
        timings["calibrate+fit"] = time.perf_counter() - clock - timings["load"]
        heal_time(result, timings)
        return result, prune_report(result, recipe, num_samples, notes, {}, timings), tokenizer
    if recipe.offload:
        console.print("--offload never holds the dense model: only the pruned one is evaluated")
    with evaluation_bar(1 if recipe.offload else 3, eval_windows, split(recipe.eval.tasks)) as bar:
        result, metrics = _prune_between_evaluations(
            recipe,
            lm,
            tokenizer,
            eval_windows,
            bar,
            timings,
            lambda: _prune(recipe, lm, calib, _record(recipe, num_samples, calib, notes), checkpoint, work),
        )
    return result, prune_report(result, recipe, num_samples, notes, metrics, timings), tokenizer


def _prune_between_evaluations(
    recipe: PruneRecipe,
    lm: PreTrainedModel,
    tokenizer,
    windows: dict,
    bar: tqdm,
    timings: dict[str, float],
    prune_now: Callable[[], PruneResult],
) -> tuple[PruneResult, dict]:
    """Evaluate the dense model, prune it, time both side by side (``speed.measure_speeds``: the removed
    layers are held by reference until then), then evaluate plain pruning and the repaired model."""
    clock, metrics = time.perf_counter(), {}
    args = dict(tasks=split(recipe.eval.tasks), limit=recipe.eval.limit, batch_size=recipe.batch_size, bar=bar)
    dense = None
    if not recipe.offload:
        identity = (weights_digest(recipe.model), recipe.dtype)  # scored once: read back by any later run or sweep
        metrics["dense"] = dense_scores(lm, tokenizer, windows, identity=identity, **args)
        timings["eval dense"], clock = time.perf_counter() - clock, time.perf_counter()
        dense = DenseLayers.of(lm) if recipe.eval.speed else None
    result = prune_now()
    timings["calibrate+fit"], clock = time.perf_counter() - clock, time.perf_counter()
    if result.guard is not None:  # its share of the run, shown apart
        timings["guard"] = result.guard.seconds
        timings["calibrate+fit"] -= result.guard.seconds
    heal_time(result, timings)
    pruned = f"pruned + {result.method}"
    speeds = {}
    if recipe.eval.speed:
        views = {"dense": functools.partial(dense_view, lm, dense)} if dense is not None else {}
        bar.set_postfix_str("speed, models side by side")
        speeds = measure_speeds(lm, views | {pruned: contextlib.nullcontext})
        del dense  # the dense model's last hold on the removed layers
        timings["speed"], clock = time.perf_counter() - clock, time.perf_counter()
    with SharedPrefix(shared_depth([(b.pre, b.post) for b in result.boundaries])) as prefix:  # run once for both
        if not method_record(result.method).repairs:
            bar.total -= len(windows) + bool(args["tasks"])  # plain pruning is the pruned model itself
            bar.refresh()
        else:
            with repair_scaled(lm, 0.0, result.unfolded):  # the same layers removed, no recovery
                metrics[report.PLAIN_ROW] = evaluate_model(lm, tokenizer, windows, label="no recovery", prefix=prefix,
                                                           **args)  # fmt: skip
            timings["eval no recovery"], clock = time.perf_counter() - clock, time.perf_counter()
        metrics[pruned] = evaluate_model(lm, tokenizer, windows, label="pruned", prefix=prefix, **args)
    timings["eval pruned"] = time.perf_counter() - clock
    for row, speed in speeds.items():
        metrics[row]["speed"] = speed
    return result, metrics


def heal_time(result: PruneResult, timings: dict[str, float]) -> None:
    """``--heal``'s share of the run, shown apart from the calibration and fit."""
    if result.heal is not None:
        timings["heal"] = result.heal.seconds
        timings["calibrate+fit"] -= result.heal.seconds


def _record(recipe: PruneRecipe, num_samples: int, calib: CalibrationSet, notes: list[str]) -> dict:
    """What the pruned model's ``ghostlayers.json`` records of its source and calibration."""
    return {
        "source_model": recipe.model,
        "model": describe(recipe.model),
        "recipe": recipe.to_dict(),
        "calibration": {
            "source": recipe.calibration,
            "num_samples": num_samples,
            "seq_len": recipe.seq_len,
            "seed": recipe.seed,
            "sources": {name: int(w.shape[0]) for name, w in calib.windows.items()},
            "tokens": calib.tokens,
            **({"split": notes} if notes else {}),
        },
    }


def _prune(
    recipe: PruneRecipe,
    lm: PreTrainedModel,
    calib: CalibrationSet,
    record: dict,
    checkpoint: Checkpoint | None,
    work: Path,
) -> PruneResult:
    """``pipeline.prune`` with the recipe's settings on the drawn calibration set, then ``--heal`` (the dense model's
    layers held by reference, so the pruned model serves as its own teacher)."""
    dense = DenseLayers.of(lm) if recipe.heal_settings is not None else None
    result = prune_model(
        lm,
        calib.batches(recipe.batch_size),
        recipe,
        heldout=calib.heldout if recipe.heldout_windows else None,
        batch_domains=calib.batch_domains(recipe.batch_size),
        record=record,
        memory_budget=recipe.memory_budget,
        offload=checkpoint,
    )
    if dense is not None:
        identity = {"model": weights_digest(recipe.model), "recipe": recipe.to_dict()}
        result.heal = heal_fitted(lm, dense, result, recipe, calib, recipe.heal_settings, work, identity)
    return result


def heal_fitted(
    lm: PreTrainedModel,
    dense: DenseLayers,
    result: PruneResult,
    recipe: PruneRecipe,
    calib: CalibrationSet,
    settings: HealSettings,
    work: Path,
    identity: dict,
    keep_cache: bool = False,
) -> Heal:
    """Heal a model ``pipeline.apply`` just pruned and repaired (``prune --heal``, a sweep's healed cells): the
    model itself is the teacher, its removed layers held by reference (``dense``, taken before pruning), and the
    guard's held-out scores of plain pruning and the closed form are reused. ``keep_cache``: the teacher's cache
    stays in ``work`` for the next heal of the same cut (a sweep's other methods and budgets)."""
    heldout = calib.heldout if recipe.heldout_windows else None
    teacher = functools.partial(dense_teacher, lm, dense, result.unfolded)
    guard = result.guard  # plain pruning and the closed form, already scored on the held-out windows
    scored = {"plain pruning": guard.plain, "closed form": guard.perplexity[guard.alpha]} if guard else None
    return heal_pruned(lm, calib.batches(recipe.batch_size), settings, work, teacher, identity, heldout=heldout,
                       keep_cache=keep_cache, unfolded=result.unfolded, batch_size=recipe.batch_size,
                       scored=scored)  # fmt: skip


def prune_report(
    result: PruneResult, recipe: PruneRecipe, num_samples: int, notes: list[str], metrics: dict, timings: dict
) -> dict:
    return {
        "command": "prune",
        "model": describe(recipe.model),
        "recipe": recipe.to_dict(),
        "settings": {
            **recipe.to_dict(),
            "num_samples": num_samples,
            **({"calibration_split": notes} if notes else {}),
        },
        "num_layers": result.calibration.num_layers,
        "removed": result.removed,
        "method": result.method,
        "passes": result.passes,
        "stats_route": result.stats_route,
        "params_before": result.params_before,
        "params_after": result.params_after,
        "boundaries": [
            {"pre": b.pre, "post": b.post, "ridge": b.ridge, "fit_quality": b.fit_quality} for b in result.boundaries
        ],
        "alpha": result.alpha,
        "method_scores": result.method_scores,
        "candidate_scores": result.candidate_scores,
        "ridge_scores": result.ridge_scores,
        "alpha_scores": result.alpha_scores,
        "guard": result.guard.to_dict() if result.guard is not None else None,
        "heal": result.heal.to_dict() if result.heal is not None else None,
        "metrics": metrics,
        "timings": timings,
    }


def evaluate(recipe: EvalRecipe, report_dir: Path | None = None, overwrite: bool = False) -> dict:
    """Evaluate ``recipe.model``; the report is written to ``report_dir`` (default ``runs/eval-<model>``),
    claimed before the model is loaded, and returned."""
    folder = recipe.check_run(report_dir, overwrite)
    resolve_device(recipe.device)
    fetch_sources(None, split_sources(recipe.eval.ppl), split(recipe.eval.tasks))
    with Claim(folder, overwrite, [recipe.model], "--report-dir", report=True) as claim:
        start = time.perf_counter()
        lm, tokenizer = load_model_and_tokenizer(recipe.model, recipe.dtype, recipe.device)
        check_seq_len(recipe.seq_len, lm.config)
        windows = perplexity_windows(
            tokenizer, split_sources(recipe.eval.ppl), recipe.seq_len, recipe.eval.ppl_windows, recipe.encoding
        )
        settings = recipe.eval
        metrics = evaluate_model(
            lm, tokenizer, windows, split(settings.tasks), settings.limit, recipe.batch_size, Path(recipe.model).name
        )
        if settings.speed:
            metrics["speed"] = measure_speed(lm)
        summary = {
            "command": "eval",
            "model": describe(recipe.model),
            "recipe": asdict(recipe),
            "settings": {"model": recipe.model, **asdict(settings), "seq_len": recipe.seq_len, "dtype": recipe.dtype},
            "metrics": {Path(recipe.model).name: metrics},
            "timings": {"total": time.perf_counter() - start},
        }
        with claim.folder() as where:
            report.write(summary, where)
    return summary


def heal_recipe(folder: Path, model: str | None) -> PruneRecipe:
    """The recipe a saved pruned ``folder`` was made with (its calibration windows are drawn again), its source
    model replaced by ``model`` when given; refused when the folder is not ghostlayers' or has no recipe."""
    record = saved_record(folder)
    if record is None or not isinstance(record.get("recipe"), dict):
        raise GhostLayersError(
            f"{folder} is not a model folder ghostlayers pruned with a recorded recipe: prune again with --heal."
        )
    changes = {"model": model} if model is not None else {}
    return PruneRecipe.from_dict(record["recipe"], f"{folder}'s recipe", **changes, evaluate=False)


def heal_saved(
    folder: Path, settings: HealSettings, output: Path, model: str | None = None, overwrite: bool = False,
    console: Console | None = None,
) -> dict | None:  # fmt: skip
    """``ghostlayers heal``: the saved pruned ``folder`` healed toward the dense ``model`` (default: its source) on
    the calibration windows its recipe draws, guarded on its held-out windows, written to ``output``. The dense
    model runs once, for the cache, and is freed before training. Under ``torchrun`` every process trains on its
    share of each step and rank 0 alone guards and writes."""
    console = console or Console()
    recipe = heal_recipe(folder, model)
    check_config(folder)  # its files and weights' headers, before the dense model is loaded
    settings.trained(saved_record(folder)["method"])
    rank, rank_device = init_from_env()
    device = rank_device or recipe.device
    claim = Claim(output, overwrite, [folder, recipe.model], "--output") if rank == 0 else None
    with claim or contextlib.nullcontext():
        ready = prepare(recipe, device, console, evaluate=False)
        pruned, tokenizer = load_model_and_tokenizer(str(folder), recipe.dtype, device)
        what_trains(pruned, settings)
        check_teacher(ready.lm, pruned, recipe.model)  # before the teacher runs
        heldout = ready.calib.heldout if recipe.heldout_windows else None
        unfolded = folded_weights(ready.lm, pruned)

        @contextlib.contextmanager
        def dense_once() -> Iterator[PreTrainedModel]:
            yield ready.lm
            ready.lm = None  # the dense model is not needed again: freed before training

        identity = {"model": weights_digest(recipe.model), "folder": weights_digest(str(folder))}
        batches = ready.calib.batches(recipe.batch_size)
        done = heal_pruned(pruned, batches, settings, work_folder(output), dense_once, identity, heldout=heldout,
                           unfolded=unfolded, batch_size=recipe.batch_size)  # fmt: skip
        summary = {"command": "heal", "source": str(folder), "recipe": recipe.to_dict(), "heal": done.to_dict()}
        if claim is None:  # a torchrun rank other than 0: it trained its share, rank 0 writes
            return None

        def write_report(where: Path) -> None:
            write_text_nofollow(where / "report.json", json.dumps(summary, indent=2) + "\n")
            lines = [f"# ghostlayers heal: {folder}", "", *report.heal_markdown(summary["heal"])]
            write_text_nofollow(where / "report.md", "\n".join(lines) + "\n")

        with console.status(f"writing {output}"):
            write_model(claim, pruned, tokenizer, extra=write_report, summary=summary)
    return summary
