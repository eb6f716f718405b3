"""Why a repair moves accuracy less than perplexity: per task, how far a method carries the log-likelihoods of
the answer choices from plain pruning's toward dense's, and how far it carries what accuracy reads, the
margin of the right choice over the wrong ones.

    python benchmarks/accuracy_gap.py [--json benchmarks/results/quality-qwen2.5-coder-1.5b.json] \
        [--block "streamline 7/28"]

Reads the zero-shot cells of a quality.py results file (each choice's log-likelihood, kept by
``evaluate_zeroshot(per_example=True)``) and writes ``accuracy-gap-<its name after quality->.md`` beside it. Per
task and method m, over examples i and choices j, with ``d = ll_m − ll_none`` and ``D = ll_dense − ll_none``:

- likelihood share ``Σd / ΣD`` over every choice: the perplexity-like share, on the tasks' own answers;
- margin share, the same for the margin ``g = ll(right) − mean ll(wrong)``: the share of dense's lead of the
  right answer that the method restores;
- common part, the share of ``Σd²`` that is one shift for all of an example's choices, ``Σ k·mean_j(d)² / Σd²``
  (k choices): a change no choice's rank feels;
- the mean margin change from none, of the method and of dense (nats, with standard errors);
- the accuracy difference from none (points, paired standard error), as in quality.py's tables.

A second table takes the two-choice tasks apart, for dense, none and each method: how often the second choice
is picked, the accuracy of always picking the more common right answer, and the separation, the chance that
``ll(choice 2) − ll(choice 1)`` ranks an example whose right answer is choice 2 above one whose right answer is
choice 1 (the area under the ROC curve: 0.5 tells the answers apart no better than chance, whatever the
accuracy). A model that gives one answer to every question scores the majority rate with no separation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import mean_se, rows, scores

Choices = dict[str, list]  # {"loglikelihoods": [[ll per choice] per example], "gold": [index per example]}


def margins(choices: Choices) -> list[float]:
    """Per example, the right choice's log-likelihood minus the mean of the wrong ones'."""
    out = []
    for lls, gold in zip(choices["loglikelihoods"], choices["gold"], strict=True):
        wrong = [ll for j, ll in enumerate(lls) if j != gold]
        out.append(lls[gold] - sum(wrong) / len(wrong))
    return out


def margin_moves(method: Choices, none: Choices, dense: Choices) -> tuple[list[float], list[float]]:
    """Per example, how far the method and dense move the margin from none's."""
    base = margins(none)
    return tuple([x - b for x, b in zip(margins(c), base, strict=True)] for c in (method, dense))


def gap_shares(method: Choices, none: Choices, dense: Choices) -> dict[str, float]:
    """The likelihood share, margin share and common part of one task (see the module docstring)."""
    flat = {k: [ll for lls in c["loglikelihoods"] for ll in lls] for k, c in (("m", method), ("n", none), ("d", dense))}
    moved = sum(m - n for m, n in zip(flat["m"], flat["n"], strict=True))
    gap = sum(d - n for d, n in zip(flat["d"], flat["n"], strict=True))
    by_method, by_dense = margin_moves(method, none, dense)
    common = total = 0.0
    for lm, ln in zip(method["loglikelihoods"], none["loglikelihoods"], strict=True):
        d = [a - b for a, b in zip(lm, ln, strict=True)]
        common += len(d) * (sum(d) / len(d)) ** 2
        total += sum(x * x for x in d)
    return {
        "likelihood share": moved / gap,
        "margin share": sum(by_method) / sum(by_dense),
        "common part": common / total if total else 1.0,
    }


def separation(choices: Choices) -> float:
    """Area under the ROC curve of ``ll(choice 2) − ll(choice 1)`` against ``gold == 1`` (ties count half)."""
    scored = [(lls[1] - lls[0], gold) for lls, gold in zip(choices["loglikelihoods"], choices["gold"], strict=True)]
    second = [s for s, g in scored if g == 1]
    first = [s for s, g in scored if g == 0]
    return sum((a > b) + 0.5 * (a == b) for a in second for b in first) / (len(second) * len(first))


def two_choice_table(cells: dict, block: str) -> str:
    """Per two-choice task and model: second choice picked, majority rate, accuracy and separation."""
    dense = cells["dense zeroshot"]["zeroshot"]
    models = {"dense": dense, **{m: cells[f"{block} {m} zeroshot"]["zeroshot"] for m in rows(cells, block, "zeroshot")}}
    lines = [
        f"### {block}: the two-choice tasks, answer by answer (accuracy_gap.py)\n",
        "| task | model | picks choice 2 | majority rate | acc (%) | separation (AUC) |",
        "|---|---|---|---|---|---|",
    ]
    for task, values in dense.items():
        if "choices" not in values or any(len(lls) != 2 for lls in values["choices"]["loglikelihoods"]):
            continue
        for name, zs in models.items():
            if "choices" not in zs[task]:
                continue
            choices = zs[task]["choices"]
            n = len(choices["gold"])
            second = sum(lls[1] > lls[0] for lls in choices["loglikelihoods"]) / n
            majority = max(sum(choices["gold"]), n - sum(choices["gold"])) / n
            accuracy = 100 * mean_se(zs[task]["examples"]["acc"])[0]
            lines.append(
                f"| {task} | {name} | {100 * second:.1f}% | {100 * majority:.1f}% | {accuracy:.2f} | "
                f"{separation(choices):.3f} |"
            )
    return "\n".join(lines)


def tables(cells: dict, block: str) -> str:
    dense, none = cells["dense zeroshot"]["zeroshot"], cells[f"{block} none zeroshot"]["zeroshot"]
    tasks = list(dense)
    lines = [
        f"### {block}: what each method moves on the zero-shot answers (accuracy_gap.py)\n",
        "| method | task | accuracy vs none (points, paired) | likelihood share | margin share | margin vs none "
        "(nats) | dense's margin vs none (nats) | common part |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in rows(cells, block, "zeroshot")[1:]:
        zs = cells[f"{block} {method} zeroshot"]["zeroshot"]
        if "choices" not in zs[tasks[0]]:  # a cell made before the log-likelihoods were kept
            continue
        for task in [*tasks, "all (pooled)"]:
            picked = tasks if task.startswith("all") else [task]
            pooled = {  # every task's examples in one pool
                name: {k: sum((z[t]["choices"][k] for t in picked), []) for k in ("loglikelihoods", "gold")}
                for name, z in (("m", zs), ("n", none), ("d", dense))
            }
            parts = gap_shares(pooled["m"], pooled["n"], pooled["d"])
            diff = [a - b for t in picked for a, b in zip(scores(zs[t]), scores(none[t]), strict=True)]
            mean, se = mean_se(diff)
            moved = [mean_se(m) for m in margin_moves(pooled["m"], pooled["n"], pooled["d"])]
            lines.append(
                f"| {method} | {task} | {100 * mean:+.1f} ± {100 * se:.1f} | {parts['likelihood share']:.2f} | "
                f"{parts['margin share']:.2f} | " + " | ".join(f"{m:+.3f} ± {e:.3f}" for m, e in moved) + " | "
                f"{parts['common part']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/quality-qwen2.5-coder-1.5b.json", type=Path)
    parser.add_argument("--block", default="streamline 7/28")
    args = parser.parse_args()
    cells = json.loads(args.json.read_text())["cells"]
    text = tables(cells, args.block) + "\n\n" + two_choice_table(cells, args.block)
    (args.json.parent / f"accuracy-gap-{args.json.stem.removeprefix('quality-')}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
