"""Output folders, light (no torch), so that the command line checks them before its heavy imports.

Every folder the tool writes (models and reports) is claimed before the work (``Claim``: checked, locked,
its parent proven writable), built in a hidden sibling folder and swapped into place at the end, so a
failed, interrupted or killed run never leaves a half-written output nor loses the old one; an existing
folder is replaced only with ``--overwrite``, and only when it is empty or ``ghostlayers.json`` lists
everything in it, so a file the tool did not write is never deleted, and a report never replaces a model.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from safetensors import SafetensorError

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.reading import read_json

MANIFEST = "ghostlayers.json"


def _entries(folder: Path) -> list[str]:
    """What deleting ``folder`` would delete, relative to it: every file, symlink and empty subfolder."""
    found = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        found += [here / name for name in files + [d for d in dirs if (here / d).is_symlink()]]
        if not dirs and not files and here != folder:
            found.append(here)
    return sorted(str(p.relative_to(folder)) for p in found)


def _manifest(folder: Path) -> dict | None:
    try:
        manifest = read_json(folder / MANIFEST)
    except GhostLayersError:
        return None
    return manifest if manifest.get("written_by") == "ghostlayers" else None


def foreign_files(folder: Path) -> list[str] | None:
    """Entries of ``folder`` that ghostlayers did not write there (a symlink or an empty subfolder always:
    it writes neither); None when it has no ghostlayers manifest."""
    manifest = _manifest(folder)
    if manifest is None:
        return None
    files = manifest.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise GhostLayersError(
            f"{folder / MANIFEST} is damaged: its files are {str(files)[:60]}, not a list of file names, so what "
            "ghostlayers wrote there is unknown and the folder is left untouched. Choose a new folder, or move it "
            "away yourself."
        )
    ours = set(files) | {MANIFEST}
    return [f for f in _entries(folder) if f not in ours or (folder / f).is_symlink() or (folder / f).is_dir()]


def _protected(output: Path, inputs: list[Path]) -> str | None:
    """Why ``output`` may never be replaced (it is or holds an input of the run, the working or home folder)."""
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if output == home:
        return "it is your home folder"
    if output == cwd:
        return "it is the current folder"
    if output in cwd.parents:
        return "it contains the current folder"
    for given in inputs:
        if output == given:
            return f"it is an input of this run ({given})"
        if output in given.parents:
            return f"it contains an input of this run ({given})"
    return None


def check_output(
    output: str | Path,
    overwrite: bool,
    inputs: Iterable[str | Path] = (),
    option: str = "--output",
    report: bool = False,
) -> Path:
    """Fail if ``output`` exists and may not be replaced; the one rule for every folder the tool writes.

    Replaced only with ``overwrite``, and only an empty folder or one whose entries ghostlayers wrote (its
    ``ghostlayers.json`` lists all of them), and by a ``report`` only a report folder; never an input (the
    source model, a compared run), the current or home folder, or a folder containing one."""
    output = Path(output).expanduser()
    given = [Path(p).expanduser().resolve() for p in inputs if Path(p).expanduser().exists()]
    if inside := next((g for g in given if g.is_dir() and g in output.resolve().parents), None):
        raise GhostLayersError(
            f"{option} {output} is inside {inside}, an input of this run: write outside it, so the input keeps "
            "only its own files. Choose another folder."
        )
    if not output.exists() and not output.is_symlink():
        return output
    if (reason := _protected(output.resolve(), given)) is not None:
        raise GhostLayersError(f"{option} {output} cannot be replaced: {reason}. Choose a new folder.")
    if output.is_symlink() or not output.is_dir():
        raise GhostLayersError(f"{option} {output} exists and is not a folder: choose a new folder.")
    if not overwrite:
        raise GhostLayersError(f"{option} {output} already exists. Pass --overwrite to replace it.")
    if not _entries(output):
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
            f"{option} {output} holds entries ghostlayers did not write ({shown}): it is left untouched. "
            "Choose a new folder, or move those away yourself."
        )
    if report and _manifest(output).get("kind") != "report":
        raise GhostLayersError(
            f"{option} {output} holds a model, not a report: a report never replaces it. Choose a new folder."
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
def written_privately(folder: Path) -> Iterator[Path]:
    """A private folder (``mkdtemp``: no one else may write in it) inside ``folder``, for writers that open their
    files by name and follow links (transformers' ``save_pretrained``); afterwards its entries move into ``folder``
    with the umask's permissions, each by rename (which never follows a link) and only to a name still free."""
    private = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder))
    try:
        yield private
        umask_permissions(private)
        for entry in sorted(private.iterdir()):
            target = folder / entry.name
            if os.path.lexists(target):
                kind = "is a symbolic link" if target.is_symlink() else "already exists"
                raise GhostLayersError(
                    f"{target} {kind}, which ghostlayers never makes there: it does not write through or over it."
                )
            entry.rename(target)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def open_new(path: Path, replace: bool = False) -> BinaryIO:
    """``path``, in a folder the tool is writing, opened as a file made new (``O_EXCL | O_NOFOLLOW``): never
    written through a link planted at that name, nor into anything else found there. ``replace`` first removes
    a plain file the tool wrote there itself (a config transformers wrote, rewritten)."""
    if replace and path.is_file() and not path.is_symlink():
        path.unlink()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        kind = "is a symbolic link" if path.is_symlink() else "already exists"
        raise GhostLayersError(
            f"{path} {kind}, which ghostlayers never makes there: it does not write through or over it."
        ) from None
    return os.fdopen(fd, "wb")


def write_text_nofollow(path: Path, text: str, replace: bool = False) -> None:
    """Write ``text`` to ``path`` as a new file (``open_new``)."""
    with open_new(path, replace) as handle:
        handle.write(text.encode())


def save_figure(figure: Any, path: Path, dpi: int) -> None:
    """A matplotlib figure saved as a new PNG (``open_new``: matplotlib would write through a link), then closed."""
    import matplotlib.pyplot as plt

    try:
        with open_new(path) as handle:
            figure.savefig(handle, format="png", dpi=dpi)
    finally:
        plt.close(figure)


class RunLock:
    """The lock file ``.NAME.ghostlayers-lock`` beside an output, flocked while a run writes it: a second run on
    the same output is refused, naming the holder's process, and a killed run's lock frees itself. Opened never
    through a link and only as a regular file (``planted`` makes the error for what is there instead)."""

    def __init__(self, path: Path, what: str, planted: Callable[[Path], GhostLayersError]) -> None:
        self.path, self.what, self.planted = path, what, planted
        self.fd: int | None = None

    def take(self) -> None:
        while self.fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise GhostLayersError(
                    f"{self.what} is being written by another ghostlayers run (process {holder}): wait for it to "
                    "finish, or choose another folder."
                ) from None
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                self.fd = fd  # else the run that held it finished and removed it meanwhile: lock the new one
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            else:
                os.close(fd)

    def _open(self) -> int:
        """The lock file, never through a link (``O_NOFOLLOW``: one planted since the claim looked fails here
        too) and only a regular file (a FIFO or device there is someone else's)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EISDIR):
                raise self.planted(self.path) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self.planted(self.path)
        return fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self.fd)
            self.fd = None


class Claim:
    """The right to write one output folder, taken before the long work so that a refusal costs nothing.

    Entering checks ``check_output``'s rule, makes the missing parents and proves them writable with the
    lock file beside the output (``RunLock``), then puts right what a killed run left there
    (``_recover``). ``folder()`` writes the output; leaving removes the lock and, when nothing was written,
    the parents it made."""

    def __init__(
        self,
        output: str | Path,
        overwrite: bool = False,
        inputs: Iterable[str | Path] = (),
        option: str = "--output",
        report: bool = False,
    ) -> None:
        self.rule = (overwrite, tuple(inputs), option, report)
        self.output = check_output(output, *self.rule).absolute()
        self.option, self.report = option, report
        self.partial, self.old, lock = (
            self.output.with_name(f".{self.output.name}.ghostlayers-{part}") for part in ("partial", "old", "lock")
        )
        self.lock = RunLock(lock, f"{option} {self.output}", self._planted)
        self.made: list[Path] = []

    def __enter__(self) -> Claim:
        try:
            with self._write_errors():
                for parent in reversed(self.output.parents):
                    if not parent.exists():
                        parent.mkdir()
                        self.made.append(parent)
                self._refuse_planted()
                self.lock.take()
                self._refuse_planted()
                self._recover()
            check_output(self.output, *self.rule)
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _planted(self, path: Path) -> GhostLayersError:
        kind = "a symbolic link" if path.is_symlink() else "not a plain file" if path == self.lock.path else ""
        return GhostLayersError(
            f"{path} is {kind or 'not a folder'}, which ghostlayers never makes there, and it will not write "
            f"through or remove it: {self.option} {self.output} is left untouched. Remove it yourself, or choose "
            "another folder."
        )

    def _refuse_planted(self) -> None:
        """What sits at the names the claim writes beside the output and that no run of the tool made (a
        link, a file where a folder goes) is refused, never followed nor removed."""
        for path in (self.lock.path, self.partial, self.old):
            if path.is_symlink() or (path != self.lock.path and path.exists() and not path.is_dir()):
                raise self._planted(path)

    def _recover(self) -> None:
        """What a killed run on this output left: its half-written folder goes; its old copy comes back when
        the swap stopped between the two renames, and goes when it stopped after them."""
        shutil.rmtree(self.partial, ignore_errors=True)
        if self.old.exists():
            if self.output.exists() or self.output.is_symlink():
                shutil.rmtree(self.old)
            else:
                os.replace(self.old, self.output)

    def release(self) -> None:
        self.lock.release()
        for parent in reversed(self.made):
            with contextlib.suppress(OSError):  # only while empty: a run that wrote nothing leaves no folder
                parent.rmdir()

    @contextlib.contextmanager
    def _write_errors(self) -> Iterator[None]:
        """A failed write (disk full, read-only, a parent that is a file) as one message, not a traceback."""
        try:
            yield
        except (OSError, SafetensorError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            where = f" ({error.filename})" if getattr(error, "filename", None) else ""
            raise GhostLayersError(
                f"Cannot write {self.option} {self.output}: {reason}{where}. Nothing there was changed."
            ) from error

    @contextlib.contextmanager
    def folder(self, manifest: dict | None = None) -> Iterator[Path]:
        """Yield the hidden folder ``.NAME.ghostlayers-partial``, which becomes the output only if the block
        succeeds: ``ghostlayers.json`` (plus ``manifest``) is added, the rule checked again (something may
        have appeared at the output meanwhile) and the folders swapped."""
        with self._write_errors():
            try:
                self.partial.mkdir()
                yield self.partial
                kind = "report" if self.report else "model"
                listing = {"written_by": "ghostlayers", "kind": kind, **(manifest or {})}
                listing["files"] = _entries(self.partial)
                if link := next((f for f in listing["files"] if (self.partial / f).is_symlink()), None):
                    raise GhostLayersError(
                        f"{self.partial / link} is a symbolic link, which ghostlayers never makes: it is not "
                        f"saved as part of {self.option} {self.output}, which is left untouched."
                    )
                write_text_nofollow(self.partial / MANIFEST, json.dumps(listing, indent=2) + "\n")
                umask_permissions(self.partial)
                check_output(self.output, *self.rule)
                self._swap()
            finally:
                shutil.rmtree(self.partial, ignore_errors=True)

    def _swap(self) -> None:
        """Old folder aside, new one in, old one deleted. An interruption between the two renames puts the
        old folder back; a kill there is put right by the next claim."""
        try:
            if self.output.exists():
                os.replace(self.output, self.old)
            os.replace(self.partial, self.output)
        except BaseException:
            if self.old.exists() and not self.output.exists():
                os.replace(self.old, self.output)
            raise
        shutil.rmtree(self.old, ignore_errors=True)
        self.rule = (True, *self.rule[1:])  # what this claim wrote, it may write again (a sweep, cell by cell)
