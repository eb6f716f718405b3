"""Output folders' rules, light (no torch) so that the command line checks them before its heavy imports:
every folder the tool writes is built in a hidden sibling folder swapped into place at the end, and an
existing folder is replaced only when it is empty or ``ghostlayers.json`` lists everything in it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ghostlayers.errors import GhostLayersError

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
