"""``ghostlayers`` command line: ``prune`` (and the evaluation commands built on the same API)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ghostlayers import operators, selection
from ghostlayers.errors import GhostLayersError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


@app.callback()
def _group() -> None:
    """Remove decoder layers from a Hugging Face causal LM and repair them in closed form."""


def _fail(error: Exception) -> None:
    console.print(f"[bold red]error:[/] {error}")
    raise typer.Exit(code=2)


@app.command()
def prune(
    model: Annotated[str, typer.Option(help="Model folder, hub id, or bundled short name.")] = "smollm2-135m",
    layers: Annotated[
        str | None, typer.Option(help="Layers to remove: 12:18 (12..17) or 3,7,9 (original indices).")
    ] = None,
    select: Annotated[
        str | None, typer.Option(help=f"Selection criterion: {', '.join(selection.CRITERIA)}.")
    ] = None,
    num_layers: Annotated[int | None, typer.Option(help="How many layers --select removes.")] = None,
    method: Annotated[str, typer.Option(help=f"Recovery: {', '.join(operators.METHODS)}.")] = "ghost",
    calibration: Annotated[str, typer.Option(help="Calibration text: a file, a folder of .txt, or a corpus.")] = "wiki",
    num_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed for drawing the windows.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 4,
    ridge: Annotated[float, typer.Option(help="Ridge λ relative to trace(XᵀX)/C.")] = operators.DEFAULT_RIDGE,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16 or float64.")] = "float32",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1 ...")] = "auto",
    output: Annotated[Path | None, typer.Option(help="Write the pruned model folder here.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --output folder.")] = False,
) -> None:
    """Remove decoder layers and repair each removed block in closed form."""
    from ghostlayers.corpora import load_text
    from ghostlayers.data import batched, calibration_windows, tokenize
    from ghostlayers.loading import load_model_and_tokenizer
    from ghostlayers.pipeline import prune as run_prune
    from ghostlayers.saving import check_output, save

    try:
        if layers is None and select is None:
            select, num_layers = "streamline", num_layers or 4
        if output is not None:
            check_output(output, overwrite)
        start = time.perf_counter()
        with console.status(f"loading {model}"):
            lm, tokenizer = load_model_and_tokenizer(model, dtype, device)
            tokens = tokenize(tokenizer, load_text(calibration, "train"))
        windows = calibration_windows(tokens, num_samples, seq_len, seed)
        loaded = time.perf_counter()
        record = {
            "calibration": {
                "source": calibration,
                "num_samples": num_samples,
                "seq_len": seq_len,
                "seed": seed,
                "tokens": windows.numel(),
            },
            "source_model": model,
        }
        result = run_prune(
            lm,
            batched(windows, batch_size),
            layers=layers,
            select=select,
            num_layers=num_layers,
            method=method,
            ridge=ridge,
            record=record,
        )
        pruned = time.perf_counter()
        print_summary(result, load_seconds=loaded - start, prune_seconds=pruned - loaded)
        if output is not None:
            with console.status(f"writing {output}"):
                save(result.model, tokenizer, output, overwrite)
            console.print(f"saved to [bold]{output}[/]")
    except GhostLayersError as error:
        _fail(error)


def print_summary(result, load_seconds: float, prune_seconds: float) -> None:
    """Removed layers, parameter counts and every method's fit residual per boundary."""
    console.print(
        f"removed layers [bold]{result.removed}[/] with [bold]{result.method}[/]; parameters "
        f"{result.params_before / 1e6:.1f}M → {result.params_after / 1e6:.1f}M "
        f"({100 * (1 - result.params_after / result.params_before):.1f}% fewer); "
        f"load {load_seconds:.1f}s, calibrate+fit {prune_seconds:.1f}s ({result.passes} pass"
        f"{'es' if result.passes > 1 else ''})"
    )
    methods = [m for m in operators.METHODS if any(m in b.fit_quality for b in result.boundaries)]
    table = Table(title="relative residual ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ (lower is better)")
    table.add_column("removed block")
    for m in methods:
        table.add_column(m + (" *" if m == result.method else ""), justify="right")
    for b in result.boundaries:
        table.add_row(f"{b.pre}..{b.post - 1}", *(f"{b.fit_quality.get(m, float('nan')):.4f}" for m in methods))
    console.print(table)
