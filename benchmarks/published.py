"""The published baselines' choices against ghostlayers' defaults, measured in perplexity (issue #17).

    python benchmarks/published.py [--model smollm2-135m] [--remove 6] [--json out.json]

One calibration per selection serves every row of it (each fitted on a fresh copy of the dense model):
- streamline: none, linearpatch and linearpatch-rotate (the published per-sequence scale), ghost with
  the relative ridge (default) and with the published absolute one;
- shortgpt: ghost and linearpatch with one operator per removed run (default) and chained, one per
  removed layer (published);
- selection range: for every criterion and every depth up to ``--max-depth``, whether the unrestricted
  choice removes the first or the last layer (one pass gathers every cosine and every run's statistics),
  and, for scale, the perplexity of removing the first or the last layer alone, repaired by ghost.
Prints markdown tables; ``--json`` keeps every number.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from cells import model_arguments, ppl_share_cells, ppl_share_header

import ghostlayers
from ghostlayers.calibration import calibrate
from ghostlayers.data import batched, calibration_windows, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.selection import CRITERIA, candidate_pairs, select
from ghostlayers.sources.corpora import load_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, ppl_windows=16)
    parser.add_argument("--remove", type=int, default=6, help="layers removed in the method rows")
    parser.add_argument("--max-depth", type=int, default=8, help="deepest selection checked for the range")
    parser.add_argument("--calibration", default="wiki")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ppl", default="wiki,web,code,austen")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tables", action="store_true", help="only print the table of --json (and write its .md)")
    args = parser.parse_args()
    if args.tables:
        results = json.loads(args.json.read_text())
        print(tables(results))
        args.json.with_suffix(".md").write_text(tables(results) + "\n")
        return
    start = time.perf_counter()
    dense, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    total = dense.config.num_hidden_layers
    train = tokenize(tokenizer, load_text(args.calibration, "train"))
    batches = batched(calibration_windows(train, args.samples, args.seq_len, 0), args.batch_size)
    windows = perplexity_windows(tokenizer, args.ppl.split(","), args.seq_len, args.ppl_windows)
    rows: list[dict] = []

    def measure(section: str, variant: str, removed: list[int], model) -> None:
        ppl = {name: perplexity(model, w, args.batch_size) for name, w in windows.items()}
        rows.append({"section": section, "variant": variant, "removed": removed, "ppl": ppl})
        print(rows[-1], flush=True)

    measure("dense", "dense", [], dense)
    plan = ghostlayers.plan(dense, batches, select="streamline", num_layers=args.remove, progress=False)
    for variant, method, options in [
        ("none", "none", {}),
        ("linearpatch, published per-sequence scale", "linearpatch", {}),
        ("linearpatch-rotate, published per-sequence scale", "linearpatch-rotate", {}),
        ("ghost, relative ridge 1e-6 (default)", "ghost", {}),
        ("ghost, absolute ridge 1e-6 (published)", "ghost", {"ridge_mode": "absolute"}),
    ]:
        result = ghostlayers.apply_plan(copy.deepcopy(dense), plan, method, progress=False, **options)
        measure("streamline", variant, plan.removed, result.model)
    plan = ghostlayers.plan(dense, batches, select="shortgpt", num_layers=args.remove, chained=True, progress=False)
    for method in ("ghost", "linearpatch"):
        for chained, how in ((False, "one per run (default)"), (True, "chained per layer (published)")):
            result = ghostlayers.apply_plan(copy.deepcopy(dense), plan, method, progress=False, chained=chained)
            measure("shortgpt", f"{method}, {how}", plan.removed, result.model)

    pairs = candidate_pairs("ghost-aware-runs", args.max_depth, total)  # every run of ≤ max-depth layers
    cal = calibrate(dense, batches, pairs, depth=total, band=None, progress=False)
    choices = []
    for criterion in CRITERIA:
        for n in range(1, args.max_depth + 1):
            chosen = {r: select(criterion, cal.similarity, n, total, cal.pairs, r) for r in ("all", "published")}
            edge = sorted({0, total - 1} & set(chosen["all"]))
            choices.append({"criterion": criterion, "n": n, **chosen, "edge": edge})
    for layer in (0, total - 1):
        result = ghostlayers.prune(copy.deepcopy(dense), batches, layers=[layer], progress=False)
        measure("range", f"remove layer {layer} alone + ghost", [layer], result.model)
    best = next(c["all"] for c in choices if c["criterion"] == "shortgpt" and c["n"] == 1)
    result = ghostlayers.prune(copy.deepcopy(dense), batches, layers=best, progress=False)
    measure("range", f"remove layer {best[0]} alone (shortgpt's choice) + ghost", best, result.model)

    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    results |= {"rows": rows, "selections": choices, "seconds": round(time.perf_counter() - start)}
    print(tables(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        args.json.with_suffix(".md").write_text(tables(results) + "\n")


def tables(results: dict) -> str:
    """The table of docs/RESULTS.md from the JSON alone, with each row's share of the none→dense gap where
    plain pruning of the same layers was measured."""
    settings, rows = results["settings"], results["rows"]
    names = settings["ppl"].split(",")
    dense = next(r["ppl"] for r in rows if r["section"] == "dense")
    plain = {tuple(r["removed"]): r["ppl"] for r in rows if r["variant"] == "none"}
    lines = [
        f"\n{settings['model']}: {settings['samples']} × {settings['seq_len']} {settings['calibration']} calibration "
        f"tokens; perplexity on {settings['ppl_windows']} × {settings['seq_len']} held-out tokens per corpus\n",
        f"| selection | variant | removed | {ppl_share_header(names)} |",
        "|---" * (3 + 2 * len(names)) + "|",
    ]
    for r in rows:
        none = plain.get(tuple(r["removed"])) if r["variant"] != "none" else None
        cells = ppl_share_cells(r["ppl"], names, none, dense)
        lines.append(f"| {r['section']} | {r['variant']} | {r['removed']} | {cells} |")
    edges = [c for c in results["selections"] if c["edge"]]
    lines.append(f"\nSelections (criteria × depths) removing the first or last layer: {len(edges)}")
    lines += [f"- {c['criterion']} {c['n']}: all {c['all']}, published {c['published']}" for c in edges]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
