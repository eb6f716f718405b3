"""Inference cost of a model: prefill latency, decode throughput, parameters and weight memory.

Dense and pruned models are measured in the same run (these machines are noisy: compare ratios).
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import PreTrainedModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_speed(
    model: PreTrainedModel, prompt_len: int = 128, new_tokens: int = 32, repeats: int = 3, seed: int = 0
) -> dict[str, float]:
    """Median over ``repeats`` of one prefill of ``prompt_len`` tokens and of ``new_tokens`` cached
    greedy decode steps, after one warm-up round."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed)).to(device)
    prefill, decode = [], []
    for _ in range(repeats + 1):
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
        prefill.append(mid - start)
        decode.append(time.perf_counter() - mid)
    prefill, decode = prefill[1:], decode[1:]
    return {
        "prefill_ms": 1000 * statistics.median(prefill),
        "decode_tokens_per_s": new_tokens / statistics.median(decode),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
