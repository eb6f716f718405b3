"""Hadamard matrices checked against the definition only: entries ±1 and ``H Hᵀ = n I`` exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ghostlayers.errors import GhostLayersError
from ghostlayers.hadamard import (
    GF,
    HadamardRotation,
    _paley1,
    _paley2,
    hadamard_matrix,
    has_hadamard,
    orthonormal_hadamard,
)

PALEY_BASES = (12, 20, 28, 36, 40, 52, 60, 108, 140)
HIDDEN_SIZES = (576, 640, 896, 960, 1536, 2048, 3584)
SIZES = sorted(
    {2**k for k in range(13)}
    | {b * 2**k for b in PALEY_BASES for k in (0, 1, 2, 3) if b * 2**k <= 4096}
    | set(HIDDEN_SIZES)
)
# multiples of 4 up to 300 with no Paley base b (n = b * 2^j): 92 = 4*23 (91 = 7*13, 45 = 3^2*5), ...
UNSUPPORTED_MULTIPLES_OF_4 = {92, 116, 156, 172, 184, 188, 232, 236, 260, 268, 292}


def _prime_powers(limit: int) -> list[int]:
    """Prime powers below ``limit`` by a sieve (independent of the module's trial division)."""
    composite = set()
    for p in range(2, limit):
        composite.update(range(p * p, limit, p))
    primes = [p for p in range(2, limit) if p not in composite]
    return sorted(p**k for p in primes for k in range(1, limit.bit_length()) if p**k < limit)


def assert_hadamard(h: np.ndarray) -> None:
    n = h.shape[0]
    assert h.shape == (n, n)
    a = h.astype(np.int8)
    assert np.array_equal(a, h) and np.all(a * a == 1), "entries must be exactly +-1"
    # int64 matmul is slow for big n; float32 BLAS is exact there too (integer sums of +-1, |sum| <= n < 2^24)
    b = a.astype(np.int64 if n <= 512 else np.float32)
    gram = (b @ b.T).astype(np.int64)
    assert np.all(np.diag(gram) == n) and np.count_nonzero(gram) == n, "H H^T must equal n I exactly"


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_property(n):
    h = hadamard_matrix(n)
    assert h.dtype == torch.float64
    assert_hadamard(h.numpy())
    q = orthonormal_hadamard(n)
    assert q.dtype == torch.float64
    rows = torch.arange(n) if n <= 1024 else torch.linspace(0, n - 1, 256).long()  # a sample: fast
    err = (q[rows] @ q.T - torch.eye(n, dtype=torch.float64)[rows]).abs().max()
    assert err < 1e-12, f"orthonormal_hadamard({n}) is off by {err}"
    assert has_hadamard(n)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 14, 22, 92, 156, 172, 184, 0, -4])
def test_unsupported_sizes_raise_naming_the_size_and_fix(n):
    assert not has_hadamard(n)
    with pytest.raises(GhostLayersError, match=rf"order {n}\b") as info:
        hadamard_matrix(n)
    assert "--method ghost" in str(info.value) and "--method linearpatch" in str(info.value)
    with pytest.raises(GhostLayersError):
        orthonormal_hadamard(n)


def test_supported_orders_up_to_300():
    """Only orders with a Hadamard matrix at all (1, 2, 4k) are claimed, and all are built correctly."""
    supported = {n for n in range(1, 301) if has_hadamard(n)}
    assert supported == {1, 2} | (set(range(4, 301, 4)) - UNSUPPORTED_MULTIPLES_OF_4)
    for n in sorted(supported):
        assert_hadamard(hadamard_matrix(n).numpy())


@pytest.mark.parametrize("q", [q for q in _prime_powers(300) if q % 2 == 1])
def test_paley_constructions_for_every_odd_prime_power(q):
    """Both Paley branches directly, including the fields GF(3^2..3^5), GF(5^2), GF(5^3), GF(7^2), ..."""
    h = _paley1(q) if q % 4 == 3 else _paley2(q)
    assert h.shape[0] == (q + 1 if q % 4 == 3 else 2 * (q + 1))
    assert_hadamard(h)


@pytest.mark.parametrize("q", [4, 8, 9, 25, 27, 49, 81])
def test_prime_power_field_axioms(q):
    f = GF(q)
    mul = np.array([[f.mul(a, b) for b in range(q)] for a in range(q)])
    powers = f.p ** np.arange(f.k)
    add = ((f.digits[:, None, :] + f.digits[None, :, :]) % f.p) @ powers  # polynomials add digit-wise
    assert np.array_equal(f.sub()[add, np.arange(q)[None, :]], mul[:, [1] * q]), "(a + b) - b == a"
    assert np.array_equal(mul, mul.T) and np.array_equal(add, add.T)
    assert np.all(mul[0] == 0) and np.array_equal(mul[1], np.arange(q)), "0 absorbs, 1 is the identity"
    for a in range(1, q):
        assert sorted(mul[a, 1:]) == list(range(1, q)), f"{a} must be invertible (no zero divisors)"
    for a, b, c in itertools.product(range(q), repeat=3) if q <= 27 else []:
        assert mul[a, add[b, c]] == add[mul[a, b], mul[a, c]]
        assert mul[a, mul[b, c]] == mul[mul[a, b], c]
    if q % 2:  # chi: (q-1)/2 nonzero squares, and multiplicative
        chi = f.chi()
        assert chi[0] == 0 and (chi == 1).sum() == (chi == -1).sum() == (q - 1) // 2
        assert all(chi[mul[a, b]] == chi[a] * chi[b] for a in range(1, q) for b in range(1, q))


def test_returned_matrices_are_fresh_copies():
    h = hadamard_matrix(12)
    h.zero_()
    assert_hadamard(hadamard_matrix(12).numpy())


@pytest.mark.parametrize("n", [1, 2, 12, 36, 64, 128, 576, 640, 896, 4096])
def test_factored_rotation_equals_the_dense_matrix(n):
    """The Kronecker-factored product is ``x @ H / sqrt(n)`` with the matrix checked above."""
    x = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    dense = x @ orthonormal_hadamard(n)
    torch.testing.assert_close(HadamardRotation(n, "cpu", torch.float64)(x), dense, rtol=1e-12, atol=1e-12)


def test_factored_rotation_refuses_sizes_without_a_construction():
    with pytest.raises(GhostLayersError, match="92"):
        HadamardRotation(92, "cpu", torch.float64)
