"""Token windows from text: the calibration samples and the perplexity windows."""

from __future__ import annotations

import torch
from torch import Tensor

from ghostlayers.errors import GhostLayersError


def tokenize(tokenizer, text: str) -> Tensor:
    """The whole text as one token sequence (special tokens as the tokenizer adds them, e.g. one BOS)."""
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def calibration_windows(tokens: Tensor, num_samples: int, seq_len: int, seed: int = 0) -> Tensor:
    """``num_samples`` distinct non-overlapping windows of ``seq_len`` tokens, drawn with ``seed``."""
    available = tokens.numel() // seq_len
    if num_samples < 1 or seq_len < 2:
        raise GhostLayersError("--num-samples must be ≥ 1 and --seq-len ≥ 2.")
    if available < num_samples:
        raise GhostLayersError(
            f"The calibration text has {tokens.numel()} tokens: {num_samples} samples of {seq_len} tokens need "
            f"{num_samples * seq_len}. Use a longer text, fewer --num-samples (at most {available}) or a "
            "shorter --seq-len."
        )
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:num_samples]
    starts = order.sort().values * seq_len
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def split_shared_text(tokens: Tensor, seq_len: int, eval_windows: int | None) -> tuple[Tensor, Tensor]:
    """One text used for calibration and for perplexity: the calibration part from its start and the
    evaluation part (``eval_windows`` windows, or the last tenth when None) from its end, disjoint, so the
    perplexity never measures tokens the operator was fitted on."""
    total = tokens.numel() // seq_len
    count = eval_windows if eval_windows is not None else max(1, total // 10)
    if total < count + 1:
        raise GhostLayersError(
            f"The text used for both calibration and perplexity has {tokens.numel()} tokens: {count} evaluation "
            f"windows of {seq_len} leave nothing to calibrate on. Use fewer --ppl-windows or a longer text."
        )
    cut = tokens.numel() - count * seq_len
    return tokens[:cut], tokens[cut:]


def batched(samples: Tensor, batch_size: int) -> list[Tensor]:
    return list(samples.split(batch_size))
