"""Cost of held-out scoring with and without the shared prefix, measured side by side in one run.

    python benchmarks/heldout.py [--model smollm2-135m] [--remove 6] [--windows 2] [--repeats 3]

The guard (and ``--alpha auto``, ``--method auto``, ``--ridge auto``, ``--select loss``) scores several variants
of one pruned model on held-out windows. The variants differ only from the first removed run on, so the
layers before it run once (``guard.prefix_states``) and every variant starts from their output. This script
prunes the model once (streamline, ghost, mix calibration at the default size), then times ``run_guard`` at
``alpha="auto"`` (five α values) from layer 0 and from the shared depth in interleaved rounds, checks the
two give the same perplexities, and writes ``benchmarks/results/heldout-<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import ghostlayers
from ghostlayers.data import calibration_set, tokenize
from ghostlayers.guard import run_guard, shared_depth
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.selection import runs
from ghostlayers.sources.corpora import OFFLINE, load_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--remove", type=int, default=6, help="layers removed (streamline)")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=2, help="held-out windows per domain (the CLI default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="default: benchmarks/results/heldout-<model>.json")
    args = parser.parse_args()

    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, device="cpu")
    size, total = model.config.hidden_size, model.config.num_hidden_layers
    texts = {c: tokenize(tokenizer, load_text(c, "train")) for c in OFFLINE}
    data = calibration_set(texts, round(args.per_channel * size / args.seq_len), args.seq_len, 0, args.windows)
    result = ghostlayers.prune(model, data.batches(4), select="streamline", num_layers=args.remove, progress=False)
    depths = {"from layer 0": 0, "from the shared prefix": shared_depth(runs(result.removed))}
    seconds: dict[str, list[float]] = {label: [] for label in depths}
    scores = {}
    for _ in range(args.repeats):
        for label, depth in depths.items():
            start = time.perf_counter()
            guard = run_guard(model, data.heldout, result.unfolded, "auto", progress=False, depth=depth)
            seconds[label].append(time.perf_counter() - start)
            scores[label] = guard.perplexity
    first, second = (scores[label] for label in depths)
    worst = max(abs(first[a][d] / second[a][d] - 1) for a in first for d in first[a])
    median = {label: statistics.median(s) for label, s in seconds.items()}
    base = median["from layer 0"]
    windows = sum(int(w.shape[0]) for w in data.heldout.values())
    print(
        f"\n{args.model} ({args.dtype}), removed {result.removed} of {total}, guard at α auto (5 values) on "
        f"{windows} held-out windows of {args.seq_len} tokens; median of {args.repeats} interleaved rounds\n"
    )
    print("| held-out scoring | shared layers run once | seconds | × from layer 0 |")
    print("|---|---|---|---|")
    for label, depth in depths.items():
        print(f"| {label} | {depth} | {median[label]:.1f} | {median[label] / base:.2f} |")
    print(f"\nlargest relative difference between the two routes' perplexities: {worst:.1e}")
    path = Path(args.json or f"benchmarks/results/heldout-{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads"}
    rows = {k: {"depth": depths[k], "seconds": median[k], "x_layer0": median[k] / base} for k in depths}
    path.write_text(
        json.dumps({"settings": settings, "removed": result.removed, "rows": rows, "max_rel_diff": worst}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    main()
