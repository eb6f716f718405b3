"""What the options may say, and every check of them that needs neither the model nor torch.

Light on purpose (no torch, no transformers): the command line builds its help from these tables and
refuses a bad option with these checks before it imports the heavy modules, so both answer at once.
``checks.check_model`` adds the checks that need the model.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ghostlayers.errors import GhostLayersError
from ghostlayers.registry.criteria import CRITERIA, criterion  # noqa: F401 (CRITERIA: spec and the package read it here)
from ghostlayers.registry.criteria import names as criteria_names
from ghostlayers.registry.methods import (
    AUTO,
    DEFAULT_RIDGE,
    DEFAULT_RIDGE_MODE,
    METHODS,
    candidates,
    check_chainable,
    check_ridge_mode,
    names,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SELECT_RANGES = ("all", "published")
DEFAULT_SELECT_RANGE = "all"
DEFAULT_BATCH_SIZE = 4  # windows per forward pass, wherever a batch size is not given
FITS = ("dense", "sequential", "chained")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def setting(default: Any, help: str, minimum: int | None = None, **option: Any) -> Any:
    """A settings field with what the command line says of it: its ``help``, its least value (``minimum``,
    checked when the settings are made) and ``option``: ``flags`` (the option's names), ``show_default``, and
    ``text`` (read as text on the command line, as ``auto`` or a number). ``cli`` builds the options from these."""
    return field(default=default, metadata={"help": help, "minimum": minimum, **option})


def check_ranges(settings: object) -> None:
    """Each field of the dataclass ``settings`` that has a ``minimum`` is None or from it to ``LARGEST``."""
    for f in fields(settings):
        if f.metadata.get("minimum") is not None:
            check_at_least(f.metadata["minimum"], **{f.name: getattr(settings, f.name)})


def check_select_range(select_range: str) -> None:
    if select_range not in SELECT_RANGES:
        raise GhostLayersError(
            f"Unknown --select-range '{select_range}': use 'all' (any layer may be removed) or 'published' "
            "(never the first or the last layer, as the published selection code)."
        )


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise GhostLayersError(f"Unknown dtype '{dtype}'. Choose one of: {', '.join(DTYPES)}.")


NOT_FILE_ENCODINGS = ("punycode", "idna", "undefined")  # text codecs no text file is written in


def check_encoding(encoding: str) -> None:
    """``--encoding`` names a codec text files are decoded with, checked before any work: not a bytes-to-bytes
    or text-to-text one (base64, zlib, rot13), nor one for host names (punycode), which fail on a file."""
    try:
        codec = codecs.lookup(encoding)
    except (LookupError, ValueError):
        raise GhostLayersError(f"--encoding {encoding} is not a known text encoding (e.g. utf-8, latin-1).") from None
    if not getattr(codec, "_is_text_encoding", True) or codec.name in NOT_FILE_ENCODINGS:
        raise GhostLayersError(
            f"--encoding {encoding} is a codec but not an encoding of text files: give the files' encoding (e.g. "
            "utf-8, latin-1, cp1252)."
        )


def read_layers(spec: str) -> range | list[int]:
    """``"12:18"`` (half-open, like a Python slice) or ``"3,7,9"`` as indices, unchecked against a model; a
    range stays a ``range`` (5:10000000 must not become a list before its bounds are checked)."""
    try:
        if ":" in spec:
            start, stop = (int(part) for part in spec.split(":"))
            indices = range(start, stop)
        else:
            indices = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError as error:
        raise GhostLayersError(
            f"Cannot read --layers '{spec}': give a range like 12:18 (layers 12..17) or a list like 3,7,9."
        ) from error
    if ":" in spec and not indices:
        raise GhostLayersError(f"--layers {spec} is an empty range: use START:STOP with START < STOP.")
    return indices


def _number_or_auto(value: str | float, option: str, valid, expected: str) -> float | str:
    """``auto``, or a number ``valid`` accepts (NaN never is), else an error naming ``option``."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if math.isnan(number) or not valid(number):
        raise GhostLayersError(f"{option} {value} is not valid: give {expected} or 'auto'.")
    return number


def parse_ridge(value: str | float) -> float | str:
    """``auto`` or a finite number ≥ 0 (``nan`` and ``inf`` would fit a broken operator)."""
    return _number_or_auto(value, "--ridge", lambda r: math.isfinite(r) and r >= 0, "a finite number ≥ 0 (e.g. 1e-6)")


def parse_alpha(value: str | float) -> float | str:
    """``auto`` or a number in [0, 1]: the share of the fitted repair kept (0 is plain pruning)."""
    return _number_or_auto(value, "--alpha", lambda a: 0.0 <= a <= 1.0, "a number from 0 to 1 (1: the full repair)")


LARGEST = 2**63 - 1  # torch counts and seeds are int64: a larger one overflows deep inside torch


def check_at_least(minimum: int, **values: int | None) -> None:
    """Each named option (``num_samples=32`` is ``--num-samples``) is None or from ``minimum`` to ``LARGEST``."""
    for name, value in values.items():
        if value is not None and not minimum <= value <= LARGEST:
            option = "--" + name.replace("_", "-")
            raise GhostLayersError(f"{option} {value} is not valid: it must be from {minimum} to {LARGEST}.")


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's position embeddings cover, where the config says."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(seq_len: int, config: PretrainedConfig | None = None) -> None:
    check_at_least(2, seq_len=seq_len)
    limit = max_positions(config) if config is not None else None
    if limit is not None and seq_len > limit:
        raise GhostLayersError(
            f"--seq-len {seq_len} is longer than this model's {limit} positions: use --seq-len {limit} or less."
        )


def check_route(name: str, select: str | None, offload: bool) -> None:
    """The sums of a method gathered after selection (refit's) come from an in-memory pass over the removed
    runs once they are known: not with a criterion that reads the candidates' sums, nor layer by layer."""
    late = any(m.after_selection for m in candidates(name))
    if late and (offload or (select is not None and criterion(select).candidate_stats)):
        plain = criteria_names(lambda c: not c.candidate_stats)
        raise GhostLayersError(
            f"{name} gathers its statistics (I × I per removed run, I the MLP width) in the in-memory pass, once "
            f"the removed layers are known: use it with --layers or --select {', '.join(plain)}, without "
            "--offload; or use --method replaceme, which needs no more than ghost."
        )


DEFAULT_METHOD = "ghost"
DEFAULT_ALPHA = "auto"  # the CLI's and the API's: the largest safe share on held-out windows, else the full fit
DEFAULT_FIT = "dense"
LEAVE_ONE_DOMAIN_OUT, ON_HELD_OUT = "leave-one-domain-out", "held-out"  # how alpha_rule settles "auto"


def alpha_rule(alpha: float | str, heldout: bool, domains: int) -> float | str:
    """The one place that says what ``alpha="auto"`` means. With held-out windows of several calibration
    domains, ``LEAVE_ONE_DOMAIN_OUT``: each domain left out of the fit in turn (``choices``); of one,
    ``ON_HELD_OUT``: the guard's grid on its windows (``guard``); with none, the full fit, α = 1, as the
    papers publish it. A number is itself."""
    if alpha != "auto":
        return float(alpha)
    if not heldout:
        return 1.0
    return LEAVE_ONE_DOMAIN_OUT if domains > 1 else ON_HELD_OUT


AUTO_NEEDS = (
    "--method auto compares the methods on held-out windows of a dense fit: give --heldout-windows 1 or more and "
    "--fit dense, or name a method."
)


@dataclass(frozen=True)
class Settings:
    """What to remove and how to repair it, as ``pipeline.prune`` takes it; ``recipes.PruneRecipe`` is these
    settings and what the job runs on (model, text, device, evaluation, heal), so each field, its default and
    its command-line help are declared here once. ``ridge`` and ``alpha`` are numbers or ``"auto"`` (a number
    given as text is read as one); ``layers`` a text (``12:18``, ``3,7,9``) or a list of indices. Checked once,
    when made, by every check that needs neither the data nor the model: ``check_data`` adds the data's,
    ``checks.check_model`` the model's."""

    layers: str | list[int] | None = setting(
        None, "Layers to remove: 12:18 (12..17) or 3,7,9 (original indices).", text=True
    )
    select: str | None = setting(None, f"Selection criterion: {', '.join(CRITERIA)}.")
    num_layers: int | None = setting(None, "How many layers --select removes (default 4).", minimum=1)
    method: str = setting(
        DEFAULT_METHOD,
        f"Recovery: {', '.join(METHODS)}, or auto (the lowest held-out loss among the methods worse than plain "
        "pruning on no calibration source).",
    )
    ridge: str | float = setting(
        DEFAULT_RIDGE,
        "Ridge λ relative to trace(XᵀX)/C, or 'auto': the ridge of lowest held-out perplexity (ghost, "
        "replaceme) of 1e-6, 1e-4, 1e-3, 1e-2, 1e-1.",
        text=True,
    )
    alpha: str | float = setting(
        DEFAULT_ALPHA,
        "Share of the fitted repair kept, W = I + αM (0: plain pruning, 1: the full fit), or 'auto': the α of "
        "lowest held-out loss among those worse than plain pruning on no source; with several calibration "
        "sources each is left out of the fit in turn and scored on its own held-out windows.",
        text=True,
    )
    fit: str = setting(
        DEFAULT_FIT,
        "dense (one operator per removed run), sequential (later runs fit on the patched model) or chained (one "
        "operator per removed layer, multiplied: the published Ghosted Layers code).",
    )
    ridge_mode: str = setting(
        DEFAULT_RIDGE_MODE, "relative (λ = ridge · trace(XᵀX)/C) or absolute (λ = ridge, as the published code)."
    )
    select_range: str = setting(
        DEFAULT_SELECT_RANGE, "Layers --select may remove: all, or published (never the first or the last layer)."
    )
    _checked: set = field(default_factory=set, init=False, repr=False, compare=False)  # what it was checked against

    def __post_init__(self) -> None:
        check_ranges(self)
        object.__setattr__(self, "ridge", parse_ridge(self.ridge))
        object.__setattr__(self, "alpha", parse_alpha(self.alpha))
        self._check_choices()
        self._check_fit()

    def _check_choices(self) -> None:
        """Which layers and which method: each a known name, and exactly one way to choose the layers."""
        layers, select, method = self.layers, self.select, self.method
        if (layers is None) == (select is None):
            raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
        if isinstance(layers, str):
            read_layers(layers)
        if select is not None:
            criterion(select)
        if select is not None and self.num_layers is None:
            raise GhostLayersError(f"--select {select} needs --num-layers N (how many layers to remove).")
        candidates(method)

    def _check_fit(self) -> None:
        """How the operators are fitted, and what the method's record allows of that fit."""
        fit, method = self.fit, self.method
        if method == AUTO and fit != "dense":
            raise GhostLayersError(AUTO_NEEDS)
        if fit not in FITS:
            raise GhostLayersError(
                f"Unknown --fit '{fit}': use 'dense' (one operator per removed run), 'sequential' (later runs fit "
                "on the patched model) or 'chained' (one operator per removed layer, multiplied, as published)."
            )
        check_ridge_mode(self.ridge_mode)
        check_select_range(self.select_range)
        if fit == "chained":
            check_chainable(method)
            if self.ridge == "auto":
                raise GhostLayersError(
                    "--ridge auto chooses one ridge per removed run, not per layer: give --fit chained a number "
                    "(e.g. --ridge 1e-6)."
                )
        if fit == "sequential" and not all(m.sequential for m in candidates(method)):
            sequential = names(lambda m: m.sequential)
            raise GhostLayersError(
                f"--fit sequential fits later runs on the stream earlier operators produce; {method} puts no "
                f"operator on the stream. Use --fit dense, or one of {', '.join(sequential)}."
            )
        check_route(method, self.select, offload=False)

    def once(self, *key: object) -> bool:
        """True the first time these settings are checked against ``key``: a check the command line made
        before loading the model is not made again by ``pipeline.prune``, which checks for API callers."""
        fresh = key not in self._checked
        self._checked.add(key)
        return fresh

    def check_data(self, heldout_windows: int | None, offload: bool) -> None:
        """The checks that need what the settings are used on: how many held-out windows per source (0: none)
        and whether calibration streams the layers (``offload``). Once per settings and data."""
        if self.once("data", heldout_windows, offload):
            self._check_data(heldout_windows, offload)

    def _check_data(self, heldout_windows: int | None, offload: bool) -> None:
        select, method = self.select, self.method
        by_loss = select is not None and bool(criterion(select).by_loss)
        if method == AUTO and heldout_windows == 0:
            raise GhostLayersError(AUTO_NEEDS)
        if offload:
            check_route(method, select, offload)
        if offload and (by_loss or method == AUTO):
            raise GhostLayersError(
                "--select loss and --method auto score repairs on the whole model, which --offload never holds: "
                "use them without --offload, or name the layers and the method."
            )
        if self.fit == "sequential" and offload:
            raise GhostLayersError("--fit sequential runs the whole dense model per batch: use it without --offload.")
        if by_loss and heldout_windows == 0:
            raise GhostLayersError(
                "--select loss scores candidates on held-out windows: give --heldout-windows 1 or more."
            )
