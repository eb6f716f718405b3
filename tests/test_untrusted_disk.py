"""Nothing on disk is trusted: a link planted at any name the tool writes is never written through, and every
small file it parses (config, record, recipe, report, tokenizer) made a FIFO, a link to /dev/zero, a folder,
empty, truncated, deeply nested or mistyped ends in one ``GhostLayersError`` (one ``error:`` line at the
command line), quickly."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import plant_hostile, random_batches, random_text, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file
from test_export import bpe_tokenizer
from test_faults import _file_size_limit
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import Claim

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


WRITTEN_INSIDE = {  # what each command writes into its hidden folder (transformers' files through a private one)
    "prune": ["report.json", "report.md", "similarity.png"],
    "prune --output": ["modeling_ghostlayers.py", "README.md", "report.json", "similarity.png"]
    + ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"],
    "compare": ["compare.md", "perplexity.png"],
    "sweep": ["sweep.json", "sweep.md", "sweep.png"],
}


@pytest.mark.parametrize("command,name", [(c, n) for c, names in WRITTEN_INSIDE.items() for n in names])
def test_a_link_planted_in_the_hidden_folder_as_it_is_made_is_never_written_through(
    sources, tmp_path, monkeypatch, command, name
):
    """The reports, plots and sweep files were written through a link that appeared in ``.NAME.ghostlayers-partial``
    while the run filled it: the link's target was overwritten, exit 0. Planted there as soon as the folder is
    made: one error line, the target unchanged, no output and nothing left beside it."""
    precious, _ = _victims(tmp_path)
    make_folder = Claim.folder

    @contextlib.contextmanager
    def planting(self, *args, **kwargs):
        with make_folder(self, *args, **kwargs) as where:
            (where / name).symlink_to(precious)
            yield where

    monkeypatch.setattr(Claim, "folder", planting)
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    out, text = tmp_path / "place" / "out", sources / "calib.txt"
    calibrate = ["--model", sources / "tiny", "--calibration", text, "--num-samples", "4", "--seq-len", "16"]
    evaluate = ["--ppl", text, "--ppl-windows", "2"]
    args = {
        "prune": ["prune", *calibrate, *evaluate, "--layers", "2:4", "--report-dir", out],
        "prune --output": ["prune", *calibrate, *evaluate, "--layers", "2:4", "--method", "ghost", "--output", out],
        "compare": ["compare", sources / "run", "--output", out],
        "sweep": ["sweep", *calibrate, *evaluate, "--num-layers", "2", "--methods", "none", "--output", out],
    }[command]
    result = runner.invoke(app, [str(a) for a in args])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]  # after progress bars
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert name in errors[0] and "symbolic link" in errors[0], errors[0]
    assert precious.read_text() == "precious\n"
    assert not (tmp_path / "place").exists()


# The sweep: every file the tool reads, made hostile in each way, ends in one error: line within 10 s.

DEEP_JSON = "[" * 100_000 + "]" * 100_000
VARIANTS = ["fifo", "link to /dev/zero", "folder", "empty", "truncated", "deeply nested", "mistyped"]


def _header(text: str) -> bytes:
    """A safetensors file whose header is ``text``."""
    return struct.pack("<Q", len(text)) + text.encode()


def _make_hostile(path: Path, variant: str) -> None:
    """Replace the file at ``path`` (kept beside it as the template for truncation) by its ``variant``: deeply
    nested and mistyped in the file's own format (a TOML table, a safetensors header, else JSON)."""
    toml, weights = path.suffix == ".toml", path.suffix == ".safetensors"
    texts = {"deeply nested": "a = " + DEEP_JSON if toml else DEEP_JSON,
             "mistyped": 'model = ["x"]\n' if toml else '["a", "list"]'}  # fmt: skip
    plant_hostile(path, variant, {k: _header(t) if weights else t.encode() for k, t in texts.items()})


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A tiny llama (word-level tokenizer), a plain pruned one with a byte-level BPE tokenizer (the kind
    export-gguf writes), a text, a recipe in JSON and TOML, a report and an output folder ghostlayers wrote."""
    root = tmp_path_factory.mktemp("sources")
    tiny_model("llama").save_pretrained(root / "tiny")
    tiny_tokenizer().save_pretrained(root / "tiny")
    (root / "calib.txt").write_text(random_text(2000))
    model = ghostlayers.prune(tiny_model("llama"), random_batches(), layers="2:4", method="none", progress=False)
    ghostlayers.save(model.model, bpe_tokenizer(), root / "plain")
    (root / "recipe.json").write_text(json.dumps({"model": str(root / "tiny"), "layers": "2:4"}))
    (root / "recipe.toml").write_text(f'model = "{root / "tiny"}"\nlayers = "2:4"\n')
    (root / "run").mkdir()
    (root / "run" / "report.json").write_text(json.dumps({"command": "eval", "metrics": {"m": {"ppl": {"a": 3.0}}}}))
    (root / "out").mkdir()
    (root / "out" / "ghostlayers.json").write_text(json.dumps({"written_by": "ghostlayers", "kind": "model"}))
    swept = _commands(root, root / "swept")["sweep output's sweep.json"][2]
    assert runner.invoke(app, swept).exit_code == 0  # a finished sweep, for the reader of its sweep.json
    prune = ["prune", "--model", str(root / "tiny"), "--calibration", str(root / "calib.txt"), "--num-samples", "8"]
    prune += ["--seq-len", "16", "--layers", "2:4", "--method", "none", "--output", str(root / "pruned")]
    assert runner.invoke(app, prune).exit_code == 0  # a folder with its recipe, for heal's readers
    return root


def _commands(root: Path, case: Path) -> dict[str, tuple[str | None, str, list[str]]]:
    """For each file read: the file inside ``case`` (a copy of what it needs) and the command that reads it."""
    text = str(root / "calib.txt")
    evaluate = ["--ppl", text, "--ppl-windows", "2", "--seq-len", "16", "--no-speed", "--tasks", ""]
    prune = ["--calibration", text, "--num-samples", "4", "--seq-len", "16", "--layers", "2:4"]
    export = ["export-gguf", str(case), str(case.parent / f"{case.name}.gguf")]
    sweep = ["--calibration", text, "--num-samples", "4", "--seq-len", "16", "--ppl", text, "--ppl-windows", "2"]
    sweep += ["--depths", "2", "--methods", "none", "--output"]
    heal = ["--heal", "64", "--output"]  # the calibration the folder's record names
    teacher = ["--model", str(root / "tiny")]
    return {
        "eval config.json": ("tiny", "config.json", ["eval", str(case), *evaluate]),
        "eval weights header": ("tiny", "model.safetensors", ["eval", str(case), *evaluate]),
        "eval tokenizer.json": ("tiny", "tokenizer.json", ["eval", str(case), *evaluate]),
        "eval ghostlayers.json": ("plain", "ghostlayers.json", ["eval", str(case), *evaluate]),
        "prune config.json": ("tiny", "config.json", ["prune", "--model", str(case), *prune]),
        "prune output's ghostlayers.json": (
            "out",
            "ghostlayers.json",
            ["prune", "--model", str(root / "tiny"), *prune, "--output", str(case), "--overwrite"],
        ),
        "recipe json": (None, "recipe.json", ["prune", "--recipe", str(case / "recipe.json")]),
        "recipe toml": (None, "recipe.toml", ["prune", "--recipe", str(case / "recipe.toml")]),
        "compare report.json": ("run", "report.json", ["compare", str(case)]),
        "export config.json": ("plain", "config.json", export),
        "export weights header": ("plain", "model.safetensors", export),
        "export tokenizer.json": ("plain", "tokenizer.json", export),
        "export ghostlayers.json": ("plain", "ghostlayers.json", export),
        "sweep config.json": ("tiny", "config.json", ["sweep", "--model", str(case), *sweep, str(case.parent / "s")]),
        "sweep output's sweep.json": (
            "swept",
            "sweep.json",
            ["sweep", "--model", str(root / "tiny"), *sweep, str(case)],
        ),
        "heal config.json": ("pruned", "config.json", ["heal", str(case), *heal, str(case.parent / "h"), *teacher]),
        "heal ghostlayers.json": (
            "pruned",
            "ghostlayers.json",
            ["heal", str(case), *heal, str(case.parent / "h"), *teacher],
        ),
        "heal weights header": (
            "pruned",
            "model.safetensors",
            ["heal", str(case), *heal, str(case.parent / "h"), *teacher],
        ),
        "heal teacher config.json": (
            "tiny",
            "config.json",
            ["heal", str(root / "pruned"), *heal, str(case.parent / "h"), "--model", str(case)],
        ),
    }


READERS = list(_commands(Path("/r"), Path("/c")))


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("reader", READERS)
def test_every_file_read_made_hostile_ends_in_one_error_line(sources, tmp_path, reader, variant):
    case = tmp_path / "case"
    source, name, args = _commands(sources, case)[reader]
    if source is None:
        case.mkdir()
        shutil.copy(sources / name, case / name)
    else:
        shutil.copytree(sources / source, case)
    _make_hostile(case / name, variant)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        result = runner.invoke(app, args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not isinstance(result.exception, _Hung), f"{reader} / {variant} hung"
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (
        result.output,
        result.exception,
    )
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) < 500 << 10  # KiB: under 500 MB more


def _one_error_line(args: list[str], *needles: str) -> str:
    """Run the command line; it must fail with exit 2 and one ``error:`` line holding ``needles``, in 10 s."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        result = runner.invoke(app, [str(a) for a in args])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    progress = ("it/s]", "s/it]")  # transformers' bar while it loads weights, on stderr
    lines = [line for line in result.output.splitlines() if line.strip() and not line.endswith(progress)]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (
        result.output,
        result.exception,
    )
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _edited(source: Path, folder: Path, **changes) -> Path:
    """A copy of ``source`` whose config.json has ``changes`` (None removes a key)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in {**config, **changes}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _never_built(*args, **kwargs):
    raise AssertionError("a model was built from the config")


CONFIGS = {
    "100000 layers": ({"num_hidden_layers": 100_000}, "num_hidden_layers"),
    "12 layers, weights 6": ({"num_hidden_layers": 12}, "weights hold 6"),
    "3 layers, weights 6": ({"num_hidden_layers": 3}, "weights hold 6"),
    "no heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "a string hidden_size": ({"hidden_size": "64"}, "hidden_size"),
    "a float layer count": ({"num_hidden_layers": 6.0}, "num_hidden_layers"),
    "NaN": ({"rms_norm_eps": math.nan}, "NaN"),
    "infinite rope base": ({"rope_theta": math.inf}, "NaN or infinite"),
}


@pytest.mark.parametrize("command", ["eval", "prune"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_is_checked_before_a_model_is_built_from_it(sources, tmp_path, monkeypatch, command, case):
    """``prune`` and ``eval`` alike: the layer count against the weights' headers, counts within bounds and
    whole, every number finite; one line, and from_pretrained is never reached (100000 layers built first
    took 18.8 GB)."""
    changes, needle = CONFIGS[case]
    folder = _edited(sources / "tiny", tmp_path / "m", **changes)
    monkeypatch.setattr("ghostlayers.store.loading.from_pretrained_checked", _never_built)
    monkeypatch.setattr("ghostlayers.store.loading.load", _never_built)
    text = str(sources / "calib.txt")
    if command == "eval":
        args = ["eval", folder, "--ppl", text, "--ppl-windows", "2", "--seq-len", "16", "--no-speed", "--tasks", ""]
    else:
        args = ["prune", "--model", folder, "--calibration", text, "--num-samples", "4", "--layers", "1:2"]
    _one_error_line(args, needle)


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", "cuda:99"])
def test_a_device_that_is_unknown_or_absent_is_one_error_line(sources, device):
    text = str(sources / "calib.txt")
    args = ["eval", sources / "tiny", "--ppl", text, "--ppl-windows", "2", "--seq-len", "16", "--no-speed"]
    _one_error_line([*args, "--tasks", "", "--device", device], "--device")


@pytest.mark.parametrize("world", ["2", "abc", "-1"])
def test_world_size_without_torchrun_is_one_error_line_before_any_work(sources, tmp_path, monkeypatch, world):
    """Without torchrun's other variables a process group waits for ranks that never start: refused first."""
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr("ghostlayers.store.loading.from_pretrained_checked", _never_built)
    args = ["prune", "--model", sources / "tiny", "--calibration", sources / "calib.txt", "--layers", "1:2"]
    _one_error_line([*args, "--num-samples", "4", "--output", tmp_path / "out"], "WORLD_SIZE")
    assert not (tmp_path / "out").exists()


# export-gguf: the guarantees of prune.


@pytest.mark.parametrize("layers", [12, 3])
def test_export_checks_the_config_against_the_weights(sources, tmp_path, layers):
    """The config said 12 (or 3) layers, the weights hold 4: exit 0 with 8 random blocks (a truncated file)."""
    folder = _edited(sources / "plain", tmp_path / "m", num_hidden_layers=layers)
    _one_error_line(["export-gguf", folder, tmp_path / "m.gguf"], "weights hold 4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.fixture(scope="module")
def ghost(sources) -> Path:
    result = ghostlayers.prune(tiny_model("llama"), random_batches(), layers="2:4", method="ghost", progress=False)
    ghostlayers.save(result.model, bpe_tokenizer(), sources / "ghost")
    return sources / "ghost"


@pytest.mark.parametrize("edit", ["record removed, model_type llama", "and auto_map and module removed"])
def test_export_refuses_a_ghost_folder_whose_record_is_gone(ghost, tmp_path, edit):
    """Exported, its operator was silently dropped: a model without the repair the folder says it has."""
    folder = _edited(ghost, tmp_path / "m", ghostlayers=None, model_type="llama")
    if edit.startswith("and"):
        _edited(folder, tmp_path / "n", auto_map=None)
        (tmp_path / "n" / "modeling_ghostlayers.py").unlink()
        folder = tmp_path / "n"
    _one_error_line(["export-gguf", folder, tmp_path / "m.gguf"])
    assert not (tmp_path / "m.gguf").exists()


def test_export_of_bad_inputs_is_one_error_line_and_writes_nothing(sources, tmp_path):
    """A malformed tokenizer.json, pickled weights, a parent that is a file, a full disk."""
    broken = shutil.copytree(sources / "plain", tmp_path / "tokenizer")
    spec = json.loads((broken / "tokenizer.json").read_text())
    (broken / "tokenizer.json").write_text(json.dumps({**spec, "model": {**spec["model"], "vocab": [1, 2]}}))
    _one_error_line(["export-gguf", broken, tmp_path / "t.gguf"], "tokenizer.json")
    pickled = shutil.copytree(sources / "plain", tmp_path / "pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    _one_error_line(["export-gguf", pickled, tmp_path / "p.gguf"], "pickle")
    (tmp_path / "file").write_text("a file")
    _one_error_line(["export-gguf", sources / "plain", tmp_path / "file" / "sub" / "m.gguf"], "is a file")
    before = _tree(tmp_path)
    with _file_size_limit(1000):
        _one_error_line(["export-gguf", sources / "plain", tmp_path / "full.gguf"], "Cannot write")
    assert _tree(tmp_path) == before


KILLED_MID_WRITE = """
import os, signal, sys, gguf
sys.path[:0] = [{src!r}]
from ghostlayers.store.gguf import export_gguf
gguf.GGUFWriter.write_tensors_to_file = lambda self, *a, **k: os.kill(os.getpid(), signal.SIGTERM)
export_gguf({folder!r}, {out!r}, "f32")
"""


def test_export_leaves_nothing_on_sigterm_and_cleans_a_killed_runs_partial_file(sources, tmp_path):
    out = tmp_path / "m.gguf"
    leftover = tmp_path / ".m.gguf.killed.partial"  # what kill -9 mid-write left: no process locks it
    leftover.write_bytes(b"\0" * 4096)
    src = str(Path(ghostlayers.__file__).parents[1])
    script = KILLED_MID_WRITE.format(src=src, folder=str(sources / "plain"), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["prune --output", "eval --report-dir"])
def test_an_output_inside_the_source_model_folder_is_refused(sources, tmp_path, command):
    """It was accepted: the model folder gained files the tool then listed as foreign to it."""
    model = shutil.copytree(sources / "tiny", tmp_path / "model")
    before = _tree(model)
    text = str(sources / "calib.txt")
    if command.startswith("prune"):
        args = ["prune", "--model", model, "--calibration", text, "--layers", "1:2", "--output", model / "out"]
    else:
        args = ["eval", model, "--ppl", text, "--no-speed", "--tasks", "", "--report-dir", model / "report"]
    _one_error_line(args, "inside", "an input of this run")
    assert _tree(model) == before


# Records: a ghostlayers.json or pruning record of the wrong shape, read before anything else of the folder.


@pytest.mark.parametrize("files", [5, None, [["a"]]], ids=["a-number", "null", "a-list-of-lists"])
def test_a_file_list_of_the_wrong_shape_is_one_error_line(sources, tmp_path, files):
    """``--overwrite`` reads the list to know what ghostlayers wrote there: a TypeError traceback."""
    out = shutil.copytree(sources / "out", tmp_path / "out")
    (out / "ghostlayers.json").write_text(json.dumps({"written_by": "ghostlayers", "kind": "model", "files": files}))
    before = _tree(tmp_path)
    args = ["prune", "--model", sources / "tiny", "--calibration", sources / "calib.txt", "--num-samples", "4"]
    _one_error_line([*args, "--layers", "2:4", "--output", out, "--overwrite"], str(out / "ghostlayers.json"))
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("host", ["", "model.embed_tokens"], ids=["the-model", "the-embedding"])
def test_an_operator_hosted_outside_the_kept_layers_is_one_error_line(ghost, sources, tmp_path, host):
    """The weights renamed to fit, so the folder loads: the operator ran on the embedding's token ids (a shape
    error deep in the forward) or hooked the whole model (a KeyError)."""
    folder = _edited(ghost, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["ghostlayers"]["operators"][0]["host"] = host
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    weights[".".join(filter(None, [host, "ghost_operator.delta"]))] = weights.pop("model.layers.2.ghost_operator.delta")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    text = str(sources / "calib.txt")
    args = ["eval", folder, "--ppl", text, "--ppl-windows", "2", "--seq-len", "16", "--no-speed", "--tasks", ""]
    _one_error_line(args, str(folder / "config.json"), "host")
    with pytest.raises(GhostLayersError, match="host"):
        ghostlayers.load(folder)


def test_heal_of_a_record_without_its_method_is_one_error_line(sources, tmp_path):
    """``ghostlayers heal`` read the record's method with no check: a KeyError traceback."""
    folder = tmp_path / "m"
    args = ["prune", "--model", sources / "tiny", "--calibration", sources / "calib.txt", "--num-samples", "4"]
    made = runner.invoke(app, [str(a) for a in [*args, "--seq-len", "16", "--layers", "2:4", "--output", folder]])
    assert made.exit_code == 0, made.output
    config = json.loads((folder / "config.json").read_text())
    del config["ghostlayers"]["method"]
    (folder / "config.json").write_text(json.dumps(config))
    _one_error_line(["heal", folder, "--heal", "64", "--output", tmp_path / "healed"], "config.json", "method")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_heal_past_any_budget_is_refused_before_its_steps_are_listed(sources, tmp_path):
    """99999999999 tokens passed the token check and hung listing billions of steps: prune --heal and heal
    refuse it in a line, before a model loads, writing nothing."""
    text = sources / "calib.txt"
    args = ["prune", "--model", sources / "tiny", "--calibration", text, "--num-samples", "4", "--seq-len", "16"]
    args += ["--layers", "2:4"]
    _one_error_line([*args, "--heal", "99999999999", "--output", tmp_path / "out"], "--heal 99999999999 tokens")
    made = runner.invoke(app, [str(a) for a in [*args, "--output", tmp_path / "m"]])
    assert made.exit_code == 0, made.output
    heal = ["heal", tmp_path / "m", "--heal", "99999999999", "--output", tmp_path / "healed"]
    _one_error_line(heal, "--heal 99999999999 tokens is 6,249,999,999 windows of --seq-len 16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _relabelled(source: Path, folder: Path, before: str, after: str, shards: bool) -> Path:
    """A copy of ``source`` (its weights saved in bfloat16 for ``before="BF16"``) whose first safetensors file
    says one ``before`` weight is ``after`` (same width, same bytes): read as another type and cast, a model of
    garbage weights that loads without a word."""
    shutil.copytree(source, folder)
    if shards or before == "BF16":
        (folder / "model.safetensors").unlink()
        model = tiny_model("llama").to(torch.bfloat16 if before == "BF16" else torch.float32)
        model.save_pretrained(folder, max_shard_size="20KB" if shards else "1GB")
        assert (folder / "model.safetensors.index.json").exists() == shards
    file = sorted(folder.glob("*.safetensors"))[0]
    data = file.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    name = next(k for k, v in header.items() if k.endswith(".weight") and v.get("dtype") == before)
    header[name]["dtype"] = after
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])
    return folder


@pytest.mark.parametrize("shards", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize(
    "before,after,needle", [("F32", "I32", "integer dtype"), ("F32", "U32", "integer dtype"), ("BF16", "F16", "F16")]
)
def test_weights_relabelled_as_another_type_are_one_error_line(
    sources, tmp_path, monkeypatch, before, after, needle, shards
):
    folder = _relabelled(sources / "tiny", tmp_path / "m", before, after, shards)
    text = str(sources / "calib.txt")
    args = ["eval", folder, "--ppl", text, "--ppl-windows", "2", "--seq-len", "16", "--no-speed", "--tasks", ""]
    _one_error_line([*args, "--report-dir", tmp_path / "report"], needle, after)
    monkeypatch.setattr("ghostlayers.store.loading.from_pretrained_checked", _never_built)
    args = ["prune", "--model", folder, "--calibration", text, "--num-samples", "4", "--layers", "1:2"]
    _one_error_line([*args, "--output", tmp_path / "out"], after)
