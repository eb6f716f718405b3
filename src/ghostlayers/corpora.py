"""Text for calibration and perplexity: files, folders, offline corpora from PyPI, and hub corpora.

Offline corpora come from the BIG-bench source archive on PyPI (``bigbench==1.0.0``, read in place):
``wiki`` is the Wikipedia paragraphs of SQuAD-shifts (new_wiki) and SQuAD dev, ``news`` the BBC articles
of GEM/XSum. Documents are de-duplicated in order of first appearance; a document belongs to the
**test** part when the first byte of its SHA-1 is below 26 (about 10%), else to **train**, so the parts
are disjoint, stable, and independent of how many documents there are. Each part is cached as text.

Hub corpora follow the GPTQ protocol and need the hub: ``wikitext2`` (wikitext-2-raw-v1, documents
joined with blank lines), ``ptb`` (ptb_text_only, sentences joined with spaces), ``c4`` (allenai/c4 en,
first train shard / first validation shard, documents joined with spaces).
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

from ghostlayers.cache import cache_dir, pip_download
from ghostlayers.errors import GhostLayersError

BIGBENCH = ("bigbench==1.0.0", "bigbench-1.0.0.tar.gz")
_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"
OFFLINE = {
    "wiki": ("squad_shifts/new_wiki_v1.0.json", "squad_shifts/squaddev_v1.1.json"),
    "news": ("gem/xsum/task.json",),
}
HUB = ("wikitext2", "ptb", "c4")


def bigbench_archive() -> Path:
    return pip_download(*BIGBENCH)


def _documents(archive: Path, members: tuple[str, ...]) -> Iterator[str]:
    """SQuAD-style contexts or BIG-bench example inputs of ``members``, in archive order."""
    wanted = {_TASKS + m for m in members}
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.name not in wanted:
                continue
            data = json.load(tar.extractfile(member))
            if "data" in data:
                yield from (p["context"] for article in data["data"] for p in article["paragraphs"])
            else:
                yield from (example["input"] for example in data["examples"])


def is_test(document: str) -> bool:
    return hashlib.sha1(document.encode()).digest()[0] < 26


def split_documents(documents: Iterator[str]) -> dict[str, list[str]]:
    """Unique, stripped documents divided into disjoint train and test parts by hash."""
    parts: dict[str, list[str]] = {"train": [], "test": []}
    seen: set[str] = set()
    for doc in documents:
        doc = doc.strip()
        if doc and doc not in seen:
            seen.add(doc)
            parts["test" if is_test(doc) else "train"].append(doc)
    return parts


def offline_corpus(name: str, split: str, archive: Path | None = None) -> str:
    folder = cache_dir() / "corpora" / name
    path = folder / f"{split}.txt"
    if not path.is_file():
        parts = split_documents(_documents(archive or bigbench_archive(), OFFLINE[name]))
        folder.mkdir(parents=True, exist_ok=True)
        for part, docs in parts.items():
            tmp = folder / f".{part}.txt.partial"
            tmp.write_text("\n\n".join(docs))
            tmp.replace(folder / f"{part}.txt")
    return path.read_text()


def hub_corpus(name: str, split: str) -> str:
    try:
        from datasets import load_dataset

        if name == "wikitext2":
            data = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
            return "\n\n".join(data["text"])
        if name == "ptb":
            data = load_dataset("ptb_text_only", "penn_treebank", split="validation" if split == "test" else split)
            return " ".join(data["sentence"])
        shard = "en/c4-train.00000-of-01024.json.gz" if split == "train" else "en/c4-validation.00000-of-00008.json.gz"
        data = load_dataset("allenai/c4", data_files={split: shard}, split=split)
        return " ".join(data["text"][:1100] if split == "test" else data["text"])
    except Exception as error:  # datasets raises many types when the hub is unreachable
        raise GhostLayersError(
            f"Could not load the hub corpus '{name}' ({type(error).__name__}: {str(error)[:200]}). It needs the "
            f"Hugging Face hub; offline, use one of {', '.join(OFFLINE)} or a text file path."
        ) from error


def load_text(source: str, split: str) -> str:
    """Text of ``source`` for ``split`` ("train": calibration, "test": perplexity)."""
    path = Path(source)
    if path.is_file():
        return path.read_text()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise GhostLayersError(f"Folder {path} holds no .txt files.")
        return "\n\n".join(f.read_text() for f in files)
    if source in OFFLINE:
        return offline_corpus(source, split)
    if source in HUB:
        return hub_corpus(source, split)
    raise GhostLayersError(
        f"Unknown text source '{source}': give a text file, a folder of .txt files, an offline corpus "
        f"({', '.join(OFFLINE)}) or a hub corpus ({', '.join(HUB)})."
    )
