"""``ghostlayers prune`` end to end on a local folder, and its errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, random_text, tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.files.folders import Claim

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["prune", *args])


def base_args(folder: Path) -> list[str]:
    return [
        "--model",
        str(folder),
        "--calibration",
        str(folder.parent / "calib.txt"),
        "--num-samples",
        "6",
        "--seq-len",
        "32",
        "--batch-size",
        "3",
    ]


def test_prune_writes_a_folder_that_reloads(model_folder, tmp_path):
    out = tmp_path / "out"
    result = run(*base_args(model_folder), "--select", "streamline", "--num-layers", "2", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "relative residual" in result.output.lower() and "ghost" in result.output
    model = ghostlayers.load(out)
    record = model.config.ghostlayers
    assert model.config.num_hidden_layers == 4 and len(record["removed_layers"]) == 2
    assert record["calibration"] == {
        "source": str(model_folder.parent / "calib.txt"),
        "num_samples": 6,
        "seq_len": 32,
        "seed": 0,
        "sources": {str(model_folder.parent / "calib.txt"): 6},
        "tokens": 6 * 32,
    }
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    # the saved model is the pruned dense model: same kept weights as the source folder
    dense = tiny_model("llama")
    kept = [i for i in range(6) if i not in record["removed_layers"]]
    for new, old in enumerate(kept):
        torch.testing.assert_close(
            model.model.layers[new].mlp.up_proj.weight, dense.model.layers[old].mlp.up_proj.weight
        )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_refit_selects_first_and_writes_a_plain_checkpoint(model_folder, tmp_path):
    """With a criterion, refit's statistics come from a second pass over the chosen run only; the result is
    a plain llama folder where only the last kept layer's down-projection differs from the source."""
    out = tmp_path / "out"
    args = [
        *base_args(model_folder),
        "--select",
        "streamline",
        "--num-layers",
        "2",
        "--method",
        "refit",
        "--alpha",
        "1",
    ]
    result = run(*args, "--output", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert "refit's statistics are gathered for the selected layers only" in json.dumps(report)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and not (out / "modeling_ghostlayers.py").exists()
    removed = json.loads((out / "ghostlayers.json").read_text())["record"]["removed_layers"]
    model, dense = ghostlayers.load(out), tiny_model("llama")
    kept = [i for i in range(6) if i not in removed]
    for new, old in enumerate(kept):
        same = torch.equal(model.model.layers[new].mlp.down_proj.weight, dense.model.layers[old].mlp.down_proj.weight)
        assert same == (old != removed[0] - 1), old
        torch.testing.assert_close(
            model.model.layers[new].mlp.up_proj.weight, dense.model.layers[old].mlp.up_proj.weight
        )


def test_prune_report_and_record_name_the_model(model_folder, tmp_path):
    out = tmp_path / "out"
    assert run(*base_args(model_folder), "--layers", "2:4", "--output", str(out)).exit_code == 0
    identity = {
        "name": str(model_folder),
        "checkpoint": str(model_folder.resolve()),
        "model_type": "llama",
        "source": str(model_folder.resolve()),
        "label": f"{model_folder.resolve()} (llama)",
    }
    assert json.loads((out / "report.json").read_text())["model"] == identity
    heading = (out / "report.md").read_text().splitlines()[0]
    assert heading == f"# ghostlayers prune: {model_folder} — {identity['label']}"
    assert ghostlayers.load(out).config.ghostlayers["model"] == identity  # the saved folder says where it came from


def test_model_help_names_each_bundled_checkpoint():
    result = runner.invoke(app, ["prune", "--help"], env={"COLUMNS": "1000"})
    for name, checkpoint in [
        ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32 on load)"),
        ("gemma3-270m", "google/gemma-3-270m (Q4_K_M GGUF"),
        ("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF"),
    ]:
        assert f"{name} = {checkpoint}" in result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layers", "2:9"], "out of range"),
        (["--layers", "1,1"], "more than once"),
        (["--layers", "0:6"], "Cannot remove all 6 layers"),
        (["--select", "streamline", "--num-layers", "6"], "between 1 and 5"),
        (["--select", "nearest", "--num-layers", "2"], "Unknown selection criterion"),
        (["--layers", "2:4", "--method", "magic"], "Unknown recovery method"),
        (["--layers", "0:2", "--method", "replaceme"], "starts at layer 0"),
        (["--layers", "2:4", "--num-samples", "500"], "need 16064"),
        (["--layers", "2:4", "--calibration", "no-such-corpus"], "no-such-corpus"),
        (["--layers", "2:4", "--ridge-mode", "scaled"], "Unknown --ridge-mode"),
        (["--layers", "2:4", "--method", "replaceme", "--fit", "chained"], "folds its map"),
        (["--select", "streamline", "--num-layers", "5", "--select-range", "published"], "between 1 and 4"),
    ],
)
def test_bad_input_is_a_clear_error_and_leaves_no_folder(model_folder, tmp_path, extra, message):
    out = tmp_path / "out"
    result = run(*base_args(model_folder), *extra, "--output", str(out))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_published_options_are_recorded(model_folder, tmp_path):
    out = tmp_path / "out"
    options = ["--ridge-mode", "absolute", "--fit", "chained", "--select-range", "published"]
    result = run(*base_args(model_folder), "--select", "shortgpt", "--num-layers", "2", *options, "--output", str(out))
    assert result.exit_code == 0, result.output
    record = ghostlayers.load(out).config.ghostlayers
    assert (record["ridge_mode"], record["fit"], record["select_range"]) == ("absolute", "chained", "published")
    assert min(record["removed_layers"]) >= 1 and max(record["removed_layers"]) <= 4
    settings = json.loads((out / "report.json").read_text())["settings"]
    assert (settings["ridge_mode"], settings["fit"], settings["select_range"]) == ("absolute", "chained", "published")


def test_unsupported_architecture_names_its_model_type(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "gpt2"
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(" ".join(["w1"] * 1000))
    result = run(*base_args(folder), "--layers", "1")
    assert result.exit_code == 2 and "'gpt2' is not supported" in result.output


def test_overwrite_replaces_only_what_ghostlayers_wrote(model_folder, tmp_path):
    """--overwrite replaces an empty folder or one ghostlayers wrote; a folder of the user's own files, or a
    ghostlayers folder the user added a file to, is refused with nothing touched."""
    out, args = tmp_path / "out", [*base_args(model_folder), "--layers", "2:4"]
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run(*args, "--output", str(out))
    assert result.exit_code == 2 and "--overwrite" in result.output
    result = run(*args, "--output", str(out), "--overwrite")
    assert result.exit_code == 2 and "not written by ghostlayers" in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # empty: replaced
    assert run(*args, "--output", str(out), "--overwrite").exit_code == 0
    assert ghostlayers.load(out).config.num_hidden_layers == 4
    assert run(*base_args(model_folder), "--layers", "1", "--output", str(out), "--overwrite").exit_code == 0
    assert ghostlayers.load(out).config.num_hidden_layers == 5  # our own folder: replaced
    (out / "notes.md").write_text("my notes")
    result = run(*args, "--output", str(out), "--overwrite")
    assert result.exit_code == 2 and "notes.md" in result.output and (out / "notes.md").read_text() == "my notes"
    assert ghostlayers.load(out).config.num_hidden_layers == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "out", "tiny-llama"]  # nothing left beside


@pytest.mark.parametrize("target", ["source", "cwd", "ancestor of cwd", "ancestor of source", "home"])
def test_overwrite_never_replaces_protected_folders(model_folder, tmp_path, monkeypatch, target):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work))
    folder = {
        "source": model_folder,
        "cwd": work,
        "ancestor of cwd": tmp_path,
        "ancestor of source": model_folder.parent,
        "home": work,
    }[target]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    result = run(*base_args(model_folder), "--layers", "2:4", "--output", str(folder), "--overwrite")
    assert result.exit_code == 2 and "cannot be replaced" in result.output, result.output
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_saved_folder_has_normal_permissions(model_folder, tmp_path):
    import os
    import stat

    out = tmp_path / "out"
    umask = os.umask(0o022)
    try:
        assert run(*base_args(model_folder), "--layers", "2:4", "--output", str(out)).exit_code == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert modes == {0o644}


def test_shared_calibration_and_perplexity_text_is_split(model_folder, tmp_path):
    """The same file as --calibration and --ppl: calibration from its start, perplexity from its end, said
    in the log and the report."""
    text = str(model_folder.parent / "calib.txt")
    report_dir = tmp_path / "report"
    args = [*base_args(model_folder), "--layers", "2:4", "--eval", "--ppl", text, "--ppl-windows", "3", "--no-speed"]
    args += ["--tasks", ""]
    result = run(*args, "--report-dir", str(report_dir))
    assert result.exit_code == 0, result.output
    assert "both calibration and perplexity text" in " ".join(result.output.split())
    report = json.loads((report_dir / "report.json").read_text())
    assert "perplexity windows from" in report["settings"]["calibration_split"][0]


def test_a_text_whose_name_holds_a_comma_is_one_source(model_folder, tmp_path):
    """``--calibration`` and ``--ppl`` were split at every comma, so ``a,b.txt`` was refused as two unknown
    sources: an existing path is read whole, beside other sources in the same list."""
    texts = tmp_path / "texts, kept"
    texts.mkdir()
    (texts / "a,b.txt").write_text(random_text(4000, seed=3))
    (texts / "c.txt").write_text(random_text(1000, seed=4))
    both, other = str(texts / "a,b.txt"), str(texts / "c.txt")
    args = [*base_args(model_folder), "--calibration", both, "--layers", "2:4", "--eval", "--ppl", f"{both},{other}"]
    result = run(*args, "--ppl-windows", "2", "--no-speed", "--tasks", "", "--report-dir", str(tmp_path / "report"))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [list(m["ppl"]) for m in report["metrics"].values()] == [[both, other]] * len(report["metrics"])
    assert report["settings"]["calibration_split"]  # the one text is both: split, as any shared text


def test_failure_while_writing_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), Claim(out) as claim, claim.folder() as folder:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags", [["--offload"], ["--stats-memory", "0"]])
def test_offload_and_two_pass_write_the_same_model(model_folder, tmp_path, flags):
    """``--offload`` (layer by layer, weights read from the files) and ``--stats-memory 0`` (selection
    pass, then a truncated statistics pass) save the model the default in-memory single pass saves."""
    outputs = {}
    for flag in ([], flags):
        out = tmp_path / f"out{len(flag)}"
        result = run(
            *base_args(model_folder), "--select", "ghost-aware", "--num-layers", "2", "--output", str(out), *flag
        )
        assert result.exit_code == 0, result.output
        outputs[bool(flag)] = ghostlayers.load(out)
        passes = json.loads((out / "report.json").read_text())["passes"]
        assert passes == (2 if flag == ["--stats-memory", "0"] else 1)
    assert outputs[True].config.ghostlayers["removed_layers"] == outputs[False].config.ghostlayers["removed_layers"]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(outputs[True](ids).logits, outputs[False](ids).logits, rtol=1e-4, atol=1e-4)


def test_eval_reports_dense_no_recovery_and_ghost_perplexity(model_folder, tmp_path):
    """Perplexities in report.json against models built and scored here: the dense model, and the same
    model with layers 2, 3 deleted by hand (plain pruning), by exp of the mean next-token NLL."""
    report_dir = tmp_path / "report"
    text = model_folder.parent / "calib.txt"
    args = [
        *base_args(model_folder),
        "--layers",
        "2:4",
        "--eval",
        "--ppl",
        str(text),
        "--ppl-windows",
        "2",
        "--tasks",
        "",
    ]
    result = run(*args, "--no-speed", "--report-dir", str(report_dir))
    assert result.exit_code == 0, result.output
    metrics = json.loads((report_dir / "report.json").read_text())["metrics"]
    assert list(metrics) == ["dense", "pruned, no recovery", "pruned + ghost"]
    # the calibration text is also the perplexity text: perplexity is measured on its last two windows
    ids = torch.tensor(tiny_tokenizer()(text.read_text())["input_ids"][-64:]).view(2, 32)

    def ppl(model) -> float:
        with torch.no_grad():
            logits = model(ids).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).exp())

    dense = tiny_model("llama")
    assert metrics["dense"]["ppl"][str(text)] == pytest.approx(ppl(dense), rel=1e-4)
    dense.model.layers = torch.nn.ModuleList([dense.model.layers[i] for i in (0, 1, 4, 5)])
    for i, layer in enumerate(dense.model.layers):
        layer.self_attn.layer_idx = i
    dense.config.num_hidden_layers = 4
    assert metrics["pruned, no recovery"]["ppl"][str(text)] == pytest.approx(ppl(dense), rel=1e-4)
    assert metrics["pruned + ghost"]["ppl"][str(text)] != pytest.approx(ppl(dense), rel=1e-3)


def test_calibration_size_scales_with_the_hidden_size_and_too_few_tokens_warn(model_folder, tmp_path):
    """By default 32 tokens per hidden channel (C = 64, 32-token windows: 64 windows); 6 windows (192 tokens,
    3 per channel) draw a warning that names the default."""
    args = ["--model", str(model_folder), "--calibration", str(model_folder.parent / "calib.txt"), "--seq-len", "32"]
    report_dir = tmp_path / "report"
    result = runner.invoke(app, ["prune", *args, "--layers", "2:4", "--report-dir", str(report_dir)])
    assert result.exit_code == 0, result.output
    assert json.loads((report_dir / "report.json").read_text())["settings"]["num_samples"] == 64
    assert "warning" not in result.output
    result = runner.invoke(
        app, ["prune", *args, "--layers", "2:4", "--num-samples", "6", "--report-dir", str(report_dir), "--overwrite"]
    )
    assert result.exit_code == 0, result.output
    assert "3.0 per hidden channel" in " ".join(result.output.split()) and "--num-samples 64" in result.output


def test_a_recipe_reruns_a_run_and_options_override_its_fields(model_folder, tmp_path):
    """report.json's recipe, given back with --recipe, removes the same layers with the same operator (equal
    weights); an option on the command line replaces one field and leaves the others; TOML reads the same."""
    first = tmp_path / "first"
    result = run(*base_args(model_folder), "--select", "streamline", "--num-layers", "2", "--output", str(first))
    assert result.exit_code == 0, result.output
    recipe = json.loads((first / "report.json").read_text())["recipe"]
    assert recipe["select"] == "streamline" and recipe["num_layers"] == 2
    again = tmp_path / "again"
    result = runner.invoke(app, ["prune", "--recipe", str(first / "report.json"), "--output", str(again)])
    assert result.exit_code == 0, result.output
    for name, tensor in load_file(first / "model.safetensors").items():
        assert torch.equal(tensor, load_file(again / "model.safetensors")[name]), name
    toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in recipe.items() if v is not None and k != "eval")
    (tmp_path / "recipe.toml").write_text(toml + "\n[eval]\nppl_windows = 3\n")
    changed = tmp_path / "changed"
    result = runner.invoke(
        app,
        ["prune", "--recipe", str(tmp_path / "recipe.toml"), "--layers", "1:3", "--report-dir", str(changed)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((changed / "report.json").read_text())
    assert report["removed"] == [1, 2] and report["recipe"]["select"] is None
    assert report["recipe"]["eval"]["ppl_windows"] == 3
    assert {k: v for k, v in report["recipe"].items() if k not in ("layers", "select", "num_layers", "eval")} == {
        k: v for k, v in recipe.items() if k not in ("layers", "select", "num_layers", "eval")
    }


def test_loading_a_ghost_folder_warns_nothing_about_its_model_type(model_folder, tmp_path):
    """``ghostlayers eval`` loads a ghost output's model and tokenizer; transformers' generic config, which its
    tokenizer loader falls back to without remote code, warned that ``ghostlayers_llama`` may be unsupported."""
    import logging

    from transformers import AutoTokenizer

    from ghostlayers.store.loading import load_model_and_tokenizer

    out = tmp_path / "out"
    assert run(*base_args(model_folder), "--layers", "2:4", "--output", str(out)).exit_code == 0
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # as in a user's own script (the command above quiets it in this process)
    try:
        AutoTokenizer.from_pretrained(out)  # the warning, as a user loading the tokenizer by hand sees it
        assert any("model of type `ghostlayers_llama`" in m for m in seen), seen
        seen.clear()
        model, tokenizer = load_model_and_tokenizer(str(out), device="cpu")
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "model of type" in m], seen
    assert type(model).__name__ == "GhostLayersForCausalLM_llama"
    assert tokenizer("w1 w5").input_ids == tiny_tokenizer()("w1 w5").input_ids
