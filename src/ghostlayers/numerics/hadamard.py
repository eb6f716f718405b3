"""The Hadamard rotation of ``linearpatch-rotate``: exactly the matrix the published LinearPatch code uses.

LinearPatch (arXiv 2505.24680; github.com/chenxinrui-tsinghua/LinearPatch at commit d1274e8) takes QuIP#'s
construction through QuaRot (``rotate_utils/hadamard_utils.py``):

- ``get_hadK`` (lines 5-55) picks the *first* order K of 172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12 that
  divides n and asserts that n / K is a power of two; with none dividing, n itself must be a power of two (K = 1).
- ``matmul_hadU`` (lines 58-79) views a row as (K, 2^m), runs the butterfly ``(a, b) -> (a + b, a - b)`` over the
  2^m axis (the Sylvester matrix ``S``, ``S_1 = [1]``, ``S_2k = [[S_k, S_k], [S_k, -S_k]]``, symmetric), then
  left-multiplies the K axis by ``had_K`` and divides by sqrt(n). As a dense matrix acting on rows this is
  ``x ↦ x @ H`` with ``H = (had_Kᵀ ⊗ S_{2^m}) / sqrt(n)``: the base index is the slow one, and ``had_K``
  enters transposed (the published ``had_12``, ``had_20``, ``had_40`` … are not symmetric; 28 and 36 are).
- ``get_hadamard_matrix`` (lines 92-95) is ``matmul_hadU(I)``, i.e. that ``H``. LinearPatch measures the
  scales on ``x @ H`` (``layer_select.py`` lines 13 and 33-34) and applies ``x @ H diag(s) Hᵀ``
  (``block_scaling.py`` lines 6-10), which is what ``HadamardRotation`` (the rotated ratios'
  sums) and the ``linearpatch-rotate`` record of ``methods`` do with the ``H`` returned here.

The ±1 tables ``had_K`` (lines 164-4204; identical in QuaRot's ``fake_quant/hadamard_utils.py``) are data, kept
in ``hadamard_bases.txt`` as hex rows with a sha256 check: the one PyPI package shipping such tables,
compressed-tensors, has a different ``had_20`` and needs Python ≥ 3.11, pydantic and loguru.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ghostlayers.errors import GhostLayersError

# get_hadK's order of preference: it matters where several divide n (640 = 40·16 = 20·32 uses 40).
BASE_ORDERS = (172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12)
_BASES_FILE = Path(__file__).with_name("hadamard_bases.txt")
_BASES_SHA256 = "0e4d898c38e5815dd86970dfd03023012877d2cca3a180f0c322ef6815d58356"


@lru_cache(maxsize=1)
def _bases() -> dict[int, np.ndarray]:
    """The published ``had_K`` as read-only int8 ±1 arrays, refusing a data file that is not the one shipped."""
    data = _BASES_FILE.read_bytes()
    if hashlib.sha256(data).hexdigest() != _BASES_SHA256:
        raise GhostLayersError(f"{_BASES_FILE} is damaged (sha256 is not the shipped one): reinstall ghostlayers")
    rows: dict[int, list[list[int]]] = {k: [] for k in BASE_ORDERS}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            order, hex_row = line.split()
            bits = bin(int(hex_row, 16))[2:].zfill(int(order))
            rows[int(order)].append([1 if b == "1" else -1 for b in bits])
    bases = {k: np.array(r, dtype=np.int8) for k, r in rows.items()}
    for b in bases.values():
        b.flags.writeable = False
    return bases


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _plan(n: int) -> tuple[int, int] | None:
    """``(K, 2^m)`` with ``n = K · 2^m`` as ``get_hadK`` chooses (K = 1 for powers of two), else None."""
    if not isinstance(n, int) or n < 1:
        return None
    k = next((k for k in BASE_ORDERS if n % k == 0), 1)
    return (k, n // k) if _is_pow2(n // k) else None


@lru_cache(maxsize=8)
def _sylvester(n: int) -> np.ndarray:
    """Read-only int8 Sylvester matrix of order ``n = 2^m`` (symmetric; the butterfly of ``matmul_hadU``)."""
    s = np.ones((1, 1), dtype=np.int8)
    while s.shape[0] < n:
        s = np.block([[s, s], [s, -s]])
    s.flags.writeable = False
    return s


@lru_cache(maxsize=32)
def _hadamard_np(n: int) -> np.ndarray:
    """Read-only int8 ``had_Kᵀ ⊗ S_{2^m}`` (cached: hidden sizes repeat across calls)."""
    k, p = _plan(n)
    h = _sylvester(p) if k == 1 else np.kron(_bases()[k].T, _sylvester(p))
    h.flags.writeable = False
    return h


def has_hadamard(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` works (cheap: plans the construction, builds nothing)."""
    return _plan(n) is not None


def _require(n: int) -> tuple[int, int]:
    plan = _plan(n)
    if plan is None:
        raise GhostLayersError(
            f"No Hadamard matrix of order {n} in the published LinearPatch/QuIP# construction: it supports a "
            f"power of two or K * 2^m with K in {', '.join(map(str, BASE_ORDERS))} (the first K dividing n), "
            "e.g. 576 = 36*16 or 3584 = 28*128. Use --method ghost or --method linearpatch instead, which need "
            "no Hadamard matrix."
        )
    return plan


def hadamard_matrix(n: int) -> torch.Tensor:
    """n×n float64 ±1 matrix ``had_Kᵀ ⊗ S_{2^m}`` with ``H Hᵀ = n I`` (a fresh copy: callers may mutate it)."""
    _require(n)
    return torch.from_numpy(_hadamard_np(n).astype(np.float64))


def orthonormal_hadamard(n: int) -> torch.Tensor:
    """``hadamard_matrix(n) / sqrt(n)``: LinearPatch's ``get_hadamard_matrix(n)``, rotation ``x ↦ x @ H``."""
    return hadamard_matrix(n) / math.sqrt(n)


class HadamardRotation:
    """``x ↦ x @ orthonormal_hadamard(n)`` through its Kronecker factors: a row viewed as (K, 2^m) is multiplied by
    ``had_Kᵀ`` on the first axis and by Sylvester blocks of order ≤ 64 on the rest (``S_{2^m}`` is their
    Kronecker product). That costs ``n · (Σ factor orders)`` multiply-adds per row instead of ``n²``
    (576 = 36·16: 52 instead of 576), which is what calibration pays for the per-channel sums at every boundary."""

    def __init__(self, n: int, device: torch.device | str, dtype: torch.dtype):
        k, p = _require(n)
        j = p.bit_length() - 1
        factors = [_bases()[k].T] if k > 1 else []
        factors += [_sylvester(64)] * (j // 6) + ([_sylvester(2 ** (j % 6))] if j % 6 else [])
        self.factors = [torch.from_numpy(f.astype(np.float64)).to(device, dtype) for f in factors]
        self.scale = 1 / math.sqrt(n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.reshape(-1, *(f.shape[0] for f in self.factors))
        for axis, factor in enumerate(self.factors, start=1):
            out = (out.movedim(axis, -1) @ factor).movedim(-1, axis)
        return out.reshape(x.shape) * self.scale
