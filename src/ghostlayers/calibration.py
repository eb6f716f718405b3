"""One forward pass that streams the statistics every recovery operator and selection criterion needs.

Boundary ``b`` is the residual stream entering decoder layer ``b`` (``b = L`` is the output of the last
layer, before the final norm). Removing layers ``i..j-1`` hands layer ``j`` the state ``X_i`` instead of
``X_j``; a ``PairStats`` for ``(i, j)`` holds sums over calibration tokens (and sequences) from which
every operator is a closed-form function. Only the current batch's hidden states are ever held, as
``[batch, seq, C]`` (LinearPatch's scale is taken per sequence), the model is never copied, and the
forward stops at the deepest boundary needed (no later layers, no LM head).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.adapters import adapter_for, decoder_layers, layer_output
from ghostlayers.distributed import distributed_rank
from ghostlayers.hadamard import HadamardRotation, has_hadamard


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
        )

    def tensors(self) -> list[Tensor]:
        """Every sum, for reduction across processes."""
        return [v for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)]

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


@dataclass
class Similarity:
    """Per-token cosine and angular distance between boundaries, summed over tokens; ``[a, b]`` is the
    pair (a, b). Cosine is taken over the hidden dimension for each token, then averaged over tokens."""

    cos_sum: Tensor
    angle_sum: Tensor
    count: Tensor

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

    def tensors(self) -> list[Tensor]:
        kept_apart = [s for sums in self.groups.values() for s in sums.values()]
        out = [t for s in (*self.pairs.values(), *kept_apart) for t in s.tensors()]
        if self.similarity is not None:
            out += [self.similarity.cos_sum, self.similarity.angle_sum, self.similarity.count]
        return out


class _ReachedDepth(Exception):
    """Raised by the hook at the deepest boundary to stop the forward pass there."""


def pair_stats_bytes(hidden_size: int, num_pairs: int, replaceme: bool, groups: int = 0) -> int:
    """Memory of the C×C float64 sums for ``num_pairs`` pairs (two matrices each, four with ReplaceMe),
    once for the totals and once per group kept apart."""
    return num_pairs * (4 if replaceme else 2) * (1 + groups) * hidden_size**2 * 8


def batch_groups(num_batches: int, holdout: bool, groups: Sequence[Hashable] | None) -> list[Hashable | None]:
    """The group of each batch whose sums are also kept apart (None: in the totals only): ``groups`` as
    given (e.g. each batch's calibration domain), or with ``holdout`` every other batch."""
    if groups is not None:
        if len(groups) != num_batches:
            raise ValueError(f"{len(groups)} group labels for {num_batches} calibration batches")
        return list(groups)
    return [HELD_OUT if holdout and i % 2 == 1 else None for i in range(num_batches)]


def calibration_plan(
    model: PreTrainedModel, pairs: Sequence[tuple[int, int]], depth: int | None, replaceme: bool
) -> tuple[int, int, set[int]]:
    """The layer count, the deepest boundary to reach (default: the deepest ``post`` in ``pairs``) and the
    layers whose down-projection output ReplaceMe needs: one decision for both calibration passes."""
    num_layers = len(decoder_layers(model))
    depth = max((p for _, p in pairs), default=num_layers) if depth is None else depth
    return num_layers, depth, last_kept_layers(model, pairs) if replaceme else set()


def last_kept_layers(model: PreTrainedModel, pairs: Sequence[tuple[int, int]]) -> set[int]:
    """The layers before the pairs' removed runs, whose down-projection ReplaceMe and refit rewrite."""
    layers = {pre - 1 for pre, _ in pairs if pre >= 1}
    if layers and adapter_for(model).down_proj is None:
        raise ValueError("replaceme and refit statistics need an architecture whose MLP ends in a plain Linear")
    return layers


def down_projection_widths(model: PreTrainedModel, pairs: Sequence[tuple[int, int]]) -> dict[int, int]:
    """The input width ``I`` of each down-projection refit rewrites (the last kept layer of each run)."""
    down_proj, layers = adapter_for(model).down_proj, decoder_layers(model)
    return {k: layers[k].get_submodule(down_proj).in_features for k in last_kept_layers(model, pairs)}


def hadamard_for(size: int, device: torch.device | str, dtype: torch.dtype) -> HadamardRotation | None:
    """The rotation whose per-channel sums linearpatch-rotate needs, where such a matrix exists."""
    return HadamardRotation(size, device, dtype) if has_hadamard(size) else None


def share_across_ranks(batches: list) -> list:
    """This process's share under ``torch.distributed``: every ``world_size``-th batch (or batch label)."""
    rank, world = distributed_rank()
    if world > 1 and len(batches) < world:
        raise ValueError(f"{len(batches)} calibration batches cannot be shared by {world} processes")
    return batches[rank::world]


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


def sequence_abs_sums(state: Tensor, hadamard: HadamardRotation | None) -> tuple[Tensor, Tensor | None]:
    """Per-sequence, per-channel ``Σ_t |X|`` and ``Σ_t |X H|`` of a ``[batch, seq, C]`` state: the two
    halves of each sequence's LinearPatch ratio (a batch's sequences all have the same length, so the
    ratio of sums is the ratio of means)."""
    return state.abs().sum(1), hadamard(state).abs().sum(1) if hadamard is not None else None


class Accumulator:
    """The calibration sums of one run, and the only code that adds to them (as GPTQ's ``add_batch``).

    A driver (the in-memory pass ``calibrate``, the layer-by-layer ``offload.calibrate_layerwise``, the
    sequential fit) only obtains hidden states and hands each one over with ``add(boundary, hidden, batch)``
    as soon as it exists, in increasing boundary order within a batch; the last kept layer's down-projection
    output goes to ``add_mlp_output`` before the boundary it feeds. Each statistic is added as soon as its
    later boundary arrives, and a state is dropped once no later statistic of its batch reads it: a batch
    holds about ``band`` + (open pairs) states, not one per layer. ``result()`` masks what was not measured
    and sums over ``torch.distributed`` processes (each gave its own share of the batches).

    ``pairs``: the boundary pairs whose ``PairStats`` to gather; ``band``: similarity (cosine, angle) for
    boundaries at most that far apart, or None for none; ``replaceme``: the down-projection sums too;
    ``refit``: the down-projection input's sums (its input goes to ``add_mlp_input``, like the output);
    ``labels``: each batch's group (None: the totals only), whose sums are also kept apart; ``dtype``: the
    sums' dtype (the states stay in the model's, see ``product``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pairs: Sequence[tuple[int, int]],
        *,
        depth: int | None = None,
        band: int | None = None,
        replaceme: bool = False,
        refit: bool = False,
        labels: Sequence[Hashable | None] = (),
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ):
        num_layers, depth, self.z_layers = calibration_plan(model, pairs, depth, replaceme)
        self.a_sizes = down_projection_widths(model, pairs) if refit else {}
        self.pairs, self.band, self.labels, self.dtype = list(pairs), band, list(labels), dtype
        self.device = next(model.parameters()).device if device is None else device
        self.hadamard = hadamard_for(model.config.hidden_size, self.device, dtype)
        self.calibration = Calibration(num_layers=num_layers, depth=depth)
        self._allocate(model.config.hidden_size)
        self.states: dict[int, dict[int, Tensor]] = {}  # batch → boundary → state, only those still needed
        self.mlp_out: dict[int, dict[int, Tensor]] = {}  # batch → layer → down-projection output
        self.mlp_in: dict[int, dict[int, Tensor]] = {}  # batch → layer → down-projection input (refit)

    @property
    def depth(self) -> int:
        return self.calibration.depth

    @property
    def boundaries(self) -> set[int]:
        """The boundaries whose states the statistics read."""
        if self.band is not None:
            return set(range(self.depth + 1))
        return {b for pair in self.pairs for b in pair}

    def _allocate(self, size: int) -> None:
        """Every pair's zeroed sums (and those of each group), made before the forward pass. Long-lived
        buffers made amid the pass's temporaries fragment the C heap: on SmolLM2 with 27 candidate blocks,
        peak RSS was 600 MB above the weights with sums made on first use, 200 MB so."""
        result = self.calibration
        result.groups = {g: {} for g in dict.fromkeys(self.labels) if g is not None}
        for totals in (result.pairs, *result.groups.values()):
            for pre, post in self.pairs:
                totals[(pre, post)] = PairStats.zeros(
                    pre,
                    post,
                    size,
                    self.dtype,
                    self.device,
                    self.hadamard is not None,
                    pre - 1 in self.z_layers,
                    self.a_sizes.get(pre - 1, 0),
                )

    def add_mlp_output(self, layer: int, out: Tensor, batch: int = 0) -> None:
        """Layer ``layer``'s down-projection output for ``batch`` (tokens × C), if ReplaceMe needs it."""
        if layer in self.z_layers:
            self.mlp_out.setdefault(batch, {})[layer] = out.detach().reshape(-1, out.shape[-1])

    def add_mlp_input(self, layer: int, a: Tensor, batch: int = 0) -> None:
        """Layer ``layer``'s down-projection input for ``batch`` (tokens × I), if refit needs it."""
        if layer in self.a_sizes:
            self.mlp_in.setdefault(batch, {})[layer] = a.detach().reshape(-1, a.shape[-1])

    def add(self, boundary: int, hidden: Tensor, batch: int = 0) -> None:
        """Add ``batch``'s terms that the state at ``boundary`` (``[batch, seq, C]``) completes, then drop
        that batch's states and MLP outputs no later statistic reads."""
        states = self.states.setdefault(batch, {})
        states[boundary] = hidden.detach()
        group = self.labels[batch] if self.labels else None
        self._add_pairs(boundary, states, self.mlp_out.get(batch, {}), self.mlp_in.get(batch, {}), group)
        if self.band is not None:
            near = [(a, boundary) for a in sorted(states) if boundary - a <= self.band]
            self._add_similarity(states, near, count=boundary == 0)
        if boundary == self.depth:  # the batch is complete: nothing of it is read again
            self.states.pop(batch)
            self.mlp_out.pop(batch, None)
            self.mlp_in.pop(batch, None)
            return
        needed = {pre for pre, post in self.pairs if post > boundary}
        if self.band is not None:
            needed |= set(range(boundary + 1 - self.band, boundary + 1))
        self.states[batch] = {b: s for b, s in states.items() if b in needed}
        z_needed = {pre - 1 for pre, post in self.pairs if post > boundary}
        self.mlp_out[batch] = {k: z for k, z in self.mlp_out.get(batch, {}).items() if k in z_needed}
        self.mlp_in[batch] = {k: a for k, a in self.mlp_in.get(batch, {}).items() if k in z_needed}

    def result(self) -> Calibration:
        """The sums over every batch (of every process); similarity beyond ``band`` is NaN (not measured)."""
        self.states.clear()
        self.mlp_out.clear()
        self.mlp_in.clear()
        result = self.calibration
        if result.similarity is not None and self.band is not None:
            far = torch.ones_like(result.similarity.cos_sum, dtype=torch.bool).triu(self.band + 1)
            far |= far.T.clone()
            result.similarity.cos_sum[far] = float("nan")
            result.similarity.angle_sum[far] = float("nan")
        if distributed_rank()[1] > 1:
            for tensor in result.tensors():
                torch.distributed.all_reduce(tensor)
        return result

    def _add_pairs(
        self,
        boundary: int,
        states: dict[int, Tensor],
        mlp_out: dict[int, Tensor],
        mlp_in: dict[int, Tensor],
        group: Hashable | None,
    ) -> None:
        """The ``X`` terms of the pairs starting at ``boundary`` and the ``Y``, cross and per-sequence ratio
        terms of those ending there. This boundary's own products (Gram matrix, per-sequence abs-sums) are
        computed once however many pairs share it."""
        opening = [pair for pair in self.pairs if pair[0] == boundary]
        closing = [pair for pair in self.pairs if pair[1] == boundary]
        if not opening and not closing:
            return
        dtype, result = self.dtype, self.calibration
        state = states[boundary]
        flat = state.reshape(-1, state.shape[-1])
        x = flat.to(dtype)
        every = (result.pairs, result.groups[group]) if group is not None else (result.pairs,)
        if opening:
            gram = product(flat, flat, dtype)
            z, a = mlp_out.get(boundary - 1), mlp_in.get(boundary - 1)
            ztz = product(z, z, dtype) if z is not None else None
            ata = product(a, a, dtype) if a is not None else None
        for pair in opening:
            for totals in every:
                t = totals[pair]
                t.count += x.shape[0]
                t.xtx += gram
                if ztz is not None:
                    t.ztz += ztz
                if ata is not None:
                    t.ata += ata
        if closing:
            abs_y, abs_yh = sequence_abs_sums(state.to(dtype), self.hadamard)
        for pre, post in closing:
            earlier = states[pre]
            before = earlier.reshape(-1, earlier.shape[-1])
            xty, yty = product(before, flat, dtype), (x * x).sum()
            abs_x, abs_xh = sequence_abs_sums(earlier.to(dtype), self.hadamard)
            ratio = (abs_y / abs_x).sum(0)
            ratio_h = (abs_yh / abs_xh).sum(0) if abs_yh is not None else None
            if result.pairs[(pre, post)].ztz is not None:
                z = mlp_out[pre - 1]
                ztd = product(z, (flat, -before, z), dtype)
                d = x - before.to(dtype) + z.to(dtype)
                dtd = (d * d).sum()
            if result.pairs[(pre, post)].ata is not None:
                atd = product(mlp_in[pre - 1], (flat, -before), dtype)
            for totals in every:
                t = totals[(pre, post)]
                t.xty += xty
                t.yty += yty
                t.sequences += state.shape[0]
                t.ratio += ratio
                if ratio_h is not None:
                    t.ratio_h += ratio_h
                if t.ztz is not None:
                    t.ztd += ztd
                    t.dtd += dtd
                if t.ata is not None:
                    t.atd += atd

    def _add_similarity(self, states: dict[int, Tensor], pairs: Sequence[tuple[int, int]], count: bool) -> None:
        """Per-token cosine and angle sums for boundary ``pairs`` (a ≤ b), pair by pair from the held states
        (no stacked copy); ``count`` adds the batch's tokens to the count."""
        dtype, result = self.dtype, self.calibration
        first = next(iter(states.values()))
        if result.similarity is None:
            zeros = torch.zeros(result.num_layers + 1, result.num_layers + 1, dtype=dtype, device=self.device)
            result.similarity = Similarity(zeros.clone(), zeros.clone(), torch.zeros_like(zeros[0, 0]))
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
            result.similarity.cos_sum[a, b] += c
            result.similarity.angle_sum[a, b] += angle
            if a != b:
                result.similarity.cos_sum[b, a] += c
                result.similarity.angle_sum[b, a] += angle
        if count:
            result.similarity.count += first.shape[:-1].numel()


@torch.no_grad()
def calibrate(
    model: PreTrainedModel,
    batches: Iterable[Tensor],
    pairs: Sequence[tuple[int, int]] = (),
    *,
    depth: int | None = None,
    similarity: bool = True,
    band: int | None = None,
    replaceme: bool = False,
    refit: bool = False,
    holdout: bool = False,
    groups: Sequence[Hashable] | None = None,
    stats_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> Calibration:
    """Run ``batches`` (token-id tensors ``[batch, seq]``) through ``model`` once, up to boundary
    ``depth`` (default: the deepest ``post`` in ``pairs``), handing every boundary's state to an
    ``Accumulator``: ``PairStats`` for each pair and, if ``similarity``, cosine/angle sums between
    boundaries up to ``depth`` at most ``band`` apart (default: every two; the others are NaN).
    ``replaceme`` also gathers the last kept layer's down-projection statistics (pairs with pre ≥ 1),
    ``refit`` those of its input.
    ``holdout`` also keeps the sums of every other batch apart, for choosing the ridge on held-out tokens;
    ``groups`` (a label per batch, e.g. its domain) keeps each group's sums apart (``Calibration.groups``),
    for leave-one-group-out fits. Under ``torch.distributed`` each rank takes every ``world_size``-th
    batch and every rank ends with the statistics of all batches."""
    labels = share_across_ranks(batch_groups(len(list(batches)), holdout, groups))
    batches = share_across_ranks(list(batches))
    layers = decoder_layers(model)
    device = next(model.parameters()).device  # sums live here even when layers are spread over devices
    depth = max((p for _, p in pairs), default=len(layers)) if depth is None else depth
    band = (depth if band is None else band) if similarity else None
    stats = Accumulator(
        model, pairs, depth=depth, band=band, replaceme=replaceme, refit=refit, labels=labels, dtype=stats_dtype
    )
    current = [0]  # the batch in the forward pass, for the hooks

    def keep(boundary: int, hidden: Tensor) -> None:
        stats.add(boundary, hidden.to(device), current[0])
        if boundary == depth:
            raise _ReachedDepth

    handles = []
    if 0 in stats.boundaries:

        def first_input(module, args, kwargs):
            keep(0, args[0] if args else kwargs["hidden_states"])

        handles.append(layers[0].register_forward_pre_hook(first_input, with_kwargs=True))
    for b in sorted(stats.boundaries - {0}):
        handles.append(layers[b - 1].register_forward_hook(lambda m, a, out, b=b: keep(b, layer_output(out))))
    down_proj = adapter_for(model).down_proj
    for k in stats.z_layers:
        handles.append(
            layers[k]
            .get_submodule(down_proj)
            .register_forward_hook(lambda m, a, out, k=k: stats.add_mlp_output(k, out.to(device), current[0]))
        )
    for k in stats.a_sizes:
        handles.append(
            layers[k]
            .get_submodule(down_proj)
            .register_forward_pre_hook(lambda m, args, k=k: stats.add_mlp_input(k, args[0].to(device), current[0]))
        )
    try:
        for current[0], batch in enumerate(tqdm(batches, desc="calibrating", unit="batch", disable=not progress)):
            with contextlib.suppress(_ReachedDepth):
                model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats.result()


@torch.no_grad()
def boundary_state(model: PreTrainedModel, batch: Tensor, boundary: int) -> Tensor:
    """The residual stream at ``boundary`` for one batch (``[batch, seq, C]``, the model's dtype), running
    only the layers before it. Seen after any operator attached at that boundary's layer."""
    layers = decoder_layers(model)
    captured: list[Tensor] = []
    device = next(model.parameters()).device

    def grab(hidden: Tensor) -> None:
        captured.append(hidden.detach().to(device))
        raise _ReachedDepth

    if boundary < len(layers):
        handle = layers[boundary].register_forward_pre_hook(
            lambda m, args, kwargs: grab(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
    else:
        handle = layers[-1].register_forward_hook(lambda m, a, out: grab(layer_output(out)))
    try:
        with contextlib.suppress(_ReachedDepth):
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        handle.remove()
    return captured[0]
