"""What the sweep's calibration costs, against one ``prune``'s and one forward pass, on the same windows.

    python benchmarks/sweep_cost.py [--model qwen2.5-coder-1.5b --dtype bfloat16] [--depths 2:15:3]

On the default calibration (``mix``, 32 tokens per hidden channel, 2 held-out windows a source, each
domain's sums kept apart for ``--alpha auto``), in one run, the median over ``--repeats`` of:
- one forward pass of the dense model over the calibration windows, to the last layer (the unit);
- ``pipeline.plan`` for one depth, as ``ghostlayers prune --select streamline`` calibrates it;
- ``pipeline.plan_depths`` for every depth of ``--depths``, with the sums of every method of the sweep.
Writes ``benchmarks/results/sweep-cost-<model>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from harness import machine, model_arguments, open_bench

from ghostlayers.config.recipes import parse_depths
from ghostlayers.repair.pipeline import plan, plan_depths
from ghostlayers.sources.corpora import MIX_CORPORA

METHODS = ("none", "ghost", "refit-ghost", "linearpatch", "replaceme")


def interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each function, ``repeats`` rounds, each round running every function once in turn."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, ppl_windows=1, dtype=True)  # open_bench reads test windows; none are scored
    parser.add_argument("--depths", default="2:15:3", help="the sweep's depths (as ghostlayers sweep --num-layers)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    bench = open_bench(args, list(MIX_CORPORA))
    sources = list(MIX_CORPORA)
    data = bench.calibration(sources, bench.windows(32, len(sources)), heldout=2)
    batches, groups = data.batches(4), data.batch_domains(4)
    depths = parse_depths(args.depths)
    model = bench.dense

    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False)

    def one_prune() -> None:
        plan(model, batches, select="streamline", num_layers=depths[len(depths) // 2], methods=("ghost",),
             groups=groups, progress=False)  # fmt: skip

    def sweep() -> None:
        plan_depths(model, batches, depths, select="streamline", methods=METHODS, groups=groups, progress=False)

    times = interleaved({"forward": forward, "prune": one_prune, "sweep": sweep}, args.repeats)
    unit = statistics.median(times["forward"])
    lines = [
        f"# Calibration cost: {args.model} ({machine(args.dtype)}), {len(batches)} batches of 4 × {args.seq_len}",
        "",
        f"Median of {args.repeats} rounds, each running all three in turn; `python benchmarks/sweep_cost.py "
        f"--model {args.model} --dtype {args.dtype} --depths {args.depths}`.",
        "",
        "| what | seconds (median [min–max]) | × one forward pass |",
        "|---|---|---|",
    ]
    labels = {
        "forward": "one forward pass over the calibration windows",
        "prune": f"`prune` calibration for one depth ({depths[len(depths) // 2]}, streamline, ghost)",
        "sweep": f"`sweep` calibration for {len(depths)} depths ({args.depths}), {len(METHODS)} methods' sums",
    }
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {labels[name]} | {median:.1f} [{min(values):.1f}–{max(values):.1f}] | {median / unit:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / f"sweep-cost-{Path(args.model).name}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
