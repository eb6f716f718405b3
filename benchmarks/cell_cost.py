"""What one sweep cell costs: scored from layer 0, as the sweep did, against scored from the dense states before
the cut, shared by every method of the depth (``prefix.SharedPrefix``), as it does now.

    python benchmarks/cell_cost.py [--model qwen2.5-coder-1.5b --dtype bfloat16] [--depth 13] [--limit 100]

One calibration (the sweep's own plan for ``--depth``), then per round every method of ``--methods`` made and
scored both ways (``sweep._cell``: fit, guard with α auto, perplexity on ``--ppl``, zero-shot on ``--tasks``),
the two ways alternating which goes first. A cell's cost is a way's seconds over the methods divided by their
number (the shared states are paid once per depth, by its first method). Writes
``benchmarks/results/cell-cost-<model>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import machine
from rich.console import Console

from ghostlayers.config.recipes import PruneRecipe, split
from ghostlayers.jobs.runs import prepare
from ghostlayers.jobs.sweep import _cell, _plans
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.repair.guard import shared_depth
from ghostlayers.sources.tasks import DEFAULT_TASKS
from ghostlayers.store.loading import resolve_device


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--depth", type=int, default=8, help="layers removed (the streamline block)")
    parser.add_argument("--methods", default="none,ghost")
    parser.add_argument("--ppl", default="wiki,web,code")
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    scoring = dict(ppl=args.ppl, ppl_windows=args.ppl_windows, tasks=args.tasks, limit=args.limit, speed=False)
    recipe = PruneRecipe.from_dict(
        {}, model=args.model, dtype=args.dtype, select="streamline", num_layers=args.depth, evaluate=True, **scoring
    )
    ready = prepare(recipe, resolve_device("cpu"), Console(stderr=True), evaluate=True)
    methods = split(args.methods)
    plan = _plans(ready.lm, ready, recipe, [args.depth], methods)[args.depth]
    dense: dict = {}

    def way(shared: bool) -> float:
        start = time.perf_counter()
        with SharedPrefix(shared_depth(plan.pairs)) as prefix:
            for method in methods:
                _cell(ready.lm, plan, method, ready, recipe, dense, prefix if shared else None)
        return (time.perf_counter() - start) / len(methods)

    seconds: dict[str, list[float]] = {"from layer 0": [], "shared dense states": []}
    for r in range(args.rounds):
        for name in list(seconds)[:: 1 if r % 2 == 0 else -1]:
            seconds[name].append(way(name == "shared dense states"))
    before, after = (statistics.median(v) for v in seconds.values())
    lines = [
        f"# Seconds per sweep cell: {args.model}",
        "",
        f"`python benchmarks/cell_cost.py --model {args.model} --dtype {args.dtype} --depth {args.depth} "
        f"--methods {args.methods} --ppl {args.ppl} --ppl-windows {args.ppl_windows} --limit {args.limit} "
        f"--rounds {args.rounds}` ({machine(args.dtype)}; tasks: {args.tasks}).",
        "",
        f"Block {plan.removed[0]}..{plan.removed[-1]} ({args.depth} layers removed); the layers before "
        f"{shared_depth(plan.pairs)} are the dense model's in every cell. A cell: fit, guard (α auto), perplexity "
        "and zero-shot; median over rounds of each way's seconds over the methods, divided by their number.",
        "",
        "| cell scored | seconds per cell | of from layer 0 |",
        "|---|---|---|",
        f"| from layer 0 (the sweep before) | {before:.1f} | 100% |",
        f"| from shared dense states (the sweep now) | {after:.1f} | {100 * after / before:.0f}% |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(f"benchmarks/results/cell-cost-{args.model}.md").write_text(text)


if __name__ == "__main__":
    main()
