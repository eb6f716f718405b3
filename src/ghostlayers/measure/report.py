"""The report a person reads: ``report.json`` (everything), ``report.md`` (tables) and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ghostlayers.calibration.selection import runs
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import save_figure, write_text_nofollow
from ghostlayers.files.reading import read_json
from ghostlayers.registry.methods import METHODS


def guard_table(guard: dict) -> list[str]:
    """Markdown rows from ``Guard.to_dict()``: per domain, plain pruning against the repair at each α tried."""
    alphas = list(guard["perplexity"])
    lines = [
        "| held-out domain (windows) | "
        + " | ".join(f"α = {a}" + (" (kept)" if float(a) == guard["alpha"] else "") for a in alphas)
        + " |",
        "|---" * (len(alphas) + 1) + "|",
    ]
    for domain, count in guard["windows"].items():
        cells = [f"{guard['perplexity'][a][domain]:.3f}" for a in alphas]
        lines.append(f"| {domain} ({count}) | " + " | ".join(cells) + " |")
    return lines


def score_table(scores: dict[str, dict[str, float]], heading: str) -> list[str]:
    """Markdown rows of held-out perplexity per domain for each choice (method or candidate removal)."""
    domains = list(next(iter(scores.values())))
    lines = [f"| {heading} | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    return lines + [f"| {k} | " + " | ".join(f"{p[d]:.3f}" for d in domains) + " |" for k, p in scores.items()]


def similarity_plot(cosine: torch.Tensor, depth: int, removed: list[int], path: Path) -> None:
    """Cosine between the boundaries reached (those compared: blank beyond the criterion's distance), with
    the removed layers' blocks outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(cosine[: depth + 1, : depth + 1].cpu().numpy(), cmap="viridis", vmin=0, vmax=1)
    for pre, post in runs(removed):
        ax.add_patch(Rectangle((post - 0.5, pre - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xlabel("boundary j (input of layer j)")
    ax.set_ylabel("boundary i")
    ax.set_title("per-token cosine(X_i, X_j); red: removed blocks (i, j)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def heal_markdown(record: dict) -> list[str]:
    """The report's section from ``Heal.to_dict()``: held-out perplexity of each variant per domain, and what was
    kept and why."""
    lines = [f"## Healing ({', '.join(record['params'])}, {record['tokens']} tokens, {record['steps']} steps)", ""]
    before, after = record["loss_before"], record["loss_after"]
    lines.append(f"KL to the teacher on the training windows: {before:.4f} → {after:.4f}.")
    if not record["scores"]:
        return [*lines, "", "No held-out windows: the heal is kept unguarded."]
    lines += ["", *score_table(record["scores"], "held-out perplexity"), ""]
    if record["kept"]:
        return [*lines, "Kept: the healed model is no worse than the closed form on any held-out domain."]
    worse = ", ".join(record["hurt"])
    return [*lines, f"Not kept: healing is worse than the closed form on {worse}; the closed form stays."]


def markdown(report: dict) -> str:
    """Tables for one run."""
    identity = f" — {report['model']['label']}" if "model" in report else ""
    lines = [f"# ghostlayers {report['command']}: {report['settings'].get('model')}{identity}", ""]
    if "removed" in report:
        lines += [
            f"Removed layers {report['removed']} of {report['num_layers']} with **{report['method']}** "
            f"(selection: {report['settings'].get('select') or 'manual'}); parameters "
            f"{report['params_before']:,} → {report['params_after']:,}.",
            "",
        ]
        if report.get("stats_route"):
            lines += [f"Calibration: {report['stats_route']}.", ""]
        methods = [m for m in METHODS if any(m in b["fit_quality"] for b in report["boundaries"])]
        lines += ["Relative residual ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ on the calibration tokens:", ""]
        lines += ["| removed block | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        for b in report["boundaries"]:
            cells = [f"{b['fit_quality'][m]:.4f}" if m in b["fit_quality"] else "–" for m in methods]
            lines.append(f"| {b['pre']}..{b['post'] - 1} | " + " | ".join(cells) + " |")
        lines.append("")
    if report.get("candidate_scores"):
        lines += ["`--select loss`: held-out perplexity of each candidate, repaired:", ""]
        lines += [*score_table(report["candidate_scores"], "removed"), ""]
    if report.get("alpha_scores"):
        lines += [
            f"`--alpha auto` chose {report['alpha']:g}, each source left out of the fit in turn "
            "(perplexity on its held-out windows):",
            "",
            *score_table(report["alpha_scores"], "α"),
            "",
        ]
    if report.get("ridge_scores"):
        lines += [
            "`--ridge auto`: held-out perplexity at each ridge:",
            "",
            *score_table(report["ridge_scores"], "ridge"),
            "",
        ]
    if report.get("method_scores"):
        lines += [f"`--method auto` chose **{report['method']}**; held-out perplexity of each method:", ""]
        lines += [*score_table(report["method_scores"], "method"), ""]
    if report.get("guard"):
        guard = report["guard"]
        lines += [
            f"Guard: held-out perplexity of plain pruning (α = 0) and of the repair; kept α = {guard['alpha']} "
            f"({guard['seconds']:.1f} s).",
            "",
            *guard_table(guard),
            "",
        ]
        if guard["hurt"]:
            lines += [f"**The repair is worse than plain pruning on held-out {', '.join(guard['hurt'])} text.**", ""]
    if report.get("heal"):
        lines += [*heal_markdown(report["heal"]), ""]
    metrics = report.get("metrics", {})
    if metrics:
        lines += metric_rows(metrics)
        lines += zeroshot_summary(metrics)
        lines += speed_summary(metrics)
    if report.get("timings"):
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report["timings"].items())]
    return "\n".join(lines) + "\n"


SPEED_COLUMNS = ("speed prefill_ms", "speed decode_tokens_per_s", "speed parameters")  # the medians; the rest
# of a speed measurement (ranges, work per token) is in report.json and in a run's speed table


def _metric_keys(metrics: dict[str, dict], speed: bool = True) -> list[str]:
    """Every metric of any model, in first-seen order (the speed medians only with ``speed``); standard
    errors, sample counts and the rest stay in report.json, to keep the tables readable."""
    keys: list[str] = []
    for row in metrics.values():
        for key in flatten(row):
            if key.startswith("speed ") and not (speed and key in SPEED_COLUMNS):
                continue
            if key not in keys and not key.endswith(("_stderr", " n")):
                keys.append(key)
    return keys


def _heading(key: str) -> str:
    return key.removeprefix("zeroshot ").removeprefix("speed ").removeprefix("gl_")


def metrics_table(metrics: dict[str, dict]) -> list[str]:
    """One row per model (of several runs: ``compare``), one column per metric."""
    columns = _metric_keys(metrics)
    lines = ["| model | " + " | ".join(map(_heading, columns)) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in metrics.items():
        flat = flatten(row)
        lines.append(f"| {name} | " + " | ".join(_fmt(flat.get(c)) for c in columns) + " |")
    return lines


def metric_rows(metrics: dict[str, dict]) -> list[str]:
    """One row per metric, one column per model: a run's few models (dense, plain pruning, repaired) fit an
    80-column terminal, where a column per metric (9 tasks, 3 corpora, speed) did not."""
    flats = {name: flatten(row) for name, row in metrics.items()}
    lines = ["| metric | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for key in _metric_keys(metrics, speed=False):
        lines.append(f"| {_heading(key)} | " + " | ".join(_fmt(flat.get(key)) for flat in flats.values()) + " |")
    return lines


def _within(a: dict, b: dict, key: str) -> bool:
    """Whether two speed measurements' ranges over their rounds overlap: a difference the run did not resolve."""
    return a[f"{key}_min"] <= b[f"{key}_max"] and b[f"{key}_min"] <= a[f"{key}_max"]


def speed_summary(metrics: dict[str, dict]) -> list[str]:
    """Each timed model's median prefill latency and decode throughput with their ranges; with two (dense and
    pruned, timed in turn), the measured ratio beside the ratio the work per token predicts, and a plain
    sentence where the ranges overlap."""
    speeds = {name: m["speed"] for name, m in metrics.items() if isinstance(m.get("speed"), dict)}
    if not speeds or not all("prefill_ms_min" in s for s in speeds.values()):
        return []
    some = next(iter(speeds.values()))
    rows = [
        ("prefill", f"prefill {some['prompt_tokens']} tokens (ms)", "prefill_ms", "prefill_flops_per_token"),
        ("decode", "decode (tokens/s)", "decode_tokens_per_s", "decode_flops_per_token"),
    ]
    pair = list(speeds.values()) if len(speeds) == 2 else None
    header = "| | " + " | ".join(speeds) + (" | time ratio | expected |" if pair else " |")
    intro = f"Speed: median of {some['rounds']} rounds [min–max], the models timed in turn"
    if pair:
        intro += "; the second's time over the first's, and the ratio their FLOPs per token predict"
    lines = ["", intro + ":", "", header]
    lines.append("|---" * (len(speeds) + 1 + 2 * bool(pair)) + "|")
    verdicts = []
    for what, label, key, flops in rows:
        cells = [f"{s[key]:.4g} [{s[key + '_min']:.4g}–{s[key + '_max']:.4g}]" for s in speeds.values()]
        if pair:
            a, b = pair
            time_ratio = b[key] / a[key] if key == "prefill_ms" else a[key] / b[key]
            cells += [f"{time_ratio:.2f}×", f"{b[flops] / a[flops]:.2f}×"]
            if _within(a, b, key):
                verdicts.append(f"{what}: the difference is within the run-to-run spread (not resolved by this run)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ratio = f" | {pair[1]['parameters'] / pair[0]['parameters']:.2f}× | |" if pair else " |"
    lines.append("| parameters | " + " | ".join(f"{s['parameters']:,}" for s in speeds.values()) + ratio)
    if verdicts:
        lines += ["", "; ".join(verdicts).capitalize() + "."]
    return lines


def zeroshot_average(zeroshot: dict[str, dict], metric: str = "acc_norm") -> tuple[float, float]:
    """Mean accuracy over the tasks (``metric`` where the task has it, else acc: acc_norm as the papers'
    tables) and its standard error, from each task's own (independent samples)."""
    scores = [
        (t[metric], t[f"{metric}_stderr"]) if metric in t else (t["acc"], t["acc_stderr"]) for t in zeroshot.values()
    ]
    return sum(m for m, _ in scores) / len(scores), sum(se * se for _, se in scores) ** 0.5 / len(scores)


PLAIN_ROW = "pruned, no recovery"  # the row a run's repaired model is compared with, example by example


def example_scores(task: dict, metric: str = "acc_norm") -> list[float]:
    """One task's per-example scores (``metric`` where the task has it, else acc), as
    ``evaluate_zeroshot(per_example=True)`` keeps them."""
    examples = task["examples"]
    return examples.get(metric, examples["acc"])


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (sample variance; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def example_average(
    zeroshot: dict[str, dict], other: dict[str, dict] | None = None, metric: str = "acc_norm"
) -> tuple[float, float]:
    """Mean over the tasks of the per-example scores and its standard error; with ``other``, of the
    per-example differences ``zeroshot − other``. The same examples score both models, so what makes an
    example hard cancels: far tighter than the difference of two averages, each with its own error."""
    parts = []
    for task, values in zeroshot.items():
        scores = example_scores(values, metric)
        base = example_scores(other[task], metric) if other is not None else [0.0] * len(scores)
        parts.append(mean_se([a - b for a, b in zip(scores, base, strict=True)]))
    return sum(m for m, _ in parts) / len(parts), math.sqrt(sum(se * se for _, se in parts)) / len(parts)


def zeroshot_summary(metrics: dict[str, dict]) -> list[str]:
    """The zero-shot average of each model, the share of the first (dense) model's it keeps, and, where the
    per-example scores were kept, each model's paired difference from plain pruning (``PLAIN_ROW``)."""
    zeroshot = {name: m["zeroshot"] for name, m in metrics.items() if m.get("zeroshot")}
    if not zeroshot:
        return []
    rows = {name: zeroshot_average(z) for name, z in zeroshot.items()}
    first = next(iter(rows.values()))[0]
    tasks = len(next(iter(zeroshot.values())))
    plain = zeroshot.get(PLAIN_ROW)
    paired = plain is not None and all("examples" in t for z in zeroshot.values() for t in z.values())
    lines = ["", f"Zero-shot average over {tasks} tasks (%, acc_norm where the task has it):", ""]
    header = "| model | average | of " + next(iter(rows)) + " |"
    lines += [header + (" vs plain pruning (paired) |" if paired else ""), "|---" * (4 if paired else 3) + "|"]
    for name, (mean, se) in rows.items():
        kept = f"{100 * mean / first:.1f}%" if first else "–"
        line = f"| {name} | {100 * mean:.2f} ± {100 * se:.2f} | {kept} |"
        if paired:
            diff, diff_se = example_average(zeroshot[name], plain)
            line += " – |" if name == PLAIN_ROW else f" {100 * diff:+.2f} ± {100 * diff_se:.2f} |"
        lines.append(line)
    if paired:
        lines += ["", "A difference within two standard errors is not evidence that the two models differ."]
    return lines


def flatten(row: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "examples":  # per-example scores: report.json keeps them for paired differences
            continue
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key} "))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def write(report: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_text_nofollow(folder / "report.json", json.dumps(report, indent=2) + "\n")
    write_text_nofollow(folder / "report.md", markdown(report))


def read_report(folder: Path) -> dict:
    """A run's ``report.json``, or an error naming the folder when it is missing or not a report."""
    try:
        report = read_json(Path(folder) / "report.json", "the report")
    except GhostLayersError:
        raise
    except OSError as error:
        raise GhostLayersError(
            f"Cannot read {folder}/report.json ({error.strerror}): give folders written by prune or eval."
        ) from error
    except ValueError as error:
        raise GhostLayersError(
            f"{folder}/report.json is not valid JSON ({error}): give folders written by prune or eval."
        ) from error
    if not isinstance(report, dict) or not isinstance(report.get("metrics", {}), dict):
        raise GhostLayersError(
            f"{folder}/report.json is not a ghostlayers report: give folders written by prune or eval."
        )
    if (wrong := broken_metric(report.get("metrics", {}))) is not None:
        raise GhostLayersError(f"{folder}/report.json: {wrong}. Leave this run out, or run it again.")
    return report


def broken_metric(metrics: dict) -> str | None:
    """What makes a report's metrics unfit to compare (tables of finite numbers per model; lm-eval writes
    "N/A" for a missing stderr): a NaN perplexity is a broken run, anything else an edited file."""
    for name, row in metrics.items():
        if not isinstance(row, dict) or not isinstance(row.get("ppl", {}), dict):
            return f"the metrics of {name} are not tables of numbers"
        for key, value in flatten(row).items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if (number and not math.isfinite(value)) or not (number or value is None or isinstance(value, str)):
                return f"{name} {key} is {value!r}, not a finite number"
            if key.startswith("ppl ") and (not number or value < 1):  # exp of a mean NLL ≥ 0: never below 1
                return f"{name} {key} is {value!r}, not a perplexity"
    return None


def run_labels(folders: list[Path]) -> list[str]:
    """A distinct label per run folder: its name, or as much of its path as tells two folders apart."""
    paths = [Path(f).absolute().parts for f in folders]
    for depth in range(1, max(map(len, paths)) + 1):
        labels = ["/".join(p[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i + 1}: {label}" for i, label in enumerate(labels)]  # the same folder given twice


def printable(text: str) -> str:
    """``text`` without control characters (a crafted report's terminal escape sequences), each shown as ``?``."""
    return "".join("?" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in str(text))


def _runs(folders: list[Path]) -> list[tuple[str, str, dict, dict]]:
    """``(label, model name, report, metrics)`` for every evaluated model of every run; labels are distinct
    and printable (``printable``), whatever a report names its models."""
    return [
        (printable(f"{label}: {name}"), printable(name), report, metrics)
        for label, folder in zip(run_labels(folders), folders, strict=True)
        for report in [read_report(folder)]
        for name, metrics in report.get("metrics", {}).items()
    ]


def compare(folders: list[Path]) -> str:
    """Several runs side by side: one row per evaluated model of each run, with its method and depth."""
    rows = {
        label: {
            "method": report.get("method", "–") if name != "dense" else "dense",
            "removed": len(report.get("removed", [])) if name != "dense" else 0,
            **metrics,
        }
        for label, name, report, metrics in _runs(folders)
    }
    return "\n".join(metrics_table(rows)) + "\n"


def perplexity_plot(folders: list[Path], path: Path) -> None:
    """Perplexity per run and corpus, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, float]] = {}
    for label, _, _, metrics in _runs(folders):  # one bar per evaluated model: labels never coincide
        for corpus, value in metrics.get("ppl", {}).items():
            series.setdefault(corpus, {})[label] = value
    if not series:
        return
    labels = list(dict.fromkeys(label for s in series.values() for label in s))
    fig, ax = plt.subplots(figsize=(min(40, max(5, 1.2 * len(labels))), 4))  # bounded for any number of runs
    width = 0.8 / len(series)
    for k, (corpus, values) in enumerate(series.items()):
        ax.bar(
            [i + k * width for i in range(len(labels))],
            [values.get(lbl, 0) for lbl in labels],
            width,
            label=corpus,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
