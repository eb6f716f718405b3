"""Token windows from text: the calibration samples and the perplexity windows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ghostlayers.errors import GhostLayersError

WHOLE_CHARS = 1 << 23  # more than any bundled corpus: a text up to this long is tokenized whole, as always
PIECE_CHARS = 1 << 20  # a tokenizer holds ~400 bytes per token of what it is given: 100 MB whole took 12+ GB


def tokenize(tokenizer, text: str, limit: int | None = None) -> Tensor:
    """The text as one token sequence (special tokens as the tokenizer adds them, e.g. one BOS), or its first
    ``limit`` tokens. A text longer than ``WHOLE_CHARS`` is tokenized in pieces of ``PIECE_CHARS``, which
    bounds the memory, and only until ``limit`` tokens are reached. Pieces are cut before a line break, where
    byte-level BPE splits the text anyway, so they give the whole text's tokens."""
    size = len(text) if len(text) <= WHOLE_CHARS else PIECE_CHARS
    pieces, count, start = [], 0, 0
    while not pieces or (start < len(text) and (limit is None or count < limit)):
        stop = len(text) if len(text) - start <= size else text.rfind("\n", start + 1, start + size)
        stop = stop if stop > start else start + size  # no line break: a hard cut
        pieces.append(torch.tensor(tokenizer(text[start:stop], add_special_tokens=start == 0)["input_ids"]))
        count, start = count + pieces[-1].numel(), stop
    return torch.cat(pieces).long()[:limit]


def draw_windows(
    tokens: Tensor, num_samples: int, seq_len: int, seed: int = 0, heldout: int = 0, name: str = "calibration text"
) -> tuple[Tensor, Tensor]:
    """``num_samples`` distinct non-overlapping windows of ``seq_len`` tokens drawn with ``seed``, and
    ``heldout`` further windows disjoint from them (for scoring a fit on text it was not fitted on). The
    calibration windows are the same whatever ``heldout`` is."""
    available = tokens.numel() // seq_len
    if num_samples < 1 or seq_len < 2:
        raise GhostLayersError("--num-samples must be ≥ 1 and --seq-len ≥ 2.")
    if available < num_samples + heldout:
        need = f"{num_samples} samples" + (f" and {heldout} held-out windows" if heldout else "")
        fewer = [f"fewer --num-samples (at most {available - heldout})"] if available > heldout else []
        fewer += [f"fewer --heldout-windows (at most {available - num_samples})"] if available > num_samples else []
        raise GhostLayersError(
            f"The {name} has {tokens.numel()} tokens: {need} of {seq_len} tokens need "
            f"{(num_samples + heldout) * seq_len}. Use a longer text, {', '.join([*fewer, 'a shorter --seq-len'])}."
        )
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))

    def windows(indices: Tensor) -> Tensor:
        starts = indices.sort().values * seq_len
        return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()]) if indices.numel() else tokens[:0]

    return windows(order[:num_samples]), windows(order[num_samples : num_samples + heldout]).view(-1, seq_len)


def calibration_windows(tokens: Tensor, num_samples: int, seq_len: int, seed: int = 0) -> Tensor:
    """``num_samples`` distinct non-overlapping windows of ``seq_len`` tokens, drawn with ``seed``."""
    return draw_windows(tokens, num_samples, seq_len, seed)[0]


@dataclass
class CalibrationSet:
    """Calibration windows drawn from one or several sources (domains), and held-out windows of each
    source that the fit never sees."""

    windows: dict[str, Tensor]
    heldout: dict[str, Tensor]

    def batches(self, batch_size: int) -> list[Tensor]:
        """Each source's windows in batches of its own, so every batch belongs to one domain."""
        return [b for w in self.windows.values() for b in batched(w, batch_size)]

    def batch_domains(self, batch_size: int) -> list[str]:
        """The source of each batch of ``batches(batch_size)``."""
        return [name for name, w in self.windows.items() for _ in batched(w, batch_size)]

    @property
    def tokens(self) -> int:
        return sum(w.numel() for w in self.windows.values())


def calibration_set(
    texts: dict[str, Tensor], num_samples: int, seq_len: int, seed: int = 0, heldout: int = 0
) -> CalibrationSet:
    """``num_samples`` windows shared evenly among the sources (the first ones take the remainder), and
    ``heldout`` held-out windows from each."""
    if num_samples < len(texts):
        raise GhostLayersError(
            f"--num-samples {num_samples} cannot be shared among {len(texts)} calibration sources: give at least "
            f"{len(texts)}."
        )
    share = [num_samples // len(texts) + (k < num_samples % len(texts)) for k in range(len(texts))]
    drawn = {
        name: draw_windows(tokens, n, seq_len, seed, heldout, name=f"calibration text '{name}'")
        for (name, tokens), n in zip(texts.items(), share, strict=True)
    }
    return CalibrationSet({k: v[0] for k, v in drawn.items()}, {k: v[1] for k, v in drawn.items()})


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
