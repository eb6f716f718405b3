"""The beyond-the-paper options against default ghost, same model, tokens and depth.

    python benchmarks/options.py [--model smollm2-135m] [--samples 16] [--remove 7] [--tasks '']

Rows: streamline + ghost (relative ridge 1e-6, the default) vs ghost-aware selection (contiguous, and
the non-contiguous ghost-aware-runs); ridge 1e-6 vs auto; for shortgpt (several runs) dense vs
sequential fitting; the layer-by-layer ``offload`` calibration (must equal the first row); plain pruning
of both selections, the reference of each row's share of the none→dense gap. Perplexity on held-out text,
and zero-shot accuracy through lm-eval on the offline tasks with standard errors and the paired difference
from the first row (``--tasks ''`` skips it). Every row is written to
``benchmarks/results/options-<model>.json`` (and ``.md``) as it finishes and skipped on a rerun.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from cells import ResultsFile, model_arguments, ppl_share_cells, ppl_share_header
from quality import average, difference

import ghostlayers
from ghostlayers.data import calibration_set, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_for_offload, load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.sources.corpora import load_text
from ghostlayers.sources.tasks import DEFAULT_TASKS
from ghostlayers.zeroshot import evaluate_zeroshot

ROWS = {
    "streamline, relative ridge 1e-6 (default)": dict(select="streamline"),
    "streamline, offload (layer by layer)": dict(select="streamline", offload=True),
    "ghost-aware selection": dict(select="ghost-aware"),
    "ghost-aware-runs selection": dict(select="ghost-aware-runs"),
    "streamline, ridge auto (held-out loss)": dict(select="streamline", ridge="auto", heldout=True),
    "streamline, none": dict(select="streamline", method="none"),
    "shortgpt, dense fit (one operator per run)": dict(select="shortgpt"),
    "shortgpt, sequential fit": dict(select="shortgpt", fit="sequential"),
    "shortgpt, none": dict(select="shortgpt", method="none"),
}


def tables(results: dict) -> str:
    """The table of docs/RESULTS.md from the JSON alone: each row's share against plain pruning of the same
    layers, and its zero-shot average and paired difference from the first (default) row."""
    cells, settings = results["cells"], results["settings"]
    corpora = settings["ppl"].split(",")
    dense = cells.get("dense")
    if dense is None:
        return ""
    plain = {tuple(c["removed"]): c["ppl"] for c in cells.values() if c.get("method") == "none"}
    first = cells.get(next(iter(ROWS)))
    zeroshot = "zeroshot" in dense
    lines = [
        f"{results['model']}, remove {settings['remove']}, {settings['samples']} × {settings['seq_len']} `wiki` "
        f"calibration tokens" + (f"; zero-shot limit {settings['limit']}" if zeroshot else "") + "\n",
        f"| variant | removed (λ) | {ppl_share_header(corpora)} |"
        + (" 0-shot avg | vs default (paired) |" if zeroshot else ""),
        "|---" * (2 + 2 * len(corpora) + 2 * zeroshot) + "|",
    ]
    for name, cell in cells.items():
        none = plain.get(tuple(cell.get("removed", ()))) if cell.get("method") not in (None, "none") else None
        row = f"| {name} | {cell['removed']} {cell['ridges']} | " if "removed" in cell else f"| {name} | – | "
        row += ppl_share_cells(cell["ppl"], corpora, none, dense["ppl"] if none else None) + " |"
        if zeroshot:
            mean, se = average(cell["zeroshot"])
            paired = difference(cell["zeroshot"], first["zeroshot"]) if first and cell is not first else "–"
            row += f" {mean:.2f} ± {se:.2f} | {paired} |"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--remove", type=int, default=7)
    parser.add_argument("--ppl", default="wiki,web,code,austen")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    parser.add_argument("--limit", type=int, default=300, help="zero-shot examples per task")
    parser.add_argument("--json", help="default: benchmarks/results/options-<model>.json (and .md)")
    parser.add_argument("--tables", action="store_true", help="only print the table of the JSON")
    args = parser.parse_args()
    path = Path(args.json or f"benchmarks/results/options-{args.model}.json")
    if args.tables:
        print(tables(json.loads(path.read_text())))
        return
    store = ResultsFile(path, args.model, "float32", render=tables)
    store.data["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "tables")}
    dense, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    train = tokenize(tokenizer, load_text("wiki", "train"))
    data = calibration_set({"wiki": train}, args.samples, args.seq_len, 0, heldout=2)  # held out: ridge auto
    windows = perplexity_windows(tokenizer, args.ppl.split(","), args.seq_len, args.ppl_windows)
    tasks = [t for t in args.tasks.split(",") if t]

    def measure(model) -> dict:
        out = {"ppl": {c: perplexity(model, w, 4, progress=False) for c, w in windows.items()}}
        if tasks:
            out["zeroshot"] = evaluate_zeroshot(model, tokenizer, tasks, args.limit, 8, per_example=True)
        return out

    def pruned(options: dict) -> dict:
        options = dict(options)
        if options.pop("offload", False):
            checkpoint, _ = load_for_offload(args.model, device="cpu")
            model, options["offload"] = checkpoint.skeleton(), checkpoint
        else:
            model = copy.deepcopy(dense)
        if options.pop("heldout", False):
            options["heldout"] = data.heldout
        result = ghostlayers.prune(model, data.batches(4), num_layers=args.remove, progress=False, **options)
        ridges = f"(λ {', '.join(f'{b.ridge:.0e}' for b in result.boundaries)})"
        return {"removed": result.removed, "ridges": ridges, "method": result.method, **measure(result.model)}

    store.cell("dense", lambda: measure(dense))
    for name, options in ROWS.items():
        store.cell(name, lambda o=options: pruned(o))
    print(tables(store.data))


if __name__ == "__main__":
    main()
