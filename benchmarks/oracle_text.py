"""The scored examples themselves, with their right answers, as calibration text: the best case for what a
repair fitted at the boundary could learn from calibration data for zero-shot accuracy.

    python benchmarks/oracle_text.py ~/oracle.txt --limit 100
    python benchmarks/quality.py --model qwen2.5-coder-1.5b --dtype bfloat16 --blocks streamline:7 \\
        --zeroshot-blocks streamline:7 --limit 100 --methods none,ghost --calibration ~/oracle.txt \\
        --json benchmarks/results/quality-qwen2.5-coder-1.5b-oracle.json

Each of the first ``--limit`` examples of each standard task (those ``quality.py --limit`` scores) is written
as lm-eval requests it, context then delimiter then the right choice, one per paragraph, interleaved (seed
0). A fit on it has seen the test: if even that cannot move accuracy, calibration text cannot.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from lm_eval.tasks import TaskManager, get_task_dict

from ghostlayers.sources.fetch import offline_hub
from ghostlayers.sources.tasks import DEFAULT_TASKS, standard_task_dir


def right_answer(task, doc: dict) -> str:
    """The request lm-eval scores for the right choice, as one text."""
    choices, target, delimiter = task.doc_to_choice(doc), task.doc_to_target(doc), task.config.target_delimiter
    if task.multiple_input:  # the choices are contexts (WinoGrande); the text gives the right one's index
        return choices[task.doc_to_text(doc)] + delimiter + target
    gold = target if isinstance(target, int) else choices.index(target)
    return task.doc_to_text(doc) + delimiter + choices[gold]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--limit", type=int, default=100, help="examples a task, as quality.py --limit")
    args = parser.parse_args()
    manager = TaskManager(include_path=str(standard_task_dir()), include_defaults=False)
    with offline_hub():
        tasks = get_task_dict(list(DEFAULT_TASKS), manager)
    paragraphs = [right_answer(task, doc) for task in tasks.values() for doc in list(task.eval_docs)[: args.limit]]
    random.Random(0).shuffle(paragraphs)
    args.output.expanduser().write_text("\n\n".join(paragraphs) + "\n")
    print(f"{len(paragraphs)} examples, {sum(map(len, paragraphs)):,} characters: {args.output}")


if __name__ == "__main__":
    main()
