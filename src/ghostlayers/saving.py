"""Write a pruned model as a standard Hugging Face folder, atomically, and load it back.

The folder holds safetensors weights, the tokenizer, ``config.json`` (``model_type =
"ghostlayers_<base>"``, an ``auto_map`` and the ``ghostlayers`` record) and a copy of
``modeling_ghostlayers.py``. Everything is written to a hidden sibling folder that is renamed into
place at the end, so a failed or interrupted run never leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import PreTrainedModel

from ghostlayers import modeling_ghostlayers
from ghostlayers.errors import GhostLayersError
from ghostlayers.modeling_ghostlayers import ghost_classes


def check_output(output: str | Path, overwrite: bool) -> Path:
    """Fail before any work if ``output`` exists and may not be replaced."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise GhostLayersError(f"Output folder {output} already exists. Pass --overwrite to replace it.")
    return output


@contextlib.contextmanager
def atomic_folder(output: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``output`` that becomes ``output`` only if the block succeeds."""
    output = check_output(output, overwrite).absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        yield tmp
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_model_folder(model: PreTrainedModel, tokenizer, folder: Path) -> None:
    """Save ``model`` (pruned by ``surgery.apply_pruning``) so it reloads with or without ghostlayers."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    shutil.copyfile(modeling_ghostlayers.__file__, folder / "modeling_ghostlayers.py")


def save(
    model: PreTrainedModel,
    tokenizer,
    output: str | Path,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write the model folder atomically; ``extra(folder)`` may add files (reports) before the rename."""
    with atomic_folder(output, overwrite) as folder:
        write_model_folder(model, tokenizer, folder)
        if extra is not None:
            extra(folder)
    return Path(output)


def is_pruned_folder(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and "ghostlayers" in json.loads(config.read_text())


def load(path: str | Path, **kwargs) -> PreTrainedModel:
    """Load a folder written by ``save`` (kwargs go to ``from_pretrained``, e.g. ``dtype``)."""
    if not is_pruned_folder(path):
        raise GhostLayersError(f"{path} is not a ghostlayers model folder (no 'ghostlayers' in config.json).")
    base = json.loads((Path(path) / "config.json").read_text())["ghostlayers"]["base_model_type"]
    return ghost_classes(base)[1].from_pretrained(path, **kwargs)
