"""Write a pruned model as a standard Hugging Face folder, atomically, and load it back.

The folder holds safetensors weights, the tokenizer, ``config.json`` (``model_type =
"ghostlayers_<base>"``, an ``auto_map`` and the ``ghostlayers`` record), a copy of
``modeling_ghostlayers.py`` and ``ghostlayers.json``, the list of files ghostlayers wrote there.
Every folder the tool writes (models and reports) is built in a hidden sibling folder that is swapped
into place at the end, so a failed or interrupted run never leaves a half-written output; an existing
folder is replaced only when it is empty or ``ghostlayers.json`` lists everything in it, so a file the
tool did not write is never deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ghostlayers import modeling_ghostlayers
from ghostlayers.errors import GhostLayersError
from ghostlayers.modeling_ghostlayers import ghost_classes
from ghostlayers.record import PruneRecord
from ghostlayers.surgery import plain_view

MANIFEST = "ghostlayers.json"


def _written_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def foreign_files(folder: Path) -> list[str] | None:
    """Files in ``folder`` that ghostlayers did not write there; None when it has no ghostlayers manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("written_by") != "ghostlayers":
        return None
    ours = set(manifest.get("files", [])) | {MANIFEST}
    return [f for f in _written_files(folder) if f not in ours]


def _protected(output: Path, source: Path | None) -> str | None:
    """Why ``output`` may never be replaced (it holds the source model, the working or home folder)."""
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if output == home:
        return "it is your home folder"
    if output == cwd:
        return "it is the current folder"
    if output in cwd.parents:
        return "it contains the current folder"
    if source is not None:
        if output == source:
            return "it is the source model's folder"
        if output in source.parents:
            return "it contains the source model's folder"
    return None


def check_output(
    output: str | Path, overwrite: bool, source: str | Path | None = None, option: str = "--output"
) -> Path:
    """Fail before any work if ``output`` exists and may not be replaced.

    Replaced only with ``overwrite``, and only an empty folder or one whose files ghostlayers wrote (its
    ``ghostlayers.json`` lists all of them); never the source model's folder, the current or home folder,
    or a folder containing either."""
    output = Path(output).expanduser()
    if not output.exists() and not output.is_symlink():
        return output
    resolved = output.resolve()
    source_dir = Path(source).expanduser().resolve() if source is not None and Path(source).exists() else None
    if (reason := _protected(resolved, source_dir)) is not None:
        raise GhostLayersError(f"{option} {output} cannot be replaced: {reason}. Choose a new folder.")
    if output.is_symlink() or not output.is_dir():
        raise GhostLayersError(f"{option} {output} exists and is not a folder: choose a new folder.")
    if not overwrite:
        raise GhostLayersError(f"{option} {output} already exists. Pass --overwrite to replace it.")
    if not any(output.iterdir()):
        return output
    foreign = foreign_files(output)
    if foreign is None:
        raise GhostLayersError(
            f"{option} {output} was not written by ghostlayers (it has no {MANIFEST}): it is left untouched. "
            "Choose a new folder, or move its contents away yourself."
        )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise GhostLayersError(
            f"{option} {output} holds files ghostlayers did not write ({shown}): it is left untouched. "
            "Choose a new folder, or move those files away yourself."
        )
    return output


def umask_permissions(written: Path) -> None:
    """Give a file, or a folder and everything in it, the permissions the umask asks for: ``mkdtemp`` and
    ``mkstemp`` make private ones, and so does transformers' safetensors writer."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [written, *(written.rglob("*") if written.is_dir() else [])]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_folder(
    output: str | Path,
    overwrite: bool = False,
    source: str | Path | None = None,
    option: str = "--output",
    manifest: dict | None = None,
) -> Iterator[Path]:
    """Yield a temporary folder beside ``output`` that becomes ``output`` only if the block succeeds. The
    old folder (one ``check_output`` allows replacing) is moved aside, the new one renamed into place, and
    only then the old one deleted. ``manifest`` adds entries to ``ghostlayers.json``."""
    output = check_output(output, overwrite, source, option).absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    old = None
    try:
        yield tmp
        listing = {"written_by": "ghostlayers", **(manifest or {}), "files": _written_files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(listing, indent=2) + "\n")
        umask_permissions(tmp)
        if output.exists():
            old = output.with_name(f".{output.name}.{os.getpid()}.old")
            os.replace(output, old)
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_finite_weights(model: PreTrainedModel) -> None:
    """Refuse to save a model with a non-finite weight (a broken operator or merged projection)."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise GhostLayersError(
            f"Not saved: {', '.join(bad[:3])} hold NaN or infinite values. The source weights or the fitted "
            "operator are broken; check that the source model is finite and use --dtype float32."
        )


def write_model_folder(model: PreTrainedModel, tokenizer, folder: Path) -> dict | None:
    """Save ``model`` (pruned by ``surgery.apply_pruning``) so it reloads with or without ghostlayers. A
    model with no stream operator is saved as a plain checkpoint of its base architecture, and its record
    returned for ``ghostlayers.json``; one with operators carries ``modeling_ghostlayers.py``."""
    record = PruneRecord.from_dict(model.config.ghostlayers, "this model")
    if record.needs_custom_module:
        model.save_pretrained(folder)
        shutil.copyfile(modeling_ghostlayers.__file__, folder / "modeling_ghostlayers.py")
    else:
        with plain_view(model):
            model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return None if record.needs_custom_module else record.to_dict()


def save(
    model: PreTrainedModel,
    tokenizer,
    output: str | Path,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the model folder atomically; ``extra(folder)`` may add files (reports) before the rename.
    ``source`` (the source model's folder) is never replaced."""
    check_finite_weights(model)
    record: dict = {}
    with atomic_folder(output, overwrite, source, manifest=record) as folder:
        plain = write_model_folder(model, tokenizer, folder)
        if plain is not None:
            record["record"] = plain
        if extra is not None:
            extra(folder)
    return Path(output)


def saved_record(path: str | Path) -> dict | None:
    """The pruning record of a folder: in ``config.json`` (needs the custom module) or, for a plain
    checkpoint, in ``ghostlayers.json``; None for a folder ghostlayers did not prune."""
    for name, key in (("config.json", "ghostlayers"), (MANIFEST, "record")):
        try:
            data = json.loads((Path(path) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            return data[key]
    return None


def is_pruned_folder(path: str | Path) -> bool:
    return saved_record(path) is not None


def from_pretrained_checked(model_class: type, path: str | Path, **kwargs) -> PreTrainedModel:
    """``model_class.from_pretrained`` that never runs a folder's code nor unpickles its weights, and refuses
    weights that do not fit the config: transformers would initialise missing tensors at random and drop
    unexpected ones, and the damaged model would be pruned and saved without a word."""
    model, info = model_class.from_pretrained(
        path, trust_remote_code=False, use_safetensors=True, output_loading_info=True, **kwargs
    )
    problems = [
        f"{len(info[key])} {key.split('_')[0]} tensors ({', '.join(sorted(map(str, info[key]))[:2])}, …)"
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if info.get(key)
    ]
    if problems:
        raise GhostLayersError(
            f"The weights of {path} do not fit its config.json: {'; '.join(problems)}. The folder is "
            "damaged or its config.json was edited: restore the model's own config and weights."
        )
    return model


def load(path: str | Path, **kwargs) -> PreTrainedModel:
    """Load a folder written by ``save`` (kwargs go to ``from_pretrained``, e.g. ``dtype``); a folder of a
    newer record format is refused."""
    data = saved_record(path)
    if data is None:
        raise GhostLayersError(f"{path} is not a ghostlayers model folder (no pruning record).")
    record = PruneRecord.from_dict(data, str(path))
    if record.needs_custom_module:
        try:
            return from_pretrained_checked(ghost_classes(record.base_model_type)[1], path, **kwargs)
        except (KeyError, AttributeError) as error:  # an unknown architecture, an operator host the model lacks
            raise GhostLayersError(
                f"{path}: its ghostlayers record does not fit the model ({error}). Prune the source model again."
            ) from error
    model = from_pretrained_checked(AutoModelForCausalLM, path, **kwargs)
    model.config.ghostlayers = data  # for reports; not saved back into a plain checkpoint
    return model
