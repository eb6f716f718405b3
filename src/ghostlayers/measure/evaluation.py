"""What ``--eval`` measures on one model: perplexity per corpus and zero-shot accuracy (speed: ``speed``)."""

from __future__ import annotations

from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.config.settings import DEFAULT_BATCH_SIZE
from ghostlayers.measure.perplexity import eval_windows, perplexity
from ghostlayers.measure.prefix import SharedPrefix, running
from ghostlayers.measure.zeroshot import evaluate_zeroshot
from ghostlayers.sources.corpora import (
    OFFLINE,
    calibration_sources,
    calibration_texts,
    load_text,
    local_text,
    offline_corpus,
)
from ghostlayers.sources.tasks import STANDARD_TASKS, standard_task_dir
from ghostlayers.sources.windows import split_shared_text, tokenize


def fetch_sources(calibration: str | None, ppl: list[str], tasks: list[str]) -> None:
    """Fetch and extract every offline corpus and standard task a run names, before any model is loaded: a
    source that cannot be fetched stops the run at once with one error, not after minutes of work."""
    names = [*(calibration_sources(calibration) if calibration else []), *ppl]
    for name in dict.fromkeys(n for n in names if n in OFFLINE):
        offline_corpus(name, "train")  # extracts both parts
    if any(t in STANDARD_TASKS for t in tasks):
        standard_task_dir()


def perplexity_windows(
    tokenizer, sources: list[str], seq_len: int, max_windows: int | None, encoding: str = "utf-8"
) -> dict[str, Tensor]:
    """Test windows of each source, tokenized once (only as far as the windows reach) and shared by the dense
    and the pruned model."""
    limit = max_windows * seq_len if max_windows is not None else None
    return {
        s: eval_windows(tokenize(tokenizer, load_text(s, "test", encoding), limit), seq_len, max_windows)
        for s in sources
    }


def calibration_and_perplexity_tokens(
    tokenizer,
    calibration: str,
    sources: list[str],
    seq_len: int,
    max_windows: int | None,
    encoding: str = "utf-8",
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    """The tokens of each calibration source (``corpora.calibration_texts``: ``mix`` or comma-separated) and
    each perplexity source's test windows. A file or folder that is both calibration and perplexity text is
    split (``data.split_shared_text``); the notes say which and where, for the log and the report."""
    raw, notes = calibration_texts(calibration, encoding), []
    texts = {c: tokenize(tokenizer, text) for c, text in raw.items()}
    shared = {s: c for s in sources for c in texts if local_text(s) is not None and local_text(s) == local_text(c)}
    windows = perplexity_windows(tokenizer, [s for s in sources if s not in shared], seq_len, max_windows, encoding)
    for source, name in shared.items():
        whole = texts[name].numel()
        texts[name], test = split_shared_text(texts[name], seq_len, max_windows)
        windows[source] = eval_windows(test, seq_len)
        notes.append(
            f"{name} is both calibration and perplexity text: calibration windows come from its tokens "
            f"0..{texts[name].numel() - 1}, perplexity windows from {texts[name].numel()}..{whole - 1} (disjoint)"
        )
    return texts, {s: windows[s] for s in sources}, notes


def evaluation_bar(models: int, windows: dict[str, Tensor], tasks: list[str]) -> tqdm:
    """One bar over a run's whole evaluation: each model's perplexity corpora and its zero-shot tasks, one
    step each (the steps' own bars show the work inside them)."""
    return tqdm(total=models * (len(windows) + bool(tasks)), desc="evaluation", unit="step", position=0)


def evaluate(
    model: PreTrainedModel,
    tokenizer,
    windows: dict[str, Tensor],
    tasks: list[str] = (),
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    label: str = "",
    bar: tqdm | None = None,
    prefix: SharedPrefix | None = None,
) -> dict:
    """Perplexity on each corpus's windows and zero-shot accuracy (per-example scores kept), each a step of
    ``bar``; speed is measured apart (``speed.measure_speeds``: models side by side). With ``prefix``, the
    layers before its depth do not run: the dense states there are shared with every model scored at that cut
    (``prefix.SharedPrefix``), and the scores are the same."""
    owned = bar is None
    bar = bar or evaluation_bar(1, windows, list(tasks))
    metrics: dict = {}
    for name, w in windows.items():
        bar.set_postfix_str(f"{label} ppl {name}".strip())
        desc = f"{label} ppl {name}".strip()
        metrics.setdefault("ppl", {})[name] = perplexity(model, w, batch_size, desc=desc, prefix=prefix)
        bar.update()
    if tasks:
        bar.set_postfix_str(f"{label} zero-shot".strip())
        # per-example scores, for the report's paired differences; the choices' log-likelihoods are left out
        with running(model, prefix):
            zeroshot = evaluate_zeroshot(
                model,
                tokenizer,
                list(tasks),
                limit=limit,
                batch_size=batch_size,
                per_example=True,
                note=lambda line: tqdm.write(f"{label}: {line}" if label else line),
            )
        metrics["zeroshot"] = {
            name: {k: v for k, v in task.items() if k != "choices"} for name, task in zeroshot.items()
        }
        bar.update()
    if owned:
        bar.close()
    return metrics
