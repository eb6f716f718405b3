"""``ghostlayers`` command line: ``prune``, ``eval`` and ``compare``, thin wrappers over the API.

It answers at once: this module imports only light ones (``config.settings``, ``config.recipes``,
``files.folders``; no torch, transformers or lm-eval), builds its help from them and checks a command's
options, output folder included, before the command imports the modules that do the work (the package's one exception to
imports at the top, see tests/test_structure.py)."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from ghostlayers.config.recipes import EvalRecipe, EvalSettings, HealSettings, PruneRecipe, SweepSettings
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import Claim, check_output, write_text_nofollow
from ghostlayers.measure.chatter import quiet_others

OUT_OF_MEMORY = (
    "Out of memory: each process holds the whole model (and, healing, its trained parameters and one cached batch); "
    "lower --batch-size or --seq-len, use --dtype bfloat16, or --offload for prune without --heal. A model that "
    "fits no single device (FSDP, a device map) is not supported."
)


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
        except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
            if not isinstance(error, MemoryError) and "out of memory" not in str(error).lower():
                raise
            _error_console.print(f"[bold red]error:[/] {escape(OUT_OF_MEMORY)} ({escape(str(error).splitlines()[0])})")
            sys.exit(2)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrors)
console = Console()
_error_console = Console(stderr=True, soft_wrap=True)

Overwrite = Annotated[
    bool, typer.Option(help="Replace an existing output folder that ghostlayers wrote (a report only a report).")
]
KEYWORD = inspect.Parameter.KEYWORD_ONLY


@app.callback()
def _group(
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Show other libraries' log lines (lm-eval, transformers, ...) too.")
    ] = False,
) -> None:
    """Remove decoder layers from a Hugging Face causal LM and repair them in closed form."""
    quiet_others(verbose)


def _options(*classes: type, skip: tuple[str, ...] = ("eval",)) -> list[inspect.Parameter]:
    """One command-line option per field of the recipe ``classes``: its type, its default, and what the
    field's ``config.settings.setting`` says (help, names); a field read as text (``auto`` or a number) is a
    text option. ``--model``, what every command starts from, comes first."""
    parameters = []
    for cls in classes:
        types = get_type_hints(cls)
        for f in sorted(fields(cls), key=lambda f: f.name != "model"):
            if f.name in skip or not f.init:
                continue
            meta = f.metadata
            option = typer.Option(
                *meta.get("flags", ()), help=meta["help"], show_default=meta.get("show_default", True)
            )
            kind = str if meta.get("text") else types[f.name]
            parameters.append(inspect.Parameter(f.name, KEYWORD, default=f.default, annotation=Annotated[kind, option]))
    return parameters


def _command(handler: Callable[..., None], parameters: list[inspect.Parameter]) -> Callable[..., None]:
    """``handler`` (which takes its options by name) with ``parameters`` as the options typer reads."""
    handler.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return handler


def _option(name: str, kind: object, default: object, help: str, **option: Any) -> inspect.Parameter:
    """An option that is no recipe field (where a run writes, a recipe to read)."""
    return inspect.Parameter(
        name, KEYWORD, default=default, annotation=Annotated[kind, typer.Option(help=help, **option)]
    )


OVERWRITE = inspect.Parameter("overwrite", KEYWORD, default=False, annotation=Overwrite)
RECIPE_OPTIONS = {p.name for p in _options(PruneRecipe, EvalSettings)}


def prune(ctx: typer.Context, **values: Any) -> None:
    """Remove decoder layers and repair each removed block in closed form."""
    output, overwrite, report_dir, recipe = (values.pop(k) for k in ("output", "overwrite", "report_dir", "recipe"))
    given = {
        name: value
        for name, value in values.items()
        if ctx.get_parameter_source(name).name != "DEFAULT"  # typer vendors its own click
    }
    try:
        plan = PruneRecipe.from_file(recipe, **given) if recipe is not None else PruneRecipe.from_dict({}, **values)
        plan.check_run(output, overwrite, report_dir)
        from ghostlayers.jobs.runs import run

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


app.command()(
    _command(
        prune,
        [
            inspect.Parameter("ctx", KEYWORD, annotation=typer.Context),
            *_options(PruneRecipe, EvalSettings),
            _option("output", Path | None, None, "Write the pruned model folder (and its report) here."),
            OVERWRITE,
            _option("report_dir", Path | None, None, "Report folder when there is no --output."),
            _option(
                "recipe",
                Path | None,
                None,
                "A recipe file (JSON or TOML, as in a run's report.json 'recipe'): rerun it; options given on the "
                "command line replace its fields.",
                show_default=False,
            ),
        ],
    )
)


def evaluate_command(**values: Any) -> None:
    """Perplexity, zero-shot accuracy and speed of one model."""
    report_dir, overwrite = values.pop("report_dir"), values.pop("overwrite")
    try:
        settings = EvalSettings(**{f.name: values.pop(f.name) for f in fields(EvalSettings)})
        recipe = EvalRecipe(eval=settings, **values)
        folder = recipe.check_run(report_dir, overwrite)
        from rich.markdown import Markdown

        from ghostlayers.jobs.runs import evaluate
        from ghostlayers.measure import report

        summary = evaluate(recipe, report_dir, overwrite)
        console.print(Markdown(report.markdown(summary)))
        console.print(f"report in [bold]{folder}[/]")
    except GhostLayersError as error:
        _fail(error)


app.command("eval")(
    _command(
        evaluate_command,
        [
            inspect.Parameter(
                "model",
                KEYWORD,
                annotation=Annotated[str, typer.Argument(help="Model folder (pruned or not), hub id, or short name.")],
            ),
            *_options(EvalSettings, EvalRecipe, skip=("model", "eval")),
            _option("report_dir", Path | None, None, "Where to write report.json / report.md."),
            OVERWRITE,
        ],
    )
)


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run folders holding report.json.")],
    output: Annotated[Path | None, typer.Option(help="Also write compare.md and perplexity.png here.")] = None,
    overwrite: Overwrite = False,
) -> None:
    """Several runs side by side."""
    try:
        claim = Claim(output, overwrite, runs, report=True) if output is not None else None
        from ghostlayers.measure import report as reports

        with claim or contextlib.nullcontext():
            table = reports.compare(runs)
            console.print(table, markup=False, highlight=False)  # names from reports are text, not markup
            if claim is not None:
                with claim.folder() as where:
                    write_text_nofollow(where / "compare.md", table)
                    reports.perplexity_plot(runs, where / "perplexity.png")
    except GhostLayersError as error:
        _fail(error)


def sweep_command(**values: Any) -> None:
    """The depth curve of one model: every depth and method from one calibration, scored side by side."""
    output, overwrite = values.pop("output"), values.pop("overwrite")
    try:
        sweep = SweepSettings(**{f.name: values.pop(f.name) for f in fields(SweepSettings)})
        recipe = PruneRecipe.from_dict({}, **values, num_layers=max(sweep.depth_list()), evaluate=True)
        from rich.markdown import Markdown

        from ghostlayers.jobs.sweep import markdown, run_sweep

        results = run_sweep(recipe, sweep, output, overwrite, console)
        if results is None:  # a torchrun rank other than 0: it calibrated its share, rank 0 reports
            return
        console.print(Markdown(markdown(results)))
        console.print(f"sweep in [bold]{output}[/] (sweep.md, sweep.json, sweep.png)")
    except GhostLayersError as error:
        _fail(error)


NOT_SWEPT = ("eval", "layers", "num_layers", "method", "offload", "evaluate", "speed")  # the sweep sets these
NOT_SWEPT += ("heal",)  # the sweep's --heal is its list of budgets (SweepSettings.heal)
app.command("sweep")(
    _command(
        sweep_command,
        [
            *(
                p.replace(default="") if p.name == "tasks" else p  # zero-shot at every cell: only when asked
                for p in _options(PruneRecipe, EvalSettings, skip=NOT_SWEPT)
            ),
            *_options(SweepSettings),
            _option("output", Path, ..., "Folder of the sweep: sweep.json, sweep.md, sweep.png (resumed if there)."),
            OVERWRITE,
        ],
    )
)


def heal_command(**values: Any) -> None:
    """Heal a pruned model folder toward the dense model's next-token distribution (the step after prune)."""
    folder, model, output, overwrite = (values.pop(k) for k in ("folder", "model", "output", "overwrite"))
    try:
        settings = HealSettings(**values)
        check_output(output, overwrite, [folder], "--output")  # refused before anything loads
        from rich.markdown import Markdown

        from ghostlayers.jobs.runs import heal_recipe, heal_saved
        from ghostlayers.measure.report import heal_markdown

        heal_recipe(folder, model).check_heal_tokens(settings.tokens)  # before the models load
        summary = heal_saved(folder, settings, output, model, overwrite, console)
        if summary is None:  # a torchrun rank other than 0: it trained its share, rank 0 reports
            return
        console.print(Markdown("\n".join(heal_markdown(summary["heal"]))))
        console.print(f"saved the healed model to [bold]{output}[/]")
    except GhostLayersError as error:
        _fail(error)


app.command("heal")(
    _command(
        heal_command,
        [
            inspect.Parameter(
                "folder", KEYWORD, annotation=Annotated[Path, typer.Argument(help="A model folder ghostlayers pruned.")]
            ),
            _option("model", str | None, None, "The dense model to distil from (default: the folder's source model)."),
            *_options(HealSettings, skip=("seed", "accumulate")),
            _option("output", Path, ..., "Write the healed model folder (and its report) here."),
            OVERWRITE,
        ],
    )
)


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
        from ghostlayers.store.gguf import export_gguf

        with console.status(f"writing {output}"):
            export_gguf(model, output, dtype, overwrite)
        console.print(f"wrote [bold]{output}[/] ({dtype})")
    except GhostLayersError as error:
        _fail(error)


def print_summary(report: dict) -> None:
    """The run's tables (``report.markdown``, as in report.md) and, where the repair hurts, a warning."""
    from rich.markdown import Markdown

    from ghostlayers.measure.report import markdown

    console.print(Markdown(markdown(report)))  # the heal's section too
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
