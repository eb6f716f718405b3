"""Perplexity by the protocol of the GPTQ / LinearPatch / Ghosted Layers evaluations.

The test text is tokenized as one sequence and cut into non-overlapping windows of ``seq_len`` tokens
(the tail shorter than a window is dropped); each window is scored on its own, with no context carried
between windows, and perplexity is ``exp`` of the mean next-token negative log-likelihood over every
predicted token of every window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.config.settings import DEFAULT_BATCH_SIZE
from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.prefix import SharedPrefix, running


def eval_windows(tokens: Tensor, seq_len: int, max_windows: int | None = None) -> Tensor:
    """The first ``max_windows`` non-overlapping windows (all of them when None)."""
    count = tokens.numel() // seq_len
    if count == 0:
        raise GhostLayersError(
            f"The evaluation text has {tokens.numel()} tokens, fewer than one window of --seq-len {seq_len}. "
            "Use a longer text or a shorter --seq-len."
        )
    count = count if max_windows is None else min(count, max_windows)
    return tokens[: count * seq_len].view(count, seq_len)


@torch.no_grad()
def perplexity(
    model: PreTrainedModel,
    windows: Tensor,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    desc: str = "perplexity",
    prefix: SharedPrefix | None = None,
) -> float:
    """With ``prefix``, the layers before its depth do not run: their states are shared (``prefix.SharedPrefix``,
    made from the same layers); the result is the same."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with running(model, prefix):
        for batch in tqdm(windows.split(batch_size), desc=desc, unit="batch", disable=not progress):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
            count += batch[:, 1:].numel()
    return math.exp(total / count)
