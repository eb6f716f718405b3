"""Slow: the bundled default model converts faithfully from its GGUF and reloads from the cache."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghostlayers.models import _smollm2_gguf, resolve_model

pytestmark = pytest.mark.slow


def test_converted_default_model_matches_its_gguf():
    folder = Path(resolve_model("smollm2-135m"))
    assert resolve_model("smollm2-135m") == str(folder) and resolve_model("org/other") == "org/other"
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    with tempfile.TemporaryDirectory() as work:
        gguf = _smollm2_gguf(Path(work))
        reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
        with torch.no_grad():
            torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    assert converted.config.num_hidden_layers == 30 and not hasattr(converted.config, "quantization_config")
    assert tokenizer.decode(converted.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1] :]).strip()
