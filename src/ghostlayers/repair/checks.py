"""Every check of a run's settings that can be made before the model's first forward pass, in one place
(the finiteness checks made where numbers are born are ``numerics.finite``).

A bad setting found after an hour of calibration, or deep inside torch as a traceback, costs the user
far more than a one-line message at the start: ``config.settings.Settings`` checks itself when made (what needs
no model), and ``check_model`` adds what needs the model's config, before any work, from the CLI and from
``pipeline.prune`` alike.
"""

from __future__ import annotations

import math

from transformers import PreTrainedModel

from ghostlayers.calibration.selection import parse_layers, validate_count, validate_layers
from ghostlayers.config.settings import Settings
from ghostlayers.errors import GhostLayersError
from ghostlayers.model.adapters import adapter_for
from ghostlayers.numerics.hadamard import has_hadamard
from ghostlayers.registry.methods import REGISTRY, SUMS, candidates

TOKENS_PER_CHANNEL = 32  # calibration tokens per hidden channel by default (docs/RESULTS.md, calibration size)
FEW_TOKENS_PER_CHANNEL = 16  # below this the recovered share falls off: warn


def default_num_samples(hidden_size: int, seq_len: int) -> int:
    """Calibration windows for ``TOKENS_PER_CHANNEL`` tokens per hidden channel: the least-squares map has
    C² unknowns, so the calibration it needs grows with C (SmolLM2 C = 576: 36 windows of 512; a 1.5B
    model, C = 1536: 96; an 8B model, C = 4096: 256)."""
    return max(1, math.ceil(TOKENS_PER_CHANNEL * hidden_size / seq_len))


def few_tokens_warning(tokens: int, hidden_size: int, method: str, seq_len: int) -> str | None:
    """A warning when a least-squares repair is fitted on fewer tokens than the calibration-size curve needs."""
    least_squares = any(m.least_squares for m in candidates(method))
    if not least_squares or tokens >= FEW_TOKENS_PER_CHANNEL * hidden_size:
        return None
    return (
        f"{tokens} calibration tokens are {tokens / hidden_size:.1f} per hidden channel (C = {hidden_size}); the "
        f"fit recovers clearly less below {FEW_TOKENS_PER_CHANNEL} per channel (docs/RESULTS.md, calibration "
        f"size). The default for this model is --num-samples {default_num_samples(hidden_size, seq_len)} at "
        f"--seq-len {seq_len}."
    )


def check_model(model: PreTrainedModel, settings: Settings, tokens: int | None = None) -> None:
    """What ``settings`` (checked without a model when made) need of ``model`` (loaded, or an offload
    skeleton): not pruned already, the layers to remove, and what the method needs (``check_method``), with
    the ``tokens`` of calibration for a ridge of 0. Once per settings, model and tokens (``Settings.once``)."""
    if settings.once("model", id(model), tokens):
        _check_model(model, settings, tokens)


def _check_model(model: PreTrainedModel, settings: Settings, tokens: int | None) -> None:
    if getattr(model.config, "ghostlayers", None) is not None:
        raise GhostLayersError(
            "This model is already pruned by ghostlayers: prune its source model instead (its record names it), "
            "removing all the layers you want gone in one run."
        )
    adapter_for(model)
    layers, total = settings.layers, model.config.num_hidden_layers
    removed = None
    if isinstance(layers, str):
        removed = parse_layers(layers, total)
    elif layers is not None:
        removed = validate_layers(list(layers), total)
    else:
        validate_count(settings.num_layers, total, settings.select_range)
    check_method(model, settings.method, removed, settings.ridge, tokens)


def check_method(
    model: PreTrainedModel, method: str, removed: list[int] | None, ridge: float | str, tokens: int | None = None
) -> None:
    """What ``method`` needs of the model: a Hadamard matrix of its width, a down-projection to fold into
    (not in front of layer 0), enough ``tokens`` for a ridge of 0. ``auto`` checks each candidate by what the
    statistics allow; ``pipeline.apply`` checks the method ``auto`` chose."""
    record, config = REGISTRY.get(method), model.config
    if record is None:
        return
    size = config.hidden_size
    if any(SUMS[name].rotated for name in record.sums) and not has_hadamard(size):
        raise GhostLayersError(
            f"{method} needs a Hadamard matrix of order {size} (this model's hidden size), which "
            "ghostlayers cannot build. Use --method linearpatch or --method ghost."
        )
    if record.folded and adapter_for(model).down_proj is None:
        raise GhostLayersError(
            f"{method} is not available for {config.model_type}: its MLP output is normalized before the "
            "residual add, so nothing can be folded into the down-projection. Use --method ghost."
        )
    if record.folded and removed and min(removed) == 0:
        raise GhostLayersError(
            f"{method} rewrites the MLP of the layer before the removed block, but the block starts at layer 0. "
            "Keep layer 0 or use --method ghost."
        )
    if ridge == 0 and record.least_squares and tokens is not None and tokens < size:
        raise GhostLayersError(
            f"--ridge 0 with {tokens} calibration tokens, fewer than the hidden size {size}: the least-squares "
            f"problem has no unique solution. Use at least {size} tokens or a ridge > 0 (e.g. 1e-6)."
        )
