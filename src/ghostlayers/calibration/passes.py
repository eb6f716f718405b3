"""One forward pass that streams the statistics every recovery operator and selection criterion needs.

Boundary ``b`` is the residual stream entering decoder layer ``b`` (``b = L`` is the output of the last
layer, before the final norm). Removing layers ``i..j-1`` hands layer ``j`` the state ``X_i`` instead of
``X_j``; a ``stats.PairStats`` for ``(i, j)`` holds sums over calibration tokens (and sequences) from which
every operator is a closed-form function. Only the current batch's hidden states are ever held, as
``[batch, seq, C]`` (LinearPatch's scale is taken per sequence), the model is never copied, and the
forward stops at the deepest boundary needed (no later layers, no LM head).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.calibration.distributed import distributed_rank, share_across_ranks
from ghostlayers.model.adapters import StopForward, adapter_for, decoder_layers, hidden_states, layer_output
from ghostlayers.numerics.finite import check_token_ids
from ghostlayers.numerics.hadamard import HadamardRotation, has_hadamard
from ghostlayers.numerics.sums import HELD_OUT, Batch, Calibration, OutputState, PairStats, Similarity
from ghostlayers.registry.methods import SUMS, Sum, gathered

TAPS = {"z": "output", "a": "input"}  # states beyond the stream: the last kept layer's down-projection output, input


def batch_groups(num_batches: int, holdout: bool, groups: Sequence[Hashable] | None) -> list[Hashable | None]:
    """The group of each batch whose sums are also kept apart (None: in the totals only): ``groups`` as
    given (e.g. each batch's calibration domain), or with ``holdout`` every other batch."""
    if groups is not None:
        if len(groups) != num_batches:
            raise ValueError(f"{len(groups)} group labels for {num_batches} calibration batches")
        return list(groups)
    return [HELD_OUT if holdout and i % 2 == 1 else None for i in range(num_batches)]


def last_kept_layers(model: PreTrainedModel, pairs: Sequence[tuple[int, int]]) -> set[int]:
    """The layers before the pairs' removed runs, whose down-projection the folded methods rewrite (and the
    sums of ``methods.Sum.taps`` read)."""
    layers = {pre - 1 for pre, _ in pairs if pre >= 1}
    if layers and adapter_for(model).down_proj is None:
        raise ValueError("sums that read the down-projection need an architecture whose MLP ends in a plain Linear")
    return layers


def down_projection_widths(model: PreTrainedModel, pairs: Sequence[tuple[int, int]]) -> dict[int, int]:
    """The input width ``I`` of each down-projection refit rewrites (the last kept layer of each run)."""
    down_proj, layers = adapter_for(model).down_proj, decoder_layers(model)
    return {k: layers[k].get_submodule(down_proj).in_features for k in last_kept_layers(model, pairs)}


class Accumulator:
    """The calibration sums of one run: which state reaches which sum, and when a state may go (what a batch
    adds to each sum is its ``methods.Sum.term``, as GPTQ's ``add_batch``).

    A driver (the in-memory pass ``calibrate``, the layer-by-layer ``offload.calibrate_layerwise``, the
    sequential fit) only obtains hidden states and hands each one over with ``add(boundary, hidden, batch)``
    as soon as it exists, in increasing boundary order within a batch; a tapped state (``TAPS``) of the last
    kept layer goes to ``add_tap`` before the boundary it feeds. Each sum is added as soon as its later
    boundary arrives, and a state is dropped once no later sum of its batch reads it: a batch holds about
    ``band`` + (open pairs) states, not one per layer. ``result()`` masks what was not measured and sums over
    ``torch.distributed`` processes (each gave its own share of the batches).

    ``pairs``: the boundary pairs whose ``PairStats`` to gather; ``band``: similarity (cosine, angle) for
    boundaries at most that far apart, or None for none; ``sums``: the names of the sums to gather
    (``methods.SUMS``; ``methods.gathered(["replaceme"])``: the stream's and ReplaceMe's), each where it
    can be (a tap needs a kept layer before the run, a rotated sum a Hadamard matrix); ``labels``:
    each batch's group (None: the totals only), whose sums are also kept apart; ``dtype``: the sums' dtype
    (the states stay in the model's, see ``products.product``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pairs: Sequence[tuple[int, int]],
        *,
        depth: int | None = None,
        band: int | None = None,
        sums: Sequence[str] = gathered(),
        labels: Sequence[Hashable | None] = (),
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ):
        num_layers = len(decoder_layers(model))
        depth = max((p for _, p in pairs), default=num_layers) if depth is None else depth
        self.pairs, self.band, self.labels, self.dtype = list(pairs), band, list(labels), dtype
        self.device = next(model.parameters()).device if device is None else device
        size = model.config.hidden_size
        self.hadamard = HadamardRotation(size, self.device, dtype) if has_hadamard(size) else None
        self.sums = {pair: self._sums_of(pair, sums) for pair in self.pairs}
        self.taps = self._tapped_layers(model)  # tap → the layers whose state it reads
        self.calibration = Calibration(num_layers=num_layers, depth=depth)
        self._allocate(model)
        self.states: dict[int, dict[int, Tensor]] = {}  # batch → boundary → state, only those still needed
        self.tapped: dict[int, dict[tuple[str, int], Tensor]] = {}  # batch → (tap, layer) → state

    def _sums_of(self, pair: tuple[int, int], names: Sequence[str]) -> tuple[Sum, ...]:
        """The sums of ``names`` this pair can have: a tap needs a layer before the run, a rotation its matrix."""
        usable = [SUMS[n] for n in names]
        return tuple(s for s in usable if (pair[0] >= 1 or not s.taps) and (self.hadamard or not s.rotated))

    def _tapped_layers(self, model: PreTrainedModel) -> dict[str, set[int]]:
        taps = {tap for sums in self.sums.values() for s in sums for tap in s.taps}
        if taps:
            last_kept_layers(model, self.pairs)  # refuses an architecture without a plain down-projection
        return {t: {pre - 1 for (pre, post), sums in self.sums.items() if any(t in s.taps for s in sums)} for t in taps}

    @classmethod
    def for_batches(
        cls,
        model: PreTrainedModel,
        batches: Iterable[Tensor],
        pairs: Sequence[tuple[int, int]],
        *,
        holdout: bool = False,
        groups: Sequence[Hashable] | None = None,
        stats_dtype: torch.dtype = torch.float64,
        **options,
    ) -> tuple[Accumulator, list[Tensor]]:
        """The accumulator of a pass over ``batches`` and this process's share of them (every driver's
        start: batch groups, ``holdout`` or ``groups``, and the split across ``torch.distributed`` ranks)."""
        batches = list(batches)
        labels = share_across_ranks(batch_groups(len(batches), holdout, groups))
        return cls(model, pairs, labels=labels, dtype=stats_dtype, **options), share_across_ranks(batches)

    @property
    def depth(self) -> int:
        return self.calibration.depth

    @property
    def boundaries(self) -> set[int]:
        """The boundaries whose states the statistics read."""
        if self.band is not None:
            return set(range(self.depth + 1))
        return {b for pair in self.pairs for b in pair}

    def _allocate(self, model: PreTrainedModel) -> None:
        """Every pair's zeroed sums (and those of each group), made before the forward pass. Long-lived
        buffers made amid the pass's temporaries fragment the C heap: on SmolLM2 with 27 candidate blocks,
        peak RSS was 600 MB above the weights with sums made on first use, 200 MB so."""
        result = self.calibration
        result.groups = {g: {} for g in dict.fromkeys(self.labels) if g is not None}
        wide = any("I" in s.shape for sums in self.sums.values() for s in sums)
        widths = down_projection_widths(model, self.pairs) if wide else {}
        for pre, post in self.pairs:
            sizes = {"C": model.config.hidden_size, "I": widths.get(pre - 1, 0)}
            shapes = {s.name: s.size(sizes) for s in self.sums[(pre, post)]}
            for totals in (result.pairs, *result.groups.values()):
                totals[(pre, post)] = PairStats.zeros(pre, post, shapes, self.dtype, self.device)

    def add_tap(self, tap: str, layer: int, state: Tensor, batch: int = 0) -> None:
        """The state ``tap`` (``TAPS``) of layer ``layer`` for ``batch`` (tokens × width), if a sum reads it."""
        if layer in self.taps.get(tap, ()):
            self.tapped.setdefault(batch, {})[(tap, layer)] = state.detach().reshape(-1, state.shape[-1])

    def add(self, boundary: int, hidden: Tensor, batch: int = 0) -> None:
        """Add ``batch``'s terms that the state at ``boundary`` (``[batch, seq, C]``) completes, then drop
        that batch's states and tapped states no later sum reads."""
        states = self.states.setdefault(batch, {})
        states[boundary] = hidden.detach()
        group = self.labels[batch] if self.labels else None
        self._add_pairs(boundary, states, self.tapped.get(batch, {}), group)
        if self.band is not None:
            if self.calibration.similarity is None:
                self.calibration.similarity = Similarity.zeros(self.calibration.num_layers + 1, self.dtype, self.device)
            near = [(a, boundary) for a in sorted(states) if boundary - a <= self.band]
            self.calibration.similarity.add(states, near, self.dtype, count=boundary == 0)
        if boundary == self.depth:  # the batch is complete: nothing of it is read again
            self.states.pop(batch)
            self.tapped.pop(batch, None)
            return
        needed = {pre for pre, post in self.pairs if post > boundary}
        if self.band is not None:
            needed |= set(range(boundary + 1 - self.band, boundary + 1))
        self.states[batch] = {b: s for b, s in states.items() if b in needed}
        tap_needed = {pre - 1 for pre, post in self.pairs if post > boundary}
        self.tapped[batch] = {k: t for k, t in self.tapped.get(batch, {}).items() if k[1] in tap_needed}

    def result(self) -> Calibration:
        """The sums over every batch (of every process); similarity beyond ``band`` is NaN (not measured)."""
        self.states.clear()
        self.tapped.clear()
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
        tapped: dict[tuple[str, int], Tensor],
        group: Hashable | None,
    ) -> None:
        """The terms of the pairs opening at ``boundary`` and of those closing there, each opening term
        computed once however many pairs (and groups) share it, the closing ones sharing the state there."""
        result = self.calibration
        every = (result.pairs, result.groups[group]) if group is not None else (result.pairs,)
        opening = [pair for pair in self.pairs if pair[0] == boundary]
        if opening:
            taps = {tap: state for (tap, layer), state in tapped.items() if layer == boundary - 1}
            batch = Batch(states[boundary], self.dtype, taps, hadamard=self.hadamard)
            sums = {s.name: s for pair in opening for s in self.sums[pair] if not s.closes}
            terms = {name: s.term(batch) for name, s in sums.items()}
            for pair in opening:
                for totals in every:
                    totals[pair].add_terms(terms)
        closing = [pair for pair in self.pairs if pair[1] == boundary]
        post = OutputState(states[boundary], self.dtype, self.hadamard) if closing else None
        for pre, post_boundary in closing:
            taps = {tap: state for (tap, layer), state in tapped.items() if layer == pre - 1}
            batch = Batch(states[pre], self.dtype, taps, post, self.hadamard)
            terms = {s.name: s.term(batch) for s in self.sums[(pre, post_boundary)] if s.closes}
            for totals in every:
                totals[(pre, post_boundary)].add_terms(terms)


def hook_taps(
    stats: Accumulator, layers: Sequence[torch.nn.Module], down_proj: str | None, sink, only: int | None = None
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks handing each tapped state to ``sink(tap, layer, state)``: the down-projection's output (``z``)
    or its input (``a``) of every layer ``stats`` reads one of (``only``: of that layer alone), whichever
    pass (in memory, layer by layer)."""
    handles = []
    for tap, indices in stats.taps.items():
        for k in indices if only is None else {only} & indices:
            module = layers[k].get_submodule(down_proj)
            if TAPS[tap] == "output":
                handles.append(module.register_forward_hook(lambda m, a, out, t=tap, k=k: sink(t, k, out)))
            else:
                handles.append(module.register_forward_pre_hook(lambda m, args, t=tap, k=k: sink(t, k, args[0])))
    return handles


@torch.no_grad()
def calibrate(
    model: PreTrainedModel,
    batches: Iterable[Tensor],
    pairs: Sequence[tuple[int, int]] = (),
    *,
    depth: int | None = None,
    similarity: bool = True,
    band: int | None = None,
    sums: Sequence[str] = gathered(),
    holdout: bool = False,
    groups: Sequence[Hashable] | None = None,
    stats_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> Calibration:
    """Run ``batches`` (token-id tensors ``[batch, seq]``) through ``model`` once, up to boundary
    ``depth`` (default: the deepest ``post`` in ``pairs``), handing every boundary's state to an
    ``Accumulator``: ``PairStats`` for each pair and, if ``similarity``, cosine/angle sums between
    boundaries up to ``depth`` at most ``band`` apart (default: every two; the others are NaN).
    ``sums`` names the sums each pair gathers (``methods.gathered``: by default those of every pair, with
    ``gathered(["replaceme"])`` also the last kept layer's down-projection sums).
    ``holdout`` also keeps the sums of every other batch apart, for choosing the ridge on held-out tokens;
    ``groups`` (a label per batch, e.g. its domain) keeps each group's sums apart (``Calibration.groups``),
    for leave-one-group-out fits. Under ``torch.distributed`` each rank takes every ``world_size``-th
    batch and every rank ends with the statistics of all batches."""
    batches = check_token_ids(model, batches)
    layers = decoder_layers(model)
    device = next(model.parameters()).device  # sums live here even when layers are spread over devices
    depth = max((p for _, p in pairs), default=len(layers)) if depth is None else depth
    band = (depth if band is None else band) if similarity else None
    options = dict(depth=depth, band=band, sums=sums, holdout=holdout, groups=groups, stats_dtype=stats_dtype)
    stats, batches = Accumulator.for_batches(model, batches, pairs, **options)
    current = [0]  # the batch in the forward pass, for the hooks

    def keep(boundary: int, hidden: Tensor) -> None:
        stats.add(boundary, hidden.to(device), current[0])
        if boundary == depth:
            raise StopForward

    handles = []
    if 0 in stats.boundaries:

        def first_input(module, args, kwargs):
            keep(0, hidden_states(args, kwargs))

        handles.append(layers[0].register_forward_pre_hook(first_input, with_kwargs=True))
    for b in sorted(stats.boundaries - {0}):
        handles.append(layers[b - 1].register_forward_hook(lambda m, a, out, b=b: keep(b, layer_output(out))))
    sink = lambda tap, k, state: stats.add_tap(tap, k, state.to(device), current[0])  # noqa: E731
    handles += hook_taps(stats, layers, adapter_for(model).down_proj, sink)
    try:
        for current[0], batch in enumerate(tqdm(batches, desc="calibrating", unit="batch", disable=not progress)):
            with contextlib.suppress(StopForward):
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
        raise StopForward

    if boundary < len(layers):
        handle = layers[boundary].register_forward_pre_hook(
            lambda m, args, kwargs: grab(hidden_states(args, kwargs)), with_kwargs=True
        )
    else:
        handle = layers[-1].register_forward_hook(lambda m, a, out: grab(layer_output(out)))
    try:
        with contextlib.suppress(StopForward):
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        handle.remove()
    return captured[0]
