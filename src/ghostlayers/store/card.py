"""The model card of an output folder: the ``README.md`` a hub renders, with its metadata (``base_model``,
``library_name``, ``tags``, ``pipeline_tag``, the source's license), the pruning record in a sentence, what the
run measured (only numbers its ``report.json`` holds) and how to load the folder."""

from __future__ import annotations

import contextlib
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ghostlayers.calibration.selection import describe
from ghostlayers.measure import report

TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}\n"


def source_license(source: str | None) -> str | None:
    """The license the source model's own card gives, when the source is a folder with one."""
    if source is None or not (Path(source) / "README.md").is_file():
        return None
    with contextlib.suppress(Exception):  # a card that does not parse gives no license, not an error
        return ModelCard.load(Path(source) / "README.md").data.license
    return None


def sentence(record: dict) -> str:
    """The record in a sentence: what was removed out of what, the repair, α and the heal."""
    removed, total = record["removed_layers"], record["original_num_hidden_layers"]
    text = f"{len(removed)} of {total} decoder layers ({describe(removed)}) removed, repaired with `{record['method']}`"
    if record.get("operators") or record["method"] != "none":
        text += f" at α = {record.get('alpha', 1.0):g}"
    if heal := record.get("heal"):
        kept = "kept" if heal.get("kept") else "undone by the guard (worse than the closed form on a held-out domain)"
        text += f"; healed on {heal.get('tokens', 0):,} tokens by distillation ({', '.join(heal.get('params', []))}), "
        text += kept
    return text + "."


def measured(summary: dict) -> list[str]:
    """The run's table: perplexity per text and the task average with its standard error per model, and each
    model's paired difference from plain pruning, as report.json holds them."""
    metrics = {name: m for name, m in summary.get("metrics", {}).items() if m.get("ppl") or m.get("zeroshot")}
    if not metrics:
        return []
    texts = list(dict.fromkeys(t for m in metrics.values() for t in m.get("ppl", {})))
    tasks = len(next((m["zeroshot"] for m in metrics.values() if m.get("zeroshot")), {}))
    head = ["model", *(f"perplexity {t}" for t in texts)]
    head += [f"{tasks}-task average (%)", "vs plain pruning (paired)"] if tasks else []
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    plain = metrics.get(report.PLAIN_ROW, {}).get("zeroshot")
    for name, m in metrics.items():
        cells = [name, *(f"{m['ppl'][t]:.4g}" if t in m.get("ppl", {}) else "–" for t in texts)]
        if tasks:
            mean, se = report.zeroshot_average(m["zeroshot"])
            cells.append(f"{100 * mean:.2f} ± {100 * se:.2f}")
            paired = "–"
            if plain is not None and name not in ("dense", report.PLAIN_ROW):
                diff, diff_se = report.example_average(m["zeroshot"], plain)
                paired = f"{100 * diff:+.2f} ± {100 * diff_se:.2f}"
            cells.append(paired)
        lines.append("| " + " | ".join(cells) + " |")
    recipe = summary.get("recipe", {})
    evaluation = recipe.get("eval", {})
    limit = evaluation.get("limit")
    examples = "every example" if limit is None else f"the first {limit} examples"
    return [
        "## Measured",
        "",
        f"By `ghostlayers prune --eval`: perplexity on at most {evaluation.get('ppl_windows')} windows of "
        f"{recipe.get('seq_len')} tokens of each text's held-out part; zero-shot accuracy (acc_norm where the task "
        f"has it) on {examples} of each task. The full record is in `report.json`.",
        "",
        *lines,
        "",
    ]


def loading(custom: bool) -> list[str]:
    """How to load the folder (named by where it is: the card does not depend on the folder's name, so saving
    stays deterministic)."""
    folder_name = "path/to/this/folder"
    if custom:
        why = (
            "the repair is an operator on the residual stream, defined in `modeling_ghostlayers.py` beside the weights"
        )
        call = f'AutoModelForCausalLM.from_pretrained("{folder_name}", trust_remote_code=True)'
    else:
        why = "a plain checkpoint of the base architecture: no custom code"
        call = f'AutoModelForCausalLM.from_pretrained("{folder_name}")'
    return ["## Loading", "", f"{why[0].upper()}{why[1:]}.", "", "```python", "from transformers import "
            "AutoModelForCausalLM", "", f"model = {call}", "```", ""]  # fmt: skip


def model_card(record: dict, summary: dict | None, custom: bool) -> ModelCard:
    """The card of a folder whose pruning record is ``record`` and whose run reported ``summary``."""
    checkpoint = (record.get("model") or {}).get("checkpoint") or record.get("source_model")
    data = ModelCardData(
        base_model=checkpoint,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["ghostlayers", "layer-pruning", record["method"]],
        license=source_license(record.get("source_model")),
    )
    source = (record.get("model") or {}).get("label") or checkpoint
    removed = len(record["removed_layers"])
    body = [
        f"# {checkpoint}, {removed} of {record['original_num_hidden_layers']} layers removed ({record['method']})",
        "",
        f"{source}, made shallower by [ghostlayers](https://pypi.org/project/ghostlayers/): {sentence(record)}",
        "",
        *measured(summary or {}),
        *loading(custom),
    ]
    return ModelCard.from_template(data, template_str=TEMPLATE, body="\n".join(body).rstrip())
