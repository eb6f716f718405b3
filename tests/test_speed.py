"""Speed measured side by side: the dense view of a pruned model is the dense model, the models are timed in
turn, the work per token is counted by hand, and the report says when a difference is within the spread."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import random_batches, tiny_model

import ghostlayers
from ghostlayers.measure.report import speed_summary
from ghostlayers.measure.speed import flops_per_token, measure_speeds
from ghostlayers.model.surgery import DenseLayers, dense_view

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch,method", [("llama", "ghost"), ("llama", "refit"), ("gemma3_text", "ghost")])
def test_dense_view_of_a_pruned_model_is_the_dense_model(arch, method):
    model = tiny_model(arch)
    with torch.no_grad():
        dense_logits = tiny_model(arch)(IDS).logits
    held = DenseLayers.of(model)
    result = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method=method, progress=False)
    with torch.no_grad():
        pruned_logits = result.model(IDS).logits
        with dense_view(result.model, held):
            assert result.model.config.num_hidden_layers == 6
            viewed = result.model(IDS).logits
        after = result.model(IDS).logits
    assert not torch.allclose(pruned_logits, dense_logits, atol=1e-3)
    if method == "refit":  # refit rewrote a kept layer's down_proj: the view has its cost, not its values
        assert not torch.allclose(viewed, dense_logits, atol=1e-3)
    else:
        torch.testing.assert_close(viewed, dense_logits)
    torch.testing.assert_close(after, pruned_logits, rtol=0, atol=0)
    assert result.model.config.num_hidden_layers == 4


def test_flops_per_token_counted_by_hand():
    model = tiny_model("llama")
    c = model.config
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim or c.hidden_size // c.num_attention_heads
    per_layer = (
        c.hidden_size * (heads * d + 2 * kv * d) + heads * d * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    head = c.vocab_size * c.hidden_size
    context = 10.5
    expected = 2 * (c.num_hidden_layers * per_layer + head) + 4 * c.num_hidden_layers * heads * d * context
    assert flops_per_token(model, context) == pytest.approx(expected)
    result = ghostlayers.prune(model, random_batches(num=3), layers="2:4", method="ghost", progress=False)
    pruned = 2 * (4 * per_layer + head + c.hidden_size**2) + 4 * 4 * heads * d * context  # + the C×C operator
    assert flops_per_token(result.model, context) == pytest.approx(pruned)


def test_models_are_timed_in_turn_in_alternating_order():
    model, entered = tiny_model("llama"), []

    def view(name):
        @contextlib.contextmanager
        def enter():
            entered.append(name)
            yield

        return enter

    speeds = measure_speeds(model, {"a": view("a"), "b": view("b")}, rounds=3, prompt_len=8, new_tokens=2)
    timed = entered[:8]  # then one more entry each, to count the work
    assert timed == ["b", "a", "a", "b", "b", "a", "a", "b"]
    for s in speeds.values():
        assert s["prefill_ms_min"] <= s["prefill_ms"] <= s["prefill_ms_max"]
        assert s["decode_tokens_per_s_min"] <= s["decode_tokens_per_s"] <= s["decode_tokens_per_s_max"]


def speed(prefill: tuple[float, float, float], decode: tuple[float, float, float], flops: float) -> dict:
    return {
        **dict(zip(("prefill_ms_min", "prefill_ms", "prefill_ms_max"), prefill, strict=True)),
        **dict(zip(("decode_tokens_per_s_min", "decode_tokens_per_s", "decode_tokens_per_s_max"), decode, strict=True)),
        "rounds": 5,
        "prompt_tokens": 128,
        "new_tokens": 32,
        "parameters": int(flops),
        "prefill_flops_per_token": flops,
        "decode_flops_per_token": flops,
    }


def test_the_report_says_when_a_difference_is_within_the_spread():
    dense = speed((90, 100, 110), (9, 10, 11), 1000)
    resolved = speed((70, 80, 85), (12, 12.5, 13), 800)  # disjoint ranges
    lines = "\n".join(speed_summary({"dense": {"speed": dense}, "pruned": {"speed": resolved}}))
    assert "| prefill 128 tokens (ms) | 100 [90–110] | 80 [70–85] | 0.80× | 0.80× |" in lines
    assert "| decode (tokens/s) | 10 [9–11] | 12.5 [12–13] | 0.80× | 0.80× |" in lines
    assert "spread" not in lines
    unresolved = speed((95, 105, 120), (8.5, 9.5, 10.5), 800)  # slower medians, overlapping ranges
    lines = "\n".join(speed_summary({"dense": {"speed": dense}, "pruned": {"speed": unresolved}}))
    assert "Prefill: the difference is within the run-to-run spread" in lines
    assert "decode: the difference is within the run-to-run spread" in lines
