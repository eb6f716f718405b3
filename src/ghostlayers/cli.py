"""``ghostlayers`` command line: ``prune``, ``eval`` and ``compare``, thin wrappers over the API."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ghostlayers import operators, selection
from ghostlayers.errors import GhostLayersError
from ghostlayers.pipeline import DEFAULT_MEMORY_BUDGET

app = typer.Typer(add_completion=False, no_args_is_help=True)
console = Console()

Model = Annotated[str, typer.Option(help="Model folder, hub id, or bundled short name (smollm2-135m, gemma3-270m).")]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16, float16 or float64.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1 ...")]
SeqLen = Annotated[int, typer.Option(help="Tokens per calibration / perplexity window.")]
BatchSize = Annotated[int, typer.Option(help="Windows per forward pass.")]
Ppl = Annotated[str, typer.Option(help="Comma-separated perplexity texts: files, folders or corpora.")]
PplWindows = Annotated[int | None, typer.Option(help="Evaluate at most this many windows per text.")]
Tasks = Annotated[str, typer.Option(help="Comma-separated zero-shot tasks (offline gl_* tasks or lm-eval names).")]
Limit = Annotated[int | None, typer.Option(help="Examples per zero-shot task.")]
Speed = Annotated[bool, typer.Option(help="Measure prefill latency and decode throughput.")]


@app.callback()
def _group() -> None:
    """Remove decoder layers from a Hugging Face causal LM and repair them in closed form."""


def _split(values: str) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()]


@app.command()
def prune(
    model: Model = "smollm2-135m",
    layers: Annotated[
        str | None, typer.Option(help="Layers to remove: 12:18 (12..17) or 3,7,9 (original indices).")
    ] = None,
    select: Annotated[str | None, typer.Option(help=f"Selection criterion: {', '.join(selection.CRITERIA)}.")] = None,
    num_layers: Annotated[int | None, typer.Option(help="How many layers --select removes (default 4).")] = None,
    method: Annotated[str, typer.Option(help=f"Recovery: {', '.join(operators.METHODS)}.")] = "ghost",
    calibration: Annotated[str, typer.Option(help="Calibration text: a file, a folder of .txt, or a corpus.")] = "wiki",
    num_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 32,
    fit: Annotated[
        str,
        typer.Option(
            help="dense (one operator per removed run), sequential (later runs fit on the patched model) or "
            "chained (one operator per removed layer, multiplied: the published Ghosted Layers code)."
        ),
    ] = "dense",
    seq_len: SeqLen = 512,
    seed: Annotated[int, typer.Option(help="Seed for drawing the windows.")] = 0,
    batch_size: BatchSize = 4,
    ridge: Annotated[
        str, typer.Option(help="Ridge λ relative to trace(XᵀX)/C, or 'auto' (chosen on held-out batches).")
    ] = str(operators.DEFAULT_RIDGE),
    ridge_mode: Annotated[
        str,
        typer.Option(help="relative (λ = ridge · trace(XᵀX)/C) or absolute (λ = ridge, as the published code)."),
    ] = operators.DEFAULT_RIDGE_MODE,
    select_range: Annotated[
        str,
        typer.Option(help="Layers --select may remove: all, or published (never the first or the last layer)."),
    ] = selection.DEFAULT_SELECT_RANGE,
    dtype: Dtype = "float32",
    device: Device = "auto",
    output: Annotated[Path | None, typer.Option(help="Write the pruned model folder (and its report) here.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --output folder.")] = False,
    evaluate: Annotated[bool, typer.Option("--eval", help="Evaluate the dense and the pruned model.")] = False,
    ppl: Ppl = "wiki",
    ppl_windows: PplWindows = 32,
    tasks: Tasks = "",
    limit: Limit = None,
    speed: Speed = True,
    report_dir: Annotated[Path | None, typer.Option(help="Report folder when there is no --output.")] = None,
    offload: Annotated[
        bool,
        typer.Option(help="Calibrate layer by layer, reading weights from the files: for models larger than memory."),
    ] = False,
    stats_memory: Annotated[
        int,
        typer.Option(
            help="MiB of candidate-block statistics one pass may hold; beyond it (or at 0) selection takes a "
            "second, truncated pass instead: less memory, more time."
        ),
    ] = DEFAULT_MEMORY_BUDGET // 2**20,
) -> None:
    """Remove decoder layers and repair each removed block in closed form."""
    from ghostlayers.corpora import load_text
    from ghostlayers.data import batched, calibration_windows, tokenize
    from ghostlayers.distributed import init_from_env
    from ghostlayers.evaluation import evaluate as run_eval
    from ghostlayers.evaluation import perplexity_windows
    from ghostlayers.loading import load_for_offload, load_model_and_tokenizer
    from ghostlayers.pipeline import prune as run_prune
    from ghostlayers.saving import check_output, save
    from ghostlayers.surgery import operators_bypassed

    try:
        if layers is None and select is None:
            select = "streamline"
        if select is not None and num_layers is None:
            num_layers = 4
        if output is not None:
            check_output(output, overwrite)
        ridge_value = parse_ridge(ridge)
        rank, rank_device = init_from_env()  # under torchrun: calibration batches are split across ranks
        device = rank_device or device
        evaluate = evaluate and rank == 0
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        checkpoint = None
        with console.status(f"loading {model}"):
            if offload:
                checkpoint, tokenizer = load_for_offload(model, dtype, device)
                lm = checkpoint.skeleton()
            else:
                lm, tokenizer = load_model_and_tokenizer(model, dtype, device)
            windows = calibration_windows(
                tokenize(tokenizer, load_text(calibration, "train")), num_samples, seq_len, seed
            )
            eval_windows = perplexity_windows(tokenizer, _split(ppl), seq_len, ppl_windows) if evaluate else {}
        timings["load"], clock = time.perf_counter() - clock, time.perf_counter()
        metrics = {}
        eval_args = dict(tasks=_split(tasks), limit=limit, speed=speed, batch_size=batch_size)
        if evaluate and offload:
            console.print("--offload never holds the dense model: only the pruned one is evaluated")
        elif evaluate:
            metrics["dense"] = run_eval(lm, tokenizer, eval_windows, label="dense", **eval_args)
            timings["eval dense"], clock = time.perf_counter() - clock, time.perf_counter()
        settings = {
            "model": model,
            "layers": layers,
            "select": select,
            "num_layers": num_layers,
            "method": method,
            "calibration": calibration,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "seed": seed,
            "batch_size": batch_size,
            "ridge": ridge,
            "ridge_mode": ridge_mode,
            "select_range": select_range,
            "fit": fit,
            "dtype": dtype,
            "offload": offload,
            "stats_memory": stats_memory,
        }
        record = {
            "source_model": model,
            "calibration": {
                "source": calibration,
                "num_samples": num_samples,
                "seq_len": seq_len,
                "seed": seed,
                "tokens": windows.numel(),
            },
        }
        result = run_prune(
            lm,
            batched(windows, batch_size),
            layers=layers,
            select=select,
            num_layers=num_layers,
            method=method,
            ridge=ridge_value,
            ridge_mode=ridge_mode,
            fit=fit,
            select_range=select_range,
            record=record,
            memory_budget=stats_memory * 2**20,
            offload=checkpoint,
        )
        timings["calibrate+fit"], clock = time.perf_counter() - clock, time.perf_counter()
        if evaluate and method in operators.STREAM_METHODS and method != "none":
            with operators_bypassed(lm):  # the same layers removed, no recovery: what the operators bring
                metrics["pruned, no recovery"] = run_eval(
                    lm, tokenizer, eval_windows, label="no recovery", **{**eval_args, "speed": False}
                )
            timings["eval no recovery"], clock = time.perf_counter() - clock, time.perf_counter()
        if evaluate:
            metrics[f"pruned + {method}"] = run_eval(lm, tokenizer, eval_windows, label="pruned", **eval_args)
            timings["eval pruned"] = time.perf_counter() - clock
        if rank != 0:
            return
        report = prune_report(result, settings, metrics, timings)
        print_summary(report)

        def write_report(folder: Path) -> None:
            from ghostlayers import report as reports

            reports.write(report, folder)
            reports.similarity_plot(
                result.calibration.similarity.cosine,
                result.calibration.depth,
                result.removed,
                folder / "similarity.png",
            )

        if output is not None:
            with console.status(f"writing {output}"):
                save(result.model, tokenizer, output, overwrite, extra=write_report)
            console.print(f"saved model and report to [bold]{output}[/]")
        else:
            folder = report_dir or Path("runs") / f"{Path(model).name}-{select or 'manual'}-{method}"
            write_report(folder)
            console.print(f"report in [bold]{folder}[/] (pass --output DIR to save the pruned model)")
    except GhostLayersError as error:
        _fail(error)


@app.command("eval")
def evaluate_command(
    model: Annotated[str, typer.Argument(help="Model folder (pruned or not), hub id, or short name.")],
    ppl: Ppl = "wiki",
    ppl_windows: PplWindows = 32,
    seq_len: SeqLen = 512,
    tasks: Tasks = "",
    limit: Limit = None,
    speed: Speed = True,
    batch_size: BatchSize = 4,
    dtype: Dtype = "float32",
    device: Device = "auto",
    report_dir: Annotated[Path | None, typer.Option(help="Where to write report.json / report.md.")] = None,
) -> None:
    """Perplexity, zero-shot accuracy and speed of one model."""
    from ghostlayers import report as reports
    from ghostlayers.evaluation import evaluate, perplexity_windows
    from ghostlayers.loading import load_model_and_tokenizer

    try:
        start = time.perf_counter()
        lm, tokenizer = load_model_and_tokenizer(model, dtype, device)
        windows = perplexity_windows(tokenizer, _split(ppl), seq_len, ppl_windows)
        metrics = evaluate(lm, tokenizer, windows, _split(tasks), limit, speed, batch_size, label=Path(model).name)
        report = {
            "command": "eval",
            "settings": {
                "model": model,
                "ppl": ppl,
                "ppl_windows": ppl_windows,
                "seq_len": seq_len,
                "tasks": tasks,
                "limit": limit,
                "dtype": dtype,
            },
            "metrics": {Path(model).name: metrics},
            "timings": {"total": time.perf_counter() - start},
        }
        folder = report_dir or Path("runs") / f"eval-{Path(model).name}"
        reports.write(report, folder)
        console.print(reports.markdown(report))
        console.print(f"report in [bold]{folder}[/]")
    except GhostLayersError as error:
        _fail(error)


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run folders holding report.json.")],
    output: Annotated[Path | None, typer.Option(help="Also write compare.md and perplexity.png here.")] = None,
) -> None:
    """Several runs side by side."""
    from ghostlayers import report as reports

    missing = [str(r) for r in runs if not (r / "report.json").is_file()]
    if missing:
        _fail(GhostLayersError(f"No report.json in {', '.join(missing)}: give folders written by prune or eval."))
    table = reports.compare(runs)
    console.print(table)
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        (output / "compare.md").write_text(table)
        reports.perplexity_plot(runs, output / "perplexity.png")


def parse_ridge(value: str) -> float | str:
    if value == "auto":
        return value
    try:
        ridge = float(value)
    except ValueError:
        ridge = -1.0
    if ridge < 0:
        raise GhostLayersError(f"--ridge {value} is not valid: give a number ≥ 0 (e.g. 1e-6) or 'auto'.")
    return ridge


def prune_report(result, settings: dict, metrics: dict, timings: dict) -> dict:
    return {
        "command": "prune",
        "settings": settings,
        "num_layers": result.calibration.num_layers,
        "removed": result.removed,
        "method": result.method,
        "passes": result.passes,
        "params_before": result.params_before,
        "params_after": result.params_after,
        "boundaries": [
            {"pre": b.pre, "post": b.post, "ridge": b.ridge, "fit_quality": b.fit_quality} for b in result.boundaries
        ],
        "metrics": metrics,
        "timings": timings,
    }


def print_summary(report: dict) -> None:
    """Removed layers, parameter counts, every method's fit residual per boundary, and metrics."""
    before, after = report["params_before"], report["params_after"]
    console.print(
        f"removed layers [bold]{report['removed']}[/] of {report['num_layers']} with [bold]{report['method']}[/]; "
        f"parameters {before / 1e6:.1f}M → {after / 1e6:.1f}M ({100 * (1 - after / before):.1f}% fewer); "
        + ", ".join(f"{k} {v:.1f}s" for k, v in report["timings"].items())
    )
    methods = [m for m in operators.METHODS if any(m in b["fit_quality"] for b in report["boundaries"])]
    table = Table(title="relative residual ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ (lower is better)")
    table.add_column("removed block")
    table.add_column("ridge", justify="right")
    for m in methods:
        table.add_column(m + (" *" if m == report["method"] else ""), justify="right")
    for b in report["boundaries"]:
        cells = (f"{b['fit_quality'].get(m, float('nan')):.4f}" for m in methods)
        table.add_row(f"{b['pre']}..{b['post'] - 1}", f"{b['ridge']:g}", *cells)
    console.print(table)
    if report["metrics"]:
        from ghostlayers.report import metrics_table

        console.print("\n".join(metrics_table(report["metrics"])))


def _fail(error: Exception) -> None:
    console.print(f"[bold red]error:[/] {error}")
    raise typer.Exit(code=2)
