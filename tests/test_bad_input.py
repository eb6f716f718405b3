"""Bad input to the real CLI, as a new user gives it: every case exits with code 2 and a one-line message,
prints no traceback, creates no file or folder, and leaves the user's own files byte for byte as they were.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import random_batches, random_text, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.config.recipes import EvalSettings, PruneRecipe
from ghostlayers.errors import GhostLayersError
from ghostlayers.sources.corpora import MAX_TEXT_BYTES
from ghostlayers.sources.windows import draw_windows, tokenize

runner = CliRunner()


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A tiny llama, a tiny llama of hidden size 90 (no Hadamard matrix of that order exists), a calibration
    text, a Latin-1 file, a folder of the user's own files, a user file, a run folder and a broken report."""
    root = tmp_path_factory.mktemp("place")
    tiny_model("llama").save_pretrained(root / "tiny-llama")
    tiny_tokenizer().save_pretrained(root / "tiny-llama")
    config = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=90, num_hidden_layers=4, num_attention_heads=3, intermediate_size=64
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "odd-llama")
    tiny_tokenizer().save_pretrained(root / "odd-llama")
    (root / "calib.txt").write_text(random_text(3000))

    pruned = ghostlayers.prune(tiny_model("llama"), random_batches(), layers="2:4", progress=False).model
    ghostlayers.save(pruned, tiny_tokenizer(), root / "pruned")
    (root / "latin1.txt").write_bytes("w1 w2 café w3 ".encode("latin-1") * 200)
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my notes")
    (root / "notes.txt").write_text("beside the output")
    (root / "run").mkdir()
    (root / "run" / "report.json").write_text(json.dumps({"command": "eval", "settings": {}, "metrics": {}}))
    shutil.copytree(root / "run", root / "our-run")  # as ghostlayers writes a report folder
    manifest = {"written_by": "ghostlayers", "kind": "report", "files": ["report.json"]}
    (root / "our-run" / "ghostlayers.json").write_text(json.dumps(manifest))
    (root / "broken-run").mkdir()
    (root / "broken-run" / "report.json").write_text("{not json")
    (root / "no-report").mkdir()
    (root / "work").mkdir()
    (root / "unknown-field.json").write_text(json.dumps({"model": str(root / "tiny-llama"), "layrs": "2:4"}))
    (root / "broken-recipe.json").write_text("{not json")
    (root / "broken-recipe.toml").write_text("method = ")
    (root / "bad-method.toml").write_text(f'model = "{root / "tiny-llama"}"\nmethod = "magic"\n')
    _broken_models(root)
    _broken_records(root)
    for field, value in RECIPE_FIELDS.items():
        entry = {"eval": {field.removeprefix("eval."): value}} if field.startswith("eval.") else {field: value}
        (root / f"wrong-{field}.json").write_text(json.dumps({"model": str(root / "tiny-llama"), **entry}))
    (root / "offload-false.toml").write_text(f'model = "{root / "tiny-llama"}"\noffload = "false"\n')
    (root / "float-batch.toml").write_text(f'model = "{root / "tiny-llama"}"\nbatch_size = 2.0\n')
    (root / "eval-unknown.toml").write_text(f'model = "{root / "tiny-llama"}"\n[eval]\npll = "wiki"\n')
    for name in ("fifo", "device"):
        (root / name).mkdir()
        (root / name / "b.txt").write_text(random_text(3000))
    os.mkfifo(root / "fifo" / "a.txt")
    for name, size in (("huge.txt", MAX_TEXT_BYTES + 1), ("sparse.txt", 2**20)):
        with open(root / name, "wb") as sparse:  # no disk used
            sparse.truncate(size)
    (root / "device" / "a.txt").symlink_to("/dev/zero")
    return root


WRONG = {"str": 5, "int": "8", "float": "0.1", "bool": "false", "EvalSettings": "x"}  # another type, per annotation
TYPES = {
    prefix + f.name: f.type
    for cls, prefix in ((PruneRecipe, ""), (EvalSettings, "eval."))
    for f in fields(cls)
    if f.init
}
RECIPE_FIELDS = {name: WRONG[t.split(" |")[0]] for name, t in TYPES.items() if t.split(" |")[0] in WRONG}


RECORDS = {  # a ghost folder's record (config.json "ghostlayers"), edited
    "operators not a list": {"operators": "model.layers.2"},
    "operator not a record": {"operators": [5]},
    "operator host missing": {"operators": [{"host": "model.layers.99", "kind": "ghost"}]},
    "operator host a number": {"operators": [{"host": 2, "kind": "ghost"}]},
    "removed layers a string": {"removed_layers": "2:4"},
    "layer count a string": {"original_num_hidden_layers": "6"},
    "unknown architecture": {"base_model_type": "nonesuch"},
}
REPORTS = {
    "NaN": {"m": {"ppl": {"wiki": math.nan}}},
    "text": {"m": {"ppl": "low"}},
    "list": {"m": [1, 2]},
    "zero perplexity": {"m": {"ppl": {"wiki": 0.0}}},
    "negative perplexity": {"m": {"ppl": {"wiki": -3.5}}},
    "perplexity below one": {"m": {"ppl": {"wiki": 0.5}}},
}


def _broken_records(root: Path) -> None:
    """Ghost folders whose record or operator is broken, and run folders whose report is."""
    config = json.loads((root / "pruned" / "config.json").read_text())
    for name, change in RECORDS.items():
        folder = shutil.copytree(root / "pruned", root / name)
        (folder / "config.json").write_text(json.dumps({**config, "ghostlayers": {**config["ghostlayers"], **change}}))
    weights = load_file(root / "pruned" / "model.safetensors")
    nan = {k: torch.full_like(v, math.nan) if "ghost_operator" in k else v for k, v in weights.items()}
    save_file(nan, shutil.copytree(root / "pruned", root / "NaN operator") / "model.safetensors")
    small = {k: v[:8, :8].contiguous() if "ghost_operator" in k else v for k, v in weights.items()}
    save_file(small, shutil.copytree(root / "pruned", root / "operator of the wrong shape") / "model.safetensors")
    for name, metrics in REPORTS.items():
        (root / f"{name} report").mkdir()
        (root / f"{name} report" / "report.json").write_text(json.dumps({"command": "eval", "metrics": metrics}))


def _broken_models(root: Path) -> None:
    """Copies of the tiny llama, each broken in one way a download or an edit breaks a folder."""

    def copy(name: str) -> Path:
        shutil.copytree(root / "tiny-llama", root / name)
        return root / name

    weights = (root / "tiny-llama" / "model.safetensors").read_bytes()
    (copy("truncated") / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (copy("corrupt") / "model.safetensors").write_bytes(b"\x00not safetensors" * 64)
    for file in copy("no-tokenizer").glob("tokenizer*"):
        file.unlink()
    remote = copy("remote-code")
    config = json.loads((remote / "config.json").read_text())
    auto_map = {"AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps({**config, "model_type": "x", "auto_map": auto_map}))
    (remote / "modeling_x.py").write_text(f"open({str(root / 'ran')!r}, 'w')\n")
    pickled = copy("pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    for name, layers in (("config-more-layers", 12), ("config-fewer-layers", 4)):
        folder = copy(name)
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): str(p.stat().st_mtime_ns)
        if p.is_file() and p.stat().st_size > 2**26
        else hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


PRUNE = [
    "prune",
    "--model",
    "{root}/tiny-llama",
    "--calibration",
    "{root}/calib.txt",
    "--num-samples",
    "4",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
]
LAYERS = [*PRUNE, "--layers", "2:4"]
EVAL = ["eval", "{root}/tiny-llama", "--ppl", "{root}/calib.txt", "--ppl-windows", "2", "--seq-len", "32", "--no-speed"]
EVAL += ["--tasks", ""]  # no zero-shot data to fetch: the sweep needs no network
OUT = ["--output", "{root}/work/out"]
BROKEN = ("truncated", "corrupt", "no-tokenizer", "remote-code", "pickled", "config-more-layers", "config-fewer-layers")

CASES = {
    # prune: the model and the layers
    "model missing": [*LAYERS[:2], "{root}/no-such-model", *LAYERS[3:], *OUT],
    "model already pruned": [*LAYERS[:2], "{root}/pruned", *LAYERS[3:], *OUT],
    **{
        f"model {name}{offload}": [*LAYERS[:2], f"{{root}}/{name}", *LAYERS[3:], *OUT, *offload.split()]
        for name in BROKEN
        for offload in ("", " --offload")
    },
    "layers unreadable": [*PRUNE, "--layers", "two", *OUT],
    "layers out of range": [*PRUNE, "--layers", "2:9", *OUT],
    "layers beyond any model": [*PRUNE, "--layers", "5:10000000000000", *OUT],
    "layers repeated": [*PRUNE, "--layers", "1,1", *OUT],
    "layers all": [*PRUNE, "--layers", "0:6", *OUT],
    "layers empty range": [*PRUNE, "--layers", "4:2", *OUT],
    "layers and select": [*LAYERS, "--select", "streamline", "--num-layers", "2", *OUT],
    "select unknown": [*PRUNE, "--select", "nearest", "--num-layers", "2", *OUT],
    "select loss without held-out windows": [
        *PRUNE,
        "--select",
        "loss",
        "--num-layers",
        "2",
        "--heldout-windows",
        "0",
        *OUT,
    ],
    "num-layers too many": [*PRUNE, "--select", "streamline", "--num-layers", "6", *OUT],
    "num-layers zero": [*PRUNE, "--select", "angular", "--num-layers", "0", *OUT],
    "num-layers not a number": [*PRUNE, "--select", "angular", "--num-layers", "x", *OUT],
    # prune: the method and the fit
    "method unknown": [*LAYERS, "--method", "magic", *OUT],
    "method auto without held-out windows": [*LAYERS, "--method", "auto", "--heldout-windows", "0", *OUT],
    "heal no tokens": [*LAYERS, "--heal", "0", *OUT],
    "heal unknown params": [*LAYERS, "--heal", "1000", "--heal-params", "everything", *OUT],
    "heal operator of none": [*LAYERS, "--method", "none", "--heal", "1000", "--heal-params", "operator", *OUT],
    "heal learning rate not a rate": [*LAYERS, "--heal", "1000", "--heal-lr", "5", *OUT],
    "heal no logits": [*LAYERS, "--heal", "1000", "--heal-topk", "0", *OUT],
    "method auto with sequential fit": [*LAYERS, "--method", "auto", "--fit", "sequential", *OUT],
    "replaceme from layer 0": [*PRUNE, "--layers", "0:2", "--method", "replaceme", *OUT],
    "refit from layer 0": [*PRUNE, "--layers", "0:2", "--method", "refit", *OUT],
    "refit with loss selection": [*PRUNE, "--select", "loss", "--num-layers", "2", "--method", "refit", *OUT],
    "refit with offload": [*LAYERS, "--method", "refit", "--offload", *OUT],
    "refit over the statistics memory": [*LAYERS, "--method", "refit", "--stats-memory", "0", *OUT],
    "rotate without hadamard": [
        *LAYERS[:2],
        "{root}/odd-llama",
        *LAYERS[3:-1],
        "1:3",
        "--method",
        "linearpatch-rotate",
        *OUT,
    ],
    "fit unknown": [*LAYERS, "--fit", "magic", *OUT],
    "sequential none": [*LAYERS, "--fit", "sequential", "--method", "none", *OUT],
    "sequential replaceme": [*LAYERS, "--fit", "sequential", "--method", "replaceme", *OUT],
    "sequential offload": [*LAYERS, "--fit", "sequential", "--offload", *OUT],
    "ridge nan": [*LAYERS, "--ridge", "nan", *OUT],
    "ridge-mode unknown": [*LAYERS, "--ridge-mode", "sideways", *OUT],
    "select-range unknown": [*PRUNE, "--select", "streamline", "--num-layers", "2", "--select-range", "middle", *OUT],
    "chained fit of replaceme": [*PRUNE, "--layers", "1,3", "--fit", "chained", "--method", "replaceme", *OUT],
    "chained fit of refit": [*PRUNE, "--layers", "1,3", "--fit", "chained", "--method", "refit", *OUT],
    "alpha above 1": [*LAYERS, "--alpha", "1.5", *OUT],
    "alpha word": [*LAYERS, "--alpha", "most", *OUT],
    "heldout-windows negative": [*LAYERS, "--heldout-windows", "-1", *OUT],
    "heldout-windows beyond the text": [*LAYERS, "--heldout-windows", "200", *OUT],
    "ridge inf": [*LAYERS, "--ridge", "inf", *OUT],
    "ridge negative": [*LAYERS, "--ridge", "-1", *OUT],
    "ridge word": [*LAYERS, "--ridge", "small", *OUT],
    "ridge auto one batch": [*LAYERS, "--ridge", "auto", "--batch-size", "4", "--heldout-windows", "0", *OUT],
    "ridge 0 too few tokens": [*LAYERS, "--ridge", "0", "--num-samples", "1", *OUT],
    # prune: calibration
    "calibration unknown": [*LAYERS, "--calibration", "no-such-corpus", *OUT],
    "calibration latin-1": [*LAYERS, "--calibration", "{root}/latin1.txt", *OUT],
    "encoding unknown": [*LAYERS, "--calibration", "{root}/latin1.txt", "--encoding", "klingon", *OUT],
    "encoding punycode": [*LAYERS, "--calibration", "{root}/calib.txt", "--encoding", "punycode", *OUT],
    "encoding not of text": [*LAYERS, "--calibration", "{root}/calib.txt", "--encoding", "base64", *OUT],
    "calibration folder without txt": [*LAYERS, "--calibration", "{root}/no-report", *OUT],
    "calibration folder with a FIFO": [*LAYERS, "--calibration", "{root}/fifo", *OUT],
    "calibration folder with a link to a device": [*LAYERS, "--calibration", "{root}/device", *OUT],
    "calibration FIFO": [*LAYERS, "--calibration", "{root}/fifo/a.txt", *OUT],
    "calibration file too large": [*LAYERS, "--calibration", "{root}/huge.txt", *OUT],
    "calibration sparse file": [*LAYERS, "--calibration", "{root}/sparse.txt", *OUT],
    "eval ppl sparse file": [*EVAL, "--ppl", "{root}/sparse.txt"],
    "num-samples zero": [*LAYERS, "--num-samples", "0", *OUT],
    "num-samples too many": [*LAYERS, "--num-samples", "500", *OUT],
    "seq-len one": [*LAYERS, "--seq-len", "1", *OUT],
    "seq-len beyond positions": [*LAYERS, "--seq-len", "100000", *OUT],
    "seed not a number": [*LAYERS, "--seed", "x", *OUT],
    "seed beyond int64": [*LAYERS, "--seed", str(2**100), *OUT],
    "seed negative": [*LAYERS, "--seed", "-1", *OUT],
    "batch-size beyond int64": [*LAYERS, "--batch-size", str(2**100), *OUT],
    "eval batch-size beyond int64": [*EVAL, "--batch-size", str(2**100)],
    "batch-size zero": [*LAYERS, "--batch-size", "0", *OUT],
    "stats-memory negative": [*LAYERS, "--stats-memory", "-5", *OUT],
    "dtype unknown": [*LAYERS, "--dtype", "int8", *OUT],
    "device unknown": [*LAYERS, "--device", "tpu", *OUT],
    "offload of nothing": [*PRUNE, "--layers", "0:6", "--offload", *OUT],
    # prune: where it writes
    "output is the user's folder": [*LAYERS, "--output", "{root}/mine", "--overwrite"],
    "output is a user file": [*LAYERS, "--output", "{root}/notes.txt", "--overwrite"],
    "output is the source": [*LAYERS, "--output", "{root}/tiny-llama", "--overwrite"],
    "output is the current folder": [*LAYERS, "--output", ".", "--overwrite"],
    "output contains the current folder": [*LAYERS, "--output", "{root}", "--overwrite"],
    "output exists": [*LAYERS, "--output", "{root}/mine"],
    "report-dir is the user's folder": [*LAYERS, "--report-dir", "{root}/mine"],
    "report-dir is a model": [*LAYERS, "--report-dir", "{root}/pruned", "--overwrite"],
    "report-dir is a report, no overwrite": [*LAYERS, "--report-dir", "{root}/our-run"],
    "output under a file": [*LAYERS, "--output", "{root}/notes.txt/out"],
    "report-dir beside output": [*LAYERS, "--report-dir", "{root}/work/report", *OUT],
    # prune: evaluation
    "prune --eval ppl unknown": [*LAYERS, "--eval", "--ppl", "no-such-corpus", *OUT],
    "prune --eval ppl latin-1": [*LAYERS, "--eval", "--ppl", "{root}/latin1.txt", "--tasks", "", *OUT],
    "prune --eval ppl-windows zero": [*LAYERS, "--eval", "--ppl-windows", "0", *OUT],
    "prune --eval tasks retired": [*LAYERS, "--eval", "--tasks", "gl_winogrande", *OUT],
    "prune --eval limit zero": [*LAYERS, "--eval", "--tasks", "piqa", "--limit", "0", *OUT],
    "speed takes no value": [*LAYERS, "--speed", "yes", *OUT],
    "unknown option": [*LAYERS, "--prune-harder", *OUT],
    # prune: recipes
    "recipe missing": ["prune", "--recipe", "{root}/no-such-recipe.json"],
    "recipe unknown field": ["prune", "--recipe", "{root}/unknown-field.json"],
    "recipe not JSON": ["prune", "--recipe", "{root}/broken-recipe.json"],
    "recipe not TOML": ["prune", "--recipe", "{root}/broken-recipe.toml"],
    "recipe method unknown": ["prune", "--recipe", "{root}/bad-method.toml", *OUT],
    "recipe offload a string": ["prune", "--recipe", "{root}/offload-false.toml", *OUT],
    "recipe batch size a float": ["prune", "--recipe", "{root}/float-batch.toml", *OUT],
    "recipe unknown eval key": ["prune", "--recipe", "{root}/eval-unknown.toml", *OUT],
    **{
        f"recipe {field} of the wrong type": ["prune", "--recipe", f"{{root}}/wrong-{field}.json", *OUT]
        for field in RECIPE_FIELDS
    },
    # eval
    "eval model missing": ["eval", "{root}/no-such-model"],
    **{f"eval model {name}": [EVAL[0], f"{{root}}/{name}", *EVAL[2:]] for name in BROKEN},
    **{
        f"eval record {name}": [EVAL[0], f"{{root}}/{name}", *EVAL[2:]]
        for name in [*RECORDS, "NaN operator", "operator of the wrong shape"]
    },
    "eval ppl-windows negative": [*EVAL, "--ppl-windows", "-1"],
    "eval seq-len one": [*EVAL, "--seq-len", "1"],
    "eval seq-len beyond positions": [*EVAL, "--seq-len", "100000"],
    "eval limit zero": [*EVAL, "--limit", "0", "--tasks", "piqa"],
    "eval tasks retired": [*EVAL, "--tasks", "gl_nope"],
    "eval batch-size zero": [*EVAL, "--batch-size", "0"],
    "eval dtype unknown": [*EVAL, "--dtype", "int4"],
    "eval device unknown": [*EVAL, "--device", "tpu"],
    "eval latin-1": [*EVAL, "--ppl", "{root}/latin1.txt"],
    "eval ppl folder with a link to a device": [*EVAL, "--ppl", "{root}/device"],
    "eval encoding unknown": [*EVAL, "--ppl", "{root}/latin1.txt", "--encoding", "klingon"],
    "eval encoding punycode": [*EVAL, "--ppl", "{root}/calib.txt", "--encoding", "punycode"],
    "eval report-dir is the user's folder": [*EVAL, "--report-dir", "{root}/mine"],
    "eval report-dir is the source": [*EVAL, "--report-dir", "{root}/tiny-llama"],
    "eval report-dir is a model": [*EVAL, "--report-dir", "{root}/pruned", "--overwrite"],
    "eval report-dir is the evaluated model": [*EVAL[:1], "{root}/pruned", *EVAL[2:], "--report-dir", "{root}/pruned"],
    # compare
    "compare missing run": ["compare", "{root}/no-such-run"],
    "compare folder without report": ["compare", "{root}/no-report"],
    "compare broken report": ["compare", "{root}/broken-run"],
    **{f"compare {name} report": ["compare", "{root}/run", f"{{root}}/{name} report"] for name in REPORTS},
    "compare output is the user's folder": ["compare", "{root}/run", "--output", "{root}/mine"],
    "compare output is a user file": ["compare", "{root}/run", "--output", "{root}/notes.txt"],
    "compare output is a model": ["compare", "{root}/our-run", "--output", "{root}/pruned", "--overwrite"],
    "compare output is a compared run": ["compare", "{root}/our-run", "--output", "{root}/our-run", "--overwrite"],
    "compare output exists, no overwrite": ["compare", "{root}/run", "--output", "{root}/our-run"],
    "compare nothing": ["compare"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_and_touches_nothing(place, case, monkeypatch):
    monkeypatch.chdir(place / "work")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = _tree(place)
    result = runner.invoke(app, [arg.format(root=place) for arg in CASES[case]])
    lines = [line for line in result.output.splitlines() if line.strip() and "it/s]" not in line]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and len(errors[0]) > 20, result.output
    assert _tree(place) == before  # nothing created, nothing changed, nothing deleted


def test_the_sweep_covers_every_option():
    """At least 40 cases, every option of prune, eval and compare appears in one, and every recipe field
    (eval settings as eval.NAME) in a recipe that gives it a value of the wrong type."""
    from typer.main import get_command

    assert len(CASES) >= 40
    used = {arg for case in CASES.values() for arg in case}
    group = get_command(app)
    for name in ("prune", "eval", "compare"):
        options = {o for p in group.commands[name].params for o in p.opts if o.startswith("--")}
        missing = {o for o in options if o not in used and o.replace("--", "--no-", 1) not in used} - {"--help"}
        assert not missing, f"{name}: no bad-input case uses {sorted(missing)}"
    untyped = sorted(name for name in TYPES if f"recipe {name} of the wrong type" not in CASES)
    assert not untyped, f"no recipe gives {untyped} a wrong type: add their types to WRONG"


def test_code_in_a_ghost_folder_never_runs(place, tmp_path, monkeypatch):
    """eval, compare and ``ghostlayers.load`` read a ghost folder with ghostlayers' own classes: a
    ``modeling_ghostlayers.py`` planted there is never imported, even when the user answers 'y'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, marker = tmp_path / "ghost", tmp_path / "ran"
    pruned = runner.invoke(app, [arg.format(root=place) for arg in LAYERS] + ["--alpha", "1", "--output", str(out)])
    assert pruned.exit_code == 0, pruned.output
    assert "auto_map" in json.loads((out / "config.json").read_text())
    (out / "modeling_ghostlayers.py").write_text(f"open({str(marker)!r}, 'w')\n")
    evaluated = runner.invoke(app, [EVAL[0], str(out), *[a.format(root=place) for a in EVAL[2:]]], input="y\n" * 4)
    assert evaluated.exit_code == 0, evaluated.output
    assert runner.invoke(app, ["compare", str(out)], input="y\n").exit_code == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 4))
    ghostlayers.load(out)
    assert not marker.exists()


@pytest.mark.parametrize("heldout", [3, 40])
def test_too_short_a_text_suggests_only_possible_counts(heldout):
    """The message names only counts that fit (it once said "at most -2" windows)."""
    with pytest.raises(GhostLayersError, match="Use a longer text") as caught:
        draw_windows(torch.arange(100), num_samples=3, seq_len=20, heldout=heldout)
    assert "at most -" not in str(caught.value) and "at most 0 " not in str(caught.value)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer as GPT-2, SmolLM2 and Qwen use, trained on the tiny vocabulary."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    text = "".join(random_text(50, seed=k) + "\n" * (1 + k % 3) for k in range(100))  # merges "\n\n" too
    backend.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("make", [tiny_tokenizer, byte_level_tokenizer])
def test_a_long_text_is_tokenized_in_pieces_and_only_as_far_as_needed(make, monkeypatch):
    """Pieces cut before line breaks give the whole text's tokens, the tokenizer never sees more than a
    piece, and with a limit it stops at the first piece that reaches it."""
    tokenizer, seen = make(), []
    text = "".join(random_text(50, seed=k) + "\n" * (1 + k % 3) for k in range(40))
    whole = tokenize(tokenizer, text)
    monkeypatch.setattr("ghostlayers.sources.windows.WHOLE_CHARS", 5000)
    monkeypatch.setattr("ghostlayers.sources.windows.PIECE_CHARS", 1000)

    def spy(piece: str, **kwargs):
        seen.append(len(piece))
        return tokenizer(piece, **kwargs)

    assert torch.equal(tokenize(spy, text), whole) and max(seen) <= 1000 and len(seen) > 5
    seen.clear()
    assert torch.equal(tokenize(spy, text, limit=300), whole[:300]) and sum(seen) < 3000


def test_compare_prints_report_names_as_text_without_escape_sequences(tmp_path):
    """A report is data: rich markup in a model's name is printed as written, a terminal escape sequence
    never reaches the terminal, and a plot of thousands of models stays a bounded image."""
    name = "[bold red]x[/] \x1b[2J\x1b]0;owned\x07"
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        metrics = {name: {"ppl": {"wiki": 12.5}}, **{f"m{i}": {"ppl": {"wiki": 10.0 + i}} for i in range(3000)}}
        (tmp_path / run / "report.json").write_text(json.dumps({"command": "eval", "metrics": metrics}))
    result = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "[bold red]x[/] ?[2J?]0;owned?" in result.output and "\x1b" not in result.output
    from PIL import Image

    with Image.open(tmp_path / "c" / "perplexity.png") as image:
        assert image.width <= 40 * 120


# The Python API: token ids that are not a list of 2-D integer tensors of the model's vocabulary.

IDS = random_batches(num=2)
BAD_BATCHES = {
    "negative ids": ([IDS[0], torch.full((2, 16), -1)], r"batches\[1\] is a tensor holding the id -1:"),
    "ids past the vocabulary": ([torch.full((2, 16), 128)], r"batches\[0\] is a tensor holding the id 128:"),
    "floats": ([IDS[0].float()], r"float32 tensor"),
    "bools": ([IDS[0] > 5], r"bool tensor"),
    "1-D": ([IDS[0][0]], r"1-D tensor of shape \(16,\)"),
    "3-D": ([IDS[0][None]], r"3-D tensor of shape \(1, 2, 16\)"),
    "an empty batch": ([IDS[0][:, :0]], r"empty \(shape \(2, 0\)\)"),
    "no batches": ([], r"batches is empty"),
    "lists": ([IDS[0].tolist()], r"batches\[0\] is a list, not a tensor"),
    "one tensor": (IDS[0], r"batches is one tensor of shape \(2, 16\): give a list"),
}


@pytest.mark.parametrize("entry", ["prune", "plan", "calibrate"])
@pytest.mark.parametrize("kind", list(BAD_BATCHES))
def test_bad_token_batches_are_one_value_error_before_any_work(kind, entry):
    """They failed deep in torch (an IndexError in the embedding, a shape error in attention, a list with no
    ``numel``) or, with no batches, calibrated nothing without a word: one ValueError saying what was given
    and what is expected, before the model is touched."""
    batches, given = BAD_BATCHES[kind]
    model = tiny_model("llama")
    call = {
        "prune": lambda: ghostlayers.prune(model, batches, layers="2:4", progress=False),
        "plan": lambda: ghostlayers.plan(model, batches, layers="2:4", progress=False),
        "calibrate": lambda: ghostlayers.calibrate(model, batches, [(2, 4)], progress=False),
    }[entry]
    with pytest.raises(ValueError, match=given + r".*2-D integer tensor \[batch, seq\] of token ids from 0 to 127"):
        call()
    assert model.config.num_hidden_layers == 6 and not hasattr(model.config, "ghostlayers")


def test_bad_held_out_or_sequential_windows_are_one_value_error():
    """The held-out windows (by domain) and the sequential fit's batches are checked as the batches are."""
    model = tiny_model("llama")
    made = ghostlayers.plan(model, IDS, layers="2:4", progress=False)
    with pytest.raises(ValueError, match=r"sequential_batches\[0\] is a 1-D tensor"):
        ghostlayers.apply_plan(model, made, sequential_batches=[IDS[0][0]])
    heldout = {"wiki": IDS[0].float()}
    with pytest.raises(ValueError, match=r"heldout\['wiki'\] is a float32 tensor"):
        ghostlayers.apply_plan(model, made, heldout=heldout)
    with pytest.raises(ValueError, match=r"heldout\['wiki'\] is a float32 tensor"):
        ghostlayers.prune(model, IDS, layers="2:4", heldout=heldout, progress=False)
    assert model.config.num_hidden_layers == 6
