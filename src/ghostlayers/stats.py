"""The calibration statistics as data: the sums of a boundary pair (``PairStats``), the similarity sums and
a pass's ``Calibration``, with the terms one batch adds to them and the closed-form algebra every method's
solve and residual is written in (``methods``).

A leaf: it knows neither models nor passes. ``calibration.Accumulator`` decides which states reach which
sums; what a batch adds to a sum is defined here, once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from ghostlayers.errors import GhostLayersError
from ghostlayers.hadamard import HadamardRotation, orthonormal_hadamard
from ghostlayers.options import check_ridge_mode
from ghostlayers.products import product

Z_SUMS = ("ztz", "ztd", "dtd")  # ReplaceMe: the last kept layer's down-projection output
A_SUMS = ("ata", "atd", "atx")  # refit: that projection's input


@dataclass
class PairStats:
    """Token sums for the boundary pair ``X = X_pre`` (input of the removed block) and ``Y = X_post``.

    LinearPatch's scale is a mean over sequences of per-sequence ratios (its published estimator), so
    ``ratio`` sums one ratio per sequence and ``sequences`` counts them: both add across batches and
    processes like the token sums, whatever the batch size. ``z`` is the down-projection output of the
    last kept layer (layer ``pre - 1``) and ``d = Y - X + z`` what that projection would have to produce
    instead (ReplaceMe's target). ``a`` is that projection's input (the MLP's ``I`` hidden activations) and
    ``aᵀ(Y − X)`` what a least-squares change of its weight must produce (``refit``).
    """

    pre: int
    post: int
    count: Tensor  # number of tokens
    xtx: Tensor  # XᵀX, C×C
    xty: Tensor  # XᵀY, C×C
    yty: Tensor  # trace(YᵀY)
    sequences: Tensor  # number of calibration sequences
    ratio: Tensor  # Σ over sequences of mean_t|Y| / mean_t|X|, per channel (LinearPatch's scale × sequences)
    ratio_h: Tensor | None = None  # the same for X H and Y H, H the orthonormal Hadamard matrix
    ztz: Tensor | None = None
    ztd: Tensor | None = None
    dtd: Tensor | None = None
    ata: Tensor | None = None  # aᵀa, I×I
    atd: Tensor | None = None  # aᵀ(Y − X), I×C
    atx: Tensor | None = None  # aᵀX, I×C: with ata and atd, the sums of the stream refit hands over

    @classmethod
    def zeros(
        cls,
        pre: int,
        post: int,
        size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rotated: bool,
        replaceme: bool,
        refit_size: int = 0,
    ) -> PairStats:
        """Empty sums for a ``size``-channel pair (``refit_size``: the refitted projection's inputs, 0: none)."""

        def zero(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            pre=pre,
            post=post,
            count=zero(),
            xtx=zero(size, size),
            xty=zero(size, size),
            yty=zero(),
            sequences=zero(),
            ratio=zero(size),
            ratio_h=zero(size) if rotated else None,
            ztz=zero(size, size) if replaceme else None,
            ztd=zero(size, size) if replaceme else None,
            dtd=zero() if replaceme else None,
            ata=zero(refit_size, refit_size) if refit_size else None,
            atd=zero(refit_size, size) if refit_size else None,
            atx=zero(refit_size, size) if refit_size else None,
        )

    def has(self, sums: Sequence[str]) -> bool:
        """Whether every named sum was gathered (a method's ``Method.sums``)."""
        return all(getattr(self, name) is not None for name in sums)

    def tensors(self) -> list[Tensor]:
        """Every sum, for reduction across processes."""
        return [v for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)]

    def add_terms(self, terms: dict[str, Tensor]) -> None:
        """One batch's terms (``input_terms``, ``output_terms``), each added to the sum of its name where
        that sum is gathered."""
        for name, term in terms.items():
            total = getattr(self, name)
            if total is not None:
                total += term

    def add_(self, other: PairStats, sign: float = 1.0) -> PairStats:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value.add_(getattr(other, f.name), alpha=sign)
        return self

    def copy(self) -> PairStats:
        return replace(
            self, **{f.name: v.clone() for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)}
        )

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


def sequence_abs_sums(state: Tensor, hadamard: HadamardRotation | None) -> tuple[Tensor, Tensor | None]:
    """Per-sequence, per-channel ``Σ_t |X|`` and ``Σ_t |X H|`` of a ``[batch, seq, C]`` state: the two
    halves of each sequence's LinearPatch ratio (a batch's sequences all have the same length, so the
    ratio of sums is the ratio of means)."""
    return state.abs().sum(1), hadamard(state).abs().sum(1) if hadamard is not None else None


def input_terms(x: Tensor, z: Tensor | None, a: Tensor | None, dtype: torch.dtype) -> dict[str, Tensor]:
    """What one batch's state ``x`` (tokens × C) at a pair's ``pre`` adds: the token count and ``XᵀX``, and
    the Gram matrices of the last kept layer's down-projection output ``z`` and input ``a`` where given.
    Shared by every pair opening at that boundary."""
    terms = {"count": torch.tensor(x.shape[0], dtype=dtype, device=x.device), "xtx": product(x, x, dtype)}
    if z is not None:
        terms["ztz"] = product(z, z, dtype)
    if a is not None:
        terms["ata"] = product(a, a, dtype)
        terms["atx"] = product(a, x, dtype)
    return terms


@dataclass
class OutputState:
    """One batch's state at a boundary (``[batch, seq, C]``), with what every pair closing there shares."""

    state: Tensor
    dtype: torch.dtype
    hadamard: HadamardRotation | None

    def __post_init__(self) -> None:
        self.flat = self.state.reshape(-1, self.state.shape[-1])
        self.upcast = self.flat.to(self.dtype)
        self.yty = (self.upcast * self.upcast).sum()
        self.abs_y, self.abs_yh = sequence_abs_sums(self.state.to(self.dtype), self.hadamard)


def output_terms(y: OutputState, earlier: Tensor, z: Tensor | None, a: Tensor | None) -> dict[str, Tensor]:
    """What one batch adds to the pair from ``earlier`` (its ``pre`` state, ``[batch, seq, C]``) to ``y``: the
    cross and per-sequence ratio terms, ReplaceMe's with ``z`` and refit's with ``a`` where given."""
    dtype, flat = y.dtype, y.flat
    before = earlier.reshape(-1, earlier.shape[-1])
    abs_x, abs_xh = sequence_abs_sums(earlier.to(dtype), y.hadamard)
    terms = {
        "xty": product(before, flat, dtype),
        "yty": y.yty,
        "sequences": torch.tensor(y.state.shape[0], dtype=dtype, device=flat.device),
        "ratio": (y.abs_y / abs_x).sum(0),
    }
    if y.abs_yh is not None:
        terms["ratio_h"] = (y.abs_yh / abs_xh).sum(0)
    if z is not None:
        terms["ztd"] = product(z, (flat, -before, z), dtype)
        d = y.upcast - before.to(dtype) + z.to(dtype)
        terms["dtd"] = (d * d).sum()
    if a is not None:
        terms["atd"] = product(a, (flat, -before), dtype)
    return terms


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


def pair_stats_bytes(hidden_size: int, num_pairs: int, replaceme: bool, groups: int = 0) -> int:
    """Memory of the C×C float64 sums for ``num_pairs`` pairs (two matrices each, four with ReplaceMe),
    once for the totals and once per group kept apart."""
    return num_pairs * (4 if replaceme else 2) * (1 + groups) * hidden_size**2 * 8
