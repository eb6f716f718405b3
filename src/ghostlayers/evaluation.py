"""Everything ``--eval`` measures on one model: perplexity per corpus, zero-shot accuracy, speed."""

from __future__ import annotations

from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.data import tokenize
from ghostlayers.perplexity import eval_windows, perplexity
from ghostlayers.speed import measure_speed


def perplexity_windows(tokenizer, sources: list[str], seq_len: int, max_windows: int | None) -> dict[str, Tensor]:
    """Test windows of each source, tokenized once and shared by the dense and the pruned model."""
    from ghostlayers.corpora import load_text

    return {s: eval_windows(tokenize(tokenizer, load_text(s, "test")), seq_len, max_windows) for s in sources}


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
