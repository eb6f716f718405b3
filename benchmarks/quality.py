"""Perplexity and zero-shot accuracy of every recovery method at fixed blocks, like the Ghosted Layers paper's
tables, with standard errors and paired significance.

    python benchmarks/quality.py --model qwen2.5-coder-1.5b --dtype bfloat16 \\
        --blocks streamline:7,streamline:4,shortgpt:4,shortgpt:7 --zeroshot-blocks streamline:7

For each block (criterion:layers removed) one calibration (``ghostlayers.plan`` on ``--calibration``, by
default ``mix`` at the tool's default size, 32 tokens per hidden channel) serves every method, each applied
at α = 1 (as published) to the one loaded model and undone after its cells (``ghostlayers.applied``, as the
sweep makes its cells). Perplexity on the held-out parts of wiki, web and code (the calibration's domains)
and austen (a domain left out of it), with each method's share of the none→dense gap recovered; zero-shot
through lm-eval on the 9 standard tasks (acc_norm where the task has it), with standard errors, the
average's share of dense accuracy kept (as the papers report it), and each method's difference from none
and from ghost with its paired standard error (the same examples score both), marked ``*`` only beyond 2
standard errors.

Every finished cell is written to the JSON at once and skipped on a rerun (hours for the 1.5B model on 2
cores: stop and resume at will); each records the machine, dtype and wall time. A block's zero-shot cells
follow its perplexity cells. ``--tables`` only prints the markdown from the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import ORDER, ResultsFile, block_plan, cached_plan, model_arguments, open_bench, plan_name, quality_tables

import ghostlayers
from ghostlayers.registry.methods import DEFAULT_RIDGE, REGISTRY
from ghostlayers.repair.guard import shared_depth
from ghostlayers.sources.corpora import calibration_sources
from ghostlayers.sources.models import describe
from ghostlayers.sources.tasks import DEFAULT_TASKS

TASKS = ",".join(DEFAULT_TASKS)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, dtype=True)
    parser.add_argument("--blocks", default="streamline:6", help="criterion:layers removed, comma-separated")
    parser.add_argument("--zeroshot-blocks", default="streamline:6", help="blocks that also get zero-shot")
    parser.add_argument("--calibration", default="mix")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--methods", default=",".join(ORDER), help="the methods to run, of " + ",".join(ORDER))
    parser.add_argument(
        "--ridge", type=float, default=DEFAULT_RIDGE, help="other than the default: rows '<method> ridge <r>'"
    )
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--limit", type=int, default=300, help="zero-shot examples per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="default: benchmarks/results/quality-<model>.json (and .md)")
    parser.add_argument("--tables", action="store_true", help="only print the tables of the JSON")
    return parser.parse_args()


def label(method: str, ridge: float) -> str:
    """A method's row: its name, with its ridge when not the default."""
    return method if ridge == DEFAULT_RIDGE or method == "none" else f"{method} ridge {ridge:g}"


def block_names(blocks: str, total: int) -> list[str]:
    """``streamline:6,angular:4`` as the results' block names (``streamline 6/30``, ...)."""
    return [b.replace(":", " ") + f"/{total}" for b in blocks.split(",") if b]


def description(args: argparse.Namespace, num_samples: int, size: int) -> str:
    return (
        f"Calibration: {num_samples} windows of {args.seq_len} tokens from `{args.calibration}` "
        f"({args.per_channel:g} tokens per hidden channel, C = {size}); perplexity on {args.ppl_windows} "
        f"windows of each corpus's held-out part; every method at α = 1; zero-shot limit {args.limit}."
    )


def main() -> None:
    args = arguments()
    path = Path(args.json or f"benchmarks/results/quality-{args.model}.json")
    if args.tables:
        print(quality_tables(json.loads(path.read_text())))
        return
    store = ResultsFile(path, args.model, args.dtype, render=quality_tables)
    results, cell = store.data, store.cell
    sources = calibration_sources(args.calibration)
    bench = open_bench(args, sources)
    dense = bench.dense
    total, size = dense.config.num_hidden_layers, bench.hidden_size
    num_samples = bench.windows(args.per_channel, len(sources))
    blocks, zeroshot_blocks = block_names(args.blocks, total), block_names(args.zeroshot_blocks, total)
    tasks = [t for t in args.tasks.split(",") if t]
    results.update(
        label=describe(args.model).get("label", args.model),
        blocks=list(dict.fromkeys([*results.get("blocks", []), *blocks])),
        description=description(args, num_samples, size),
    )
    data = bench.calibration(sources, num_samples)

    def zeroshot(model, depth: int = 0) -> dict:
        return {"zeroshot": bench.zeroshot(model, tasks, args.limit, args.batch_size, depth)}

    plans: dict[str, ghostlayers.Plan] = {}
    methods = [m for m in ORDER if m in args.methods.split(",") and (bench.folds or not REGISTRY[m].folded)]

    def pruned(block: str, method: str):
        if block not in plans:  # kept on disk: a resumed run's zero-shot cells skip the calibration
            plans[block] = block_plan(args, bench, data, block)
        made = plans[block]
        if REGISTRY[method].after_selection:  # its statistics (I × I) for the block's runs only: a second pass
            made = cached_plan(
                f"{plan_name(args, data, block)}-refit-atx",  # plans before refit-ghost lack its aᵀX
                lambda: ghostlayers.plan(dense, data.batches(4), layers=made.removed, methods=ORDER, progress=False),
            )
        return ghostlayers.applied(dense, made, ghostlayers.FitSettings(method, args.ridge, progress=False))

    def ppl_cell(block: str, method: str) -> dict:
        with pruned(block, method) as result:
            residual = sum(b.fit_quality[method] for b in result.boundaries) / len(result.boundaries)
            ppl = bench.perplexity(dense, shared_depth(plans[block].pairs))
        return {"ppl": ppl, "removed": result.removed, "fit residual": residual}

    def zeroshot_cell(block: str, method: str) -> dict:
        with pruned(block, method):
            return zeroshot(dense, shared_depth(plans[block].pairs))

    cell("dense ppl", lambda: {"ppl": bench.perplexity(dense)})
    for block in blocks:  # a block's zero-shot cells right after its perplexity cells, on the same plan
        for method in methods:
            cell(f"{block} {label(method, args.ridge)} ppl", lambda b=block, m=method: ppl_cell(b, m))
        if tasks and block in zeroshot_blocks:
            cell("dense zeroshot", lambda: zeroshot(dense))
            for method in methods:
                cell(f"{block} {label(method, args.ridge)} zeroshot", lambda b=block, m=method: zeroshot_cell(b, m))
        plans.pop(block, None)
    store.save()
    print(quality_tables(results))


if __name__ == "__main__":
    main()
