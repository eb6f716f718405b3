"""Does the repair help text it was not fitted on? Calibration size per hidden channel, and leave-one-domain-out.

    python benchmarks/domains.py [--model smollm2-135m] [--num-layers 6] [--json FILE]

At one fixed block (streamline, chosen once on mixed calibration text):

1. **Calibration size.** Ghost fitted on ``mix`` (wiki + web + code + austen, windows shared evenly) with
   ``tokens / C`` = 8 … 128 calibration tokens per hidden channel (or ``--curve-windows``), with the wall
   time of each calibration made in the run; perplexity on every corpus's held-out part, and the share of
   the none→dense gap recovered, ``(none − method) / (none − dense)``.
2. **One corpus or the mix.** Ghost calibrated on each corpus alone, at the same size as the mix's 32 tokens
   per channel: what ``--calibration mix`` (the default) buys on the other corpora, and costs on that one.
3. **Leave one domain out.** For each corpus as the held-out domain, calibrate on the other two and report
   none, ghost, replaceme, linearpatch (α = 1, as published) and ghost and replaceme with ``--alpha auto``
   (ghost's is the default: α chosen leaving each calibration domain out of the fit in turn), on all three
   corpora.
   One calibration of the three corpora, each domain's sums kept apart, serves every fold
   (``ghostlayers.leave_out``: the same sums as calibrating on the other two alone).

Every finished cell is written to the JSON at once and skipped on a rerun, so a long run (hours for the
1.5B model on 2 cores) can be stopped and resumed. Each cell records the machine, dtype and wall time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import ResultsFile, cached_plan, model_arguments, open_bench, ppl_share_cells, ppl_share_header, shares

import ghostlayers
from ghostlayers import FitSettings
from ghostlayers.repair.guard import shared_depth
from ghostlayers.sources.corpora import OFFLINE

METHODS = [
    ("none", 1.0),
    ("ghost", 1.0),
    ("replaceme", 1.0),
    ("linearpatch", 1.0),
    ("ghost", "auto"),
    ("replaceme", "auto"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, dtype=True)
    parser.add_argument("--num-layers", type=int, default=6, help="layers removed (streamline block)")
    parser.add_argument("--per-channel", default="8,16,32,64,128", help="calibration tokens per hidden channel")
    parser.add_argument("--curve-windows", help="the curve's sizes in windows instead (e.g. 16,64,256,1024)")
    parser.add_argument("--lodo-per-channel", type=float, default=32, help="calibration size of the LODO cells")
    parser.add_argument("--heldout-windows", type=int, default=2, help="per calibration domain, for α auto")
    parser.add_argument("--block", help="the removed block as first:end, instead of choosing it (streamline, mix)")
    parser.add_argument("--skip", default="", help="parts to skip: curve, single, lodo")
    parser.add_argument("--json", help="default: benchmarks/results/domains-<model>.json")
    args = parser.parse_args()
    store = ResultsFile(Path(args.json or f"benchmarks/results/domains-{args.model}.json"), args.model, args.dtype)
    results, cells, cell, save = store.data, store.cells, store.cell, store.save

    bench = open_bench(args)
    dense, size, windows = bench.dense, bench.hidden_size, bench.windows
    depth = 0  # the first layer every pruned variant leaves alone, once the block is known

    def ppl(model) -> dict[str, float]:  # the dense states at depth are made at the first pruned cell
        return bench.perplexity(model, depth)

    def calib(sources: list[str], n: int):
        return bench.calibration(sources, n, args.heldout_windows)

    cell("dense", lambda: {"ppl": ppl(dense)})
    if args.block:
        results["block"] = args.block
    if "block" not in results:
        chosen = ghostlayers.plan(
            dense, calib(list(OFFLINE), windows(32)).batches(4), select="streamline", num_layers=args.num_layers
        )
        results["block"] = f"{chosen.pairs[0][0]}:{chosen.pairs[0][1]}"
        save()
    block = results["block"]
    first, end = map(int, block.split(":"))
    depth = shared_depth([(first, end)])
    results["lodo_per_channel"] = args.lodo_per_channel
    results["description"] = (
        f"{args.model}, streamline block {block} fixed ({end - first} layers), seq-len {args.seq_len}, "
        f"{args.ppl_windows} test windows per corpus, C = {size}"
    )

    plans: dict[tuple, ghostlayers.Plan] = {}  # the latest calibration: every method, α and fold share it
    calibrated: dict[tuple, float] = {}  # wall time of a calibration made (not read from disk) in this cell
    replaceme = bench.folds

    def fit(sources: list[str], n: int, method: str, alpha: float | str, out: str | None = None) -> dict:
        """Prune the dense model at the fixed block as ``ghostlayers prune`` would, for this cell only
        (``ghostlayers.applied``): held-out windows of each calibration domain decide ``auto`` (α leaving one
        domain out at a time). With ``out``, the calibration of ``sources`` less that domain
        (``ghostlayers.leave_out``): the windows a calibration on the others alone would draw, and no text of
        ``out`` anywhere, held-out windows included."""
        data, key = calib(sources, n), (tuple(sources), n)
        if key not in plans:
            plans.clear()
            domains = data.batch_domains(4) if len(sources) > 1 else None

            def make() -> ghostlayers.Plan:
                start = time.perf_counter()
                made = ghostlayers.plan(
                    dense, data.batches(4), layers=block, replaceme=replaceme, groups=domains, progress=False
                )
                calibrated[key] = round(time.perf_counter() - start, 1)
                return made

            name = f"domains-{args.model}-{args.dtype}-{block}-{'+'.join(sources)}-{n}x{args.seq_len}"
            plans[key] = cached_plan(f"{name}-{args.heldout_windows}", make)
        made = plans[key] if out is None else ghostlayers.leave_out(plans[key], out)
        heldout = {d: w for d, w in data.heldout.items() if d != out}
        with ghostlayers.applied(dense, made, FitSettings(method, alpha=alpha, progress=False), heldout) as result:
            tokens = sum(w.numel() for d, w in data.windows.items() if d != out)
            measured = {"ppl": ppl(dense), "alpha": result.alpha, "method": result.method, "tokens": tokens}
        return measured | ({"calibration seconds": calibrated.pop(key)} if key in calibrated else {})

    none = cell("none", lambda: fit(list(OFFLINE), len(OFFLINE), "none", 1.0))
    if "curve" not in args.skip:
        sizes = args.per_channel.split(",")
        if args.curve_windows:
            sizes = [int(w) * args.seq_len / size for w in args.curve_windows.split(",")]
        for per_channel in map(float, sizes):
            key = f"curve {per_channel:.4g} ghost"
            cell(key, lambda p=per_channel: fit(list(OFFLINE), windows(p), "ghost", 1.0))
    if "single" not in args.skip:
        for source in OFFLINE:
            cell(f"single {source} ghost", lambda s=source: fit([s], windows(args.lodo_per_channel), "ghost", 1.0))
    if "lodo" not in args.skip:
        # one calibration of all corpora, each fold its sums less the left-out corpus's: every fold gets
        # ``lodo_per_channel`` tokens per channel from the other corpora, the windows it would draw alone
        n = windows(args.lodo_per_channel) * len(OFFLINE) // (len(OFFLINE) - 1)
        # a method in every fold before the next method, the default (ghost, α auto) and the paper's first:
        # a run stopped early has the comparison that matters on every held-out domain
        for method, alpha in sorted(METHODS[1:], key=lambda m: m != ("ghost", "auto")):
            for out in OFFLINE:
                if replaceme or method != "replaceme":
                    key = f"lodo {out} {method} alpha={alpha}"
                    cell(key, lambda o=out, m=method, a=alpha: fit(list(OFFLINE), n, m, a, out=o))
    dense_ppl = cells["dense"]["ppl"]
    for key, value in cells.items():
        if key not in ("dense", "none"):
            value["share"] = shares(value["ppl"], none["ppl"], dense_ppl)
    save()
    print(tables(results))


def tables(results: dict) -> str:
    """The markdown tables of docs/RESULTS.md, from the JSON alone."""
    cells = results["cells"]
    header = "| {} | " + ppl_share_header(list(OFFLINE)) + " |"
    rule = "|---" * (1 + 2 * len(OFFLINE)) + "|"

    def row(label: str, cell: dict) -> str:
        gap = label not in ("dense", "none (plain pruning)")
        none, dense = (cells["none"]["ppl"], cells["dense"]["ppl"]) if gap else (None, None)
        return f"| {label} | {ppl_share_cells(cell['ppl'], list(OFFLINE), none, dense)} |"

    lines = [f"\n{results['description']}\n", header.format("model"), rule]
    lines += [row("dense", cells["dense"]), row("none (plain pruning)", cells["none"])]
    curve = sorted((v["tokens"], k, v) for k, v in cells.items() if k.startswith("curve"))
    if curve:
        lines += ["", "calibration size (mix, ghost)", "", header.format("tokens / C (tokens, calibration s)"), rule]
        for tokens, key, value in curve:
            seconds = f", {value['calibration seconds']:g} s" if "calibration seconds" in value else ""
            lines.append(row(f"{key.split()[1]} ({tokens}{seconds})", value))
    single = {k: v for k, v in cells.items() if k.startswith("single")}
    if single:
        mix = cells.get(f"curve {results.get('lodo_per_channel', 32):.4g} ghost")
        lines += ["", "calibration on one corpus against the mix (ghost, α = 1, same size)", ""]
        lines += [header.format("calibration (tokens)"), rule]
        lines += [row(f"{k.split()[1]} only ({v['tokens']})", v) for k, v in single.items()]
        if mix is not None:
            lines.append(row(f"mix ({mix['tokens']})", mix))
    for out in OFFLINE:
        order = [f"lodo {out} {method} alpha={alpha}" for method, alpha in METHODS]
        fold = {k: cells[k] for k in order if k in cells}
        if fold:
            lines += ["", f"{out} left out (calibration on the other two)", "", header.format("method, α"), rule]
            for key, value in fold.items():
                method, alpha = key.split()[2], key.split()[3].removeprefix("alpha=")
                chosen = f" → {value.get('method', method)}, α = {value['alpha']:g}" if "auto" in key else ""
                lines.append(row(f"{method}, α = {alpha}{chosen}", value))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
