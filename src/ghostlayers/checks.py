"""Every check of a run's settings that can be made before the model's first forward pass, in one place,
and the finiteness checks made where numbers are born (statistics, operators).

A bad setting found after an hour of calibration, or deep inside torch as a traceback, costs the user
far more than a one-line message at the start: ``check_settings`` runs before any work (without a model,
the checks that need none; with its config, the rest), from the CLI and from ``pipeline.prune`` alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

from ghostlayers.adapters import adapter_for
from ghostlayers.errors import GhostLayersError
from ghostlayers.hadamard import has_hadamard
from ghostlayers.operators import FOLDED_METHODS, METHODS, check_chainable, check_ridge_mode
from ghostlayers.selection import (
    CRITERIA,
    RECOVERY_AWARE,
    check_select_range,
    parse_layers,
    validate_count,
    validate_layers,
)
from ghostlayers.zeroshot import OFFLINE_TASKS, PREFIX

TOKENS_PER_CHANNEL = 32  # calibration tokens per hidden channel by default (docs/RESULTS.md, calibration size)
FEW_TOKENS_PER_CHANNEL = 16  # below this the recovered share falls off: warn


def default_num_samples(hidden_size: int, seq_len: int) -> int:
    """Calibration windows for ``TOKENS_PER_CHANNEL`` tokens per hidden channel: the least-squares map has
    C² unknowns, so the calibration it needs grows with C (SmolLM2 C = 576: 36 windows of 512; a 1.5B
    model, C = 1536: 96; an 8B model, C = 4096: 256)."""
    return max(1, math.ceil(TOKENS_PER_CHANNEL * hidden_size / seq_len))


def few_tokens_warning(tokens: int, hidden_size: int, method: str, seq_len: int) -> str | None:
    """A warning when a least-squares repair is fitted on fewer tokens than the calibration-size curve needs."""
    if method in ("none", "linearpatch", "linearpatch-rotate") or tokens >= FEW_TOKENS_PER_CHANNEL * hidden_size:
        return None
    return (
        f"{tokens} calibration tokens are {tokens / hidden_size:.1f} per hidden channel (C = {hidden_size}); the "
        f"fit recovers clearly less below {FEW_TOKENS_PER_CHANNEL} per channel (docs/RESULTS.md, calibration "
        f"size). The default for this model is --num-samples {default_num_samples(hidden_size, seq_len)} at "
        f"--seq-len {seq_len}."
    )


PLAIN_CRITERIA = tuple(c for c in CRITERIA if c not in (*RECOVERY_AWARE, "loss"))  # no statistics to select
SEQUENTIAL_METHODS = ("ghost", "linearpatch", "linearpatch-rotate")  # stream operators a later run can see
FITS = ("dense", "sequential", "chained")


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


def check_refit_route(select: str | None, offload: bool) -> None:
    """refit's sums are gathered in memory for the removed runs once they are known: not with a criterion
    that needs statistics to select, nor layer by layer."""
    if offload or select == "loss" or select in RECOVERY_AWARE:
        raise GhostLayersError(
            "refit gathers its statistics (I × I per removed run, I the MLP width) in the in-memory pass, once the "
            f"removed layers are known: use it with --layers or --select {', '.join(PLAIN_CRITERIA)}, without "
            "--offload; or use --method replaceme, which needs no more than ghost."
        )


def check_settings(
    model: PreTrainedModel | None = None,
    *,
    layers: str | list[int] | None = None,
    select: str | None = None,
    num_layers: int | None = None,
    method: str = "ghost",
    ridge: float | str = 1e-6,
    alpha: float | str = 1.0,
    fit: str = "dense",
    ridge_mode: str = "relative",
    select_range: str = "all",
    num_batches: int | None = None,
    tokens: int | None = None,
    heldout_windows: int | None = None,
    offload: bool = False,
) -> list[int] | None:
    """The pruning settings that need no forward pass; with ``model`` (loaded, or an offload skeleton), also
    those that depend on it: architecture, hidden size, layer indices. Returns the manual ``layers`` as
    sorted original indices (None when selected by a criterion, or without ``model``)."""
    if (layers is None) == (select is None):
        raise GhostLayersError("Give either --layers (indices to remove) or --select with --num-layers.")
    if select is not None and select not in CRITERIA:
        raise GhostLayersError(f"Unknown selection criterion '{select}'. Choose one of: {', '.join(CRITERIA)}.")
    if select is not None and num_layers is None:
        raise GhostLayersError(f"--select {select} needs --num-layers N (how many layers to remove).")
    if method not in (*METHODS, "auto"):
        raise GhostLayersError(
            f"Unknown recovery method '{method}'. Choose one of: {', '.join(METHODS)}, or auto (the best on "
            "held-out windows among the methods that are worse than plain pruning on no calibration source)."
        )
    if method == "auto" and (heldout_windows == 0 or fit != "dense"):
        raise GhostLayersError(
            "--method auto compares the methods on held-out windows of a dense fit: give "
            "--heldout-windows 1 or more and --fit dense, or name a method."
        )
    if fit not in FITS:
        raise GhostLayersError(
            f"Unknown --fit '{fit}': use 'dense' (one operator per removed run), 'sequential' (later runs fit on "
            "the patched model) or 'chained' (one operator per removed layer, multiplied, as published)."
        )
    check_ridge_mode(ridge_mode)
    check_select_range(select_range)
    if fit == "chained":
        check_chainable(method)
        if ridge == "auto":
            raise GhostLayersError(
                "--ridge auto chooses one ridge per removed run, not per layer: give --fit chained a number "
                "(e.g. --ridge 1e-6)."
            )
    if fit == "sequential" and method not in SEQUENTIAL_METHODS:
        raise GhostLayersError(
            f"--fit sequential fits later runs on the stream earlier operators produce; {method} puts no operator "
            f"on the stream. Use --fit dense, or one of {', '.join(SEQUENTIAL_METHODS)}."
        )
    if method == "refit":
        check_refit_route(select, offload)
    if offload and (select == "loss" or method == "auto"):
        raise GhostLayersError(
            "--select loss and --method auto score repairs on the whole model, which --offload never holds: "
            "use them without --offload, or name the layers and the method."
        )
    if fit == "sequential" and offload:
        raise GhostLayersError("--fit sequential runs the whole dense model per batch: use it without --offload.")
    ridge = parse_ridge(ridge)
    if select == "loss" and heldout_windows == 0:
        raise GhostLayersError("--select loss scores candidates on held-out windows: give --heldout-windows 1 or more.")
    if parse_alpha(alpha) == "auto" and heldout_windows == 0:
        raise GhostLayersError("--alpha auto is chosen on held-out windows: give --heldout-windows 1 or more.")
    if ridge == "auto" and not heldout_windows and num_batches is not None and num_batches < 2:
        raise GhostLayersError(
            f"--ridge auto without held-out windows holds every other calibration batch out, but there is "
            f"{num_batches} batch: give --heldout-windows 1 or more, use more --num-samples than --batch-size, or "
            "give a number for --ridge."
        )
    if model is None:
        return None
    if getattr(model.config, "ghostlayers", None) is not None:
        raise GhostLayersError(
            "This model is already pruned by ghostlayers: prune its source model instead (its record names it), "
            "removing all the layers you want gone in one run."
        )
    adapter, config = adapter_for(model), model.config
    total = config.num_hidden_layers
    removed = None
    if isinstance(layers, str):
        removed = parse_layers(layers, total)
    elif layers is not None:
        removed = validate_layers(list(layers), total)
    else:
        validate_count(num_layers, total, select_range)
    size = config.hidden_size
    if method == "linearpatch-rotate" and not has_hadamard(size):
        raise GhostLayersError(
            f"linearpatch-rotate needs a Hadamard matrix of order {size} (this model's hidden size), which "
            "ghostlayers cannot build. Use --method linearpatch or --method ghost."
        )
    if method in FOLDED_METHODS and adapter.down_proj is None:
        raise GhostLayersError(
            f"{method} is not available for {config.model_type}: its MLP output is normalized before the "
            "residual add, so nothing can be folded into the down-projection. Use --method ghost."
        )
    if method in FOLDED_METHODS and removed and min(removed) == 0:
        raise GhostLayersError(
            f"{method} rewrites the MLP of the layer before the removed block, but the block starts at layer 0. "
            "Keep layer 0 or use --method ghost."
        )
    if ridge == 0 and method in ("ghost", *FOLDED_METHODS) and tokens is not None and tokens < size:
        raise GhostLayersError(
            f"--ridge 0 with {tokens} calibration tokens, fewer than the hidden size {size}: the least-squares "
            f"problem has no unique solution. Use at least {size} tokens or a ridge > 0 (e.g. 1e-6)."
        )
    return removed


def check_tasks(tasks: list[str]) -> None:
    """Offline task names are known without loading anything (lm-eval's own are checked when it loads)."""

    unknown = [t for t in tasks if t.startswith(PREFIX) and t not in OFFLINE_TASKS]
    if unknown:
        raise GhostLayersError(
            f"Unknown offline zero-shot task(s) {', '.join(unknown)}: choose from {', '.join(OFFLINE_TASKS)}."
        )


def check_finite(values: Mapping[str, Tensor | None], where: str, cause: str) -> None:
    """Stop with a message naming ``where`` and the likely ``cause`` when any value is NaN or infinite."""
    bad = [name for name, value in values.items() if value is not None and not bool(torch.isfinite(value).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise GhostLayersError(f"{where}: {shown} hold NaN or infinite values. {cause}")
