"""What a cell's zero-shot scoring costs with the head run at every position of lm-eval's batches (HFLM as it
is) against only where lm-eval reads a continuation (``zeroshot.kept_positions``), and whether the scores move.

    python benchmarks/zeroshot_cost.py [--model qwen2.5-coder-1.5b --dtype bfloat16] [--block 12:19] [--limit 20]

Plain pruning of ``--block`` (the layers set aside, no calibration), scored as a sweep cell is: from the dense
states before the block (``prefix.SharedPrefix``), on the standard tasks. Round 0 makes those states and is not
counted; the later rounds alternate which way goes first. Writes ``benchmarks/results/zeroshot-cost-<model>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

from harness import machine

from ghostlayers.measure import zeroshot
from ghostlayers.measure.prefix import SharedPrefix, running
from ghostlayers.model.adapters import decoder_layers, layers_swapped
from ghostlayers.sources.tasks import DEFAULT_TASKS
from ghostlayers.store.loading import load_model_and_tokenizer

WAYS = ("every position (HFLM as is)", "scored positions only")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block", default="13:19", help="the layers removed, lo:hi (hi excluded)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after round 0")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device="cpu")
    lo, hi = map(int, args.block.split(":"))
    layers = list(decoder_layers(model))
    types = getattr(model.config, "layer_types", None)
    kept_types = None if types is None else [t for i, t in enumerate(types) if not lo <= i < hi]
    tasks = args.tasks.split(",")
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    scores: dict[str, dict] = {}
    with SharedPrefix(lo) as prefix, layers_swapped(model, layers[:lo] + layers[hi:], kept_types):
        for r in range(args.rounds + 1):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                every = patch.object(zeroshot, "kept_positions", lambda scored, inps: 0) if way == WAYS[0] else None
                start = time.perf_counter()
                with every or nullcontext(), running(model, prefix):
                    scores[way] = zeroshot.evaluate_zeroshot(
                        model, tokenizer, tasks, args.limit, args.batch_size, per_example=True, note=lambda line: None
                    )
                if r > 0:
                    seconds[way].append(time.perf_counter() - start)
    delta = changed = 0
    for task in tasks:
        ours, theirs = (scores[way][task] for way in WAYS)
        for x, y in zip(ours["choices"]["loglikelihoods"], theirs["choices"]["loglikelihoods"], strict=True):
            delta = max(delta, *(abs(a - b) for a, b in zip(x, y, strict=True)))
        for metric, values in ours["examples"].items():
            changed += sum(a != b for a, b in zip(values, theirs["examples"][metric], strict=True))
    first = statistics.median(seconds[WAYS[0]])
    lines = [
        f"# Zero-shot scoring of one cell: {args.model}",
        "",
        f"`python benchmarks/zeroshot_cost.py --model {args.model} --dtype {args.dtype} --block {args.block} "
        f"--limit {args.limit} --batch-size {args.batch_size} --rounds {args.rounds}` ({machine(args.dtype)}; "
        f"tasks: {args.tasks}).",
        "",
        f"Plain pruning of layers {lo}..{hi - 1}, scored from the dense states entering layer {lo}; median of "
        f"{args.rounds} rounds after one that made the states, the ways alternating which goes first.",
        "",
        "| lm-eval's logits computed at | seconds (median [min–max]) | of every position |",
        "|---|---|---|",
    ]
    for way, spent in seconds.items():
        median = statistics.median(spent)
        lines.append(f"| {way} | {median:.1f} [{min(spent):.1f}–{max(spent):.1f}] | {100 * median / first:.0f}% |")
    lines += [
        "",
        f"Largest difference in any choice's log-likelihood between the ways: {delta:.3g}; per-example scores "
        f"(acc and acc_norm) that differ: {changed}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(f"benchmarks/results/zeroshot-cost-{args.model}.md").write_text(text)


if __name__ == "__main__":
    main()
