"""Healing (issue #41), checked against independent computations: the loss against a KL written out in numpy,
the operator's gradient against finite differences, the merged LoRA model against the unmerged one (and its saved
plain folder), the boundary-cached step against a full student + teacher forward, and the guard's decisions."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCHITECTURES, plant_hostile, random_batches, tiny_model, tiny_tokenizer, torch_bytes
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.config.recipes import HealSettings, PruneRecipe
from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.report import heal_markdown
from ghostlayers.model.adapters import starting_at
from ghostlayers.model.surgery import DenseLayers, repair_scaled
from ghostlayers.repair import heal

BATCHES = random_batches(4, 2, 16)
HELDOUT = {"a": random_batches(1, 2, 16, seed=5)[0], "b": random_batches(1, 2, 16, seed=6)[0]}


def pruned(method: str, dtype: torch.dtype = torch.float32, layers: str = "2:4", kind: str = "llama") -> tuple:
    """A tiny model pruned with ``method`` (α = 1) and the dense model it came from, in ``dtype``."""
    dense, model = tiny_model(kind).to(dtype), tiny_model(kind).to(dtype)
    result = ghostlayers.prune(model, BATCHES, layers=layers, method=method, alpha=1.0, progress=False)
    return result, dense


def cached(dense, model, tmp_path: Path, topk: int = 10) -> heal.TeacherCache:
    return heal.cache_teacher(dense, BATCHES, heal.heal_depth(model), topk, tmp_path, progress=False)


def logits(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch, use_cache=False).logits


def test_loss_is_the_topk_kl_written_out():
    """(a) KL(p ‖ q) over the teacher's top-k tokens, both renormalised, averaged over tokens, in numpy float64."""
    batch, k = BATCHES[0], 7
    student, teacher = logits(tiny_model("llama", seed=1), batch), logits(tiny_model("llama", seed=2), batch)
    s, t = student.double().numpy().reshape(-1, student.shape[-1]), teacher.double().numpy().reshape(-1, 128)
    kls = []
    for srow, trow in zip(s, t, strict=True):
        top = np.argsort(-trow)[:k]
        p = np.exp(trow[top] - trow[top].max())
        p /= p.sum()
        q = np.exp(srow[top] - srow[top].max())
        q /= q.sum()
        kls.append(float(np.sum(p * np.log(p / q))))
    got = heal.topk_kl(student, *heal.teacher_topk(teacher, k))
    assert float(got) == pytest.approx(np.mean(kls), rel=1e-5)
    assert float(heal.topk_kl(teacher, *heal.teacher_topk(teacher, k))) == pytest.approx(0.0, abs=1e-6)


def test_operator_gradient_matches_finite_differences(tmp_path):
    """(b) float64: autograd's gradient of the cached loss in ``delta`` against central differences. GPT-NeoX,
    whose LayerNorm runs in the model's dtype (llama's RMSNorm computes in float32 even in a float64 model, which
    leaves the differences float32 noise)."""
    result, dense = pruned("ghost", torch.float64, kind="gpt_neox")
    model = result.model
    cache = cached(dense, model, tmp_path)
    (delta,) = heal.make_trainable(model, ["operator"], cache.depth)
    entry = cache.load(0)
    with starting_at(model, cache.depth) as slot:
        heal.cached_loss(heal.Student(model), slot, entry).backward()
        grad, eps = delta.grad.clone(), 1e-5
        g = torch.Generator().manual_seed(0)
        for i, j in torch.randint(0, delta.shape[0], (6, 2), generator=g).tolist():
            values = []
            for sign in (1, -1):
                with torch.no_grad():
                    delta[i, j] += sign * eps
                    values.append(float(heal.cached_loss(heal.Student(model), slot, entry)))
                    delta[i, j] -= sign * eps
            assert grad[i, j].item() == pytest.approx((values[0] - values[1]) / (2 * eps), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("method", ["none", "replaceme"])
def test_merged_lora_gives_the_unmerged_logits_and_a_plain_folder(method, tmp_path):
    """(c) LoRA with random B (trained adapters) merged into the weights: the unmerged PEFT model's logits, and the
    saved folder loads as a plain checkpoint (no remote code) with the same logits."""
    result, _ = pruned(method)
    model = result.model
    heal.make_trainable(model, ["lora"], heal.heal_depth(model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    unmerged = logits(model, BATCHES[1])
    heal.remove_lora(model, merge=True)
    merged = logits(model, BATCHES[1])
    assert not any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    ghostlayers.save(model, tiny_tokenizer(), tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=False)
    assert not (tmp_path / "out" / "modeling_ghostlayers.py").exists()
    torch.testing.assert_close(logits(reloaded.eval(), BATCHES[1]), unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("method", "params"), [("ghost", ["operator"]), ("replaceme", ["lora"]),
                                                ("ghost", ["operator", "lora"])])  # fmt: skip
def test_cached_step_equals_a_full_student_and_teacher_forward(method, params, tmp_path):
    """(d) The loss and gradients of one step from the cache (layers from the boundary on) against
    ``naive_loss``: the dense teacher and the whole student run on the batch."""
    result, dense = pruned(method)
    model = result.model
    cache = cached(dense, model, tmp_path)
    trained = heal.make_trainable(model, params, cache.depth)
    with torch.no_grad():  # LoRA's B starts at 0: give the adapters a value so their gradients are all nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    with starting_at(model, cache.depth) as slot:
        fast = heal.cached_loss(heal.Student(model), slot, cache.load(2))
    fast_grads = torch.autograd.grad(fast, trained)
    slow = heal.naive_loss(model, dense, BATCHES[2], cache.topk)
    slow_grads = torch.autograd.grad(slow, trained)
    assert fast.item() == pytest.approx(slow.item(), rel=1e-5, abs=1e-7)  # the head by rows: another sum order
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "gemma3_text softcapped"])
def test_the_students_topk_logits_are_the_full_heads_at_those_tokens(arch):
    """``Student`` scores the teacher's top-k tokens from the head's rows alone: equal to the full model's
    logits gathered at those tokens, on every architecture (bias, tied heads, Gemma's soft-capping)."""
    model = tiny_model(arch.split()[0])
    if "softcapped" in arch:
        model.config.final_logit_softcapping = 3.0  # the cap bends the logits: a head that skipped it differs
    indices = torch.randint(0, model.config.vocab_size, (*BATCHES[0].shape, 7))
    with torch.no_grad():
        full = model(input_ids=BATCHES[0], use_cache=False).logits.gather(-1, indices)
        fast = heal.Student(model)(BATCHES[0], indices)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)
    assert "softcapped" not in arch or full.abs().max() < 3.0


def test_the_pruned_model_is_its_own_exact_teacher(tmp_path):
    """The prune flow's teacher (the pruned model with its layers and folded weights put back) caches exactly what
    a separate dense copy does."""
    dense, model = tiny_model("llama"), tiny_model("llama")
    layers = DenseLayers.of(model)
    result = ghostlayers.prune(model, BATCHES, layers="2:4", method="replaceme", alpha=0.5, progress=False)
    depth = heal.heal_depth(model)
    (tmp_path / "own").mkdir()
    (tmp_path / "dense").mkdir()
    with heal.dense_teacher(model, layers, result.unfolded):
        own = heal.cache_teacher(model, BATCHES, depth, 10, tmp_path / "own", progress=False)
    separate = heal.cache_teacher(dense, BATCHES, depth, 10, tmp_path / "dense", progress=False)
    for i in range(len(own)):
        a, b = own.load(i), separate.load(i)
        assert torch.equal(a.state, b.state) and torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)


@pytest.mark.parametrize(
    ("method", "params", "lr", "share"), [("none", "lora", 1e-2, 0.8), ("ghost", "operator", 1e-3, 0.95)]
)
def test_healing_lowers_the_kl_on_the_training_windows(method, params, lr, share, tmp_path):
    """(e) A few hundred tokens lower the loss on the windows trained on."""
    result, dense = pruned(method, layers="1:4")
    cache = cached(dense, result.model, tmp_path)
    before = heal.cache_loss(result.model, cache)
    done = heal.heal(result.model, cache, HealSettings(300, params, lr, 10), progress=False)
    assert done.steps >= 300 // 32 and done.tokens >= 300
    assert done.loss_before == pytest.approx(before)
    assert done.loss_after < share * before
    assert heal.cache_loss(result.model, cache) == pytest.approx(done.loss_after)
    assert result.model.config.ghostlayers["heal"]["kept"]


def test_a_heal_worse_on_a_domain_is_undone(tmp_path):
    """The guard: a learning rate far too large makes the healed model worse than the closed form on held-out text;
    the heal is then not kept and the model is the closed form again, exactly."""
    result, dense = pruned("ghost", layers="1:4")
    model = result.model
    cache = cached(dense, model, tmp_path)
    closed, grads = logits(model, BATCHES[0]), [p.requires_grad for p in model.parameters()]
    done = heal.heal(model, cache, HealSettings(200, "operator,lora", 0.5, 10), HELDOUT, result.unfolded,
                     progress=False)  # fmt: skip
    assert not done.kept and done.hurt
    assert set(done.scores) == {"plain pruning", "closed form", "healed"}
    assert all(done.scores["healed"][d] > done.scores["closed form"][d] for d in done.hurt)
    assert "Not kept" in "\n".join(heal_markdown(done.to_dict()))
    assert torch.equal(logits(model, BATCHES[0]), closed)
    assert [p.requires_grad for p in model.parameters()] == grads


def test_kept_lora_still_shrinks_to_plain_pruning(tmp_path):
    """A kept LoRA heal adds its base weights to ``unfolded``: α = 0 is still plain pruning (a model pruned with
    ``none``), so the report's no-recovery row stays what it says."""
    result, dense = pruned("replaceme")
    model = result.model
    cache = cached(dense, model, tmp_path)
    done = heal.heal(model, cache, HealSettings(200, "lora", 1e-3, 10), unfolded=result.unfolded, progress=False)
    assert done.kept and not done.scores and "unguarded" in "\n".join(heal_markdown(done.to_dict()))
    plain, _ = pruned("none")
    with repair_scaled(model, 0.0, result.unfolded):
        torch.testing.assert_close(logits(model, BATCHES[0]), logits(plain.model, BATCHES[0]), rtol=0, atol=1e-6)


def test_the_boundary_is_the_first_layer_healing_changes():
    assert heal.heal_depth(pruned("ghost")[0].model) == 2
    assert heal.heal_depth(pruned("replaceme")[0].model) == 1  # its fold rewrote layer 1's down-projection
    assert heal.heal_depth(pruned("ghost", layers="4:6")[0].model) == 3  # the run ends the stack: the norm's operator


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (dict(heal=0), "--heal 0 is not a token count"),
        (dict(heal=10**12), "is not a token count"),
        (dict(heal=1000, heal_params="weights"), "--heal-params 'weights'"),
        (dict(heal=1000, heal_lr=0.0), "--heal-lr 0.0"),
        (dict(heal=1000, heal_topk=0), "--heal-topk 0"),
        (dict(heal=1000, method="none", heal_params="operator"), "--method none has no stream operator"),
        (dict(heal=1000, method="auto", heal_params="operator"), "--method auto may choose"),
        (dict(heal=1000, offload=True), "drop --offload"),
    ],
)
def test_bad_heal_settings_are_refused_when_the_recipe_is_made(changes, words):
    """(f) Refused before any work: the recipe checks itself when made (the CLI makes it first)."""
    with pytest.raises(GhostLayersError) as error:
        PruneRecipe.from_dict({}, **changes)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_settings_resolve_what_trains():
    assert HealSettings(10).trained("ghost") == ("operator",)
    assert HealSettings(10).trained("refit") == ("lora",)
    assert HealSettings(10, "lora,operator").trained("linearpatch") == ("operator", "lora")
    assert PruneRecipe.from_dict({}, heal=5000, method="replaceme").heal_settings.trained("replaceme") == ("lora",)
    assert PruneRecipe.from_dict({}).heal_settings is None
    assert math.isclose(HealSettings(10).lr, 1e-4)


def prune_args(folder: Path, *extra: str) -> list[str]:
    calib = str(folder.parent / "calib.txt")
    return ["prune", "--model", str(folder), "--calibration", calib, "--layers", "2:4", "--num-samples", "8",
            "--seq-len", "16", "--batch-size", "2", "--device", "cpu", *extra]  # fmt: skip


def test_prune_heal_then_heal_a_saved_folder(model_folder, tmp_path):
    """``prune --heal`` reports healed, unhealed and plain pruning per held-out domain and saves the model with its
    heal recorded; ``ghostlayers heal`` heals a saved plain folder with LoRA into a plain checkpoint."""
    runner = CliRunner()
    out = tmp_path / "ghost"
    result = runner.invoke(app, prune_args(model_folder, "--heal", "200", "--heal-lr", "1e-3", "--output", str(out)))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["heal"]["params"] == ["operator"] and report["heal"]["tokens"] >= 200
    assert set(report["heal"]["scores"]) == {"plain pruning", "closed form", "healed"}
    assert "## Healing" in (out / "report.md").read_text() and "Healing" in result.output
    assert ghostlayers.load(out).config.ghostlayers["heal"]["kept"] == report["heal"]["kept"]
    plain, healed = tmp_path / "plain", tmp_path / "healed"
    assert runner.invoke(app, prune_args(model_folder, "--method", "none", "--output", str(plain))).exit_code == 0
    result = runner.invoke(app, ["heal", str(plain), "--heal", "200", "--heal-lr", "1e-3", "--output", str(healed)])
    assert result.exit_code == 0, result.output
    assert not (healed / "modeling_ghostlayers.py").exists()
    summary = json.loads((healed / "report.json").read_text())
    assert summary["command"] == "heal" and summary["heal"]["params"] == ["lora"]
    reloaded = AutoModelForCausalLM.from_pretrained(healed, trust_remote_code=False).eval()
    before = AutoModelForCausalLM.from_pretrained(plain, trust_remote_code=False).eval()
    changed = not torch.equal(logits(reloaded, BATCHES[0]), logits(before, BATCHES[0]))
    assert changed == summary["heal"]["kept"]


@pytest.mark.parametrize(
    "args",
    [
        ["--heal", "0"],
        ["--heal", str(10**12)],
        ["--heal", "100", "--method", "none", "--heal-params", "operator"],
        ["--heal", "100", "--heal-params", "all"],
        ["--heal", "100", "--heal-topk", "0"],
    ],
)
def test_bad_heal_options_are_one_error_line_and_no_folder(model_folder, tmp_path, args):
    """(f) On the command line: exit code 2, one ``error:`` line, nothing written."""
    result = CliRunner().invoke(app, prune_args(model_folder, *args, "--output", str(tmp_path / "out")))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert not (tmp_path / "out").exists()


def test_heal_refuses_a_folder_it_cannot_heal(model_folder, tmp_path):
    """Not a pruned folder, or operator training for a plain folder: one error line before any work."""
    runner = CliRunner()
    result = runner.invoke(app, ["heal", str(model_folder), "--heal", "100", "--output", str(tmp_path / "o")])
    assert result.exit_code == 2 and result.output.startswith("error:") and "not a model folder" in result.output
    plain = tmp_path / "plain"
    assert runner.invoke(app, prune_args(model_folder, "--method", "none", "--output", str(plain))).exit_code == 0
    args = ["heal", str(plain), "--heal", "100", "--heal-params", "operator", "--output", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "no stream operator" in result.output, result.output
    assert not (tmp_path / "o").exists()


def healed(where: Path, settings: HealSettings, monkeypatch, die_after: int | None = None) -> tuple:
    """A tiny ghost model (float64) healed with its work folder at ``where``; Ctrl-C in the backward pass of step
    ``die_after + 1`` when given. Returns the model, the teacher runs and the steps taken."""
    result, dense = pruned("ghost", torch.float64)
    teachers, steps = [], []

    @contextlib.contextmanager
    def teacher():
        teachers.append(1)
        yield dense

    with monkeypatch.context() as patch:
        real = torch.Tensor.backward

        def backward(self, *args, **kwargs):
            if len(steps) == die_after:
                raise KeyboardInterrupt
            steps.append(1)
            return real(self, *args, **kwargs)

        patch.setattr(torch.Tensor, "backward", backward)
        heal.heal_pruned(result.model, BATCHES, settings, where, teacher, progress=False)
    return result.model, len(teachers), len(steps)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("params", ["operator", "operator,lora"])
def test_a_killed_heal_resumes_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch, params):
    """Ctrl-C after 3 steps of 10 (checkpoints every 2 steps, and one on Ctrl-C): the same call goes on from
    the checkpoint, reading the teacher's cache back instead of running the teacher, and its trained weights
    equal a straight heal's (float64); the finished heal leaves nothing in its folder."""
    settings = HealSettings(10 * BATCHES[0].numel(), params, 1e-2, 10)
    work, straight_work = tmp_path / "work", tmp_path / "straight"
    straight, _, steps = healed(straight_work, settings, monkeypatch)
    assert steps == 10
    monkeypatch.setattr(heal, "CHECKPOINT_EVERY", 2)
    with pytest.raises(KeyboardInterrupt):
        healed(work, settings, monkeypatch, die_after=3)
    assert work.is_dir() and list(work.glob("checkpoint-*.pt")) and (work / "teacher.json").is_file()
    assert torch.load(next(work.glob("checkpoint-*.pt")), weights_only=True)["step"] == 3  # saved on Ctrl-C
    resumed, teacher_ran, steps = healed(work, settings, monkeypatch)
    assert (teacher_ran, steps) == (0, 7)  # the cache was read back; the 7 steps left after step 3's checkpoint
    assert_same_weights(resumed, straight)
    assert not work.exists() and not straight_work.exists()
    closed_form = pruned("ghost", torch.float64)[0].model
    assert any(not torch.equal(a, b) for a, b in zip(resumed.parameters(), closed_form.parameters(), strict=True))


SIX_STEPS = HealSettings(6 * BATCHES[0].numel(), "operator", 1e-2, 10)


@pytest.fixture(scope="module")
def straight_and_killed(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A straight heal of six steps, and the work folder of the same heal killed after three."""
    with pytest.MonkeyPatch.context() as patch:
        straight = healed(tmp_path_factory.mktemp("straight") / "work", SIX_STEPS, patch)[0]
        killed = tmp_path_factory.mktemp("killed") / "work"
        patch.setattr(heal, "CHECKPOINT_EVERY", 2)
        with pytest.raises(KeyboardInterrupt):
            healed(killed, SIX_STEPS, patch, die_after=3)
    return straight, killed


@pytest.mark.parametrize("variant", ["fifo", "link to /dev/zero", "folder", "empty", "truncated", "mistyped"])
@pytest.mark.parametrize("target", ["teacher.json", "teacher/000001.pt", "checkpoint"])
def test_a_killed_heals_files_made_hostile_are_made_again(
    straight_and_killed, tmp_path, monkeypatch, within_seconds, target, variant
):
    """The files a killed heal leaves (the cache's record, one batch of the teacher's cache, the checkpoint),
    each replaced by a FIFO, a link to /dev/zero, a folder, an empty, truncated or mistyped file: the same call
    neither hangs nor fails, makes again what it cannot read (the teacher's cache by running the teacher, the
    checkpoint's steps by training them) and ends with a straight heal's weights (float64)."""
    (straight, killed), work = straight_and_killed, tmp_path / "work"
    shutil.copytree(killed, work)
    path = next(work.glob("checkpoint-*.pt")) if target == "checkpoint" else work / target
    mistyped = torch_bytes(["a", "list"]) if path.suffix == ".pt" else b'["a", "list"]'  # well formed, wrong shape
    plant_hostile(path, variant, {"mistyped": mistyped})
    within_seconds(20)
    resumed, teacher_ran, steps = healed(work, SIX_STEPS, monkeypatch)
    assert teacher_ran == (target != "checkpoint") and steps == (6 if target == "checkpoint" else 3)
    assert_same_weights(resumed, straight)
    assert not work.exists()


def test_a_heal_folder_of_other_inputs_is_cleared_not_resumed(tmp_path):
    """A checkpoint left by a heal of other settings is not read: the heal starts from the closed form."""
    settings = HealSettings(4 * BATCHES[0].numel(), "operator", 1e-2, 10)
    result, dense = pruned("ghost", torch.float64)
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoint-0123456789abcdef.pt").write_bytes(b"not a checkpoint")
    (work / "teacher.json").write_text('{"key": "another model", "sizes": [1]}')
    heal.heal_pruned(result.model, BATCHES, settings, work, lambda: contextlib.nullcontext(dense), progress=False)
    again, dense = pruned("ghost", torch.float64)
    heal.heal_pruned(again.model, BATCHES, settings, tmp_path / "fresh", lambda: contextlib.nullcontext(dense),
                     progress=False)  # fmt: skip
    for a, b in zip(result.model.parameters(), again.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def dense_text(model, tokenizer, sequences: int = 40, length: int = 120) -> str:
    """Text the dense model itself writes (sampled): distilling toward it lowers held-out perplexity, so a heal
    on it is kept, unlike on uniform random words."""
    torch.manual_seed(0)
    with torch.no_grad():
        ids = model.generate(torch.randint(4, 128, (sequences, 1)), max_new_tokens=length, do_sample=True, top_k=0,
                             pad_token_id=0)  # fmt: skip
    return "\n".join(tokenizer.decode(row, skip_special_tokens=True) for row in ids)


def test_a_kept_heal_is_written_reloads_and_scores_what_the_run_reported(tmp_path):
    """``ghostlayers heal`` with LoRA on text the dense model wrote: the heal is kept, the saved plain checkpoint
    (no remote code) gives other logits than the unhealed folder (it trained something, and the adapters were
    merged into what was saved) and, reloaded, scores on the run's held-out windows the perplexity the report
    gives for the healed model."""
    from ghostlayers.jobs.runs import heal_recipe, prepare
    from ghostlayers.measure.perplexity import perplexity

    folder = tmp_path / "tiny-llama"
    dense, tokenizer = tiny_model("llama"), tiny_tokenizer()
    dense.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(dense_text(dense, tokenizer))
    runner, plain, healed = CliRunner(), tmp_path / "plain", tmp_path / "healed"
    assert runner.invoke(app, prune_args(folder, "--method", "none", "--output", str(plain))).exit_code == 0
    args = ["heal", str(plain), "--heal", "1600", "--heal-lr", "3e-3", "--output", str(healed)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((healed / "report.json").read_text())["heal"]
    assert summary["params"] == ["lora"] and summary["kept"], summary
    assert not (healed / "modeling_ghostlayers.py").exists() and not list(tmp_path.glob(".healed.ghostlayers-*"))
    reloaded = AutoModelForCausalLM.from_pretrained(healed, trust_remote_code=False).eval()
    before = AutoModelForCausalLM.from_pretrained(plain, trust_remote_code=False).eval()
    assert not torch.allclose(logits(reloaded, BATCHES[0]), logits(before, BATCHES[0]), atol=1e-4)
    ready = prepare(heal_recipe(plain, None), "cpu", Console(quiet=True), evaluate=False)
    for domain, windows in ready.calib.heldout.items():
        got = perplexity(reloaded, windows, batch_size=2, progress=False)
        assert got == pytest.approx(summary["scores"]["healed"][domain], rel=1e-4), domain
        assert got < summary["scores"]["closed form"][domain]


def test_a_kept_operator_heal_is_written_and_reloads_with_the_score_the_run_reported(tmp_path):
    """``prune --method ghost --heal`` on text the dense model wrote, a pass over 2048 calibration tokens: the
    operator heal is kept, and the saved folder, reloaded through its remote code, scores on the run's held-out
    windows the perplexity the report gives for the healed model, below the closed form's. (On 128 tokens, 12
    passes over them, the operator's C × C entries fit the training windows and lose on the held-out ones.)"""
    from ghostlayers.jobs.runs import prepare
    from ghostlayers.measure.perplexity import perplexity

    folder = tmp_path / "tiny-llama"
    dense, tokenizer = tiny_model("llama"), tiny_tokenizer()
    dense.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(dense_text(dense, tokenizer))
    out, calib = tmp_path / "ghost", str(tmp_path / "calib.txt")
    common = dict(calibration=calib, layers="2:4", num_samples=64, seq_len=32, batch_size=2, method="ghost")
    args = ["prune", "--model", str(folder), "--calibration", calib, "--layers", "2:4", "--num-samples", "64",
            "--seq-len", "32", "--batch-size", "2", "--device", "cpu", "--method", "ghost", "--heal", "2048",
            "--heal-lr", "3e-3", "--heal-params", "operator", "--output", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "report.json").read_text())["heal"]
    assert summary["params"] == ["operator"] and summary["kept"], summary
    reloaded = ghostlayers.load(out).eval()
    ready = prepare(PruneRecipe(model=str(folder), **common), "cpu", Console(quiet=True), evaluate=False)
    for domain, windows in ready.calib.heldout.items():
        got = perplexity(reloaded, windows, batch_size=2, progress=False)
        assert got == pytest.approx(summary["scores"]["healed"][domain], rel=1e-4), domain
        assert got < summary["scores"]["closed form"][domain]


@pytest.mark.parametrize("other", ["another seed", "eight layers"])
def test_heal_refuses_a_teacher_the_folder_was_not_pruned_from(model_folder, tmp_path, other):
    """``--model`` of the same shapes but other weights, or of another layer count: one error line naming what
    differs and the folder's source, before the teacher runs, and nothing written."""
    runner = CliRunner()
    plain = tmp_path / "plain"
    assert runner.invoke(app, prune_args(model_folder, "--method", "none", "--output", str(plain))).exit_code == 0
    impostor = tmp_path / "impostor"
    tiny_model("llama", num_layers=8 if other == "eight layers" else 6, seed=9).save_pretrained(impostor)
    tiny_tokenizer().save_pretrained(impostor)
    args = ["heal", str(plain), "--model", str(impostor), "--heal", "100", "--output", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert "is not the model this folder was pruned from" in flat and str(model_folder) in flat, flat
    assert ("layer count 8 where the folder's source had 6" if other == "eight layers" else "embedding") in flat
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.ghostlayers-*"))
    fine = runner.invoke(app, ["heal", str(plain), "--model", str(model_folder), "--heal", "100", "--output",
                               str(tmp_path / "ok")])  # fmt: skip
    assert fine.exit_code == 0, fine.output  # the folder's own source is accepted
