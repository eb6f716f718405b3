"""Text sources on small local fixtures: files, folders, the archive extraction and its split."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from ghostlayers import corpora
from ghostlayers.errors import GhostLayersError


def fake_bigbench(path, contexts: list[str], articles: list[str]):
    """A tarball with the BIG-bench layout the extractor reads."""
    root = "bigbench-1.0.0/bigbench/benchmark_tasks/"
    files = {
        root + "squad_shifts/new_wiki_v1.0.json": {"data": [{"paragraphs": [{"context": c} for c in contexts]}]},
        root + "squad_shifts/squaddev_v1.1.json": {"data": [{"title": "t", "paragraphs": [{"context": contexts[0]}]}]},
        root + "gem/xsum/task.json": {"examples": [{"input": a, "target": "x"} for a in articles]},
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_offline_corpus_dedupes_and_splits_by_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    contexts = [f"Paragraph number {i} about a topic." for i in range(300)]
    archive = fake_bigbench(tmp_path / "bb.tar.gz", contexts + contexts[:50], ["Article one.", "Article two."])
    train = corpora.offline_corpus("wiki", "train", archive).split("\n\n")
    test = corpora.offline_corpus("wiki", "test", archive).split("\n\n")
    expected_test = [c for c in contexts if hashlib.sha1(c.encode()).digest()[0] < 26]
    assert test == expected_test and 10 < len(test) < 60
    assert train == [c for c in contexts if c not in expected_test]  # unique, in order, disjoint
    assert (tmp_path / "cache" / "corpora" / "wiki" / "train.txt").is_file()
    news = corpora.offline_corpus("news", "train", archive) + corpora.offline_corpus("news", "test", archive)
    assert "Article one." in news and "Article two." in news


def test_files_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("no")
    assert corpora.load_text(str(tmp_path), "test") == "first\n\nsecond"
    assert corpora.load_text(str(tmp_path / "a.txt"), "train") == "first"
    (tmp_path / "empty").mkdir()
    with pytest.raises(GhostLayersError, match="holds no .txt"):
        corpora.load_text(str(tmp_path / "empty"), "test")


def test_unknown_source_lists_the_choices():
    with pytest.raises(GhostLayersError, match="Unknown text source 'nonsense'.*wiki, news"):
        corpora.load_text("nonsense", "train")


def test_hub_corpus_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(GhostLayersError, match="needs the Hugging Face hub; offline, use one of wiki, news"):
        corpora.load_text("wikitext2", "test")
