"""Checks of the tensors the package is given or makes: token ids as the API takes them, and finiteness where
numbers are born (calibration statistics, operators, loaded weights)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.errors import GhostLayersError

TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_finite(values: Mapping[str, Tensor | None], where: str, cause: str) -> None:
    """Stop with a message naming ``where`` and the likely ``cause`` when any value is NaN or infinite."""
    bad = [name for name, value in values.items() if value is not None and not bool(torch.isfinite(value).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise GhostLayersError(f"{where}: {shown} hold NaN or infinite values. {cause}")


def check_token_ids(model: PreTrainedModel, batches: object, what: str = "batches") -> list[Tensor]:
    """``batches`` as the API takes token ids, as a list: a non-empty sequence (or mapping, as held-out windows
    by domain) of 2-D integer tensors ``[batch, seq]``, none empty, every id a row of the model's embedding.
    Anything else is one error saying what was given: torch would fail deep in the embedding or the attention."""
    vocab = model.get_input_embeddings().num_embeddings
    expected = f"a 2-D integer tensor [batch, seq] of token ids from 0 to {vocab - 1}"
    if isinstance(batches, Tensor | str | bytes) or not isinstance(batches, Iterable):
        kind = f"one tensor of shape {tuple(batches.shape)}" if isinstance(batches, Tensor) else type(batches).__name__
        raise GhostLayersError(f"{what} is {kind}: give a list of batches, each {expected}.")
    named = list(batches.items() if isinstance(batches, Mapping) else enumerate(batches))
    if not named:
        raise GhostLayersError(f"{what} is empty: give at least one batch, {expected}.")
    for key, batch in named:
        if not isinstance(batch, Tensor):
            wrong = f"a {type(batch).__name__}, not a tensor"
        elif batch.dtype not in TOKEN_DTYPES:
            wrong = f"a {str(batch.dtype).removeprefix('torch.')} tensor"
        elif batch.dim() != 2:
            wrong = f"a {batch.dim()}-D tensor of shape {tuple(batch.shape)}"
        elif batch.numel() == 0:
            wrong = f"empty (shape {tuple(batch.shape)})"
        elif (low := int(batch.min())) < 0 or (high := int(batch.max())) >= vocab:
            wrong = f"a tensor holding the id {low if low < 0 else high}"
        else:
            continue
        raise GhostLayersError(f"{what}[{key!r}] is {wrong}: each must be {expected}.")
    return [batch for _, batch in named]
