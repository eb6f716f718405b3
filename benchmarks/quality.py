"""Perplexity and zero-shot accuracy of every recovery method, like the Ghosted Layers paper's tables.

    python benchmarks/quality.py [--model smollm2-135m] [--quick] [--json out.json]

For each selection criterion and depth, one calibration (``ghostlayers.plan``) serves every method: each
method is applied to a fresh copy of the dense model. Perplexity on the held-out parts of the offline
corpora; zero-shot through lm-eval on the offline tasks. Then a calibration-size ablation and a ridge
ablation for ghost. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import ghostlayers
from ghostlayers.corpora import load_text
from ghostlayers.data import batched, calibration_windows, tokenize
from ghostlayers.evaluation import evaluate, perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.operators import METHODS

ORDER = ["none", "linearpatch", "linearpatch-rotate", "replaceme", "ghost"]


def table(title: str, rows: dict[str, dict], columns: list[str]) -> str:
    lines = [f"\n### {title}\n", "| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in rows.items():
        cells = [f"{values[c]:.2f}" if isinstance(values.get(c), float) else "–" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flat_metrics(metrics: dict) -> dict[str, float]:
    out = {f"ppl {k}": v for k, v in metrics.get("ppl", {}).items()}
    if out:
        out["ppl avg"] = sum(out.values()) / len(out)
    accs = {}
    for task, values in metrics.get("zeroshot", {}).items():
        accs[task] = 100 * values.get("acc_norm", values["acc"])
    out.update(accs)
    if accs:
        out["0-shot avg"] = sum(accs.values()) / len(accs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--criteria", default="streamline,shortgpt")
    parser.add_argument("--depths", default="0.15,0.25", help="fractions of the layers to remove")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows for the main tables")
    parser.add_argument("--sizes", default="8,32,128", help="calibration-size ablation (ghost); '' skips it")
    parser.add_argument("--ridges", default="0,1e-6,1e-4,1e-2,1e-1", help="ridge ablation (ghost); '' skips it")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ppl", default="wiki,news,austen")
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--tasks", default="gl_social_iqa,gl_winogrande,gl_cause_and_effect")
    parser.add_argument("--limit", type=int, default=100, help="zero-shot examples per task")
    parser.add_argument("--quick", action="store_true", help="one criterion and depth, wiki, no zero-shot")
    parser.add_argument("--json", help="also write all numbers here")
    args = parser.parse_args()
    if args.quick:
        args.criteria, args.depths, args.ppl, args.tasks = "streamline", "0.25", "wiki", ""
        args.sizes, args.ridges = "8,32", "0,1e-6,1e-2"
    start = time.perf_counter()
    dense, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    num_layers = dense.config.num_hidden_layers
    windows = perplexity_windows(tokenizer, args.ppl.split(","), args.seq_len, args.ppl_windows)
    tasks = [t for t in args.tasks.split(",") if t]
    train = tokenize(tokenizer, load_text("wiki", "train"))

    def batches(n: int):
        return batched(calibration_windows(train, n, args.seq_len, 0), 4)

    def measure(model, zero_shot: bool = True) -> dict[str, float]:
        return flat_metrics(
            evaluate(model, tokenizer, windows, tasks if zero_shot else [], args.limit, speed=False, batch_size=4)
        )

    results: dict = {"model": args.model, "num_layers": num_layers, "settings": vars(args), "dense": measure(dense)}
    print(f"## {args.model} ({num_layers} layers)")

    def add(title: str, key: str, rows: dict[str, dict], columns: list[str]) -> None:
        """Print a finished table at once and keep the JSON current, so a long run loses nothing if stopped."""
        results[key] = rows
        print(table(title, rows, columns), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)

    columns = list(results["dense"])
    for criterion in args.criteria.split(","):
        for fraction in map(float, args.depths.split(",")):
            n = max(1, round(fraction * num_layers))
            plan = ghostlayers.plan(dense, batches(args.samples), select=criterion, num_layers=n, replaceme=True)
            rows = {"dense": results["dense"]}
            for method in ORDER:
                if method == "replaceme" and (
                    plan.pairs[0][0] == 0 or plan.calibration.pairs[plan.pairs[0]].ztz is None
                ):
                    continue
                pruned = ghostlayers.apply_plan(copy.deepcopy(dense), plan, method)
                rows[method] = measure(pruned.model)
                rows[method]["fit residual"] = sum(b.fit_quality[method] for b in pruned.boundaries) / len(
                    pruned.boundaries
                )
            key = f"{criterion} {n}/{num_layers} (removed {plan.removed})"
            add(f"{key}, {args.samples} calibration windows", key, rows, [*columns, "fit residual"])

    n = max(1, round(float(args.depths.split(",")[-1]) * num_layers))
    criterion = args.criteria.split(",")[0]
    sizes = {}
    for size in (int(v) for v in args.sizes.split(",") if v):
        plan = ghostlayers.plan(dense, batches(size), select=criterion, num_layers=n)
        sizes[f"{size} windows"] = measure(ghostlayers.apply_plan(copy.deepcopy(dense), plan, "ghost").model, False)
    if sizes:
        title = f"calibration size, ghost, {criterion} {n}/{num_layers}"
        add(title, "calibration size", sizes, list(sizes[next(iter(sizes))]))

    ridges = {}
    values = [float(v) for v in args.ridges.split(",") if v]
    plan = ghostlayers.plan(dense, batches(args.samples), select=criterion, num_layers=n) if values else None
    for ridge in values:
        pruned = ghostlayers.apply_plan(copy.deepcopy(dense), plan, "ghost", ridge=ridge)
        ridges[f"ridge {ridge:g}"] = {
            **measure(pruned.model, False),
            "fit residual": pruned.boundaries[0].fit_quality["ghost"],
        }
    if ridges:
        title = f"ridge, ghost, {criterion} {n}/{num_layers}, {args.samples} windows"
        add(title, "ridge", ridges, list(ridges[next(iter(ridges))]))
    print(f"\n(total {time.perf_counter() - start:.0f} s; methods known: {', '.join(METHODS)})")


if __name__ == "__main__":
    main()
