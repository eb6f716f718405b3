"""Nothing lost under faults: a save interrupted at any step (Ctrl-C, an I/O error, kill -9) leaves at the
output either the old folder or the new one, complete, and the next run on it cleans what is left; a report
never replaces a model or an input; a second run on the same output is refused; a write that cannot succeed
fails before the work, with one message, leaving no folder behind."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_batches, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import Claim
from ghostlayers.jobs import runs

runner = CliRunner()
TESTS = Path(__file__).resolve().parent


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def pruned() -> dict:
    """Two tiny pruned llamas: a (layers 2, 3 removed) and b (layers 1, 2 removed)."""
    return {
        name: ghostlayers.prune(tiny_model("llama"), random_batches(), layers=layers, progress=False).model
        for name, layers in (("a", "2:4"), ("b", "1:3"))
    }


@pytest.fixture
def saved(pruned, tmp_path) -> tuple[Path, dict, dict]:
    """``place/out`` holding model a; the trees of a and b as saved to fresh folders elsewhere."""
    refs = {name: tmp_path / "refs" / name for name in pruned}
    for name, folder in refs.items():
        ghostlayers.save(pruned[name], tiny_tokenizer(), folder)
    out = tmp_path / "place" / "out"
    ghostlayers.save(pruned["a"], tiny_tokenizer(), out)
    assert _tree(out) == _tree(refs["a"]) != _tree(refs["b"])  # saving is deterministic
    return out, _tree(refs["a"]), _tree(refs["b"])


def _save_b(pruned, out: Path, extra=None) -> None:
    ghostlayers.save(pruned["b"], tiny_tokenizer(), out, overwrite=True, extra=extra)


STEPS = ["before the weights", "after the weights", "between the renames", "while the old folder is deleted"]


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError], ids=["ctrl-c", "oserror"])
@pytest.mark.parametrize("step", STEPS)
def test_an_interrupted_save_leaves_one_complete_folder_and_a_rerun_cleans_up(saved, pruned, monkeypatch, step, fault):
    out, tree_a, tree_b = saved
    extra = None
    if step == "before the weights":
        monkeypatch.setattr("transformers.modeling_utils.safe_save_file", _raise(fault))
    elif step == "after the weights":
        extra = _raise(fault)
    elif step == "between the renames":
        replace = os.replace

        def second_rename_fails(src, dst):
            if Path(src).name.endswith("partial"):
                raise fault("interrupted")
            replace(src, dst)

        monkeypatch.setattr(os, "replace", second_rename_fails)
    else:
        rmtree = shutil.rmtree

        def half_deleted(path, ignore_errors=False):
            if Path(path).name.endswith("old") and Path(path).exists():
                (Path(path) / "model.safetensors").unlink()
                if fault is KeyboardInterrupt or not ignore_errors:
                    raise fault("interrupted")
                return
            rmtree(path, ignore_errors=ignore_errors)

        monkeypatch.setattr(shutil, "rmtree", half_deleted)
    with contextlib.suppress(KeyboardInterrupt, GhostLayersError):
        _save_b(pruned, out, extra)
    monkeypatch.undo()
    expected = tree_b if step == "while the old folder is deleted" else tree_a
    assert _tree(out) == expected
    with Claim(out, overwrite=True):  # the next run on this output
        pass
    assert [p.name for p in out.parent.iterdir()] == ["out"] and _tree(out) == expected
    _save_b(pruned, out)
    assert _tree(out) == tree_b and [p.name for p in out.parent.iterdir()] == ["out"]


def _raise(fault: type[BaseException]):
    def interrupt(*args, **kwargs):
        raise fault("interrupted")

    return interrupt


KILLED_BETWEEN_THE_RENAMES = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {src!r}]
from conftest import random_batches, tiny_model, tiny_tokenizer
import ghostlayers
model = ghostlayers.prune(tiny_model("llama"), random_batches(), layers="1:3", progress=False).model
replace = os.replace
def killed(src, dst):
    if str(src).endswith("partial"):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)
os.replace = killed
ghostlayers.save(model, tiny_tokenizer(), {out!r}, overwrite=True)
"""


def test_a_kill_between_the_renames_is_put_right_by_the_next_run(saved, pruned):
    """kill -9 after the old folder was moved aside, before the new one was moved in: the output is missing;
    the next run on it moves the old folder back, then writes."""
    out, tree_a, tree_b = saved
    script = KILLED_BETWEEN_THE_RENAMES.format(tests=str(TESTS), src=str(TESTS.parent / "src"), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not out.exists() and {p.name for p in out.parent.iterdir()} == {
        ".out.ghostlayers-old",
        ".out.ghostlayers-partial",
        ".out.ghostlayers-lock",
    }
    with pytest.raises(GhostLayersError, match="already exists"):  # restored, and not replaced without --overwrite
        ghostlayers.save(pruned["b"], tiny_tokenizer(), out)
    assert _tree(out) == tree_a and [p.name for p in out.parent.iterdir()] == ["out"]
    _save_b(pruned, out)
    assert _tree(out) == tree_b and [p.name for p in out.parent.iterdir()] == ["out"]


def test_a_second_claim_on_one_output_is_refused(saved, pruned, model_folder):
    """While one run holds the output, another (API or command line) is refused before any work, with one
    message; once the first is done, or was killed and left its lock file, the output can be claimed."""
    out, tree_a, _ = saved
    with Claim(out, overwrite=True):
        with pytest.raises(GhostLayersError, match="being written by another ghostlayers run"), Claim(out, True):
            pass
        args = ["--model", str(model_folder), "--calibration", str(model_folder.parent / "calib.txt")]
        result = runner.invoke(app, ["prune", *args, "--layers", "2:4", "--output", str(out), "--overwrite"])
        assert result.exit_code == 2 and "another ghostlayers run" in result.output
        assert [line.startswith("error:") for line in result.output.splitlines() if line.strip()] == [True]
    assert _tree(out) == tree_a and [p.name for p in out.parent.iterdir()] == ["out"]
    (out.parent / ".out.ghostlayers-lock").write_text("12345\n")  # a killed run's: no process holds its lock
    _save_b(pruned, out)
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_the_swap_checks_its_target_again(saved, pruned, tmp_path):
    """A folder that appears at the output while the weights are written, or a file added to the folder
    --overwrite replaces, is not deleted: the save fails at the swap."""
    new, (out, tree_a, _) = tmp_path / "new", saved

    def someone_else(folder: Path) -> None:
        folder.mkdir()
        (folder / "theirs.txt").write_text("theirs")

    with pytest.raises(GhostLayersError, match="already exists"):
        ghostlayers.save(pruned["b"], tiny_tokenizer(), new, extra=lambda _: someone_else(new))
    assert _tree(new) == {"theirs.txt": hashlib.sha256(b"theirs").hexdigest()}
    with pytest.raises(GhostLayersError, match="theirs.txt"):
        _save_b(pruned, out, extra=lambda _: someone_else(out / "sub"))
    assert _tree(out) == {**tree_a, "sub": "dir", "sub/theirs.txt": hashlib.sha256(b"theirs").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "place", "refs"]
    assert [p.name for p in out.parent.iterdir()] == ["out"]


@pytest.mark.parametrize("entry", ["symlink to a folder", "empty folder"])
def test_a_symlink_or_an_empty_subfolder_is_foreign(saved, pruned, tmp_path, entry):
    out, tree_a, _ = saved
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    if entry == "empty folder":
        (out / "later").mkdir()
    else:
        (out / "later").symlink_to(mine, target_is_directory=True)
    with pytest.raises(GhostLayersError, match="later"):
        _save_b(pruned, out)
    assert (out / "later").is_dir() and (mine / "notes.txt").read_text() == "my notes"


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Files may not grow past ``limit`` bytes, as on a full disk (EFBIG instead of ENOSPC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_disk_full_mid_write_keeps_the_old_output_and_leaves_nothing(saved, pruned, tmp_path):
    """Files may not grow past 100 kB (as on a full disk) while model b is written over a, and into a new
    folder under parents that do not exist yet: one error, a unchanged, no partial folder, no new parents."""
    out, tree_a, _ = saved
    with _file_size_limit(100_000):
        with pytest.raises(GhostLayersError, match="Cannot write --output .*too large"):
            _save_b(pruned, out)
        with pytest.raises(GhostLayersError, match="Cannot write --output"):
            ghostlayers.save(pruned["b"], tiny_tokenizer(), tmp_path / "new" / "deeper" / "out")
    assert _tree(out) == tree_a and [p.name for p in out.parent.iterdir()] == ["out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["place", "refs"]


@pytest.mark.parametrize("fault", ["parent is a file", "disk full"])
def test_an_output_that_cannot_be_written_fails_before_the_model_is_loaded(model_folder, tmp_path, monkeypatch, fault):
    (tmp_path / "file").write_text("a file")

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runs, "load_model_and_tokenizer", never)
    before = _tree(tmp_path)
    out = tmp_path / "file" / "sub" / "out" if fault == "parent is a file" else tmp_path / "new" / "out"
    with _file_size_limit(0 if fault == "disk full" else resource.RLIM_INFINITY):
        result = runner.invoke(app, ["prune", "--model", str(model_folder), "--layers", "2:4", "--output", str(out)])
    assert result.exit_code == 2 and "Cannot write --output" in result.output, result.output
    assert [line.startswith("error:") for line in result.output.splitlines() if line.strip()] == [True]
    assert _tree(tmp_path) == before


def test_a_report_never_replaces_a_model_or_an_input(model_folder, tmp_path):
    """``compare run --output run``, ``eval --report-dir`` and ``prune --report-dir`` on a pruned model's
    folder are refused, --overwrite or not, with the model left byte for byte; a report folder is replaced
    only with --overwrite."""
    out, text = tmp_path / "out", str(model_folder.parent / "calib.txt")
    prune = ["prune", "--model", str(model_folder), "--calibration", text, "--num-samples", "4", "--seq-len", "32"]
    assert runner.invoke(app, [*prune, "--layers", "2:4", "--output", str(out)]).exit_code == 0
    before = _tree(tmp_path)
    evaluate = ["eval", str(model_folder), "--ppl", text, "--ppl-windows", "2", "--seq-len", "32", "--no-speed"]
    evaluate += ["--tasks", ""]  # no zero-shot: the default is the 9 standard tasks in full
    for command in (
        ["compare", str(out), "--output", str(out)],
        ["compare", str(out), "--output", str(out), "--overwrite"],
        [*evaluate, "--report-dir", str(out)],
        [*evaluate, "--report-dir", str(out), "--overwrite"],
        [*prune, "--layers", "1:3", "--report-dir", str(out), "--overwrite"],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and "error:" in result.output, (command, result.output)
        assert _tree(tmp_path) == before, command
    assert ghostlayers.load(out).config.num_hidden_layers == 4
    report = tmp_path / "report"
    assert runner.invoke(app, [*evaluate, "--report-dir", str(report)]).exit_code == 0
    assert runner.invoke(app, [*evaluate, "--report-dir", str(report)]).exit_code == 2
    assert runner.invoke(app, [*evaluate, "--report-dir", str(report), "--overwrite"]).exit_code == 0
    result = runner.invoke(app, ["compare", str(report), "--output", str(report), "--overwrite"])
    assert result.exit_code == 2 and "input" in result.output
