"""Text for calibration ("train") and perplexity ("test"): files, folders, offline corpora and hub corpora.

Offline corpora come from registry packages, so they work without the Hugging Face hub:

- ``wiki``: Wikipedia paragraphs, the contexts of SQuAD-shifts new_wiki and SQuAD v1.1 dev
  (``squad_shifts/{new_wiki_v1.0,squaddev_v1.1}.json`` in the BIG-bench sdist, PyPI ``bigbench==1.0.0``);
- ``news``: BBC articles, the inputs of BIG-bench ``gem/xsum/task.json``;
- ``austen``: the chapters of Jane Austen's six novels (Debian ``r-cran-janeaustenr``, its R lazy-load
  database read with the PyPI package ``rdata``), one line per paragraph.

Split rule: documents (paragraphs, articles, chapters) are stripped, their inner blank lines made single
line breaks, and de-duplicated in order of first appearance; a document is in **test** when the first byte
of the SHA-1 of its UTF-8 text is below 26 (about 10%), else in **train**. So the parts are disjoint,
stable across runs and machines, and a document's part does not depend on the others. Each part is cached
as ``<cache>/corpora/v2/<name>/<split>.txt``, documents joined by blank lines (so splitting the text at
blank lines gives the documents back), and the 358 MB archive is read once.

Hub corpora follow the GPTQ protocol and need the hub: ``wikitext2`` (wikitext-2-raw-v1, lines joined by
blank lines), ``ptb`` (ptb_text_only; "test" is its validation split, as in GPTQ; sentences joined by
spaces), ``c4`` (allenai/c4 en: "train" the first 10,000 documents of train shard 00000-of-01024, "test"
the first 1,100 of validation shard 00000-of-00008, as in GPTQ; documents joined by spaces).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import stat
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from ghostlayers.errors import GhostLayersError
from ghostlayers.sources.fetch import apt_download, bigbench_archive, ghostlayers_cache_dir, offline_hub

AUSTEN = "r-cran-janeaustenr"
_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"
BIGBENCH_MEMBERS = {
    "wiki": ("squad_shifts/new_wiki_v1.0.json", "squad_shifts/squaddev_v1.1.json"),
    "news": ("gem/xsum/task.json",),
}
OFFLINE = (*BIGBENCH_MEMBERS, "austen")
HUB = ("wikitext2", "ptb", "c4")
SPLITS = ("train", "test")
CACHE_VERSION = 2  # bump when documents or the split rule change: the cache folder is named after it
C4_DOCUMENTS = {"train": 10_000, "test": 1_100}
_CHAPTER = re.compile(r"chapter [\divxlc]+\b", re.I)
_VOLUME = re.compile(r"volume [ivx]+", re.I)
_BLANK_LINES = re.compile(r"\n\s*\n")


def bigbench_documents(archive: Path) -> dict[str, list[str]]:
    """Documents of every BIG-bench corpus, in one pass over the archive (gzip cannot seek)."""
    wanted = {_TASKS + m for members in BIGBENCH_MEMBERS.values() for m in members}
    found: dict[str, list[str]] = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.name in wanted:
                data = json.load(tar.extractfile(member))
                if "data" in data:  # SQuAD: articles of paragraphs, each context shared by its questions
                    found[member.name] = [p["context"] for a in data["data"] for p in a["paragraphs"]]
                else:
                    found[member.name] = [example["input"] for example in data["examples"]]
    if missing := sorted(wanted - set(found)):
        raise GhostLayersError(f"{archive} lacks {missing}: delete it so that it is downloaded again.")
    return {name: [d for m in members for d in found[_TASKS + m]] for name, members in BIGBENCH_MEMBERS.items()}


def austen_chapters(lines: Iterable[str]) -> list[str]:
    """A novel's lines as chapters: the text after each chapter heading (title pages and volume headings
    dropped), its hard-wrapped lines joined into one line per paragraph."""
    chapters: list[list[str]] = []
    for line in lines:
        if _CHAPTER.fullmatch(line.strip()):
            chapters.append([])
        elif chapters and not _VOLUME.fullmatch(line.strip()):
            chapters[-1].append(line)
    paragraphs = (_BLANK_LINES.split("\n".join(c)) for c in chapters)
    return ["\n".join(" ".join(p.split()) for p in ps if p.strip()) for ps in paragraphs]


def austen_documents(deb: Path) -> list[str]:
    """Chapters of the six novels in janeaustenr's data: an R lazy-load database, whose index (``.rdx``)
    maps each novel to an (offset, length) record in ``.rdb``: a 4-byte length, then a zlib stream of an
    R-serialized character vector, one element per line of the book."""
    try:
        import rdata
    except ImportError as error:
        raise GhostLayersError("The 'austen' corpus needs the PyPI package rdata: `pip install rdata`.") from error
    with tempfile.TemporaryDirectory() as work:
        try:
            subprocess.run(["dpkg", "-x", str(deb), work], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as error:
            raise GhostLayersError(
                f"Could not unpack {deb} with dpkg ({getattr(error, 'stderr', None) or error}): the 'austen' "
                "corpus needs a Debian-based system; use wiki, news or a text file path instead."
            ) from error
        data = Path(work) / "usr/lib/R/site-library/janeaustenr/data"
        if not (data / "Rdata.rdx").is_file():
            raise GhostLayersError(f"{deb} holds no janeaustenr/data/Rdata.rdx: delete it to download it again.")
        index = rdata.read_rds(data / "Rdata.rdx")
        blob = (data / "Rdata.rdb").read_bytes()
    documents = []
    for offset, length in index["variables"].values():
        record = zlib.decompress(blob[int(offset) + 4 : int(offset) + int(length)])
        lines = rdata.conversion.convert(rdata.parser.parse_data(record, extension=".rds"))
        documents += austen_chapters(str(line) for line in lines)
    return documents


def split_documents(documents: Iterable[str]) -> dict[str, list[str]]:
    """Unique, normalized documents divided into disjoint train and test parts by the hash rule above."""
    parts: dict[str, list[str]] = {split: [] for split in SPLITS}
    for doc in dict.fromkeys(_BLANK_LINES.sub("\n", d.strip()) for d in documents):
        if doc:
            parts["test" if hashlib.sha1(doc.encode()).digest()[0] < 26 else "train"].append(doc)
    return parts


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise GhostLayersError(f"Unknown split '{split}': use 'train' (calibration) or 'test' (perplexity).")


def _write_parts(name: str, documents: Iterable[str]) -> None:
    folder = ghostlayers_cache_dir() / "corpora" / f"v{CACHE_VERSION}" / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, docs in split_documents(documents).items():
        tmp = folder / f".{split}.txt.partial"
        tmp.write_text("\n\n".join(docs), encoding="utf-8")
        tmp.replace(folder / f"{split}.txt")  # atomic: readers never see half a file


def offline_corpus(name: str, split: str, source: Path | None = None) -> str:
    """``split`` of an offline corpus, extracted from ``source`` (the BIG-bench sdist or the janeaustenr
    .deb; fetched when not given) on first use, then read from the cache."""
    _check_split(split)
    folder = ghostlayers_cache_dir() / "corpora" / f"v{CACHE_VERSION}" / name
    if not all((folder / f"{s}.txt").is_file() for s in SPLITS):
        if name == "austen":
            _write_parts(name, austen_documents(source or apt_download(AUSTEN)))
        else:
            for corpus, documents in bigbench_documents(source or bigbench_archive()).items():
                _write_parts(corpus, documents)
    return (folder / f"{split}.txt").read_text(encoding="utf-8")


def _hub_reachable() -> bool:
    """One quick request without retries: offline, ``load_dataset`` retries each request for ~30 s."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception:  # any transport error means no hub
        return False
    return True


def hub_corpus(name: str, split: str) -> str:
    """A GPTQ-protocol hub corpus; with the hub unreachable, only a copy in the datasets cache is used."""
    from datasets import load_dataset

    if name == "wikitext2":
        args, column, sep = {"path": "wikitext", "name": "wikitext-2-raw-v1", "split": split}, "text", "\n\n"
    elif name == "ptb":
        hf_split = "validation" if split == "test" else split
        args, column, sep = {"path": "ptb_text_only", "name": "penn_treebank", "split": hf_split}, "sentence", " "
    else:
        hf_split = "validation" if split == "test" else "train"
        shard = f"en/c4-{hf_split}.00000-of-{'01024' if hf_split == 'train' else '00008'}.json.gz"
        args, column, sep = {"path": "allenai/c4", "data_files": {hf_split: shard}, "split": hf_split}, "text", " "
    try:
        with contextlib.nullcontext() if _hub_reachable() else offline_hub():
            data = load_dataset(**args)
    except Exception as error:  # datasets raises many types when the hub is unreachable
        raise GhostLayersError(
            f"Could not load the hub corpus '{name}' ({type(error).__name__}: {str(error)[:200]}). It needs the "
            f"Hugging Face hub; offline, use one of {', '.join(OFFLINE)} or a text file path."
        ) from error
    if name == "c4":
        data = data.select(range(min(C4_DOCUMENTS[split], len(data))))
    return sep.join(data[column])


MAX_TEXT_BYTES = 1 << 30


def read_text_file(path: Path, encoding: str = "utf-8") -> str:
    """A user's text file, or an error naming the file, the first undecodable byte and ``--encoding``. Only a
    regular file (reading a FIFO blocks, a link to /dev/zero never ends) of at most ``MAX_TEXT_BYTES``."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise GhostLayersError(f"{path} is not a regular file (a pipe, device or socket): give a text file.")
        if info.st_size > MAX_TEXT_BYTES:
            raise GhostLayersError(
                f"{path} holds {info.st_size / 2**20:.0f} MiB: text files are read whole, up to "
                f"{MAX_TEXT_BYTES >> 20} MiB, far more than calibration or perplexity needs. Give a part of it."
            )
        text = path.read_bytes().decode(encoding)
    except LookupError as error:
        raise GhostLayersError(f"--encoding {encoding} is not a known text encoding (e.g. utf-8, latin-1).") from error
    except UnicodeDecodeError as error:
        raise GhostLayersError(
            f"{path} is not valid {encoding}: the byte 0x{error.object[error.start]:02x} at offset {error.start} "
            "cannot be decoded. Pass the file's encoding with --encoding (e.g. --encoding latin-1)."
        ) from error
    except OSError as error:
        raise GhostLayersError(f"Cannot read {path}: {error.strerror}.") from error
    if "\0" in text:  # a binary or sparse file: one endless "word" a tokenizer needs gigabytes for
        raise GhostLayersError(f"{path} holds NUL characters: it is not a text file.")
    return text


def local_text(source: str) -> Path | None:
    """The resolved file or folder ``source`` names, None for a corpus name."""
    path = Path(source).expanduser()
    return path.resolve() if path.exists() else None


MIX = "mix"


def calibration_sources(spec: str) -> list[str]:
    """The sources of a ``--calibration`` value: comma-separated files, folders or corpora, where ``mix``
    stands for the train parts of every offline corpus (wiki, news, austen)."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    expanded = [n for name in names for n in (OFFLINE if name == MIX else (name,))]
    if not expanded:
        raise GhostLayersError("--calibration is empty: give a corpus (e.g. wiki or mix), a text file or a folder.")
    return list(dict.fromkeys(expanded))


def calibration_texts(spec: str, encoding: str = "utf-8") -> tuple[dict[str, str], list[str]]:
    """The train text of every ``--calibration`` source, and notes for the log. A corpus that ``mix`` stands
    for but this machine cannot fetch (austen needs ``apt-get download``: Debian-based systems only) is left
    out with a note, so the default works everywhere; a source named explicitly must load."""
    named = {part.strip() for part in spec.split(",")}
    texts, notes = {}, []
    for source in calibration_sources(spec):
        try:
            texts[source] = load_text(source, "train", encoding)
        except GhostLayersError as error:
            if source in named or MIX not in named:
                raise
            notes.append(f"mix: {source} is left out of the calibration text ({error})")
    if not texts:
        raise GhostLayersError(f"None of the corpora of mix could be fetched: {'; '.join(notes)}")
    return texts, notes


def load_text(source: str, split: str, encoding: str = "utf-8") -> str:
    """Text of ``source`` for ``split`` ("train": calibration, "test": perplexity): a text file (whole,
    whatever the split, read as ``encoding``), a folder of .txt files (sorted, joined by blank lines), or
    a corpus name."""
    _check_split(split)
    path = Path(source).expanduser()
    if path.exists() and not path.is_dir():
        return read_text_file(path, encoding)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise GhostLayersError(f"Folder {path} holds no .txt files: put the text in .txt files there.")
        return "\n\n".join(read_text_file(f, encoding) for f in files)
    if source in OFFLINE:
        return offline_corpus(source, split)
    if source in HUB:
        return hub_corpus(source, split)
    raise GhostLayersError(
        f"Unknown text source '{source}': give a text file, a folder of .txt files, an offline corpus "
        f"({', '.join(OFFLINE)}) or a hub corpus ({', '.join(HUB)})."
    )
