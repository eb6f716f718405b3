"""Plain outputs read by transformers 4 as transformers 5 reads them.

Consumers pinned to transformers 4 (llama.cpp's converter pins 4.57.6) ignore 5's ``rope_parameters``: a
config without a top-level ``rope_theta`` loads there without a warning at the default rope base, and a
tokenizer saved as 5's ``TokenizersBackend`` does not load at all. The fast tests read each saved config.json
by the rules of transformers 4.57.6's config classes, frozen in ``data/transformers4_config_defaults.json``
(every ``__init__`` parameter and its default: a field the file does not state is read as that default), and
compare each value with the one transformers 5 reads from the same file. The slow test loads every plain
output with transformers 4.57.6 itself, installed in a virtual environment of its own (cached under pytest's
cache; ``$GHOSTLAYERS_TRANSFORMERS4_PYTHON`` names an interpreter that has it instead), and compares the logits
and token ids with transformers 5's.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VOCAB, random_batches, tiny_model, tiny_tokenizer
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

import ghostlayers
from ghostlayers.sources.models import resolve_model

TRANSFORMERS4 = "4.57.6"
DEFAULTS = json.loads((Path(__file__).parent / "data" / "transformers4_config_defaults.json").read_text())
TEXT = "w1 w5 w7 w20 w3 w3 w99"
BPE_TEXT = "The cat sat on 12 mats, didn't it?<|endoftext|>"
ROPE = {  # rope bases no class defaults to: a field transformers 4 misses shows in its logits
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    "gemma3_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2000.0},
        }
    },
}
# Gemma 3 normalizes its MLP output before the residual add: only plain pruning leaves it a plain checkpoint
CASES = [(arch, method) for arch in ("llama", "qwen2") for method in ("none", "replaceme", "refit")]
CASES.append(("gemma3_text", "none"))


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of fewer tokens than the tiny models' embeddings, built as Qwen2's (NFC, Qwen2's split
    regex): transformers 5 reads the tokenizer of any qwen2 model through its own ``Qwen2Tokenizer``, which
    keeps only the vocabulary and merges of tokenizer.json, so a tokenizer of another shape would differ
    between the versions for that reason alone."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["the cat sat on the mat", "numbers like 12 and 345", "it isn't"] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def saved_output(arch: str, method: str, folder: Path, tokenizer: object | None = None) -> Path:
    """A tiny model built with a non-default rope, pruned with ``method`` and saved as a plain output."""
    model = tiny_model(arch)
    config = type(model.config).from_dict(model.config.to_dict() | ROPE[arch])
    torch.manual_seed(0)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()  # the rotary tables follow the config's rope
    rebuilt.load_state_dict(model.state_dict())
    result = ghostlayers.prune(rebuilt, random_batches(num=3), layers="2:4", method=method, progress=False)
    ghostlayers.save(result.model, tokenizer or tiny_tokenizer(), folder)
    return folder


def transformers5_value(config: PretrainedConfig, field: str) -> object:
    """What transformers 5 holds for a field transformers 4 reads, from its own attributes: the rope fields
    from ``rope_parameters`` (the global rope for models with one per attention type), the rest by name."""
    rope = config.rope_parameters
    globl = rope.get("full_attention", rope)
    if field == "rope_theta":
        return globl["rope_theta"]
    if field == "rope_local_base_freq":
        return rope["sliding_attention"]["rope_theta"]
    if field == "rope_scaling":
        return None if globl.get("rope_type", "default") == "default" else globl
    return getattr(config, field)


def read_as_transformers4(folder: Path) -> dict:
    """config.json's value for every field transformers 4.57.6's config class takes, its default where the
    file is silent."""
    raw = json.loads((folder / "config.json").read_text())
    return {field: raw.get(field, default) for field, default in DEFAULTS[raw["model_type"]].items()}


@pytest.mark.parametrize("arch,method", CASES)
def test_saved_config_reads_the_same_under_transformers4_rules(arch, method, tmp_path):
    folder = saved_output(arch, method, tmp_path / "out")
    config5 = AutoConfig.from_pretrained(folder)
    as4 = read_as_transformers4(folder)
    differing = {
        field: (value, transformers5_value(config5, field))
        for field, value in as4.items()
        if value != transformers5_value(config5, field)
    }
    assert differing == {}
    assert as4["rope_theta"] == 50000.0 and as4["num_hidden_layers"] == 4


def test_tokenizer_is_saved_under_a_class_both_versions_have(tmp_path):
    folder = saved_output("llama", "refit", tmp_path / "out")
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert AutoTokenizer.from_pretrained(folder)(TEXT).input_ids == tiny_tokenizer()(TEXT).input_ids


def test_ghost_outputs_are_left_as_transformers5_writes_them(tmp_path):
    """Outputs with operators need ghostlayers' module, itself written for transformers 5."""
    result = ghostlayers.prune(tiny_model("llama"), random_batches(num=3), layers="2:4", progress=False)
    ghostlayers.save(result.model, tiny_tokenizer(), tmp_path / "out")
    assert "rope_theta" not in json.loads((tmp_path / "out" / "config.json").read_text())


# runs under transformers 4: the folder's logits and token ids, and the version that read them
LOAD_WITH_TRANSFORMERS4 = """
import json, sys
import numpy as np, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, text, ids_file, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False).eval()
with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(np.load(ids_file))).logits
np.save(out + ".npy", logits.numpy())
ids = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)(text).input_ids
json.dump({"version": transformers.__version__, "ids": ids, "rope_theta": model.config.rope_theta}, open(out, "w"))
"""


def outer_site_packages() -> list[str]:
    """This interpreter's site-packages (a virtual environment's own, or the system's), where torch and numpy
    are: ``venv --system-site-packages`` would give a nested environment the *base* interpreter's instead,
    which inside a user's venv holds neither."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]]))


@pytest.fixture(scope="session")
def transformers4_python(pytestconfig, tmp_path_factory) -> str:
    """An interpreter with transformers 4.57.6 and this environment's torch: a virtual environment that reads
    this interpreter's site-packages after its own (a ``.pth`` line, so it works from a venv and from a system
    interpreter alike), with transformers (and the tokenizers and hub client it pins) installed in its own."""
    if given := os.environ.get("GHOSTLAYERS_TRANSFORMERS4_PYTHON"):
        return given
    cache = getattr(pytestconfig, "cache", None)  # absent under -p no:cacheprovider: a venv for this run only
    outer = outer_site_packages()
    tag = hashlib.sha256("\n".join(outer).encode()).hexdigest()[:12]  # one per outer environment
    name = f"transformers-{TRANSFORMERS4}-{tag}"
    venv = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    python = venv / "bin" / "python"
    if not (venv / "ready").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        own = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in outer)
        (Path(own) / "zz-outer-environment.pth").write_text(lines)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", f"transformers=={TRANSFORMERS4}"],
            check=True,
            capture_output=True,
        )
        (venv / "ready").write_text(TRANSFORMERS4)
    return str(python)


def test_transformers4_environment_sees_this_environments_packages(transformers4_python):
    """The nested interpreter imports this environment's torch and numpy (not the base interpreter's, nor
    none: inside a venv, ``--system-site-packages`` gave it neither) and its own transformers 4."""
    probe = (
        "import json, numpy, torch, transformers; "
        "print(json.dumps([torch.__file__, numpy.__file__, transformers.__version__]))"
    )
    done = subprocess.run([transformers4_python, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_file, numpy_file, version = json.loads(done.stdout)
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    assert Path(numpy_file).resolve() == Path(np.__file__).resolve()
    assert version == TRANSFORMERS4


def compare_under_transformers4(python: str, folder: Path, text: str, ids: torch.Tensor, tmp_path: Path) -> float:
    """The largest difference between transformers 4's and 5's logits for ``folder``, once 4 has read the same
    rope base and tokenized ``text`` to the same ids as 5."""
    np.save(tmp_path / "ids.npy", ids.numpy())
    out = tmp_path / "v4.json"
    done = subprocess.run(
        [python, "-c", LOAD_WITH_TRANSFORMERS4, str(folder), text, str(tmp_path / "ids.npy"), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(out.read_text())
    config5 = AutoConfig.from_pretrained(folder)
    assert seen["version"] == TRANSFORMERS4
    assert seen["rope_theta"] == transformers5_value(config5, "rope_theta")
    assert len(seen["ids"]) > 5 and seen["ids"] == AutoTokenizer.from_pretrained(folder)(text).input_ids
    model5 = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits5 = model5(input_ids=ids).logits
    assert logits5.abs().max() > 0.5
    return float((torch.from_numpy(np.load(str(out) + ".npy")) - logits5).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("arch,method", CASES)
def test_transformers4_loads_plain_outputs_with_transformers5_logits(arch, method, transformers4_python, tmp_path):
    folder = saved_output(arch, method, tmp_path / "out", bpe_tokenizer())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    assert compare_under_transformers4(transformers4_python, folder, BPE_TEXT, ids, tmp_path) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("method", ["refit"])  # none: the same config and tokenizer, one fewer load
def test_transformers4_reads_pruned_smollm2_as_transformers5(method, transformers4_python, tmp_path):
    """The bundled SmolLM2 (rope base 100000, not transformers 4's default 10000), its tokenizer with digit
    splitting and 17 special tokens."""
    source = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    result = ghostlayers.prune(model, random_batches(num=2, seq=32), layers="20:24", method=method, progress=False)
    ghostlayers.save(result.model, tokenizer, tmp_path / "out")
    text = "<|im_start|>user\nIn 1969, 3 astronauts flew 384400 km.<|im_end|>"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert [tokenizer.decode(i) for i in ids[0, 5:9]] == ["1", "9", "6", "9"]  # SmolLM splits every digit
    difference = compare_under_transformers4(transformers4_python, tmp_path / "out", text, ids, tmp_path)
    print(f"SmolLM2 {method}: transformers 4 against 5, max logit difference {difference:.3g}")
    assert difference <= 1e-4
