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

import ghostlayers
from ghostlayers.calibration import calibrate
from ghostlayers.corpora import load_text
from ghostlayers.data import batched, calibration_windows, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.selection import CRITERIA, candidate_pairs, select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--remove", type=int, default=6, help="layers removed in the method rows")
    parser.add_argument("--max-depth", type=int, default=8, help="deepest selection checked for the range")
    parser.add_argument("--calibration", default="wiki")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ppl", default="wiki,news,austen")
    parser.add_argument("--ppl-windows", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
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

    names = list(windows)
    print(
        f"\n{args.model}: {args.samples} × {args.seq_len} {args.calibration} calibration tokens; perplexity on "
        f"{args.ppl_windows} × {args.seq_len} held-out tokens per corpus; {time.perf_counter() - start:.0f} s\n"
    )
    print("| selection | variant | removed | " + " | ".join(f"ppl {n}" for n in names) + " | ppl avg |")
    print("|---" * (len(names) + 4) + "|")
    for r in rows:
        values = [r["ppl"][n] for n in names]
        cells = " | ".join(f"{v:.2f}" for v in [*values, sum(values) / len(values)])
        print(f"| {r['section']} | {r['variant']} | {r['removed']} | {cells} |")
    edges = [c for c in choices if c["edge"]]
    print(f"\nSelections (criteria × depths 1..{args.max_depth}) removing the first or last layer: {len(edges)}")
    for c in edges:
        print(f"- {c['criterion']} {c['n']}: all {c['all']}, published {c['published']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "selections": choices}, indent=1))


if __name__ == "__main__":
    main()
