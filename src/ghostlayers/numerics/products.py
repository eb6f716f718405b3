"""Every Gram and cross product of the calibration statistics, on tensor cores where the states allow.

One function, ``product``, so that the batch pass, ``--offload`` and ``--fit sequential`` take the same
route (docs/DESIGN.md: float64 on CPU and for float32 models; bf16/fp16 states on CUDA multiply in their
own dtype with float32 output, in chunks, each added in float64).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

TENSOR_CORE_CHUNK = 2048  # tokens per float32-accumulated product: bounds the accumulation error, see product()


def tensor_cores(*states: Tensor) -> bool:
    """Whether products of these states run on tensor cores: half precision on CUDA, with a torch whose
    ``mm`` takes ``out_dtype`` (2.8 and later; CUDA kernels only)."""
    return hasattr(torch.ops.aten.mm, "dtype") and all(
        s.is_cuda and s.dtype in (torch.bfloat16, torch.float16) for s in states
    )


def half_product(a: Tensor, b: Tensor) -> Tensor:
    """``aᵀb`` of half-precision states with float32 output, on tensor cores."""
    return torch.mm(a.T, b, out_dtype=torch.float32)


def product(a: Tensor, b: Tensor | Sequence[Tensor], dtype: torch.dtype, chunk: int = TENSOR_CORE_CHUNK) -> Tensor:
    """``aᵀ(b₁ + b₂ + …)`` over the token rows of states (tokens × C), as a term of a ``dtype`` sum: every
    Gram and cross product of the statistics is computed here (by ``Accumulator``), whatever the driver.

    bf16/fp16 states on CUDA multiply in their own dtype with float32 output (tensor cores: ~12× the
    float64 rate of an H200, and exact products of the very values the model produced), ``chunk`` tokens
    at a time so that float32 accumulation runs over a bounded number of tokens, each chunk then added in
    ``dtype``; the terms of ``b`` are multiplied one by one (their half-precision sum would round).
    Elsewhere (CPU, float32 models) the states are upcast to ``dtype`` (exactly), summed and multiplied once."""
    terms = [b] if isinstance(b, Tensor) else list(b)
    if not tensor_cores(a, *terms):
        left = a.to(dtype)
        right = left if len(terms) == 1 and terms[0] is a else functools.reduce(torch.add, (t.to(dtype) for t in terms))
        return left.T @ right
    out = torch.zeros(a.shape[1], terms[0].shape[1], dtype=dtype, device=a.device)
    for term in terms:
        for start in range(0, a.shape[0], chunk):
            out += half_product(a[start : start + chunk], term[start : start + chunk])
    return out
