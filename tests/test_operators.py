"""Operators against independent float64 numpy solutions, on captured and on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_batches, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from ghostlayers.calibration.passes import calibrate
from ghostlayers.numerics import fitting
from ghostlayers.numerics.hadamard import orthonormal_hadamard
from ghostlayers.numerics.sums import PairStats
from ghostlayers.registry.methods import gathered


def stats_from_arrays(x: np.ndarray, y: np.ndarray, z: np.ndarray | None = None) -> PairStats:
    """Sums written out directly from dense arrays, independent of calibration.py: ``x``, ``y`` are
    ``[sequences, tokens, C]``, or ``[tokens, C]`` for one sequence (LinearPatch's ratio is per sequence)."""
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
    xs, ys = (a if a.ndim == 3 else a[None] for a in (x, y))
    x, y = (a.reshape(-1, a.shape[-1]) for a in (xs, ys))
    h = orthonormal_hadamard(x.shape[1]).numpy()
    sums = {
        "count": t(len(x)),
        "xtx": t(x.T @ x),
        "xty": t(x.T @ y),
        "yty": t((y * y).sum()),
        "sequences": t(len(xs)),
        "ratio": t((np.abs(ys).mean(1) / np.abs(xs).mean(1)).sum(0)),
        "ratio_h": t((np.abs(ys @ h).mean(1) / np.abs(xs @ h).mean(1)).sum(0)),
    }
    if z is not None:
        d = y - x + z
        sums |= {"ztz": t(z.T @ z), "ztd": t(z.T @ d), "dtd": t((d * d).sum())}
    return PairStats(0 if z is None else 1, 2, sums)


def captured_states(model, batches, boundaries, per_sequence: bool = False):
    """Hidden states from ``output_hidden_states`` (entry b is the input of layer b), float64 numpy:
    ``[tokens, C]``, or ``[sequences, seq, C]`` with ``per_sequence``."""
    out = {b: [] for b in boundaries}
    with torch.no_grad():
        for batch in batches:
            hs = model(input_ids=batch, output_hidden_states=True).hidden_states
            for b in boundaries:
                out[b].append(hs[b].numpy() if per_sequence else hs[b].reshape(-1, hs[b].shape[-1]).numpy())
    return {b: np.concatenate(v) for b, v in out.items()}


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def test_ghost_matches_numpy_lstsq_on_captured_hidden_states():
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=2, seq=16)
    cal = calibrate(model, batches, [(1, 4)], progress=False)
    states = captured_states(model, batches, [1, 4])
    x, y = states[1], states[4]
    m, *_ = np.linalg.lstsq(x, y - x, rcond=None)
    w = fitting.fit("ghost", cal.pairs[(1, 4)], ridge=0.0).numpy()
    assert rel(w, np.eye(64) + m) < 1e-6
    assert cal.depth == 4


def test_calibration_sums_match_captured_states():
    model = tiny_model("qwen2").double()
    batches = random_batches(num=2)
    stats = calibrate(model, batches, [(2, 3)], progress=False).pairs[(2, 3)]
    s = captured_states(model, batches, [2, 3], per_sequence=True)
    expected = stats_from_arrays(s[2], s[3])
    for name in ("count", "xtx", "xty", "yty", "sequences", "ratio", "ratio_h"):
        assert rel(getattr(stats, name), getattr(expected, name)) < 1e-10, name


def test_replaceme_matches_numpy_and_fold_reproduces_its_stream():
    """T solves min ‖Z T − (Y − X + Z)‖ for the captured down_proj output Z of the last kept layer; after
    folding, the pruned model hands the next layer exactly X − Z + Z T."""
    from ghostlayers.model.surgery import apply_pruning

    model = tiny_model("llama").double()
    batches = random_batches(num=4)
    zs = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda m, a, o: zs.append(o.reshape(-1, 64).numpy().copy())
    )
    states = captured_states(model, batches, [2, 4])
    hook.remove()
    z, x, y = np.concatenate(zs), states[2], states[4]
    t_np, *_ = np.linalg.lstsq(z, y - x + z, rcond=None)
    stats = calibrate(model, batches, [(2, 4)], sums=gathered(["replaceme"]), progress=False).pairs[(2, 4)]
    t = fitting.fit("replaceme", stats, ridge=0.0)
    assert rel(t, t_np) < 1e-6
    apply_pruning(model, [2, 3], "replaceme", {(2, 4): t})
    after = captured_states(model, batches, [2])[2]
    assert rel(after, x - z + z @ t_np) < 1e-8
    assert fitting.relative_residual("replaceme", stats, t) == pytest.approx(
        np.linalg.norm(after - y) / np.linalg.norm(y - x), rel=1e-6
    )


def test_refit_matches_numpy_and_fold_reproduces_its_stream():
    """E solves min ‖A E − (Y − X)‖ for the captured down_proj input A of the last kept layer; after folding
    (weight W₀ + Eᵀ) the pruned model hands the next layer exactly X + A E."""
    from ghostlayers.model.surgery import apply_pruning

    model = tiny_model("llama").double()
    batches = random_batches(num=8)  # 256 tokens: more than the MLP's 128 hidden activations
    activations = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: activations.append(a[0].reshape(-1, a[0].shape[-1]).numpy().copy())
    )
    states = captured_states(model, batches, [2, 4])
    hook.remove()
    a, x, y = np.concatenate(activations), states[2], states[4]
    e_np, *_ = np.linalg.lstsq(a, y - x, rcond=None)
    stats = calibrate(model, batches, [(2, 4)], sums=gathered(["replaceme", "refit"]), progress=False).pairs[(2, 4)]
    e = fitting.fit("refit", stats, ridge=0.0)
    assert rel(e, e_np) < 1e-6
    apply_pruning(model, [2, 3], "refit", {(2, 4): e})
    after = captured_states(model, batches, [2])[2]
    assert rel(after, x + a @ e_np) < 1e-8
    assert fitting.relative_residual("refit", stats, e) == pytest.approx(
        np.linalg.norm(after - y) / np.linalg.norm(y - x), rel=1e-6
    )
    # ReplaceMe's stream X − Z + Z T is X + A W₀ᵀ(T − I): one of refit's, so its residual is no lower
    t = fitting.fit("replaceme", stats, ridge=0.0)
    assert fitting.relative_residual("refit", stats, e) <= fitting.relative_residual("replaceme", stats, t) + 1e-9


def test_refit_sums_beyond_the_budget_are_refused_before_the_pass():
    """A run's refit sums are (I² + I·C) float64 values: one byte short of that is refused, that much is
    enough (llama tiny: I = 128, C = 64)."""
    import ghostlayers
    from ghostlayers.errors import GhostLayersError

    model, batches = tiny_model("llama"), random_batches(num=2)
    need = (128 * 128 + 128 * 64) * 8
    with pytest.raises(GhostLayersError, match="refit's sums"):
        ghostlayers.plan(model, batches, layers="2:4", methods=["refit"], memory_budget=need - 1, progress=False)
    made = ghostlayers.plan(model, batches, layers="2:4", methods=["refit"], memory_budget=need, progress=False)
    assert made.calibration.pairs[(2, 4)].ata.shape == (128, 128)


def test_exact_linear_relation_is_recovered():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 12))
    a = rng.standard_normal((12, 12))
    w = fitting.fit("ghost", stats_from_arrays(x, x @ a), ridge=0.0).numpy()
    assert rel(w, a) < 1e-9


def test_ridge_is_relative_to_mean_eigenvalue():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((300, 8)) * 50, rng.standard_normal((300, 8))
    lam = 0.3 * np.trace(x.T @ x) / 8
    expected = np.eye(8) + np.linalg.solve(x.T @ x + lam * np.eye(8), x.T @ (y - x))
    assert rel(fitting.fit("ghost", stats_from_arrays(x, y), ridge=0.3), expected) < 1e-10


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    size=st.sampled_from([4, 8, 12, 16]),
    scale=st.floats(0.1, 10.0),
    shift=st.floats(-3.0, 3.0),
)
def test_ghost_objective_is_lowest(seed, size, scale, shift):
    """Ghost minimises ‖X W − Y‖²; LinearPatch (both bases) and the identity are feasible W."""
    rng = np.random.default_rng(seed)
    n = 4 * size + rng.integers(0, 50)
    x = rng.standard_normal((n, size)) * rng.uniform(0.1, 5, size) + shift
    y = scale * (x @ rng.standard_normal((size, size))) + rng.standard_normal((n, size))
    s = stats_from_arrays(x, y)
    err = {m: np.linalg.norm(x @ fitting.fit(m, s, ridge=0.0).numpy() - y) ** 2 for m in fitting.CHAINABLE_METHODS}
    for m in fitting.CHAINABLE_METHODS:
        assert err["ghost"] <= err[m] * (1 + 1e-9) + 1e-9
        # the trace formula used for the summary equals the direct residual
        assert float(s.stream_error(fitting.fit(m, s, ridge=0.0))) == pytest.approx(err[m], rel=1e-6)


def test_linearpatch_is_channel_ratio_and_rotation_is_symmetric():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((200, 12)), 2 * rng.standard_normal((200, 12))
    s = stats_from_arrays(x, y)
    lp = fitting.fit("linearpatch", s).numpy()
    assert rel(np.diag(lp), np.abs(y).mean(0) / np.abs(x).mean(0)) < 1e-12
    rot = fitting.fit("linearpatch-rotate", s).numpy()
    h = orthonormal_hadamard(12).numpy()
    assert rel(rot, rot.T) < 1e-12
    assert rel(np.linalg.eigvalsh(rot), np.sort(np.abs(y @ h).mean(0) / np.abs(x @ h).mean(0))) < 1e-10


def test_auto_ridge_minimises_two_fold_heldout_error():
    """Reference: numpy ridge fits on the even and odd batches, each scored on the other half."""
    model = tiny_model("llama").double()
    batches = random_batches(num=4, batch=1, seq=24)  # 96 tokens for C = 64: ridge matters
    cal = calibrate(model, batches, [(2, 4)], holdout=True, progress=False)
    chosen, errors = fitting.fold_ridge(cal.pairs[(2, 4)], cal.holdout[(2, 4)])
    halves = [captured_states(model, batches[k::2], [2, 4]) for k in (0, 1)]

    def heldout_error(ridge: float) -> float:
        total = 0.0
        for fit_on, score_on in ((halves[0], halves[1]), (halves[1], halves[0])):
            x, y = fit_on[2], fit_on[4]
            lam = ridge * np.trace(x.T @ x) / 64
            w = np.eye(64) + np.linalg.solve(x.T @ x + lam * np.eye(64), x.T @ (y - x))
            total += np.linalg.norm(score_on[2] @ w - score_on[4]) ** 2
        return total

    reference = {r: heldout_error(r) for r in errors if r > 0}
    for r, value in reference.items():
        assert errors[r] == pytest.approx(value, rel=1e-6)
    assert chosen == min(errors, key=errors.get) and chosen > 0  # 48 tokens per fold cannot fit 64² unregularised
    assert errors[chosen] < errors[1e-9]


def test_prune_with_auto_ridge_records_the_choice():
    import ghostlayers

    model = tiny_model("llama")
    result = ghostlayers.prune(
        model, random_batches(num=4, batch=1, seq=24), layers="2:4", ridge="auto", progress=False
    )
    assert result.boundaries[0].ridge in fitting.RIDGE_GRID
    assert model.config.ghostlayers["chosen_ridges"] == [result.boundaries[0].ridge]


def test_the_accumulator_holds_only_what_later_sums_read():
    """A batch's states are dropped as soon as no later sum reads them, and all of them once its deepest
    boundary is added: memory does not grow with the number of batches."""
    from ghostlayers.calibration.passes import Accumulator

    model = tiny_model("llama")
    stats = Accumulator(model, [(1, 3)], band=1)
    states = torch.randn(5, 2, 4, model.config.hidden_size)
    for batch in range(2):
        for boundary in range(4):
            stats.add(boundary, states[boundary, :, :, :], batch)
            held = set(stats.states.get(batch, {}))
            assert held == ({1, boundary} if boundary < 3 else set()) or boundary < 1, (boundary, held)
        assert batch not in stats.states
    result = stats.result()
    x, y = states[1].reshape(-1, states.shape[-1]).double(), states[3].reshape(-1, states.shape[-1]).double()
    torch.testing.assert_close(result.pairs[(1, 3)].xtx, 2 * x.T @ x)
    torch.testing.assert_close(result.pairs[(1, 3)].xty, 2 * x.T @ y)
