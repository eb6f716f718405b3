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

from ghostlayers.adapters import StopForward, adapter_for, decoder_layers, hidden_states, layer_output
from ghostlayers.distributed import distributed_rank, share_across_ranks
from ghostlayers.hadamard import HadamardRotation, has_hadamard
from ghostlayers.stats import HELD_OUT, Calibration, OutputState, PairStats, Similarity, input_terms, output_terms


def batch_groups(num_batches: int, holdout: bool, groups: Sequence[Hashable] | None) -> list[Hashable | None]:
    """The group of each batch whose sums are also kept apart (None: in the totals only): ``groups`` as
    given (e.g. each batch's calibration domain), or with ``holdout`` every other batch."""
    if groups is not None:
        if len(groups) != num_batches:
            raise ValueError(f"{len(groups)} group labels for {num_batches} calibration batches")
        return list(groups)
    return [HELD_OUT if holdout and i % 2 == 1 else None for i in range(num_batches)]


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


class Accumulator:
    """The calibration sums of one run: which state reaches which sum, and when a state may go (the terms a
    batch adds are ``stats.input_terms`` / ``stats.output_terms``, as GPTQ's ``add_batch``).

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
    sums' dtype (the states stay in the model's, see ``products.product``).
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
        num_layers = len(decoder_layers(model))
        depth = max((p for _, p in pairs), default=num_layers) if depth is None else depth
        self.z_layers = last_kept_layers(model, pairs) if replaceme else set()
        self.a_sizes = down_projection_widths(model, pairs) if refit else {}
        self.pairs, self.band, self.labels, self.dtype = list(pairs), band, list(labels), dtype
        self.device = next(model.parameters()).device if device is None else device
        size = model.config.hidden_size
        self.hadamard = HadamardRotation(size, self.device, dtype) if has_hadamard(size) else None
        self.calibration = Calibration(num_layers=num_layers, depth=depth)
        self._allocate(size)
        self.states: dict[int, dict[int, Tensor]] = {}  # batch → boundary → state, only those still needed
        self.mlp_out: dict[int, dict[int, Tensor]] = {}  # batch → layer → down-projection output
        self.mlp_in: dict[int, dict[int, Tensor]] = {}  # batch → layer → down-projection input (refit)

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
            if self.calibration.similarity is None:
                self.calibration.similarity = Similarity.zeros(self.calibration.num_layers + 1, self.dtype, self.device)
            near = [(a, boundary) for a in sorted(states) if boundary - a <= self.band]
            self.calibration.similarity.add(states, near, self.dtype, count=boundary == 0)
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
        """The input terms of the pairs starting at ``boundary`` and the output terms of those ending there,
        each computed once however many pairs (and groups) share it."""
        opening = [pair for pair in self.pairs if pair[0] == boundary]
        closing = [pair for pair in self.pairs if pair[1] == boundary]
        result = self.calibration
        every = (result.pairs, result.groups[group]) if group is not None else (result.pairs,)
        state = states[boundary]
        if opening:
            flat = state.reshape(-1, state.shape[-1])
            terms = input_terms(flat, mlp_out.get(boundary - 1), mlp_in.get(boundary - 1), self.dtype)
            for pair in opening:
                for totals in every:
                    totals[pair].add_terms(terms)
        if closing:
            y = OutputState(state, self.dtype, self.hadamard)
        for pre, post in closing:
            gathered = result.pairs[(pre, post)]
            z = mlp_out[pre - 1] if gathered.ztz is not None else None
            a = mlp_in[pre - 1] if gathered.ata is not None else None
            terms = output_terms(y, states[pre], z, a)
            for totals in every:
                totals[(pre, post)].add_terms(terms)


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
    layers = decoder_layers(model)
    device = next(model.parameters()).device  # sums live here even when layers are spread over devices
    depth = max((p for _, p in pairs), default=len(layers)) if depth is None else depth
    band = (depth if band is None else band) if similarity else None
    stats, batches = Accumulator.for_batches(
        model,
        batches,
        pairs,
        depth=depth,
        band=band,
        replaceme=replaceme,
        refit=refit,
        holdout=holdout,
        groups=groups,
        stats_dtype=stats_dtype,
    )
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
