"""Tiny randomly initialised models of every supported architecture, and a word-level tokenizer."""

from __future__ import annotations

import importlib
import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 128
ARCH_KWARGS = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": 6},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "gemma3_text": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
    },
    "phi3": {"num_key_value_heads": 2, "pad_token_id": 0},
    "gpt_neox": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "max_position_embeddings": 64},
}
ARCHITECTURES = list(ARCH_KWARGS)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, its folder on the path as when run as a script (its sibling
    module ``harness`` imports)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def tiny_model(model_type: str = "llama", num_layers: int = 6, seed: int = 0) -> AutoModelForCausalLM:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=128,
        **ARCH_KWARGS.get(model_type, {}),
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is nearly identity-free; larger weights make layers matter
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(3.0)
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def random_text(num_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (num_words,), generator=g))


def random_batches(num: int = 3, batch: int = 2, seq: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(num)]


def plant_hostile(path: Path, variant: str, contents: dict[str, bytes] | None = None) -> None:
    """Replace the file at ``path`` by ``variant``: a FIFO, a link to /dev/zero, a folder, an empty file, the
    first half of the file, or ``contents[variant]`` (what a reader of that file takes for a well-formed file of
    the wrong shape, a deeply nested one, ...)."""
    good = path.read_bytes() if path.is_file() else b""
    path.unlink(missing_ok=True)
    if variant == "fifo":
        os.mkfifo(path)
    elif variant == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif variant == "folder":
        path.mkdir()
    elif variant == "empty":
        path.write_bytes(b"")
    elif variant == "truncated":
        path.write_bytes(good[: len(good) // 2])
    else:
        path.write_bytes((contents or {})[variant])


def torch_bytes(value: object) -> bytes:
    """``value`` as ``torch.save`` writes it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.fixture
def within_seconds():
    """``within_seconds(n)``: a hang past n seconds is a TimeoutError in the test, not a stuck suite."""

    def hung(signum, frame):
        raise TimeoutError("hung on a planted file")

    previous = signal.signal(signal.SIGALRM, hung)
    yield signal.alarm
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A tiny llama with tokenizer saved as a local model folder, and a calibration text beside it."""
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(random_text(4000))
    return folder


@pytest.fixture(autouse=True)
def others_heard(monkeypatch):
    """A command run in this process (typer's CliRunner) quiets other libraries for the process's life
    (``chatter.quiet_others``): each test starts and ends with their log levels, warning filters and
    environment as they were, so a later test still hears them."""
    import logging
    import warnings

    from ghostlayers.measure.chatter import ENVIRONMENT, OTHERS

    levels = {name: logging.getLogger(name).level for name in OTHERS}
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings():
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's master."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` with two CPU processes running ``args``, in ``cwd``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), cwd=cwd, timeout=600)
