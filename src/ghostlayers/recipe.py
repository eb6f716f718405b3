"""The whole pruning job as data: a typed, frozen ``PruneRecipe`` and ``run(recipe)``, which loads the model,
draws the calibration windows, prunes and repairs (``pipeline.prune``), evaluates, and writes the folder and
its report. The command line only parses its options into a recipe (``ghostlayers prune --recipe FILE``
reads one, options override its fields); the recipe is saved in the report so that a run can be repeated.
``EvalRecipe`` and ``evaluate`` do the same for ``ghostlayers eval``.
"""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from rich.console import Console

from ghostlayers import operators, report, selection
from ghostlayers.checks import (
    check_at_least,
    check_seq_len,
    check_settings,
    check_tasks,
    default_num_samples,
    few_tokens_warning,
    parse_alpha,
    parse_ridge,
)
from ghostlayers.data import calibration_set
from ghostlayers.distributed import init_from_env
from ghostlayers.errors import GhostLayersError
from ghostlayers.evaluation import calibration_and_perplexity_tokens, perplexity_windows
from ghostlayers.evaluation import evaluate as evaluate_model
from ghostlayers.loading import load_for_offload, load_model_and_tokenizer, parse_dtype, resolve_device
from ghostlayers.pipeline import PruneResult
from ghostlayers.pipeline import prune as prune_model
from ghostlayers.saving import atomic_folder, check_output, save
from ghostlayers.sources.models import DEFAULT_MODEL, describe
from ghostlayers.surgery import repair_scaled


def split(values: str) -> list[str]:
    """A comma-separated option as a list."""
    return [v.strip() for v in values.split(",") if v.strip()]


@dataclass(frozen=True)
class EvalSettings:
    """What ``--eval`` (or ``ghostlayers eval``) measures."""

    ppl: str = "wiki"
    ppl_windows: int | None = 32
    tasks: str = ""
    limit: int | None = None
    speed: bool = True


def check_fields(cls: type, data: object, where: str) -> None:
    """``data`` (read from a file) holds fields of the dataclass ``cls``, each of its annotated type: JSON and
    TOML give strings and floats where numbers and booleans are meant, and ``offload = "false"`` is true."""
    known = {f.name: f.type for f in fields(cls)}
    if not isinstance(data, dict) or (unknown := set(data) - set(known)):
        raise GhostLayersError(
            f"{where} has unknown fields {sorted(unknown) if isinstance(data, dict) else data!r}: "
            f"its fields are {', '.join(sorted(known))}."
        )
    names = {"int": int, "str": str, "bool": bool, "None": type(None), "EvalSettings": dict}
    for name, value in data.items():
        allowed = [names[t.strip()] for t in known[name].split("|")]
        if type(value) not in allowed:  # exact types: True is an int to isinstance
            expected = " or ".join({type(None): "null", dict: "an [eval] table"}.get(t, t.__name__) for t in allowed)
            raise GhostLayersError(
                f"{where}: {name} = {value!r} ({type(value).__name__}) is not valid: give {expected}."
            )


@dataclass(frozen=True)
class PruneRecipe:
    """Everything that decides a pruned model: which model, which layers, which repair, fitted on what.
    Options not given take the command line's defaults; ``layers`` and ``select`` are exclusive (neither:
    ``select="streamline"``, and ``num_layers`` defaults to 4 with a criterion)."""

    model: str = DEFAULT_MODEL
    layers: str | None = None
    select: str | None = None
    num_layers: int | None = None
    method: str = "ghost"
    calibration: str = "mix"
    num_samples: int | None = None
    heldout_windows: int = 2
    alpha: str = "auto"
    fit: str = "dense"
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 4
    ridge: str = str(operators.DEFAULT_RIDGE)
    ridge_mode: str = operators.DEFAULT_RIDGE_MODE
    select_range: str = selection.DEFAULT_SELECT_RANGE
    encoding: str = "utf-8"
    dtype: str = "float32"
    device: str = "auto"
    offload: bool = False
    stats_memory: int | None = None  # MiB
    evaluate: bool = False
    eval: EvalSettings = field(default_factory=EvalSettings)

    def __post_init__(self) -> None:
        if isinstance(self.eval, dict):  # read from a file
            object.__setattr__(self, "eval", EvalSettings(**self.eval))
        if self.layers is None and self.select is None:
            object.__setattr__(self, "select", "streamline")
        if self.select is not None and self.num_layers is None and self.layers is None:
            object.__setattr__(self, "num_layers", 4)

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> PruneRecipe:
        """A recipe from a JSON or TOML file (as ``to_dict`` writes it, or a run's ``report.json``, which holds
        it), ``overrides`` replacing its fields."""
        path = Path(path)
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except OSError as error:
            raise GhostLayersError(f"Cannot read the recipe {path} ({error.strerror}).") from error
        except ValueError as error:
            kind = "TOML" if path.suffix == ".toml" else "JSON"
            raise GhostLayersError(f"The recipe {path} is not valid {kind} ({error}).") from error
        if isinstance(data, dict) and isinstance(data.get("recipe"), dict) and "command" in data:
            data = data["recipe"]  # a run's report
        return cls.from_dict(data, str(path)).override(**overrides)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the recipe") -> PruneRecipe:
        check_fields(cls, data, where)
        check_fields(EvalSettings, data.get("eval", {}), f"{where} [eval]")
        data = {k: None if v == "" and k in ("layers", "select") else v for k, v in data.items()}
        return cls(**data)

    def override(self, **changes) -> PruneRecipe:
        """This recipe with ``changes`` (eval settings by their own names); giving ``layers`` drops a
        recipe's criterion, giving ``select`` drops its layers."""
        eval_names = {f.name for f in fields(EvalSettings)}
        evals = {k: changes.pop(k) for k in list(changes) if k in eval_names}
        if "layers" in changes and "select" not in changes:
            changes.update(select=None, num_layers=None)
        if "select" in changes and "layers" not in changes:
            changes["layers"] = None
        return replace(self, **changes, eval=replace(self.eval, **evals))

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        """Every check that needs neither the model nor a forward pass: bad input fails here, in a second."""
        check_at_least(
            1,
            num_samples=self.num_samples,
            batch_size=self.batch_size,
            ppl_windows=self.eval.ppl_windows,
            limit=self.eval.limit,
        )
        check_at_least(0, stats_memory=self.stats_memory, heldout_windows=self.heldout_windows, seed=self.seed)
        check_seq_len(self.seq_len)
        check_tasks(split(self.eval.tasks))
        parse_dtype(self.dtype)
        resolve_device(self.device)
        parse_ridge(self.ridge)
        check_settings(**self._settings(), num_batches=self._batches(self.num_samples), offload=self.offload)

    def _settings(self) -> dict:
        return dict(
            layers=self.layers,
            select=self.select,
            num_layers=self.num_layers,
            method=self.method,
            ridge=self.ridge,
            alpha=self.alpha,
            fit=self.fit,
            heldout_windows=self.heldout_windows,
        )

    def _batches(self, num_samples: int | None) -> int | None:
        return -(-num_samples // self.batch_size) if num_samples is not None else None


@dataclass
class Outcome:
    """What ``run`` did: the pruned model, its report (as written to report.json) and where it went."""

    result: PruneResult
    report: dict
    folder: Path | None


def default_report_dir(recipe: PruneRecipe) -> Path:
    return Path("runs") / f"{Path(recipe.model).name}-{recipe.select or 'manual'}-{recipe.method}"


def run(
    recipe: PruneRecipe,
    output: Path | None = None,
    overwrite: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
) -> Outcome:
    """Prune as ``recipe`` says; save the model folder with its report to ``output``, or only the report to
    ``report_dir`` (default ``runs/<model>-<select>-<method>``). Under ``torchrun`` every rank calibrates
    its share of the batches and only rank 0 evaluates and writes."""
    console = console or Console()
    recipe.check()
    folder = report_dir or default_report_dir(recipe)
    if output is not None:
        check_output(output, overwrite, source=recipe.model)
    else:
        check_output(folder, True, source=recipe.model, option="--report-dir")
    rank, rank_device = init_from_env()  # under torchrun: calibration batches are split across ranks
    device = rank_device or recipe.device
    evaluate = recipe.evaluate and rank == 0
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    checkpoint = None
    with console.status(f"loading {recipe.model}"):
        if recipe.offload:
            checkpoint, tokenizer = load_for_offload(recipe.model, recipe.dtype, device)
            lm = checkpoint.skeleton()
        else:
            lm, tokenizer = load_model_and_tokenizer(recipe.model, recipe.dtype, device)
        check_seq_len(recipe.seq_len, lm.config)
        num_samples = recipe.num_samples or default_num_samples(lm.config.hidden_size, recipe.seq_len)
        check_settings(
            lm,
            **recipe._settings(),
            num_batches=recipe._batches(num_samples),
            tokens=num_samples * recipe.seq_len,
            offload=recipe.offload,
        )
        texts, eval_windows, notes = calibration_and_perplexity_tokens(
            tokenizer,
            recipe.calibration,
            split(recipe.eval.ppl) if evaluate else [],
            recipe.seq_len,
            recipe.eval.ppl_windows,
            recipe.encoding,
        )
        calib = calibration_set(texts, num_samples, recipe.seq_len, recipe.seed, recipe.heldout_windows)
    for note in notes:
        console.print(note)
    if warning := few_tokens_warning(calib.tokens, lm.config.hidden_size, recipe.method, recipe.seq_len):
        console.print(f"[bold yellow]warning:[/] {warning}")
    timings["load"], clock = time.perf_counter() - clock, time.perf_counter()
    metrics = {}
    eval_args = dict(
        tasks=split(recipe.eval.tasks), limit=recipe.eval.limit, speed=recipe.eval.speed, batch_size=recipe.batch_size
    )
    if evaluate and recipe.offload:
        console.print("--offload never holds the dense model: only the pruned one is evaluated")
    elif evaluate:
        metrics["dense"] = evaluate_model(lm, tokenizer, eval_windows, label="dense", **eval_args)
        timings["eval dense"], clock = time.perf_counter() - clock, time.perf_counter()
    record = {
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
    result = prune_model(
        lm,
        calib.batches(recipe.batch_size),
        layers=recipe.layers,
        select=recipe.select,
        num_layers=recipe.num_layers,
        method=recipe.method,
        ridge=parse_ridge(recipe.ridge),
        alpha=parse_alpha(recipe.alpha),
        heldout=calib.heldout if recipe.heldout_windows else None,
        batch_domains=calib.batch_domains(recipe.batch_size),
        ridge_mode=recipe.ridge_mode,
        fit=recipe.fit,
        select_range=recipe.select_range,
        record=record,
        memory_budget=None if recipe.stats_memory is None else recipe.stats_memory * 2**20,
        offload=checkpoint,
    )
    timings["calibrate+fit"], clock = time.perf_counter() - clock, time.perf_counter()
    if result.guard is not None:  # its share of the run, shown apart
        timings["guard"] = result.guard.seconds
        timings["calibrate+fit"] -= result.guard.seconds
    if evaluate and result.method != "none":
        with repair_scaled(lm, 0.0, result.unfolded):  # the same layers removed, no recovery
            metrics["pruned, no recovery"] = evaluate_model(
                lm, tokenizer, eval_windows, label="no recovery", **{**eval_args, "speed": False}
            )
        timings["eval no recovery"], clock = time.perf_counter() - clock, time.perf_counter()
    if evaluate:
        metrics[f"pruned + {result.method}"] = evaluate_model(lm, tokenizer, eval_windows, label="pruned", **eval_args)
        timings["eval pruned"] = time.perf_counter() - clock
    summary = prune_report(result, recipe, num_samples, notes, metrics, timings)
    if rank != 0:
        return Outcome(result, summary, None)

    def write_report(where: Path) -> None:
        report.write(summary, where)
        report.similarity_plot(
            result.calibration.similarity.cosine, result.calibration.depth, result.removed, where / "similarity.png"
        )

    if output is not None:
        with console.status(f"writing {output}"):
            save(result.model, tokenizer, output, overwrite, extra=write_report, source=recipe.model)
        return Outcome(result, summary, Path(output))
    with atomic_folder(folder, True, source=recipe.model, option="--report-dir") as tmp:
        write_report(tmp)
    return Outcome(result, summary, folder)


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
        "metrics": metrics,
        "timings": timings,
    }


@dataclass(frozen=True)
class EvalRecipe:
    """``ghostlayers eval``: one model's perplexity, zero-shot accuracy and speed."""

    model: str
    eval: EvalSettings = field(default_factory=EvalSettings)
    seq_len: int = 512
    batch_size: int = 4
    dtype: str = "float32"
    device: str = "auto"
    encoding: str = "utf-8"

    def check(self) -> None:
        check_at_least(1, ppl_windows=self.eval.ppl_windows, limit=self.eval.limit, batch_size=self.batch_size)
        check_seq_len(self.seq_len)
        check_tasks(split(self.eval.tasks))
        parse_dtype(self.dtype)
        resolve_device(self.device)


def evaluate(recipe: EvalRecipe, report_dir: Path | None = None) -> dict:
    """Evaluate ``recipe.model``; the report is written to ``report_dir`` (default ``runs/eval-<model>``)
    and returned."""
    recipe.check()
    folder = report_dir or Path("runs") / f"eval-{Path(recipe.model).name}"
    check_output(folder, True, source=recipe.model, option="--report-dir")
    start = time.perf_counter()
    lm, tokenizer = load_model_and_tokenizer(recipe.model, recipe.dtype, recipe.device)
    check_seq_len(recipe.seq_len, lm.config)
    windows = perplexity_windows(
        tokenizer, split(recipe.eval.ppl), recipe.seq_len, recipe.eval.ppl_windows, recipe.encoding
    )
    settings = recipe.eval
    metrics = evaluate_model(
        lm,
        tokenizer,
        windows,
        split(settings.tasks),
        settings.limit,
        settings.speed,
        recipe.batch_size,
        label=Path(recipe.model).name,
    )
    summary = {
        "command": "eval",
        "model": describe(recipe.model),
        "recipe": asdict(recipe),
        "settings": {"model": recipe.model, **asdict(settings), "seq_len": recipe.seq_len, "dtype": recipe.dtype},
        "metrics": {Path(recipe.model).name: metrics},
        "timings": {"total": time.perf_counter() - start},
    }
    with atomic_folder(folder, True, source=recipe.model, option="--report-dir") as tmp:
        report.write(summary, tmp)
    return summary
