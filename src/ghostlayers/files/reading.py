"""The one reader for the small files the tool parses itself (config.json, ghostlayers.json, tokenizer.json,
recipes, report.json, cache metadata): a file planted or damaged on disk ends in one ``GhostLayersError``.

Only a regular file is read (a FIFO would block for ever, a link to /dev/zero never ends, a folder is no
file), at most ``limit`` bytes of it; parsed JSON or TOML is at most ``MAX_DEPTH`` deep (Python's parsers
recurse and would end in a RecursionError) and of the expected top-level type. Links are followed: a Hugging
Face cache folder is made of links to its blobs.
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import BinaryIO

from ghostlayers.errors import GhostLayersError

METADATA_BYTES = 16 << 20  # a config, record, recipe or report is kilobytes; a report of many runs, megabytes
TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json files (Gemma 3) are about 33 MiB
MAX_DEPTH = 64


def _cap(name: str) -> str:
    return name[:1].upper() + name[1:]


def open_regular(path: str | Path, what: str = "") -> BinaryIO:
    """``path`` opened for reading in binary, only if it is a regular file (opening a FIFO never blocks)."""
    path, name = Path(path), f"{what} {path}".strip()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise GhostLayersError(f"Cannot read {name}: {error.strerror}.") from error
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a pipe, device or socket"
        raise GhostLayersError(f"{_cap(name)} is {kind}, not a regular file: restore the file.")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | Path, what: str = "", limit: int = METADATA_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (``what`` names it in errors), refused beyond ``limit``."""
    name = f"{what} {path}".strip()
    with open_regular(path, what) as handle:
        try:
            size = os.fstat(handle.fileno()).st_size
            if size > limit:
                raise GhostLayersError(f"{_cap(name)} holds {size:,} bytes, more than such a file may ({limit:,}).")
            data = handle.read(limit + 1)
        except OSError as error:
            raise GhostLayersError(f"Cannot read {name}: {error.strerror or error}.") from error
    if len(data) > limit:  # it grew while read
        raise GhostLayersError(f"{_cap(name)} holds more than the {limit:,} bytes such a file may.")
    return data


def read_text(path: str | Path, what: str = "", limit: int = METADATA_BYTES, encoding: str = "utf-8") -> str:
    """The text of the regular file ``path``, decoded, without NUL characters (a binary file)."""
    name = f"{what} {path}".strip()
    try:
        text = read_bytes(path, what, limit).decode(encoding)
    except UnicodeDecodeError as error:
        raise GhostLayersError(f"{_cap(name)} is not valid {encoding} text (byte offset {error.start}).") from error
    if "\0" in text:
        raise GhostLayersError(f"{_cap(name)} holds NUL characters: it is not a text file.")
    return text


def depth(value: object) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                break
            stack += [(child, level + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def parse(text: str, toml: bool, name: str, kind: type = dict) -> object:
    """``text`` parsed as TOML or JSON, checked for depth and top-level type."""
    language, too_deep = "TOML" if toml else "JSON", f"{_cap(name)} nests deeper than {MAX_DEPTH} levels."
    try:
        data = tomllib.loads(text) if toml else json.loads(text)
    except RecursionError:
        raise GhostLayersError(too_deep) from None
    except ValueError as error:
        reason = " ".join(str(error).split())[:200]
        raise GhostLayersError(f"{_cap(name)} is not valid {language} ({reason}).") from error
    if depth(data) > MAX_DEPTH:
        raise GhostLayersError(too_deep)
    if not isinstance(data, kind):
        expected = "an object" if kind is dict else kind.__name__
        raise GhostLayersError(f"{_cap(name)} holds a {type(data).__name__}, where {expected} is expected.")
    return data


def read_json(path: str | Path, what: str = "", limit: int = METADATA_BYTES, kind: type = dict) -> object:
    """The JSON file ``path`` (a dict unless ``kind`` says otherwise), bounded as ``read_bytes``."""
    return parse(read_text(path, what, limit), False, f"{what} {path}".strip(), kind)


def read_toml(path: str | Path, what: str = "", limit: int = METADATA_BYTES) -> dict:
    """The TOML file ``path``, bounded as ``read_bytes``; an empty one (valid TOML, all defaults) is refused:
    every TOML file the tool reads says something, and an empty one was cut short."""
    text, name = read_text(path, what, limit), f"{what} {path}".strip()
    if not text.strip():
        raise GhostLayersError(f"{_cap(name)} is empty: give a file that holds its settings.")
    return parse(text, True, name, dict)
