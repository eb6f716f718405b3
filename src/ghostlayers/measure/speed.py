"""Inference cost of a model: prefill latency, decode throughput, and the work they should take.

A single timing on a shared CPU says little: the dense and the pruned model are timed in turn, round after
round (the order alternating, so drift in the machine's load falls on both), and each gets the median over
the rounds with its range. Beside the times, the work per token that they should follow: parameters and
multiply-accumulate FLOPs for prefill and for decode.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from ghostlayers.model.modeling_ghostlayers import GhostOperator

View = Callable[[], contextlib.AbstractContextManager]  # puts the model in one state (dense, pruned) while open


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _time_once(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Seconds for one prefill of ``prompt`` and for ``new_tokens`` cached greedy decode steps."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True)
    _sync(device)
    mid = time.perf_counter()
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    return mid - start, time.perf_counter() - mid


def flops_per_token(model: PreTrainedModel, context: float) -> float:
    """FLOPs of one token attending to ``context`` tokens: 2 per weight of every linear map (the LM head and
    the ghost operators included, embeddings looked up, not multiplied) and 4 per head channel and context
    token for the attention scores and their weighted sum."""
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    linear += sum(m.delta.numel() for m in model.modules() if isinstance(m, GhostOperator))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2.0 * linear + 4.0 * config.num_hidden_layers * heads * head_dim * context


def work(model: PreTrainedModel, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """What a model's speed should follow: its parameters and weight bytes, and FLOPs per token averaged over
    a prefill of ``prompt_len`` tokens (causal: a token sees half the prompt on average) and over the
    ``new_tokens`` decode steps after it."""
    params = list(model.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "weight_bytes": sum(p.numel() * p.element_size() for p in params),
        "prefill_flops_per_token": flops_per_token(model, (prompt_len + 1) / 2),
        "decode_flops_per_token": flops_per_token(model, prompt_len + (new_tokens + 1) / 2),
    }


def measure_speeds(
    model: PreTrainedModel,
    views: dict[str, View],
    rounds: int = 5,
    prompt_len: int = 128,
    new_tokens: int = 16,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Per view: the median prefill latency (ms) and decode throughput (tokens/s) over ``rounds`` rounds,
    each with its min and max, and ``work``. Every round times every view once, in alternating order, after
    one warm-up of each."""
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    prompt = prompt.to(device)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in views}
    order = list(views)
    for round_ in range(rounds + 1):
        for name in order if round_ % 2 else order[::-1]:
            with views[name]():
                measured = _time_once(model, prompt, new_tokens)
            if round_:  # round 0 warms up
                times[name].append(measured)
    out = {}
    for name, view in views.items():
        prefill = [1000 * p for p, _ in times[name]]
        decode = [new_tokens / d for _, d in times[name]]
        with view():
            cost = work(model, prompt_len, new_tokens)
        out[name] = {
            "prefill_ms": statistics.median(prefill),
            "prefill_ms_min": min(prefill),
            "prefill_ms_max": max(prefill),
            "decode_tokens_per_s": statistics.median(decode),
            "decode_tokens_per_s_min": min(decode),
            "decode_tokens_per_s_max": max(decode),
            "rounds": rounds,
            "prompt_tokens": prompt_len,
            "new_tokens": new_tokens,
            **cost,
        }
    return out


def measure_speed(model: PreTrainedModel, rounds: int = 5) -> dict[str, float]:
    """One model's ``measure_speeds``, as it stands."""
    return measure_speeds(model, {"model": contextlib.nullcontext}, rounds)["model"]
