"""Half-precision routes against float64: the statistics' products and the inserted operator.

``torch.mm(..., out_dtype=torch.float32)`` has CUDA kernels only, so on CPU the tensor-core route of
``products.product`` is forced and its half-precision product emulated by an exact upcast to float32
followed by a float32 matmul: what is checked here is the route's plumbing (chunks, several terms,
float64 sums) and float32 accumulation on CPU, not cuBLAS's accumulation (benchmarks/gpu.py measures that).
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, random_batches, tiny_model

import ghostlayers
from ghostlayers.calibration.passes import calibrate
from ghostlayers.model.modeling_ghostlayers import GhostOperator
from ghostlayers.numerics import products
from ghostlayers.numerics.products import product
from ghostlayers.registry.methods import gathered

TOLERANCE = 1e-5  # relative to the float64 product of the same bf16 states; measured on CPU: ≤ 3e-7


def states(tokens: int, size: int, seed: int) -> torch.Tensor:
    """bf16 states shaped like a residual stream: a per-channel offset and a few large channels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(size)
    scale[:4] = 20.0
    return ((torch.randn(tokens, size, generator=g) + 0.5 * torch.randn(size, generator=g)) * scale).bfloat16()


def rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.fixture
def forced(monkeypatch):
    """Take the tensor-core route on CPU, with its product emulated (float32 inputs are exact bf16 values)."""
    monkeypatch.setattr(products, "tensor_cores", lambda *states: True)
    monkeypatch.setattr(products, "half_product", lambda a, b: a.float().T @ b.float())


def test_float64_route_is_the_exact_product():
    """bf16 states on CPU take the float64 route: an exact upcast, the terms summed, one product."""
    x, y, z = states(300, 48, 0), states(300, 48, 1), states(300, 48, 2)
    assert not products.tensor_cores(x)
    assert torch.equal(product(x, y, torch.float64), x.double().T @ y.double())
    d = y.double() - x.double() + z.double()
    assert torch.equal(product(z, (y, -x, z), torch.float64), z.double().T @ d)


@pytest.mark.parametrize("tokens, chunk", [(5000, 2048), (5000, 5000), (16384, 2048)])
def test_tensor_core_route_matches_float64(forced, tokens, chunk):
    """Gram, cross and ReplaceMe's three-term products, in chunks of tokens (the last one short) or whole."""
    x, z = states(tokens, 256, 0), states(tokens, 256, 2)
    y = (x.float() + 0.3 * states(tokens, 256, 1).float()).bfloat16()
    exact = {
        "gram": x.double().T @ x.double(),
        "cross": x.double().T @ y.double(),
        "ztd": z.double().T @ (y.double() - x.double() + z.double()),
    }
    got = {
        "gram": product(x, x, torch.float64, chunk),
        "cross": product(x, y, torch.float64, chunk),
        "ztd": product(z, (y, -x, z), torch.float64, chunk),
    }
    for name, value in got.items():
        assert value.dtype == torch.float64
        assert rel(value, exact[name]) < TOLERANCE, name


def test_calibration_sums_through_the_tensor_core_route(forced):
    """Every C×C sum of a bf16 model's calibration (ghost and ReplaceMe, held-out half too) within the
    tolerance of the float64 route's; the element-wise sums are untouched."""
    model = tiny_model("llama").bfloat16()
    batches = random_batches(num=4, batch=4, seq=32)
    options = dict(sums=gathered(["replaceme"]), holdout=True, progress=False)
    fast = calibrate(model, batches, [(2, 4), (3, 5)], **options)
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(products, "tensor_cores", lambda *states: False)
        exact = calibrate(model, batches, [(2, 4), (3, 5)], **options)
    for totals in ("pairs", "holdout"):
        for pair, stats in getattr(exact, totals).items():
            other = getattr(fast, totals)[pair]
            for name in ("xtx", "xty", "ztz", "ztd"):
                assert rel(getattr(other, name), getattr(stats, name)) < TOLERANCE, (totals, pair, name)
            for name in ("count", "yty", "sequences", "ratio", "ratio_h", "dtd"):
                assert torch.equal(getattr(other, name), getattr(stats, name)), (totals, pair, name)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_operator_in_bf16_matches_float64(model_type):
    """Inside a pruned bf16 model of every architecture, each operator's output is ``x (I + delta)`` in
    float64 rounded once to bf16: within 2⁻⁸ of each element (one rounding) plus float32 accumulation's
    bound (C·2⁻²⁴ of Σ|x||W|), in the model's dtype."""
    model = tiny_model(model_type).bfloat16()
    ghostlayers.prune(model, random_batches(), layers=[1, 2, 4], method="ghost", progress=False)
    operators = [m for m in model.modules() if isinstance(m, GhostOperator)]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    handles = [op.register_forward_hook(lambda m, a, out: seen.append((a[0], out, m.delta))) for op in operators]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)))
    for handle in handles:
        handle.remove()
    assert len(seen) == len(operators) == 2
    for x, out, delta in seen:
        assert out.dtype == delta.dtype == torch.bfloat16 and out.shape == x.shape
        size = delta.shape[0]
        flat, w = x.reshape(-1, size).double(), torch.eye(size, dtype=torch.float64) + delta.double()
        expected, accumulation = (flat @ w).view(x.shape), (size * 2**-24 * flat.abs() @ w.abs()).view(x.shape)
        assert float(delta.double().abs().max()) > 1e-3  # a real repair, not the identity
        assert bool(((out.double() - expected).abs() <= 2**-8 * expected.abs() + accumulation).all())
