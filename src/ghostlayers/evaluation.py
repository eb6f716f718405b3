"""Everything ``--eval`` measures on one model: perplexity per corpus, zero-shot accuracy, speed."""

from __future__ import annotations

from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.data import split_shared_text, tokenize
from ghostlayers.perplexity import eval_windows, perplexity
from ghostlayers.speed import measure_speed


def perplexity_windows(
    tokenizer, sources: list[str], seq_len: int, max_windows: int | None, encoding: str = "utf-8"
) -> dict[str, Tensor]:
    """Test windows of each source, tokenized once and shared by the dense and the pruned model."""
    from ghostlayers.corpora import load_text

    return {s: eval_windows(tokenize(tokenizer, load_text(s, "test", encoding)), seq_len, max_windows) for s in sources}


def calibration_and_perplexity_tokens(
    tokenizer,
    calibration: str,
    sources: list[str],
    seq_len: int,
    max_windows: int | None,
    encoding: str = "utf-8",
) -> tuple[Tensor, dict[str, Tensor], str | None]:
    """The calibration tokens and each perplexity source's test windows. A file or folder that is both
    calibration and perplexity text is split (``data.split_shared_text``): the third value then says which
    and where, for the log and the report."""
    from ghostlayers.corpora import load_text, local_text

    tokens = tokenize(tokenizer, load_text(calibration, "train", encoding))
    shared = [s for s in sources if local_text(s) is not None and local_text(s) == local_text(calibration)]
    windows = perplexity_windows(tokenizer, [s for s in sources if s not in shared], seq_len, max_windows, encoding)
    note = None
    if shared:
        whole = tokens.numel()
        tokens, test = split_shared_text(tokens, seq_len, max_windows)
        windows.update(dict.fromkeys(shared, eval_windows(test, seq_len)))
        note = (
            f"{calibration} is both calibration and perplexity text: calibration windows come from its tokens "
            f"0..{tokens.numel() - 1}, perplexity windows from {tokens.numel()}..{whole - 1} (disjoint)"
        )
    return tokens, {s: windows[s] for s in sources}, note


def evaluate(
    model: PreTrainedModel,
    tokenizer,
    windows: dict[str, Tensor],
    tasks: list[str] = (),
    limit: int | None = None,
    speed: bool = True,
    batch_size: int = 4,
    label: str = "",
) -> dict:
    metrics: dict = {}
    if windows:
        metrics["ppl"] = {
            name: perplexity(model, w, batch_size, desc=f"{label} ppl {name}".strip()) for name, w in windows.items()
        }
    if tasks:
        from ghostlayers.zeroshot import evaluate_zeroshot

        metrics["zeroshot"] = evaluate_zeroshot(model, tokenizer, list(tasks), limit=limit, batch_size=batch_size)
    if speed:
        metrics["speed"] = measure_speed(model)
    return metrics
