"""What ``--eval`` measures on one model: perplexity per corpus and zero-shot accuracy (speed: ``speed``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence

from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.config.settings import DEFAULT_BATCH_SIZE
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.reading import read_json
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
from ghostlayers.sources.fetch import cache_folder, write_text_atomic
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


def dense_scores(
    model: PreTrainedModel,
    tokenizer,
    windows: dict[str, Tensor],
    tasks: list[str],
    limit: int | None,
    batch_size: int,
    identity: tuple[str, str],
    bar: tqdm | None = None,
) -> dict:
    """``evaluate`` of the dense ``model``, computed once per model and dtype (``identity``: its weights' digest,
    ``sources.models.weights_digest``), windows (by their token ids), tasks, limit and batch size, and kept in
    the cache: a later sweep or ``prune --eval`` of them, in any folder, reads them back."""
    weights, dtype = identity
    key = hashlib.sha256(json.dumps([weights, dtype, ",".join(tasks), limit, batch_size], default=str).encode())
    for name, w in windows.items():
        key.update(f"{name}\0{tuple(w.shape)}\0".encode() + w.numpy().tobytes())
    stored = cache_folder("dense") / f"{key.hexdigest()}.json"
    with contextlib.suppress(GhostLayersError):  # unreadable, or not scores of these texts and tasks: made again
        if stored.is_file():
            scores = read_json(stored, "the cached dense scores")
            if malformed_scores(scores, list(windows), tasks) is None:
                tqdm.write(f"dense: scores read from the cache ({stored})")
                if bar is not None:
                    bar.update(len(windows) + bool(tasks))
                return scores
    scores = evaluate(model, tokenizer, windows, tasks, limit, batch_size, "dense", bar=bar)
    with contextlib.suppress(GhostLayersError):  # no room, or something planted at its name: scored again next time
        write_text_atomic(stored, json.dumps(scores) + "\n")
    return scores


def _number(value: object) -> bool:
    return type(value) in (int, float) and value == value  # not NaN


def malformed_scores(
    scores: object, texts: Sequence[str], tasks: Sequence[str], sizes: dict[str, int] | None = None
) -> str | None:
    """What is wrong with ``evaluate``'s scores read back (from a cache or a sweep's folder, where anything may
    have been written), None if nothing: one positive perplexity per text of ``texts`` and, per task of
    ``tasks``, acc (and acc_norm where there is one) with its standard error and one score per example (as many
    as ``sizes`` says, when given). Tables and paired differences read every one of them."""
    if not isinstance(scores, dict):
        return "not an object"
    ppl = scores.get("ppl", {})
    if not isinstance(ppl, dict) or sorted(ppl) != sorted(texts) or not all(_number(v) and v > 0 for v in ppl.values()):
        return f"its perplexities are not one positive number for each of {', '.join(texts) or 'no text'}"
    zeroshot = scores.get("zeroshot", {}) if tasks else {}
    if not isinstance(zeroshot, dict) or sorted(zeroshot) != sorted(tasks):
        return f"its zero-shot scores are not one for each of {', '.join(tasks)}"
    for name, task in zeroshot.items():
        n = task.get("n") if isinstance(task, dict) else None
        examples = task.get("examples") if isinstance(task, dict) else None
        if (
            type(n) is not int
            or n < 1
            or (sizes is not None and n != sizes.get(name))
            or not isinstance(examples, dict)
        ):
            return f"task {name} has no examples of the size expected"
        for metric in [m for m in ("acc", "acc_norm") if m in task or m == "acc"]:
            values = examples.get(metric)
            if not (_number(task.get(metric)) and _number(task.get(f"{metric}_stderr")) and isinstance(values, list)):
                return f"task {name} has no {metric} with its standard error and per-example scores"
            if len(values) != n or not all(_number(v) for v in values):
                return f"task {name}'s per-example {metric} are not {n} numbers"
    return None
