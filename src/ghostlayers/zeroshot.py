"""Zero-shot multiple-choice accuracy of an in-memory model through lm-evaluation-harness.

lm-eval ships task configs but no data, and its hub tasks (``arc_easy``, ``hellaswag``, ...) need the
Hugging Face hub. The offline ``gl_*`` tasks are built once from the BIG-bench source archive on PyPI
into the cache: one JSONL file per task (an example a line) and an lm-eval YAML that reads it with the
``json`` dataset builder, so lm-eval's own request building and scoring (acc, acc_norm) do all the work.

An example is ``{"context", "choices", "gold"}``: each choice is scored as a continuation of the context.
WinoGrande uses lm-eval's *partial* scoring instead, as its hub task does: ``{"choices", "continuation",
"gold"}`` where each choice is the sentence up to the blank with one option filled in, and the shared rest
of the sentence is scored after each of them. Examples are shuffled with a fixed seed, so ``limit=N``
takes the same N examples every time, drawn across all subtasks.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import random
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ghostlayers.errors import GhostLayersError
from ghostlayers.sources.fetch import bigbench_archive, ghostlayers_cache_dir, offline_hub

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PREFIX = "gl_"
VERSION = 2  # bump when the examples or YAMLs change: the cache folder is named after it
SEED = 0
METRICS = ("acc", "acc_norm")
_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"
_WINOGRANDE = re.compile(r"Sentence 1: (.*?)\s*\nAnswer1: (.*?)\s*\nSentence 2: (.*?)\s*\nAnswer2: (.*?)\s*$", re.S)


def target_scores_examples(data: dict, template: str = "{}") -> list[dict]:
    """BIG-bench ``target_scores`` examples (choice -> 1 for right, 0 for wrong) with one best choice."""
    examples = []
    for example in data["examples"]:
        scores = example.get("target_scores") or {}
        best = max(scores.values(), default=None)
        if best is None or list(scores.values()).count(best) != 1:
            continue
        choices = [c.strip() for c in scores]
        context = template.format(example["input"].strip()) if example["input"].strip() else ""
        examples.append({"context": context, "choices": choices, "gold": list(scores.values()).index(best)})
    return examples


def winogrande_examples(data: dict) -> list[dict]:
    """Twin sentences with a blank from natural-instructions subtask029, two examples per twin pair."""
    examples = []
    for example in data["examples"]:
        for target in example["target"]:
            match = _WINOGRANDE.match(target.strip())
            if not match:
                continue
            first, a1, second, a2 = match.groups()
            options = [a1.strip().rstrip(".").strip(), a2.strip().rstrip(".").strip()]
            for gold, sentence in enumerate((first, second)):
                head, blank, tail = sentence.partition("_")
                if not blank or "_" in tail or not tail.strip() or options[0] == options[1]:
                    continue
                if not all(o and o.lower() in sentence.lower() for o in options):
                    continue
                choices = [head + option for option in options]
                examples.append({"choices": choices, "continuation": tail.strip(), "gold": gold})
    return examples


def _targets(template: str) -> Callable[[dict], list[dict]]:
    return lambda data: target_scores_examples(data, template)


# task name -> (task.json members of the archive, converter); every example of every member is kept
SOURCES: dict[str, tuple[tuple[str, ...], Callable[[dict], list[dict]]]] = {
    "gl_social_iqa": (("social_iqa",), _targets("Q: {}\nA:")),
    "gl_goal_step_wikihow": (
        tuple(f"goal_step_wikihow/{sub}" for sub in ("goal_inference", "step_inference", "step_ordering")),
        _targets("{}"),
    ),
    "gl_winogrande": (("natural_instructions/subtask029_winogrande_full_object",), winogrande_examples),
    "gl_cause_and_effect": (("cause_and_effect/one_sentence_no_prompt",), _targets("{}")),
    "gl_strategyqa": (("strategyqa",), _targets("Q: {}\nA:")),
}
OFFLINE_TASKS = tuple(SOURCES)


def _unique(examples: Iterable[dict]) -> list[dict]:
    seen, kept = set(), []
    for example in examples:
        key = json.dumps(example, sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(example)
    return kept


def write_task(name: str, examples: list[dict], folder: Path, data_folder: Path | None = None) -> Path:
    """``name.jsonl`` (examples and their choices shuffled with ``SEED``) and ``name.yaml`` reading it.

    ``data_folder`` is where the JSONL will finally live (the YAML names it by absolute path), when the
    folder is written elsewhere first and moved into place.
    """
    if not examples:
        raise GhostLayersError(f"Task {name} has no examples: check the data it was built from.")
    rng = random.Random(SEED)
    examples = _unique(examples)
    rng.shuffle(examples)
    for i, e in enumerate(examples):  # BIG-bench often lists the right choice first; argmax ties then
        order = rng.sample(range(len(e["choices"])), len(e["choices"]))  # (a broken model's NaNs) score 1
        examples[i] = {**e, "choices": [e["choices"][j] for j in order], "gold": order.index(e["gold"])}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)
    partial = "continuation" in examples[0]
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str((data_folder or folder).resolve() / f"{name}.jsonl")}},
        "test_split": "test",
        "output_type": "multiple_choice",
        # a field name makes lm-eval read the field; an int from doc_to_text means "one context per choice"
        "doc_to_text": "gold" if partial else "context",
        "doc_to_choice": "choices",
        "doc_to_target": "continuation" if partial else "gold",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in METRICS],
        "metadata": {"version": VERSION},
    }
    import yaml  # here, not at the top: the command line reads OFFLINE_TASKS before any work

    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / f"{name}.yaml"


def bigbench_tasks(archive: Path) -> dict[str, list[dict]]:
    """Examples of every offline task, read from the archive in one pass."""
    members = {f"{_TASKS}{m}/task.json": name for name, (ms, _) in SOURCES.items() for m in ms}
    found: dict[str, dict] = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.name in members:
                found[member.name] = json.load(tar.extractfile(member))
    if len(found) != len(members):
        missing = sorted(set(members) - set(found))
        raise GhostLayersError(f"{archive} lacks {missing}: delete it so that it is downloaded again.")
    return {
        name: [e for m in ms for e in convert(found[f"{_TASKS}{m}/task.json"])]
        for name, (ms, convert) in SOURCES.items()
    }


def offline_task_dir(archive: Path | None = None) -> Path:
    """The cached folder of offline task YAMLs and data, built from the BIG-bench archive on first use."""
    folder = ghostlayers_cache_dir() / "zeroshot" / f"v{VERSION}"
    if all((folder / f"{name}.yaml").is_file() for name in SOURCES):
        return folder
    if archive is None:
        archive = bigbench_archive()
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    for name, examples in bigbench_tasks(archive).items():
        write_task(name, examples, work, data_folder=folder)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        work.replace(folder)
    except OSError:  # another process finished first
        shutil.rmtree(work)
    return folder


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
                    f"lm-eval's own tasks need the Hugging Face hub; offline, use {', '.join(OFFLINE_TASKS)}."
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


def evaluate_zeroshot(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = 4,
    task_dir: Path | None = None,
    per_example: bool = False,
) -> dict[str, dict]:
    """Per task ``{"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"}`` (``n``: examples scored);
    ``per_example`` adds ``"examples": {metric: [score of example 0, 1, ...]}`` for paired comparisons of two
    models on the same examples.

    ``gl_*`` tasks come from ``task_dir`` (default: the offline tasks, built on first use) and run with the
    hub switched off; any other name is an lm-eval task and passes through to it.
    """
    from unittest.mock import patch

    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM

    offline = [t for t in tasks if t.startswith(PREFIX)]
    if offline and task_dir is None:
        task_dir = offline_task_dir()
    manager = _task_manager(task_dir, defaults=len(offline) < len(tasks))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise GhostLayersError(
            f"Unknown zero-shot task(s) {', '.join(unknown)}: use offline tasks ({', '.join(OFFLINE_TASKS)}) "
            f"or lm-eval task names (`lm_eval ls tasks`)."
        )
    # backend="causal": a pruned model's model_type (ghostlayers_llama, ...) is not in transformers' tables
    # a copy of the tokenizer: lm-eval sets a pad token on the one it is given
    with _without_model_object_warning():
        lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=batch_size, backend="causal")
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
    return metrics
