"""The pruning job as data: a typed, frozen ``PruneRecipe`` (and ``EvalRecipe``) with every check that
needs neither the model nor torch. Light on purpose: the command line builds and checks a recipe, output
folder included, before it imports ``recipe`` (torch, transformers) to run it, so a bad option is refused
at once.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ghostlayers.errors import GhostLayersError
from ghostlayers.folders import check_output
from ghostlayers.options import (
    DEFAULT_RIDGE,
    DEFAULT_RIDGE_MODE,
    DEFAULT_SELECT_RANGE,
    check_at_least,
    check_dtype,
    check_options,
    check_seq_len,
    parse_ridge,
)
from ghostlayers.sources.catalog import DEFAULT_MODEL
from ghostlayers.sources.corpora import MIX_CORPORA, calibration_sources, check_source
from ghostlayers.sources.tasks import DEFAULT_TASKS, STANDARD_TASKS

RETIRED_TASK_PREFIX = "gl_"


def check_tasks(tasks: list[str]) -> None:
    """The retired BIG-bench tasks are named as such before anything loads (lm-eval checks the rest)."""
    retired = [t for t in tasks if t.startswith(RETIRED_TASK_PREFIX)]
    if retired:
        raise GhostLayersError(
            f"The gl_* zero-shot tasks ({', '.join(retired)}) are retired: their source, the BIG-bench archive, is "
            f"no longer on PyPI. Use the standard tasks ({', '.join(STANDARD_TASKS)}) or lm-eval task names."
        )


def split(values: str) -> list[str]:
    """A comma-separated option as a list."""
    return [v.strip() for v in values.split(",") if v.strip()]


@dataclass(frozen=True)
class EvalSettings:
    """What ``--eval`` (or ``ghostlayers eval``) measures."""

    ppl: str = ",".join(MIX_CORPORA)
    ppl_windows: int | None = 32
    tasks: str = ",".join(DEFAULT_TASKS)
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
    ridge: str = str(DEFAULT_RIDGE)
    ridge_mode: str = DEFAULT_RIDGE_MODE
    select_range: str = DEFAULT_SELECT_RANGE
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
        """Every check that needs neither the model nor torch (the device is checked as the run starts): bad
        input fails here, at once."""
        check_at_least(
            1,
            num_layers=self.num_layers,
            num_samples=self.num_samples,
            batch_size=self.batch_size,
            ppl_windows=self.eval.ppl_windows,
            limit=self.eval.limit,
        )
        check_at_least(0, stats_memory=self.stats_memory, heldout_windows=self.heldout_windows, seed=self.seed)
        check_seq_len(self.seq_len)
        check_tasks(split(self.eval.tasks))
        for source in calibration_sources(self.calibration) + (split(self.eval.ppl) if self.evaluate else []):
            check_source(source)
        check_dtype(self.dtype)
        parse_ridge(self.ridge)
        check_options(**self._settings(), num_batches=self._batches(self.num_samples), offload=self.offload)

    def check_run(self, output: Path | None = None, overwrite: bool = False, report_dir: Path | None = None) -> Path:
        """``check`` and the rules of the folder the run will write: all ``run`` refuses before loading
        anything. Returns the report folder."""
        self.check()
        folder = report_dir or default_report_dir(self)
        option = "--output" if output is not None else "--report-dir"
        check_output(output or folder, overwrite, [self.model], option, report=output is None)
        return folder

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


def default_report_dir(recipe: PruneRecipe) -> Path:
    return Path("runs") / f"{Path(recipe.model).name}-{recipe.select or 'manual'}-{recipe.method}"


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
        for source in split(self.eval.ppl):
            check_source(source)
        check_dtype(self.dtype)

    def check_run(self, report_dir: Path | None = None, overwrite: bool = False) -> Path:
        """``check`` and the report folder's rules; returns the report folder."""
        self.check()
        folder = report_dir or Path("runs") / f"eval-{Path(self.model).name}"
        check_output(folder, overwrite, [self.model], "--report-dir", report=True)
        return folder
