"""Which rule for α (``W = I + αM``) keeps the repair's gain on text like the calibration and hurts no text
unlike it? Leave-one-domain-out, every rule read off the same measurements.

    python benchmarks/alpha.py [--model smollm2-135m] [--block 13:19] [--ridges R,R] [--json FILE]

At one fixed block, for each corpus ``out`` of wiki, web, code and austen: ghost is fitted on the other
three (``ghostlayers.leave_out`` of one calibration of all four, each domain's sums kept apart), and
measured three ways at every α of ``guard.ALPHA_GRID``:

- what a rule may look at: the held-out windows of the three calibration domains, (a) each scored with the
  fit made without it (``leave_one_domain_out_alpha``, what ``--alpha auto`` uses today) and (b) each scored
  with the full fit (in-domain);
- what the rule is judged on: perplexity on the test part of every corpus, ``out`` included (and the
  dense model's, for a leave-one-domain-out table of α = 1).

The rules: ``loss`` (today's: the safe α with the lowest left-out loss), ``largest`` (the largest safe α),
``blend`` (the safe α with the lowest mean of left-out and in-domain loss); "safe": no left-out domain
worse than α = 0. Targets (issue #31): ``out``'s test perplexity no worse than plain pruning (α = 0), and
≥ 95% of α = 1's gain on the three calibration corpora ((ppl(0) − ppl(α)) / (ppl(0) − ppl(1))).

``--ridges 0.003,0.01``: each fold is also fitted at those relative ridges, at α = 1, and judged the same
way (rows "ridge r, α = 1"): a ridge shrinks the repair only along the directions the calibration text
barely spans, where α shrinks it along all of them. The rule row "ridge: largest keeping 95% …" takes, per
fold, the largest of those ridges whose fit keeps 95% of the default fit's gain on the calibration domains'
held-out windows (the most shrinkage the text the user gave allows, as cross-validation's one-standard-error
rule takes the simplest model near the best).

Every fold is a cell of the JSON, written at once and skipped on a rerun.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import ResultsFile, cached_plan, model_arguments, open_bench, share

import ghostlayers
from ghostlayers.config.settings import ON_HELD_OUT
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.model.surgery import repair_scaled
from ghostlayers.repair.choices import FitSettings, leave_one_domain_out_alpha
from ghostlayers.repair.guard import (
    ALPHA_GRID,
    best_safe,
    blended_safe,
    domain_perplexity,
    largest_safe,
    mean_log,
    run_guard,
    shared_depth,
)
from ghostlayers.sources.corpora import OFFLINE

RULES = {
    "loss": lambda left_out, in_domain: best_safe(left_out, 0.0),
    "largest": lambda left_out, in_domain: largest_safe(left_out),
    "blend": blended_safe,
}


def floats(table: dict) -> dict[float, dict[str, float]]:
    return {float(a): scores for a, scores in table.items()}


def judge(test: dict[float, dict[str, float]], out: str, chosen: dict[str, float]) -> dict:
    """A choice's test perplexities ``chosen`` judged: on ``out`` against plain pruning (α = 0), and on each
    calibration corpus as its share of the default fit's gain (α = 1)."""
    plain, full = test[0.0], test[1.0]
    kept = {c: (plain[c] - chosen[c]) / (plain[c] - full[c]) for c in plain if c != out}
    return {"left-out ratio": chosen[out] / plain[out], "gain kept": kept}


RIDGE_GAIN = 0.95  # the ridge rule's tolerance: the share of the default fit's held-out gain it must keep


def in_domain_gain(fold: dict, held_out: dict[str, float]) -> float:
    """The share of the default fit's gain over plain pruning (α = 1) that a fit scoring ``held_out`` keeps,
    in mean log-perplexity on the calibration domains' held-out windows: what a rule may look at."""
    plain, full = (mean_log(floats(fold["in_domain"])[a]) for a in (0.0, 1.0))
    return (plain - mean_log(held_out)) / (plain - full)


def tables(results: dict) -> str:
    lines = [
        f"\n{results['description']}\n",
        "| rule | α per left-out corpus (" + ", ".join(OFFLINE) + ") | worst left-out ppl / plain pruning "
        "| in-domain gain kept, mean | in-domain gain kept, worst | meets both targets |",
        "|---|---|---|---|---|---|",
    ]
    cells = results["cells"]
    folds = {out: cells[f"fold {out}"] for out in OFFLINE if f"fold {out}" in cells}
    choices: dict[str, dict[str, tuple[str, dict[str, float]]]] = {}  # rule → out → (choice, test perplexities)
    for rule, choose in {**RULES, "α = 1": None}.items():
        for out, f in folds.items():
            alpha = 1.0 if choose is None else choose(floats(f["left_out"]), floats(f["in_domain"]))
            choices.setdefault(rule, {})[out] = (f"{alpha:g}", floats(f["test"])[alpha])
    ridge_cells = {  # out → ridge → cell: the fits shrunk by a larger ridge instead of α
        out: {
            r: cells[f"fold {out} ridge {r:g}"] for r in results.get("ridges", []) if f"fold {out} ridge {r:g}" in cells
        }
        for out in folds
    }
    for ridge in results.get("ridges", []):
        for out in folds:
            if ridge in ridge_cells[out]:
                choices.setdefault(f"ridge {ridge:g}, α = 1", {})[out] = ("1", ridge_cells[out][ridge]["test"])
    for out, f in folds.items():  # the rule: the largest ridge keeping RIDGE_GAIN of the held-out gain
        kept = [
            r
            for r, c in ridge_cells[out].items()
            if "in_domain" in c and in_domain_gain(f, c["in_domain"]) >= RIDGE_GAIN
        ]
        test = ridge_cells[out][max(kept)]["test"] if kept else floats(f["test"])[1.0]
        choices.setdefault(f"ridge: largest keeping {RIDGE_GAIN:.0%} of the held-out gain, α = 1", {})[out] = (
            f"1 (ridge {max(kept):g})" if kept else "1 (default ridge)",
            test,
        )
    for rule, chosen in choices.items():
        judged = [judge(floats(folds[out]["test"]), out, test) for out, (_, test) in chosen.items()]
        worst = max(j["left-out ratio"] for j in judged)
        gains = [g for j in judged for g in j["gain kept"].values()]
        met = worst <= 1.0 and min(gains) >= 0.95 and len(judged) == len(OFFLINE)
        lines.append(
            f"| {rule} | {', '.join(choice for choice, _ in chosen.values())} | {worst:.4f} | "
            f"{sum(gains) / len(gains):.1%} | {min(gains):.1%} | {'yes' if met else 'no'} |"
        )
    if "code" in folds and "austen" in folds:  # issue #31's question 3, from the same folds
        lines += [
            "",
            "Code in the calibration or left out (ghost at α = 1, test perplexity; each fold calibrates on the same "
            "number of windows from three corpora):",
            "",
            "| calibration | " + " | ".join(OFFLINE) + " |",
            "|---" * (1 + len(OFFLINE)) + "|",
        ]
        rows = {
            "plain pruning (α = 0)": floats(folds["code"]["test"])[0.0],
            "wiki, web, austen (code left out)": floats(folds["code"]["test"])[1.0],
            "wiki, web, code (austen left out)": floats(folds["austen"]["test"])[1.0],
        }
        lines += [f"| {k} | " + " | ".join(f"{v[c]:.2f}" for c in OFFLINE) + " |" for k, v in rows.items()]
    if "dense" in results["cells"] and len(folds) == len(OFFLINE):
        lines += ["", *leave_one_domain_out(results["cells"]["dense"]["ppl"], folds)]
    return "\n".join(lines)


def leave_one_domain_out(dense: dict[str, float], folds: dict[str, dict]) -> list[str]:
    """Does ghost (α = 1) help text it was not fitted on? Each corpus's test perplexity with the fit that left
    it out, against the fits that kept it (the other folds'; their mean), with the share of the gap."""
    lines = [
        'Leave-one-domain-out (ghost at α = 1, test perplexity; "kept": the mean over the three folds that '
        "calibrate on it):",
        "",
        "| corpus | dense | plain pruning | ghost, corpus left out | share | ghost, corpus kept | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for out, fold in folds.items():
        test = floats(fold["test"])
        kept = [floats(f["test"])[1.0][out] for other, f in folds.items() if other != out]
        without, with_it, plain = test[1.0][out], sum(kept) / len(kept), test[0.0][out]
        lines.append(
            f"| {out} | {dense[out]:.2f} | {plain:.2f} | {without:.2f} | {share(plain, dense[out], without):.2f} | "
            f"{with_it:.2f} | {share(plain, dense[out], with_it):.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, dtype=True)
    parser.add_argument("--num-layers", type=int, default=6, help="layers removed (streamline block)")
    parser.add_argument("--block", help="the removed block as first:end, instead of choosing it (streamline)")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--heldout-windows", type=int, default=2, help="per calibration domain (the CLI's default)")
    parser.add_argument(
        "--ridges", default="", help="relative ridges to also fit each fold at (α = 1): shrinking by ridge, not α"
    )
    parser.add_argument("--json", help="default: benchmarks/results/alpha-<model>.json (and .md)")
    parser.add_argument("--tables", action="store_true", help="only print the table of the JSON")
    args = parser.parse_args()
    path = Path(args.json or f"benchmarks/results/alpha-{args.model}.json")
    store = ResultsFile(path, args.model, args.dtype, render=tables)
    if args.tables:
        print(tables(store.data))
        return
    results = store.data

    bench = open_bench(args)
    dense = bench.dense
    # each fold gets --per-channel tokens per channel from the three corpora it keeps
    n = bench.windows(args.per_channel) * len(OFFLINE) // (len(OFFLINE) - 1)
    data = bench.calibration(list(OFFLINE), n, args.heldout_windows)
    if "block" not in results:
        chosen = args.block or None
        if chosen is None:
            made = ghostlayers.plan(dense, data.batches(4), select="streamline", num_layers=args.num_layers)
            chosen = f"{made.pairs[0][0]}:{made.pairs[0][1]}"
        results["block"] = chosen
    block = results["block"]
    results["description"] = (
        f"{args.model} ({args.dtype}), ghost at the streamline block {block}; calibration {n} × {args.seq_len} "
        f"tokens of {', '.join(OFFLINE)} (each fold keeps three), {args.heldout_windows} held-out windows per "
        f"calibration domain; test: {args.ppl_windows} windows of each corpus's held-out part"
    )
    replaceme = bench.folds
    name = f"alpha-{args.model}-{args.dtype}-{block}-{n}x{args.seq_len}-{args.heldout_windows}"
    plan = cached_plan(
        name,
        lambda: ghostlayers.plan(
            dense, data.batches(4), layers=block, replaceme=replaceme, groups=data.batch_domains(4), progress=False
        ),
    )
    depth = shared_depth(plan.pairs)

    def without(out: str) -> tuple[ghostlayers.Plan, dict]:
        """The plan with ``out``'s sums left out, and the held-out windows of the domains it keeps."""
        return ghostlayers.leave_out(plan, out), {d: w for d, w in data.heldout.items() if d != out}

    heldout_prefix = SharedPrefix(depth)  # every domain's held-out states entering layer ``depth``, made once

    def fold(out: str) -> dict:
        kept, heldout = without(out)
        _, left_out = leave_one_domain_out_alpha(dense, kept, heldout, FitSettings(progress=False))
        scores = {}
        with ghostlayers.applied(dense, kept, FitSettings("ghost", alpha=1.0, progress=False)) as result:
            in_domain = run_guard(dense, heldout, result.unfolded, ON_HELD_OUT, 4, False, heldout_prefix).perplexity
            for alpha in ALPHA_GRID:
                with repair_scaled(dense, alpha, result.unfolded):
                    scores[f"{alpha:g}"] = bench.perplexity(dense, depth)
        return {"left_out": left_out, "in_domain": {f"{a:g}": p for a, p in in_domain.items()}, "test": scores}

    def ridge_fold(out: str, ridge: float) -> dict:
        kept, heldout = without(out)
        with ghostlayers.applied(dense, kept, FitSettings("ghost", ridge, progress=False)):
            in_domain = domain_perplexity(dense, heldout, 4, False, "", heldout_prefix)
            return {"test": bench.perplexity(dense, depth), "in_domain": in_domain}

    ridges = [float(r) for r in args.ridges.split(",") if r]
    results["ridges"] = sorted({*results.get("ridges", []), *ridges})
    store.cell("dense", lambda: {"ppl": bench.perplexity(dense)})
    for out in OFFLINE:
        store.cell(f"fold {out}", lambda o=out: fold(o))
        for ridge in ridges:
            store.cell(f"fold {out} ridge {ridge:g}", lambda o=out, r=ridge: ridge_fold(o, r))
    store.save()
    print(tables(results))


if __name__ == "__main__":
    main()
