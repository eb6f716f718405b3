"""Zero-shot tasks: building them from BIG-bench-shaped data, and lm-eval's scores against a hand scorer."""

from __future__ import annotations

import io
import json
import logging
import socket
import tarfile

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ghostlayers import cache, zeroshot
from ghostlayers.errors import GhostLayersError
from ghostlayers.surgery import become_ghost_model


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB - 3, (n,), generator=g))


def fixture_task(n: int = 12, seed: int = 0) -> dict:
    """A BIG-bench task.json: 2-4 choices of 1-4 words, one right; the first example has no context."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        k = int(torch.randint(2, 5, (1,), generator=g))
        choices = [words(g, int(torch.randint(1, 5, (1,), generator=g))) for _ in range(k)]
        right = int(torch.randint(0, k, (1,), generator=g))
        scores = {c: int(j == right) for j, c in enumerate(choices)}
        examples.append({"input": words(g, 3 + i % 4) if i else "", "target_scores": scores})
    return {"examples": examples}


def fixture_winogrande(seed: int = 1, n: int = 6) -> dict:
    """natural-instructions subtask029 targets: twin sentences with a blank and their two answers."""
    g = torch.Generator().manual_seed(seed)
    targets = []
    for _ in range(n):
        x, y, head, tail1, tail2 = words(g, 1), words(g, 1), words(g, 3), words(g, 2), words(g, 3)
        targets.append(
            f"Sentence 1: {head} {x} {y} _ {tail1} \nAnswer1: {x}. \nSentence 2: {head} {x} {y} _ {tail2} \n"
            f"Answer2: {y}."
        )
    return {"examples": [{"input": "Context Word: w1.", "target": targets}]}


def ghost_model():
    """A tiny llama turned into the dynamically created pruned-model class, as the pipeline does."""
    model = tiny_model("llama", num_layers=2)
    become_ghost_model(model, "llama")
    assert type(model).__module__ == "ghostlayers.modeling_ghostlayers"
    assert model.config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return model


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hand_scores(model, tokenizer, example: dict) -> list[float]:
    """Sum of log-probabilities of each choice's continuation tokens, straight from the model's logits."""
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731  (word-level: no merges across the seam)
    if "continuation" in example:  # one context per choice, the shared rest scored after it
        pairs = [(encode(c), encode(example["continuation"])) for c in example["choices"]]
    else:  # lm-eval scores after BOS when the context is empty
        context = encode(example["context"]) or [tokenizer.bos_token_id]
        pairs = [(context, encode(c)) for c in example["choices"]]
    scores = []
    for context, continuation in pairs:
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logp = model(ids).logits[0, len(context) - 1 : -1].double().log_softmax(-1)
        scores.append(float(logp[torch.arange(len(continuation)), torch.tensor(continuation)].sum()))
    return scores


def no_network(monkeypatch) -> list:
    """Refuse and record connection attempts (datasets' download counter swallows the errors)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access refused by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_converters():
    task = {"examples": [
        {"input": " Why? ", "target_scores": {"a": 0, "b": 1}},
        {"input": "Tie", "target_scores": {"a": 1, "b": 1}},
        {"input": "", "target_scores": {"x y.": 1.0, "y x.": 0.0}},
    ]}  # fmt: skip
    assert zeroshot.target_scores_examples(task, "Q: {}\nA:") == [
        {"context": "Q: Why?\nA:", "choices": ["a", "b"], "gold": 1},
        {"context": "", "choices": ["x y.", "y x."], "gold": 0},
    ]
    head = "The rats fled their holes for the open spaces since the "
    target = (
        f"Sentence 1: {head}_ were crowded for them. \nAnswer1: holes. \n"
        f"Sentence 2: {head}_ were roomy. \nAnswer2: spaces."
    )
    assert zeroshot.winogrande_examples({"examples": [{"input": "", "target": [target, "garbled"]}]}) == [
        {"choices": [head + "holes", head + "spaces"], "continuation": "were crowded for them.", "gold": 0},
        {"choices": [head + "holes", head + "spaces"], "continuation": "were roomy.", "gold": 1},
    ]


def test_lm_eval_agrees_with_hand_scoring(tmp_path, monkeypatch):
    model, tokenizer = ghost_model(), tiny_tokenizer()
    sources = {
        "gl_fixture": zeroshot.target_scores_examples(fixture_task()),
        "gl_fixture_wino": zeroshot.winogrande_examples(fixture_winogrande()),
    }
    tasks = tmp_path / "tasks"
    for name, examples in sources.items():
        zeroshot.write_task(name, examples, tasks)
    # tasks whose gold is the hand scorer's pick: lm-eval scores 1.0 there only if it agrees on every example
    picks = {}
    for name in sources:
        examples = read(tasks / f"{name}.jsonl")
        scores = [zip(hand_scores(model, tokenizer, e), e["choices"], strict=True) for e in examples]
        scores = [list(s) for s in scores]  # (log-likelihood, choice) per choice
        for metric, norm in (("acc", lambda c: 1.0), ("acc_norm", lambda c: len(c.encode()))):
            normed = [[ll / norm(c) for ll, c in s] for s in scores]
            picks[name, metric] = pick = [max(range(len(s)), key=s.__getitem__) for s in normed]
            relabelled = [{**e, "gold": p} for e, p in zip(examples, pick, strict=True)]
            zeroshot.write_task(f"{name}_{metric}", relabelled, tasks)
    names = [n for s in sources for n in (s, f"{s}_acc", f"{s}_acc_norm")]
    attempts = no_network(monkeypatch)
    warnings: list[str] = []  # lm-eval's warning about a model object, printed once per evaluated model
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("lm_eval.models.huggingface").addHandler(handler)
    try:
        result = zeroshot.evaluate_zeroshot(model, tokenizer, names, limit=None, batch_size=3, task_dir=tasks)
    finally:
        logging.getLogger("lm_eval.models.huggingface").removeHandler(handler)
    assert not attempts
    assert not [w for w in warnings if "not of type" in w]
    for name in sources:
        gold = [e["gold"] for e in read(tasks / f"{name}.jsonl")]
        for metric in ("acc", "acc_norm"):
            expected = sum(p == g for p, g in zip(picks[name, metric], gold, strict=True)) / len(gold)
            assert result[name][metric] == pytest.approx(expected, abs=1e-12), (name, metric)
            assert result[f"{name}_{metric}"][metric] == 1.0, (name, metric)
        assert result[name]["n"] == len(gold) and "acc_stderr" in result[name]
    assert 0 < result["gl_fixture"]["acc"] < 1  # a check with teeth: right and wrong picks, and length
    assert picks["gl_fixture", "acc"] != picks["gl_fixture", "acc_norm"]  # normalisation changes some


def fake_bigbench(path) -> None:
    """A tarball holding a small fixture at every member the offline tasks read."""
    with tarfile.open(path, "w:gz") as tar:
        for i, (name, (members, _)) in enumerate(zeroshot.SOURCES.items()):
            for j, member in enumerate(members):
                content = fixture_winogrande(i) if "winogrande" in name else fixture_task(seed=i * 10 + j)
                data = json.dumps(content).encode()
                info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{member}/task.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_offline_tasks_build_once_and_run(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    fake_bigbench(tmp_path / "bb.tar.gz")
    folder = zeroshot.offline_task_dir(tmp_path / "bb.tar.gz")
    assert folder == tmp_path / "cache" / "zeroshot" / f"v{zeroshot.VERSION}"
    first = {p.name: p.read_text() for p in folder.iterdir()}
    assert sorted(first) == sorted(f"{t}.{ext}" for t in zeroshot.OFFLINE_TASKS for ext in ("jsonl", "yaml"))
    assert len(read(folder / "gl_goal_step_wikihow.jsonl")) == 36  # three subtasks
    assert len(read(folder / "gl_winogrande.jsonl")) == 12  # two sentences a twin pair
    (tmp_path / "bb.tar.gz").unlink()
    assert zeroshot.offline_task_dir() == folder  # built once: the archive is not needed again
    for p in folder.iterdir():  # deterministic: a rebuild writes the same files
        p.unlink()
    fake_bigbench(tmp_path / "bb.tar.gz")
    zeroshot.offline_task_dir(tmp_path / "bb.tar.gz")
    assert {p.name: p.read_text() for p in folder.iterdir()} == first
    attempts = no_network(monkeypatch)
    model, tokenizer = ghost_model(), tiny_tokenizer()
    result = zeroshot.evaluate_zeroshot(model, tokenizer, ["gl_social_iqa", "gl_winogrande"], 5, 2)
    assert not attempts
    assert result["gl_social_iqa"]["n"] == 5 and result["gl_winogrande"]["n"] == 5
    assert tokenizer.pad_token is None  # lm-eval padded a copy, not the caller's tokenizer
    with pytest.raises(GhostLayersError, match="gl_nope.*gl_social_iqa"):
        zeroshot.evaluate_zeroshot(model, tokenizer, ["gl_nope"], 5, 2)


def test_hub_task_offline_names_the_offline_tasks(tmp_path):
    expected = pytest.raises(GhostLayersError, match="need the Hugging Face hub.*gl_social_iqa")
    with cache.offline_hub(), expected:  # as on a machine without the hub, minus the retries
        zeroshot.evaluate_zeroshot(ghost_model(), tiny_tokenizer(), ["arc_easy"], 2, 2, task_dir=tmp_path)


@pytest.mark.slow
def test_real_offline_tasks_and_smollm2():
    folder = zeroshot.offline_task_dir()
    for task in zeroshot.OFFLINE_TASKS:
        examples = read(folder / f"{task}.jsonl")
        # BIG-bench's cause_and_effect has only 51 pairs; every other task has hundreds or thousands
        assert len(examples) >= (51 if task == "gl_cause_and_effect" else 200), task
        for e in examples:
            choices = e["choices"]
            assert len(set(choices)) == len(choices) >= 2 and all(c.strip() for c in choices), e
            assert 0 <= e["gold"] < len(choices)
            assert e.get("context") or e.get("continuation") or task == "gl_cause_and_effect"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ghostlayers.sources.models import resolve_model

    path = resolve_model("smollm2-135m")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    result = zeroshot.evaluate_zeroshot(model, tokenizer, ["gl_social_iqa"], limit=100, batch_size=16)
    siqa = result["gl_social_iqa"]  # measured 0.40 / 0.40; chance is 1/3
    assert siqa["n"] == 100 and siqa["acc"] > 0.36 and siqa["acc_norm"] > 0.36
