"""Write a pruned model as a standard Hugging Face folder, through a ``folders.Claim``, and load it back.

The folder holds safetensors weights, the tokenizer, ``config.json`` (``model_type =
"ghostlayers_<base>"``, an ``auto_map`` and the ``ghostlayers`` record), a copy of
``modeling_ghostlayers.py`` and ``ghostlayers.json``, the list of files ghostlayers wrote there and
whether they are a model or a report.

Plain outputs are read by consumers pinned to transformers 4 (llama.cpp's converter pins 4.57), which ignore
5's ``rope_parameters`` and fall back to their default rope base without a word, and do not know the
``TokenizersBackend`` class: ``config.json`` also carries the fields 4 reads (``TRANSFORMERS4_ROPE_FIELDS``),
and the tokenizer is saved under a class both load.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import MANIFEST, Claim, write_text_nofollow, written_privately
from ghostlayers.files.reading import read_json
from ghostlayers.model import modeling_ghostlayers
from ghostlayers.model.modeling_ghostlayers import ghost_classes
from ghostlayers.model.record import PruneRecord
from ghostlayers.model.surgery import plain_view
from ghostlayers.store.card import model_card


def check_finite_weights(model: PreTrainedModel) -> None:
    """Refuse to save a model with a non-finite weight (a broken operator or merged projection)."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise GhostLayersError(
            f"Not saved: {', '.join(bad[:3])} hold NaN or infinite values. The source weights or the fitted "
            "operator are broken; check that the source model is finite and use --dtype float32."
        )


# transformers 5 writes this class name; 4 has no such class, and its generic fast tokenizer, which both
# versions load from tokenizer.json alone, is the one named instead.
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def transformers4_rope_fields(rope_parameters: dict | None) -> dict:
    """The top-level fields through which transformers 4 reads what 5 keeps in ``rope_parameters``:
    ``rope_theta`` and ``rope_scaling`` (None for unscaled rope; 4 keeps the base outside it), and for models
    with a rope per attention type (Gemma 3: ``full_attention`` and ``sliding_attention``) the global one as
    ``rope_theta``/``rope_scaling`` and the sliding one's base as ``rope_local_base_freq``."""
    if not isinstance(rope_parameters, dict):
        return {}

    def split(params: dict) -> tuple[float | None, dict | None]:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return params.get("rope_theta"), None if scaling.get("rope_type", "default") == "default" else scaling

    if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
        fields = {}
        if isinstance(full := rope_parameters.get("full_attention"), dict):
            fields["rope_theta"], fields["rope_scaling"] = split(full)
        if isinstance(local := rope_parameters.get("sliding_attention"), dict):
            fields["rope_local_base_freq"] = local.get("rope_theta")
        return {k: v for k, v in fields.items() if k == "rope_scaling" or v is not None}
    theta, scaling = split(rope_parameters)
    return {"rope_scaling": scaling} | ({"rope_theta": theta} if theta is not None else {})


def _update_json(path: Path, change: Callable[[dict], dict]) -> None:
    data = read_json(path)
    write_text_nofollow(path, json.dumps(change(data), indent=2, sort_keys=True) + "\n", replace=True)


def make_readable_by_transformers4(folder: Path) -> None:
    """Add to a saved folder what transformers 4 needs to read it as 5 does: the rope fields beside
    ``rope_parameters`` in config.json (5 reads ``rope_parameters`` first) and a tokenizer class both have."""
    if (folder / "config.json").is_file():
        _update_json(folder / "config.json", lambda c: c | transformers4_rope_fields(c.get("rope_parameters")))
    if (folder / "tokenizer_config.json").is_file():
        _update_json(folder / "tokenizer_config.json", _portable_tokenizer_class)


def _portable_tokenizer_class(config: dict) -> dict:
    name = config.get("tokenizer_class")
    return config | {"tokenizer_class": PORTABLE_TOKENIZER_CLASSES.get(name, name)} if name else config


def write_model_folder(model: PreTrainedModel, tokenizer, folder: Path) -> dict | None:
    """Save ``model`` (pruned by ``surgery.apply_pruning``) so it reloads with or without ghostlayers. A
    model with no stream operator is saved as a plain checkpoint of its base architecture, and its record
    returned for ``ghostlayers.json``; one with operators carries ``modeling_ghostlayers.py``."""
    record = PruneRecord.from_dict(model.config.ghostlayers, "this model")
    with written_privately(folder) as private:  # transformers opens its files by name, following links
        if record.needs_custom_module:
            model.save_pretrained(private)
            shutil.copyfile(modeling_ghostlayers.__file__, private / "modeling_ghostlayers.py")
        else:
            with plain_view(model):
                model.save_pretrained(private)
        if tokenizer is not None:
            tokenizer.save_pretrained(private)
        if not record.needs_custom_module:
            make_readable_by_transformers4(private)
    return None if record.needs_custom_module else record.to_dict()


def write_model(
    claim: Claim,
    model: PreTrainedModel,
    tokenizer,
    extra: Callable[[Path], None] | None = None,
    summary: dict | None = None,
) -> None:
    """Write the model folder to ``claim``'s output, with its model card (``card.model_card``: what ``summary``,
    the run's report, measured); ``extra(folder)`` may add files (reports) before the swap."""
    check_finite_weights(model)
    record: dict = {}
    with claim.folder(record) as folder:
        plain = write_model_folder(model, tokenizer, folder)
        if plain is not None:
            record["record"] = plain
        pruning = model.config.ghostlayers
        custom = PruneRecord.from_dict(pruning, "this model").needs_custom_module
        write_text_nofollow(folder / "README.md", str(model_card(pruning, summary, custom)))
        if extra is not None:
            extra(folder)


def save(
    model: PreTrainedModel,
    tokenizer,
    output: str | Path,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the model folder atomically (``write_model``); ``source`` (the source model's folder) is never
    replaced."""
    with Claim(output, overwrite, [source] if source is not None else []) as claim:
        write_model(claim, model, tokenizer, extra)
    return Path(output)


def saved_record(path: str | Path) -> dict | None:
    """The pruning record of a folder: in ``config.json`` (needs the custom module) or, for a plain
    checkpoint, in ``ghostlayers.json``; None for a folder ghostlayers did not prune. Its shape is checked here
    (``PruneRecord.from_dict``), with the file named, before any caller reads a field of it."""
    for name, key in (("config.json", "ghostlayers"), (MANIFEST, "record")):
        if not os.path.lexists(Path(path) / name):
            continue
        data = read_json(Path(path) / name)
        if data.get(key) is None:
            continue
        if not isinstance(data[key], dict):
            raise GhostLayersError(
                f"{Path(path) / name} has a malformed ghostlayers record: {key} is {str(data[key])[:60]}, not a "
                "record. Prune the source model again."
            )
        PruneRecord.from_dict(data[key], str(Path(path) / name))
        return data[key]
    return None


def is_pruned_folder(path: str | Path) -> bool:
    return saved_record(path) is not None


def from_pretrained_checked(model_class: type, path: str | Path, **kwargs) -> PreTrainedModel:
    """``model_class.from_pretrained`` that never runs a folder's code nor unpickles its weights, and refuses
    weights that do not fit the config: transformers would initialise missing tensors at random and drop
    unexpected ones, and the damaged model would be pruned and saved without a word."""
    model, info = model_class.from_pretrained(
        path, trust_remote_code=False, use_safetensors=True, output_loading_info=True, **kwargs
    )
    problems = [
        f"{len(info[key])} {key.split('_')[0]} tensors ({', '.join(sorted(map(str, info[key]))[:2])}, …)"
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if info.get(key)
    ]
    if problems:
        raise GhostLayersError(
            f"The weights of {path} do not fit its config.json: {'; '.join(problems)}. The folder is "
            "damaged or its config.json was edited: restore the model's own config and weights."
        )
    return model


def load(path: str | Path, **kwargs) -> PreTrainedModel:
    """Load a folder written by ``save`` (kwargs go to ``from_pretrained``, e.g. ``dtype``); a folder of a
    newer record format is refused."""
    data = saved_record(path)
    if data is None:
        raise GhostLayersError(f"{path} is not a ghostlayers model folder (no pruning record).")
    record = PruneRecord.from_dict(data, str(path))
    if record.needs_custom_module:
        try:
            return from_pretrained_checked(ghost_classes(record.base_model_type)[1], path, **kwargs)
        except (KeyError, AttributeError) as error:  # an unknown architecture, an operator host the model lacks
            raise GhostLayersError(
                f"{path}: its ghostlayers record does not fit the model ({error}). Prune the source model again."
            ) from error
    model = from_pretrained_checked(AutoModelForCausalLM, path, **kwargs)
    model.config.ghostlayers = data  # for reports; not saved back into a plain checkpoint
    return model
