"""Hadamard matrices (entries ±1, ``H Hᵀ = n I``) built by construction, for ``linearpatch-rotate``.

Every order comes from a small *base* made larger by Sylvester doubling (``H_2 ⊗ H``):

- base 1 (doubled: all powers of two),
- Paley I, order ``q + 1`` for a prime power ``q ≡ 3 (mod 4)`` (12, 20, 28, 60, 108, 140, ...),
- Paley II, order ``2(q + 1)`` for a prime power ``q ≡ 1 (mod 4)`` (12, 20, 36, 52, ...).

So ``n = b · 2^j`` is supported whenever one of its factorizations has such a base ``b``; this covers
the usual hidden sizes (576 = 16·36, 896 = 32·28, 3584 = 128·28, ...). Paley needs the quadratic
character of GF(q); prime powers (27 for order 28, 25 for order 52) use ``GF`` below.
No tables are hard-coded, so every matrix can be checked against the math alone.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from ghostlayers.errors import GhostLayersError

# ----------------------------------------------------------------------------- finite fields


def _prime_power(q: int) -> tuple[int, int] | None:
    """``(p, k)`` with ``q = p^k`` for a prime ``p``, else None (trial division: q is small)."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)  # smallest prime factor
    k = 0
    while q % p == 0:
        q, k = q // p, k + 1
    return (p, k) if q == 1 else None


def _polyrem(a: list[int], m: list[int], p: int) -> list[int]:
    """Remainder of ``a`` by the monic ``m`` over GF(p); coefficients are lowest degree first."""
    a, d = list(a), len(m) - 1
    for i in range(len(a) - 1, d - 1, -1):
        c = a[i] % p
        if c:
            for j in range(d + 1):
                a[i - d + j] -= c * m[j]
    return [x % p for x in a[:d]] + [0] * (d - len(a))


def _monic(p: int, d: int) -> list[list[int]]:
    """All monic polynomials of degree ``d`` over GF(p)."""
    return [[(e // p**i) % p for i in range(d)] + [1] for e in range(p**d)]


def _irreducible(p: int, k: int) -> list[int]:
    """The first monic degree-``k`` polynomial with no monic factor of degree 1..k/2 (brute force)."""
    for f in _monic(p, k):
        if all(any(_polyrem(f, g, p)) for d in range(1, k // 2 + 1) for g in _monic(p, d)):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")  # cannot happen


class GF:
    """GF(q), q = p^k: element ``e`` is the polynomial whose coefficients are ``e``'s base-p digits,
    multiplied modulo an irreducible polynomial. Only what Paley needs: ``mul``, ``sub``, ``chi``."""

    def __init__(self, q: int):
        pk = _prime_power(q)
        if pk is None:
            raise GhostLayersError(f"GF({q}) does not exist: {q} is not a prime power")
        self.q, (self.p, self.k) = q, pk
        self.modulus = _irreducible(self.p, self.k) if self.k > 1 else [0, 1]
        self.digits = np.array([[(e // self.p**i) % self.p for i in range(self.k)] for e in range(q)])

    def _encode(self, coeffs) -> int:
        return int(sum(int(c) * self.p**i for i, c in enumerate(coeffs)))

    def mul(self, a: int, b: int) -> int:
        da, db = self.digits[a], self.digits[b]
        prod = [0] * (2 * self.k - 1)
        for i in range(self.k):
            for j in range(self.k):
                prod[i + j] += int(da[i]) * int(db[j])
        return self._encode(_polyrem(prod, self.modulus, self.p))

    def sub(self) -> np.ndarray:
        """``S[a, b] = a − b`` for all pairs (digit-wise mod p), as a q×q table of element codes."""
        d, table = self.digits, np.zeros((self.q, self.q), dtype=np.int64)
        for i in range(self.k):
            table += ((d[:, None, i] - d[None, :, i]) % self.p) * self.p**i
        return table

    def chi(self) -> np.ndarray:
        """Quadratic character: 1 on nonzero squares, −1 on non-squares, 0 at 0 (square everything)."""
        chi = -np.ones(self.q, dtype=np.int64)
        chi[[self.mul(x, x) for x in range(self.q)]] = 1
        chi[0] = 0
        return chi


# ----------------------------------------------------------------------------- constructions


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[a, b] = χ(a − b)``: antisymmetric for q ≡ 3 (mod 4), symmetric for q ≡ 1 (mod 4)."""
    field = GF(q)
    return field.chi()[field.sub()]


def _bordered(q: int, sign: int) -> np.ndarray:
    """``[[0, 1ᵀ], [sign·1, Q]]``, the (q+1)×(q+1) core of both Paley constructions."""
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, sign, _jacobsthal(q)
    return c


def _paley1(q: int) -> np.ndarray:
    """Order q + 1 (q ≡ 3 mod 4): ``I + S`` with S the skew bordered Jacobsthal matrix."""
    return np.eye(q + 1, dtype=np.int64) + _bordered(q, -1)


def _paley2(q: int) -> np.ndarray:
    """Order 2(q + 1) (q ≡ 1 mod 4): each 0 of the symmetric core becomes [[1, −1], [−1, −1]] and each
    ±1 becomes ±[[1, 1], [1, −1]]."""
    c = _bordered(q, 1)
    return np.kron(c, [[1, 1], [1, -1]]) + np.kron(np.eye(q + 1, dtype=np.int64), [[1, -1], [-1, -1]])


def _base(b: int) -> tuple[str, int] | None:
    """How to build base order ``b`` without doubling: ('one', 1), ('paley1', q) or ('paley2', q)."""
    if b == 1:
        return ("one", 1)
    if b % 4 == 0 and _prime_power(b - 1) and (b - 1) % 4 == 3:
        return ("paley1", b - 1)
    if b % 4 == 0 and _prime_power(b // 2 - 1) and (b // 2 - 1) % 4 == 1:
        return ("paley2", b // 2 - 1)
    return None


def _plan(n: int) -> tuple[int, int] | None:
    """``(b, j)`` with ``n = b · 2^j`` and ``b`` a constructible base, smallest base first; else None."""
    if not isinstance(n, int) or n < 1:
        return None
    j = (n & -n).bit_length() - 1  # n = 2^j · odd
    for i in range(j, -1, -1):
        if _base(n >> i) is not None:
            return n >> i, i
    return None


@lru_cache(maxsize=32)
def _hadamard_np(n: int) -> np.ndarray:
    """Read-only int8 Hadamard matrix of order n (cached: hidden sizes repeat across calls)."""
    b, j = _plan(n)
    kind, q = _base(b)
    h = np.ones((1, 1)) if kind == "one" else {"paley1": _paley1, "paley2": _paley2}[kind](q)
    h = h.astype(np.int8)
    for _ in range(j):
        h = np.block([[h, h], [h, -h]])  # Sylvester: H_2 ⊗ H
    h.flags.writeable = False
    return h


# ----------------------------------------------------------------------------- public API


def has_hadamard(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` works (cheap: plans the construction, builds nothing)."""
    return _plan(n) is not None


def hadamard_matrix(n: int) -> torch.Tensor:
    """n×n float64 matrix with entries ±1 and ``H Hᵀ = n I`` (a fresh copy: callers may mutate it)."""
    if not has_hadamard(n):
        raise GhostLayersError(
            f"No Hadamard matrix of order {n} can be built: supported sizes are 2^k times a Paley order "
            "such as 1, 12, 20, 28, 36, 52, 60, 108, 140 (q+1 for a prime power q = 3 mod 4, or 2(q+1) "
            "for q = 1 mod 4), e.g. 576 = 16*36 or 3584 = 128*28. Use --method ghost or --method "
            "linearpatch instead, which need no Hadamard matrix."
        )
    return torch.from_numpy(_hadamard_np(n).astype(np.float64))


def orthonormal_hadamard(n: int) -> torch.Tensor:
    """``H / sqrt(n)``: an orthogonal float64 matrix, the rotation used by ``linearpatch-rotate``."""
    return hadamard_matrix(n) / math.sqrt(n)


class HadamardRotation:
    """``x ↦ x · H / sqrt(n)`` through H's Kronecker factors: H = H_2 ⊗ … ⊗ H_2 ⊗ base (Sylvester doubling),
    applied as Sylvester blocks of order ≤ 64 and the base, one axis of ``x`` at a time. That costs
    ``n · (Σ factor orders)`` multiply-adds per row instead of ``n²`` (576 = 16·36: 52 instead of 576),
    which is what calibration pays for linearpatch-rotate's per-channel sums at every boundary."""

    def __init__(self, n: int, device: torch.device | str, dtype: torch.dtype):
        hadamard_matrix(n)  # fails, naming the fix, where no construction exists
        b, j = _plan(n)
        orders = [2**6] * (j // 6) + ([2 ** (j % 6)] if j % 6 else []) + ([b] if b > 1 else [])
        self.factors = [torch.from_numpy(_hadamard_np(k).astype(np.float64)).to(device, dtype) for k in orders]
        self.scale = 1 / math.sqrt(n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.reshape(-1, *(f.shape[0] for f in self.factors))
        for axis, factor in enumerate(self.factors, start=1):
            out = (out.movedim(axis, -1) @ factor).movedim(-1, axis)
        return out.reshape(x.shape) * self.scale
