"""The calibration statistics as data: the sums of a boundary pair (``PairStats``), the similarity sums and
a pass's ``Calibration``, the states one batch's terms are computed from (``Batch``) and the closed-form
algebra every method's solve and residual is written in (``methods``).

A leaf: it knows neither models nor passes. Which sums there are, their shapes and what a batch adds to
each are the records of ``methods.SUMS``; ``calibration.Accumulator`` decides which states reach which sums.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics.hadamard import HadamardRotation, orthonormal_hadamard
from ghostlayers.numerics.products import product
from ghostlayers.registry.methods import check_ridge_mode


@dataclass
class PairStats:
    """Token sums for the boundary pair ``X = X_pre`` (input of the removed block) and ``Y = X_post``, by
    name (``methods.SUMS``: their shapes and terms), each read as an attribute (``stats.xtx``).

    LinearPatch's scale is a mean over sequences of per-sequence ratios (its published estimator), so
    ``ratio`` sums one ratio per sequence and ``sequences`` counts them: both add across batches and
    processes like the token sums, whatever the batch size. ``z`` is the down-projection output of the
    last kept layer (layer ``pre - 1``) and ``d = Y - X + z`` what that projection would have to produce
    instead (ReplaceMe's target). ``a`` is that projection's input (the MLP's ``I`` hidden activations) and
    ``aᵀ(Y − X)`` what a least-squares change of its weight must produce (``refit``).
    """

    pre: int
    post: int
    sums: dict[str, Tensor]

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("__") or name == "sums":  # copying and unpickling look for these before sums exists
            raise AttributeError(name)
        try:
            return self.sums[name]
        except KeyError:
            raise AttributeError(f"the sums of {self.pre}..{self.post - 1} hold no '{name}'") from None

    def __setstate__(self, state: dict) -> None:
        """Read plans pickled before the sums were held by name (every sum a field, None when not gathered)."""
        if "sums" not in state:
            keep = {"pre": state.pop("pre"), "post": state.pop("post")}
            state = {**keep, "sums": {k: v for k, v in state.items() if isinstance(v, Tensor)}}
        self.__dict__.update(state)

    @classmethod
    def zeros(
        cls,
        pre: int,
        post: int,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PairStats:
        """Empty sums of the given ``shapes`` (name → shape)."""
        return cls(pre, post, {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()})

    def has(self, names: Sequence[str]) -> bool:
        """Whether every named sum was gathered (a method's ``Method.sums``)."""
        return all(name in self.sums for name in names)

    def tensors(self) -> list[Tensor]:
        """Every sum, for reduction across processes."""
        return list(self.sums.values())

    def add_terms(self, terms: Mapping[str, Tensor]) -> None:
        """One batch's terms, each added to the sum of its name where that sum is gathered."""
        for name, total in self.sums.items():
            if name in terms:
                total += terms[name]

    def add_(self, other: PairStats, sign: float = 1.0) -> PairStats:
        for name, value in self.sums.items():
            value.add_(other.sums[name], alpha=sign)
        return self

    def copy(self) -> PairStats:
        return replace(self, sums={name: value.clone() for name, value in self.sums.items()})

    def without(self, part: PairStats) -> PairStats:
        """These sums less those of ``part`` (a subset of the same tokens)."""
        return self.copy().add_(part, sign=-1.0)

    # The algebra of the operators, in float64: each method's solve and residual is a line of these.

    def identity(self) -> Tensor:
        return torch.eye(self.xtx.shape[0], dtype=torch.float64, device=self.xtx.device)

    def hadamard(self) -> Tensor:
        """The orthonormal Hadamard matrix of the hidden size (linearpatch-rotate's basis)."""
        return orthonormal_hadamard(self.xtx.shape[0]).to(self.xtx.device)

    def ridge_solve(self, gram: Tensor, rhs: Tensor, ridge: float, ridge_mode: str) -> Tensor:
        """``(G + λI)⁻¹ R``, ``λ = ridge · tr(G)/n`` (relative) or ``ridge`` (absolute). Without a ridge a
        rank-deficient ``G`` rarely fails the solve outright (rounding makes it barely invertible) but gives a
        meaningless map, so its smallest eigenvalue is checked first."""
        check_ridge_mode(ridge_mode)
        gram = gram.double()
        lam = ridge * torch.trace(gram) / gram.shape[0] if ridge_mode == "relative" else ridge
        system = gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        singular = False
        if lam == 0:
            eigenvalues = torch.linalg.eigvalsh(system)
            singular = bool(eigenvalues[0] <= eigenvalues[-1] * gram.shape[0] * torch.finfo(gram.dtype).eps)
        solution, info = torch.linalg.solve_ex(system, rhs.double())
        if singular or bool(info.any()):
            raise GhostLayersError(
                f"The least-squares system of removed block {self.pre}..{self.post - 1} is singular at ridge "
                f"{ridge:g} (the calibration states do not span every channel). Raise --ridge (e.g. 1e-6) or "
                "calibrate on more tokens."
            )
        return solution

    @staticmethod
    def quadratic_error(gram: Tensor, cross: Tensor, constant: Tensor, w: Tensor) -> Tensor:
        """``‖A W − B‖² = tr(Wᵀ AᵀA W) − 2 tr(Wᵀ AᵀB) + ‖B‖²`` from the sums (``gram``, ``cross``, ``constant``)."""
        w = w.double()
        error = torch.trace(w.T @ gram.double() @ w) - 2 * torch.trace(w.T @ cross.double()) + constant.double()
        return error.clamp_min(0)

    def stream_error(self, w: Tensor) -> Tensor:
        """``‖X W − Y‖²``: how far the operator ``W`` on the stream lands from ``X_post``."""
        return self.quadratic_error(self.xtx, self.xty, self.yty, w)

    def refitted(self, e: Tensor) -> tuple[Tensor, Tensor]:
        """``X'ᵀX'`` and ``X'ᵀY`` of the stream ``X' = X + A E`` that refit's change ``E`` of the last kept
        layer's down-projection hands over (``AᵀY = Aᵀ(Y − X) + AᵀX``)."""
        e, atx = e.double(), self.atx.double()
        xta_e = atx.T @ e
        gram = self.xtx.double() + xta_e + xta_e.T + e.T @ self.ata.double() @ e
        return gram, self.xty.double() + e.T @ (self.atd.double() + atx)

    @staticmethod
    def stack(*parts: Tensor) -> Tensor:
        """One operator of a method that does several things (rows of each part, in order)."""
        return torch.cat(parts)

    def dense_gap(self) -> Tensor:
        """``‖Y − X‖²``: plain pruning's error, every residual's unit."""
        return self.stream_error(self.identity())


def sequence_abs_sums(state: Tensor, hadamard: HadamardRotation | None) -> Tensor:
    """Per-sequence, per-channel ``Σ_t |X|`` of a ``[batch, seq, C]`` state, or ``Σ_t |X H|`` with
    ``hadamard``: one half of each sequence's LinearPatch ratio (a batch's sequences all have the same
    length, so the ratio of sums is the ratio of means)."""
    return (state if hadamard is None else hadamard(state)).abs().sum(1)


class OutputState:
    """One batch's state at a boundary (``[batch, seq, C]``), with what every pair closing there shares,
    each computed once when a term first reads it."""

    def __init__(self, state: Tensor, dtype: torch.dtype, hadamard: HadamardRotation | None):
        self.state, self.dtype, self.hadamard = state, dtype, hadamard
        self.flat = state.reshape(-1, state.shape[-1])

    @functools.cached_property
    def upcast(self) -> Tensor:
        return self.flat.to(self.dtype)

    @functools.cached_property
    def yty(self) -> Tensor:
        return (self.upcast * self.upcast).sum()

    @functools.cached_property
    def abs_y(self) -> Tensor:
        return sequence_abs_sums(self.state.to(self.dtype), None)

    @functools.cached_property
    def abs_yh(self) -> Tensor:
        return sequence_abs_sums(self.state.to(self.dtype), self.hadamard)


class Batch:
    """What one batch's terms of a pair are computed from (``methods.Sum.term``): ``x`` the state at the
    pair's ``pre`` and, for the terms added when it closes, ``post`` (an ``OutputState``) with ``y`` its
    state, both flat (tokens × C, the model's dtype); ``taps`` the states beyond the stream (``z``, ``a``:
    tokens × width); ``dtype`` the sums'. Every Gram and cross product is ``product`` (``products.product``)."""

    def __init__(
        self,
        earlier: Tensor,
        dtype: torch.dtype,
        taps: Mapping[str, Tensor],
        post: OutputState | None = None,
        hadamard: HadamardRotation | None = None,
    ):
        self.earlier, self.dtype, self.taps, self.post, self.hadamard = earlier, dtype, taps, post, hadamard
        self.x = earlier.reshape(-1, earlier.shape[-1])
        self.y = post.flat if post is not None else None

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("__") or name == "taps":
            raise AttributeError(name)
        try:
            return self.taps[name]
        except KeyError:
            raise AttributeError(f"no tap '{name}' reaches this batch's sums") from None

    def product(self, a: Tensor, b: Tensor | Sequence[Tensor]) -> Tensor:
        return product(a, b, self.dtype)

    def up(self, state: Tensor) -> Tensor:
        return state.to(self.dtype)

    @staticmethod
    def square(values: Tensor) -> Tensor:
        return (values * values).sum()

    def count(self) -> Tensor:
        return torch.tensor(self.x.shape[0], dtype=self.dtype, device=self.x.device)

    def sequences(self) -> Tensor:
        return torch.tensor(self.post.state.shape[0], dtype=self.dtype, device=self.x.device)

    def ratio(self, rotated: bool) -> Tensor:
        """Σ over sequences of mean_t|Y| / mean_t|X| per channel, in the Hadamard basis when ``rotated``."""
        hadamard = self.hadamard if rotated else None
        abs_y = self.post.abs_yh if rotated else self.post.abs_y
        return (abs_y / sequence_abs_sums(self.up(self.earlier), hadamard)).sum(0)


@dataclass
class Similarity:
    """Per-token cosine and angular distance between boundaries, summed over tokens; ``[a, b]`` is the
    pair (a, b). Cosine is taken over the hidden dimension for each token, then averaged over tokens."""

    cos_sum: Tensor
    angle_sum: Tensor
    count: Tensor

    @classmethod
    def zeros(cls, boundaries: int, dtype: torch.dtype, device: torch.device | str) -> Similarity:
        zeros = torch.zeros(boundaries, boundaries, dtype=dtype, device=device)
        return cls(zeros.clone(), zeros.clone(), torch.zeros_like(zeros[0, 0]))

    def add(self, states: dict[int, Tensor], pairs: Sequence[tuple[int, int]], dtype: torch.dtype, count: bool) -> None:
        """Per-token cosine and angle sums of one batch for boundary ``pairs`` (a ≤ b), pair by pair from the
        held ``states`` (no stacked copy); ``count`` adds the batch's tokens to the count."""
        upcast: dict[int, Tensor] = {}
        norms: dict[int, Tensor] = {}
        for a, b in pairs:
            upcast = {k: v for k, v in upcast.items() if k in (a, b)}  # at most the current pair's two copies
            for k in (a, b):
                if k not in upcast:
                    upcast[k] = states[k].to(dtype)
                if k not in norms:
                    norms[k] = upcast[k].norm(dim=-1)
            dots = (upcast[a] * upcast[b]).sum(-1)
            cos = (dots / (norms[a] * norms[b]).clamp_min(1e-30)).clamp(-1.0, 1.0)
            c, angle = cos.sum(), (torch.arccos(cos) / torch.pi).sum()
            self.cos_sum[a, b] += c
            self.angle_sum[a, b] += angle
            if a != b:
                self.cos_sum[b, a] += c
                self.angle_sum[b, a] += angle
        if count:
            self.count += next(iter(states.values())).shape[:-1].numel()

    @property
    def cosine(self) -> Tensor:
        return self.cos_sum / self.count

    @property
    def angular(self) -> Tensor:
        return self.angle_sum / self.count


HELD_OUT = "held out"  # the group of every other batch, for choosing the ridge on held-out tokens


@dataclass
class Calibration:
    num_layers: int
    depth: int  # deepest boundary reached
    pairs: dict[tuple[int, int], PairStats] = field(default_factory=dict)
    similarity: Similarity | None = None
    groups: dict[Hashable, dict[tuple[int, int], PairStats]] = field(default_factory=dict)  # sums of a group's batches

    @property
    def holdout(self) -> dict[tuple[int, int], PairStats]:
        """The sums of every other batch (``holdout=True``)."""
        return self.groups.get(HELD_OUT, {})

    def keep(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Drop the statistics of every pair not in ``pairs`` (candidates that were not selected)."""
        self.pairs = {pair: self.pairs[pair] for pair in pairs if pair in self.pairs}
        self.groups = {g: {p: sums[p] for p in pairs if p in sums} for g, sums in self.groups.items()}

    def merge(self, other: Calibration) -> Calibration:
        """Take in the pair sums of a later pass (its similarity, if any, is not needed); returns itself."""
        self.pairs.update(other.pairs)
        for group, sums in other.groups.items():
            self.groups.setdefault(group, {}).update(sums)
        return self

    def tensors(self) -> list[Tensor]:
        kept_apart = [s for sums in self.groups.values() for s in sums.values()]
        out = [t for s in (*self.pairs.values(), *kept_apart) for t in s.tensors()]
        if self.similarity is not None:
            out += [self.similarity.cos_sum, self.similarity.angle_sum, self.similarity.count]
        return out
