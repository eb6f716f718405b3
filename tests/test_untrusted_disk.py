"""Nothing on disk is trusted: a link planted at any name the tool writes is never written through, and every
small file it parses (config, record, recipe, report, tokenizer) made a FIFO, a link to /dev/zero, a folder,
empty, truncated, deeply nested or mistyped ends in one ``GhostLayersError`` (one ``error:`` line at the
command line), quickly."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import random_batches, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.errors import GhostLayersError

runner = CliRunner()
PLANTED_BESIDE = ["lock", "partial", "old"]


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): (
            f"-> {os.readlink(p)}"
            if p.is_symlink()
            else hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file()
            else "dir"
        )
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def plain() -> object:
    """A tiny llama with layers 2 and 3 removed and no repair: saved as a plain checkpoint, whose config.json
    the tool rewrites after transformers wrote it."""
    return ghostlayers.prune(tiny_model("llama"), random_batches(), layers="2:4", method="none", progress=False).model


def _victims(tmp_path: Path) -> tuple[Path, Path]:
    """A file of someone else's, and a name outside the output's folder that must not come to exist."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("precious\n")
    return elsewhere / "precious.txt", elsewhere / "made-by-a-dangling-link"


@pytest.mark.parametrize("dangling", [False, True], ids=["link-to-a-file", "dangling-link"])
@pytest.mark.parametrize("name", PLANTED_BESIDE)
def test_a_link_planted_beside_the_output_is_refused_and_never_written_through(plain, tmp_path, name, dangling):
    precious, absent = _victims(tmp_path)
    place = tmp_path / "place"
    place.mkdir()
    (place / f".out.ghostlayers-{name}").symlink_to(absent if dangling else precious)
    before = _tree(tmp_path)
    with pytest.raises(GhostLayersError, match="symbolic link"):
        ghostlayers.save(plain, tiny_tokenizer(), place / "out")
    assert precious.read_text() == "precious\n" and not absent.exists()
    assert _tree(tmp_path) == before  # the link is left, nothing was made


def test_a_fifo_or_folder_at_the_lock_is_refused(plain, tmp_path):
    for make in (os.mkfifo, os.mkdir):
        place = tmp_path / make.__name__
        place.mkdir()
        make(place / ".out.ghostlayers-lock")
        with pytest.raises(GhostLayersError, match="ghostlayers never makes there"):
            ghostlayers.save(plain, tiny_tokenizer(), place / "out")
        assert sorted(p.name for p in place.iterdir()) == [".out.ghostlayers-lock"]


def test_prune_with_a_link_at_its_lock_prints_one_error_line(model_folder, tmp_path):
    """The case that lost data: the lock's target was overwritten with the process id, exit 0."""
    precious, absent = _victims(tmp_path)
    out = tmp_path / "out"
    for target in (precious, absent):
        (tmp_path / ".out.ghostlayers-lock").symlink_to(target)
        args = ["prune", "--model", str(model_folder), "--layers", "2:4", "--output", str(out)]
        result = runner.invoke(app, [*args, "--calibration", str(tmp_path / "calib.txt"), "--num-samples", "4"])
        assert result.exit_code == 2 and "symbolic link" in result.output, result.output
        assert [line.startswith("error:") for line in result.output.splitlines() if line.strip()] == [True]
        assert precious.read_text() == "precious\n" and not absent.exists() and not out.exists()
        (tmp_path / ".out.ghostlayers-lock").unlink()


@pytest.mark.parametrize("name", ["ghostlayers.json", "config.json", "tokenizer_config.json"])
def test_a_link_raced_into_the_hidden_folder_is_never_written_through(plain, tmp_path, monkeypatch, name):
    """The files the tool itself writes or rewrites inside its hidden folder: a link that appears there
    (another process racing the save) makes the save fail, with the link's target unchanged."""
    precious, _ = _victims(tmp_path)
    tokenizer = tiny_tokenizer()
    save_tokenizer = type(tokenizer).save_pretrained

    def then_plant(self, folder, *args, **kwargs):
        saved = save_tokenizer(self, folder, *args, **kwargs)
        if name != "ghostlayers.json":
            (Path(folder) / name).unlink()
        (Path(folder) / name).symlink_to(precious)
        return saved

    monkeypatch.setattr(type(tokenizer), "save_pretrained", then_plant)
    if name != "ghostlayers.json":  # the rewrite reads the linked file as JSON first
        precious.write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}) + "\n")
    before = precious.read_text()
    with pytest.raises(GhostLayersError, match="symbolic link"):
        ghostlayers.save(plain, tokenizer, tmp_path / "place" / "out")
    assert precious.read_text() == before
    assert not (tmp_path / "place").exists() or not any((tmp_path / "place").iterdir())
