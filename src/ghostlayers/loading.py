"""Load a model and tokenizer from a short name, a local folder or a hub id."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ghostlayers.checks import check_finite
from ghostlayers.errors import GhostLayersError
from ghostlayers.modeling_ghostlayers import ghost_classes
from ghostlayers.offload import Checkpoint
from ghostlayers.options import check_dtype
from ghostlayers.record import PruneRecord
from ghostlayers.saving import from_pretrained_checked, is_pruned_folder, load, saved_record
from ghostlayers.sources.models import resolve_model


def parse_dtype(dtype: str) -> torch.dtype:
    check_dtype(dtype)
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """``auto`` (cuda when available) or a device torch knows and this machine has."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as error:
        raise GhostLayersError(f"--device {device} is not a device: use auto, cpu, cuda or cuda:N.") from error
    if kind == "cuda" and not torch.cuda.is_available():
        raise GhostLayersError(f"--device {device}: this machine has no CUDA device. Use --device cpu or auto.")
    return device


def check_model_source(name_or_path: str) -> None:
    """A name written as a path (``/…``, ``./…``, ``~…``) must be an existing folder: otherwise it would be
    taken for a hub id and fail with the hub's message."""
    if name_or_path.startswith(("/", "./", "../", "~")) and not Path(name_or_path).expanduser().is_dir():
        raise GhostLayersError(
            f"Model folder {name_or_path} does not exist: give a model folder, a hub id or a short name."
        )


def placement(device: str) -> dict:
    """``from_pretrained`` arguments: ``device_map="auto"`` (accelerate) spreads a model over several GPUs."""
    if device == "auto" and torch.cuda.device_count() > 1:
        return {"device_map": "auto"}
    return {}


def load_tokenizer(path: str) -> object:
    """The folder's tokenizer; code in the folder is never run (transformers would ask whether to). A folder
    with operators gets its config read by ghostlayers' class: transformers' generic one, which it falls back
    to without remote code, warns that a ``ghostlayers_<base>`` model type may not be supported."""
    record = saved_record(path) if Path(path).is_dir() else None
    config = {}
    if record is not None and (pruned := PruneRecord.from_dict(record, path)).needs_custom_module:
        with contextlib.suppress(KeyError):  # an unknown architecture: the model's loading names it
            config = {"config": ghost_classes(pruned.base_model_type)[0].from_pretrained(path)}
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **config)


@contextlib.contextmanager
def loading_errors(name_or_path: str, path: str) -> Iterator[None]:
    """transformers' and safetensors' errors on a missing, damaged or foreign folder as one message."""
    try:
        yield
    except GhostLayersError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        folder = Path(path)
        if "custom code" in str(error):
            cause = "it needs code of its own (auto_map), and ghostlayers never runs code from a model folder"
        elif folder.is_dir() and not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
            cause = "its weights are pickle (.bin), which can run code when read: save them as safetensors"
        elif folder.is_dir():
            cause = "its files are incomplete or damaged: download or save the model again"
        else:
            cause = "pass a local model folder, a hub id (with the hub reachable) or a short name such as smollm2-135m"
        raise GhostLayersError(
            f"Could not load model '{name_or_path}' ({type(error).__name__}: {' '.join(str(error).split())[:200]}): "
            f"{cause}."
        ) from error


def load_model_and_tokenizer(
    name_or_path: str, dtype: str = "float32", device: str = "auto"
) -> tuple[PreTrainedModel, object]:
    """A model in eval mode on ``device``; a folder written by ghostlayers loads with its operators."""
    torch_dtype = parse_dtype(dtype)
    resolve_device(device)
    check_model_source(name_or_path)
    path = resolve_model(name_or_path)
    with loading_errors(name_or_path, path):
        tokenizer = load_tokenizer(path)
        if is_pruned_folder(path):
            model = load(path, dtype=torch_dtype, **placement(device))
        else:
            model = from_pretrained_checked(AutoModelForCausalLM, path, dtype=torch_dtype, **placement(device))
    if not placement(device):
        model = model.to(resolve_device(device))
    weights = dict(model.named_parameters())  # a NaN weight would give a NaN perplexity, reported as a result
    check_finite(weights, f"The weights of {name_or_path}", "The folder is damaged or was saved broken.")
    return model.eval(), tokenizer


def load_for_offload(name_or_path: str, dtype: str = "float32", device: str = "auto") -> tuple[object, object]:
    """A ``Checkpoint`` of the model's files (a local folder, or a hub id downloaded first) and the
    tokenizer, for ``--offload``: no weights are loaded yet."""
    torch_dtype = parse_dtype(dtype)
    check_model_source(name_or_path)
    path = resolve_model(name_or_path)
    if is_pruned_folder(path):
        raise GhostLayersError(f"{path} is already pruned: --offload calibrates an original model folder.")
    if not Path(path).is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as error:  # the hub client raises many types when offline or the id is wrong
            raise GhostLayersError(
                f"Could not download '{name_or_path}' for --offload ({type(error).__name__}): pass a local model "
                "folder, or a hub id with the hub reachable."
            ) from error
    with loading_errors(name_or_path, path):
        return Checkpoint(path, torch_dtype, resolve_device(device)), load_tokenizer(path)
