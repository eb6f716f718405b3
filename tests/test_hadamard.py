"""The Hadamard matrix of linearpatch-rotate against the published LinearPatch/QuIP# construction, re-derived here."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics import hadamard
from ghostlayers.numerics.hadamard import HadamardRotation, hadamard_matrix, has_hadamard, orthonormal_hadamard

# sha256 of each published table had_K as int8 bytes (row-major, +1/-1): computed once by evaluating get_had12 ..
# get_had172 of LinearPatch's rotate_utils/hadamard_utils.py (commit d1274e8; identical tables in QuaRot's
# fake_quant/hadamard_utils.py), casting each tensor to numpy int8 and hashing .tobytes().
PUBLISHED_SHA256 = {
    12: "67507aecbe2abee5607ebc930edc6e70f5046bd415503c71e71ac7dc6ddc9e50",
    20: "f54960fecf1ccf70671b403318d07fd1babfee079c6ebd627812276c3f5d91ed",
    28: "a6cb994c78f9acd4ce172a154b97e3982594cc0124ce7af90cb88810b9509a8c",
    36: "d674d8240e6b622bff2b54fd5f16f903ef5ccbde6e5fba55a73e6b8616ce936d",
    40: "b36c95bcae918f982ba87b8a98828c6ee5232919436228600c0714b67fe82036",
    52: "9ee082772819b1055d61f2d6bc89d814caaeb2fdc5f4d8bb54317842856be195",
    60: "091e76fba0aef58371335b478d7b3f320fcc77b1185eff7d2ed962cd5bc5a048",
    108: "690a34c6c9ed2f0edaf44022cfe6147d7e788cc555505ed5293db3c255582370",
    140: "b9ff01506ffe4db50af93f4c21e0c5af43159fbf5ccf5f8366f1c0efeee84417",
    156: "99a1b852ce559ffd6291cfc39889b4963b068b27116191ce7fc24efcacc538fd",
    172: "378ef12c7cc31f3ea558e1c66b9552a83128f8f732b0bc094b864c8e120d84bd",
}
PREFERENCE = (172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12)  # get_hadK's if/elif chain, top to bottom
HIDDEN_SIZES = (576, 640, 896, 960, 1536, 2048, 2304, 3072, 3584)
SIZES = sorted({2**k for k in range(13)} | {k * 2**j for k in PREFERENCE for j in (0, 1, 3)} | set(HIDDEN_SIZES))


def base(k: int) -> np.ndarray:
    """The shipped table had_K, as the test's float64 input (its content is pinned by the sha256 test)."""
    return hadamard._bases()[k].astype(np.float64)


def sylvester(p: int) -> np.ndarray:
    """S_1 = [1], S_2q = [[S_q, S_q], [S_q, -S_q]], written out again here."""
    s = np.ones((1, 1))
    while len(s) < p:
        s = np.vstack([np.hstack([s, s]), np.hstack([s, -s])])
    return s


def published_plan(n: int) -> tuple[int, int]:
    k = next((k for k in PREFERENCE if n % k == 0), 1)
    return k, n // k


def published_dense(n: int) -> np.ndarray:
    """The derived dense form: ``(had_Kᵀ ⊗ S_{n/K}) / sqrt(n)``, rotation ``x ↦ x @ H``."""
    k, p = published_plan(n)
    return np.kron(base(k).T if k > 1 else np.ones((1, 1)), sylvester(p)) / math.sqrt(n)


def published_procedure(x: np.ndarray) -> np.ndarray:
    """What matmul_hadU does to rows, step by step (not via the dense formula): view each row as (K, n/K), run the
    butterfly (a, b) -> (a + b, a - b) on pairs h = 1, 2, 4, ... apart along the second axis, then left-multiply
    the first axis by had_K, and divide by sqrt(n)."""
    rows, n = x.shape
    k, p = published_plan(n)
    v = x.reshape(rows, k, p).copy()
    h = 1
    while h < p:
        v = v.reshape(rows, k, p // (2 * h), 2, h)
        v = np.stack([v[:, :, :, 0] + v[:, :, :, 1], v[:, :, :, 0] - v[:, :, :, 1]], axis=3)
        h *= 2
    v = v.reshape(rows, k, p)
    if k > 1:
        v = np.einsum("ij,rjq->riq", base(k), v)
    return v.reshape(rows, n) / math.sqrt(n)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.mark.parametrize("k", sorted(PUBLISHED_SHA256))
def test_base_tables_are_the_published_ones(k):
    table = hadamard._bases()[k]
    assert table.dtype == np.int8 and table.shape == (k, k)
    assert hashlib.sha256(np.ascontiguousarray(table).tobytes()).hexdigest() == PUBLISHED_SHA256[k]


@pytest.mark.parametrize("n", [64, 512, 576, 640, 896, 1536, 3072])
def test_matrix_is_the_published_one(n):
    """576 = 36·16 (had_36 is symmetric), 1536 = 12·128 (had_12 is not: catches a missing transpose),
    640 = 40·16 (40 is preferred to 20), 64 and 512 plain Sylvester."""
    ours = orthonormal_hadamard(n).numpy()
    assert rel(ours, published_dense(n)) < 1e-6
    x = np.random.default_rng(n).standard_normal((3, n))
    assert rel(x @ ours, published_procedure(x)) < 1e-6


def test_power_of_two_is_scipy_convention_sylvester():
    h = hadamard_matrix(8).numpy()
    assert np.array_equal(h[1], [1, -1, 1, -1, 1, -1, 1, -1]) and np.array_equal(h[4], [1, 1, 1, 1, -1, -1, -1, -1])


def assert_hadamard(h: np.ndarray) -> None:
    n = h.shape[0]
    a = h.astype(np.int8)
    assert np.array_equal(a, h) and np.all(a * a == 1), "entries must be exactly +-1"
    # float32 BLAS is exact for integer sums of +-1 (|sum| <= n < 2^24) and fast at every size
    gram = (a.astype(np.float32) @ a.T.astype(np.float32)).astype(np.int64)
    assert np.array_equal(gram, n * np.eye(n, dtype=np.int64)), "H H^T must equal n I exactly"


@pytest.mark.parametrize("n", SIZES)
def test_orthogonal(n):
    assert has_hadamard(n)
    assert_hadamard(hadamard_matrix(n).numpy())
    q = orthonormal_hadamard(n)
    assert q.dtype == torch.float64
    rows = torch.arange(n) if n <= 1024 else torch.linspace(0, n - 1, 256).long()  # a sample: fast
    assert (q[rows] @ q.T - torch.eye(n, dtype=torch.float64)[rows]).abs().max() < 1e-12


def test_supported_sizes_are_the_published_ones():
    """Exactly the powers of two and K·2^m: every such n is K·2^m for the first K dividing it too."""
    expected = {2**j for j in range(12)} | {k * 2**j for k in PREFERENCE for j in range(12)}
    assert {n for n in range(1, 2049) if has_hadamard(n)} == {n for n in expected if n <= 2048}


@pytest.mark.parametrize("n", [3, 5, 6, 44, 92, 168, 720, 1000, 0, -4])
def test_unsupported_sizes_raise_naming_the_size_and_form(n):
    """44 = 4·11 and 92 have Hadamard matrices but none in the published construction; 168 = 12·14 and
    720 = 60·12 are multiples of a base with a quotient that is not a power of two."""
    assert not has_hadamard(n)
    with pytest.raises(GhostLayersError, match=rf"order {n}\b") as info:
        hadamard_matrix(n)
    message = str(info.value)
    assert "power of two" in message and "K * 2^m" in message and "172, 156, 140" in message
    assert "--method ghost" in message and "--method linearpatch" in message
    with pytest.raises(GhostLayersError):
        orthonormal_hadamard(n)
    with pytest.raises(GhostLayersError, match=rf"order {n}\b"):
        HadamardRotation(n, "cpu", torch.float64)


def test_returned_matrices_are_fresh_copies():
    h = hadamard_matrix(12)
    h.zero_()
    assert_hadamard(hadamard_matrix(12).numpy())


@pytest.mark.parametrize("n", [1, 2, 12, 20, 64, 128, 576, 640, 896, 1536, 4096])
def test_factored_rotation_equals_the_dense_matrix(n):
    x = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    dense = x @ orthonormal_hadamard(n)
    torch.testing.assert_close(HadamardRotation(n, "cpu", torch.float64)(x), dense, rtol=1e-12, atol=1e-12)


def test_damaged_table_file_is_refused(tmp_path, monkeypatch):
    text = hadamard._BASES_FILE.read_text().splitlines()
    row = next(i for i, line in enumerate(text) if line.startswith("12 "))
    text[row] = text[row][:-1] + ("0" if text[row][-1] != "0" else "1")
    damaged = tmp_path / "hadamard_bases.txt"
    damaged.write_text("\n".join(text) + "\n")
    monkeypatch.setattr(hadamard, "_BASES_FILE", damaged)
    hadamard._bases.cache_clear()
    try:
        with pytest.raises(GhostLayersError, match="damaged"):
            hadamard._bases()
    finally:
        hadamard._bases.cache_clear()
