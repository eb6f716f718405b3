"""Load a model and tokenizer from a short name, a local folder or a hub id."""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import struct
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ghostlayers.config.settings import check_dtype
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.reading import METADATA_BYTES, TOKENIZER_BYTES, open_regular, parse, read_json
from ghostlayers.model.checkpoint import Checkpoint
from ghostlayers.model.modeling_ghostlayers import ghost_classes
from ghostlayers.model.record import PruneRecord
from ghostlayers.numerics.finite import check_finite
from ghostlayers.sources.models import resolve_model
from ghostlayers.store.saving import from_pretrained_checked, is_pruned_folder, load, saved_record


def parse_dtype(dtype: str) -> torch.dtype:
    check_dtype(dtype)
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """``auto`` (cuda when available) or a device torch knows and this machine has: an absent GPU, a CUDA index
    beyond the count or ``meta`` (no data at all) is refused here, before any work, not by torch midway."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise GhostLayersError(f"--device {device} is not a device: use auto, cpu, cuda or cuda:N.") from error
    present = {"cpu": True, "cuda": torch.cuda.is_available()}
    for kind in ("mps", "xpu"):
        backend = getattr(torch.backends, kind, None) or getattr(torch, kind, None)
        present[kind] = bool(backend is not None and getattr(backend, "is_available", lambda: False)())
    if parsed.type not in present:
        raise GhostLayersError(f"--device {device}: ghostlayers runs on cpu, cuda, mps or xpu. Use --device auto.")
    if not present[parsed.type]:
        raise GhostLayersError(
            f"--device {device}: this machine has no {parsed.type.upper()} device. Use --device cpu or auto."
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise GhostLayersError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices, numbered from 0."
        )
    return device


# Far above any model's (the largest have under 200 layers and 128 heads), far below what fills a memory.
CONFIG_BOUNDS = {
    "num_hidden_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
}
HEADER_BYTES = 256 << 20  # a safetensors header: a JSON list of tensor names and shapes


def _non_finite(config: dict) -> list[str]:
    """The keys, at any depth, of the config's numbers that are NaN or infinite."""
    bad, stack = [], [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{key}.{k}".lstrip("."), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
    return sorted(bad)


def weight_dtypes(folder: Path) -> dict[str, str] | None:
    """The safetensors dtype of every tensor of ``folder``'s weights, by name, from their headers alone (no tensor
    is read): the files its index names, else every ``*.safetensors``; None when it has none."""
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.exists():
        weight_map = read_json(index, "the weights index").get("weight_map") or {}
        named = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        files = [folder / name for name in sorted(named) if isinstance(name, str) and "/" not in name]
    dtypes = {}
    for file in files:
        with open_regular(file, "the weights") as handle:
            head = handle.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= HEADER_BYTES:
                raise GhostLayersError(f"{file} is not a safetensors file: its header is damaged or missing.")
            header = parse(handle.read(size).decode("utf-8", "replace"), False, f"the header of {file}")
            entries = {name: entry for name, entry in header.items() if isinstance(entry, dict)}
            dtypes |= {name: str(entry.get("dtype", "")) for name, entry in entries.items()}
            ends = [e["data_offsets"][1] for e in entries.values() if _offsets(e.get("data_offsets"))]
            have = os.fstat(handle.fileno()).st_size
            if 8 + size + max(ends, default=0) > have:
                raise GhostLayersError(
                    f"{file} is truncated: its header places tensors up to byte {8 + size + max(ends):,}, and the file "
                    f"holds {have:,}. Download or save the model again."
                )
    return dtypes or None


def _offsets(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)


def weight_names(folder: Path) -> list[str] | None:
    """The tensor names of the safetensors weights of ``folder`` (``weight_dtypes``); None when it has none."""
    dtypes = weight_dtypes(folder)
    return list(dtypes) if dtypes else None


def layer_counts(names: Iterable[str]) -> set[int] | None:
    """How many layers weights of these tensor names hold, per stack (``model.layers``,
    ``model.decoder.layers``, …); None when there are none."""
    names = list(names)
    stacks = defaultdict(set)
    for name in names:
        if found := re.match(r"(.*?)\.?layers\.(\d+)\.", name):
            stacks[found.group(1)].add(int(found.group(2)))
    return {len(layers) for layers in stacks.values()} if names else None


def _check_entries(folder: Path) -> None:
    """Every file of a model folder is a regular file (or a link to one, as in Hugging Face's cache), and
    every JSON file an object read bounded: the libraries that read the tokenizer and weights would block on a
    FIFO, never finish a device, and fail with a TypeError on a list."""
    for entry in folder.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError as error:
            raise GhostLayersError(f"Cannot read {entry}: {error.strerror} (a broken link?). Restore it.") from error
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise GhostLayersError(f"{entry} is a pipe, device or socket, not a regular file: restore the file.")
        if entry.suffix == ".json" and stat.S_ISREG(mode):  # transformers reads each as an object
            limit = TOKENIZER_BYTES if entry.name == "tokenizer.json" else METADATA_BYTES
            data = read_json(entry, "", limit)
            if entry.name == "tokenizer.json" and not isinstance(data.get("model"), dict):
                raise GhostLayersError(f"{entry} has no tokenizer model (its 'model' is not an object): restore it.")


def check_config(folder: str | Path) -> dict:
    """A local model folder's ``config.json``, read bounded and checked before transformers builds anything
    from it (it builds every layer before the weights are compared: 100000 layers fill the memory): counts
    whole and within bounds, every number finite, the layer count that of the weights."""
    folder = Path(folder)
    _check_entries(folder)
    config = read_json(folder / "config.json", "the config")
    where = f"{folder / 'config.json'}"
    if bad := _non_finite(config):
        raise GhostLayersError(f"{where} holds NaN or infinite values ({', '.join(bad[:3])}): restore the config.")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key, top in CONFIG_BOUNDS.items():
        value = text.get(key)
        if value is not None and (type(value) is not int or not 1 <= value <= top):
            raise GhostLayersError(
                f"{where} gives {key} = {value!r}: a whole number from 1 to {top} is expected. Restore the config."
            )
    dtypes = weight_dtypes(folder) or {}  # every header read once, for both checks
    if "quantization_config" not in config:
        _check_float_weights(folder, dtypes, config)
    layers, counts = text.get("num_hidden_layers"), layer_counts(dtypes)
    if layers is not None and counts and layers not in counts:
        raise GhostLayersError(
            f"{where} gives num_hidden_layers = {layers}, but the weights hold {' or '.join(map(str, sorted(counts)))}"
            " layers: the folder is damaged or its config.json was edited. Restore the model's own config."
        )
    return config


HALF_FORMATS = {"float16": "F16", "bfloat16": "BF16"}  # same width: the bytes of one read as the other are garbage


def _check_float_weights(folder: Path, dtypes: dict[str, str], config: dict) -> None:
    """Refuse weights whose header (``dtypes``: ``weight_dtypes``) gives an integer or boolean dtype in a model
    without quantization (their bytes are read as whole numbers and cast), or the other 16-bit float format than
    the config's dtype (F16 bytes read as bfloat16, or the reverse): either way the model computes garbage without
    a word."""
    dtypes = {name: dtype for name, dtype in dtypes.items() if name.endswith((".weight", ".bias"))}
    wrong = [(name, dtype) for name, dtype in dtypes.items() if dtype.startswith(("I", "U", "BOOL"))]
    if wrong:
        listed = ", ".join(f"{name} ({dtype})" for name, dtype in wrong[:3])
        raise GhostLayersError(
            f"The safetensors headers of {folder} give {len(wrong)} weight(s) an integer dtype ({listed}), and its "
            "config.json names no quantization: the files are damaged or were relabelled. Restore the model's weights."
        )
    said = config.get("torch_dtype", config.get("dtype"))
    if said in HALF_FORMATS:
        other = next(v for k, v in HALF_FORMATS.items() if k != said)
        if relabelled := [name for name, dtype in dtypes.items() if dtype == other]:
            raise GhostLayersError(
                f"{folder / 'config.json'} says the weights are {said}, but the safetensors headers give "
                f"{len(relabelled)} of them as {other} ({', '.join(relabelled[:3])}), the other 16-bit format of the "
                f"same width: the files are damaged or were relabelled. Restore the model's weights (or, if they "
                f"really are {other}, correct the config's dtype)."
            )


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
    if Path(path).is_dir():
        check_config(path)
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
    check_config(path)
    with loading_errors(name_or_path, path):
        return Checkpoint(path, torch_dtype, resolve_device(device)), load_tokenizer(path)
