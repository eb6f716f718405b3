"""Layer-by-layer calibration for models larger than memory, with weights streamed from the checkpoint.

``--offload`` builds the model without weights (accelerate's ``init_empty_weights``), reads the
embedding and then one decoder layer at a time from the safetensors files, runs every calibration batch
through that layer and frees it before reading the next, as GPTQ and SparseGPT do. Held at once: one
layer's weights, and the hidden states of all calibration tokens at the boundaries still needed (the
``pre`` of each pair not yet closed, and the last ``band`` boundaries for the similarity sums, which are
kept only for pairs at most ``band`` apart: the block length the criterion compares). The statistics are
the same sums, added by the same ``calibration.Accumulator``, as ``calibration.calibrate`` gathers batch by batch.
Afterwards ``checkpoint.materialize`` reads only the layers that stay (the removed ones were read once, to compute
the states they produce).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.calibration.passes import Accumulator, hook_taps
from ghostlayers.model.adapters import StopForward, adapter_for, decoder_layers, layer_output
from ghostlayers.model.checkpoint import Checkpoint, parameter_names
from ghostlayers.numerics.sums import Calibration


class _Recorder(nn.Module):
    """Stands in for a decoder layer during the first pass: keeps the arguments the model hands that
    layer (masks and position embeddings differ per layer type) and passes the hidden state through."""

    def __init__(self, last: bool):
        super().__init__()
        self.last, self.calls = last, []

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        self.calls.append((hidden_states, args, kwargs))
        if self.last:
            raise StopForward
        return hidden_states


@torch.no_grad()
def calibrate_layerwise(
    model: PreTrainedModel,
    checkpoint: Checkpoint,
    batches: Sequence[Tensor],
    pairs: Sequence[tuple[int, int]] = (),
    *,
    depth: int | None = None,
    similarity: bool = True,
    band: int = 1,
    progress: bool = True,
    **options,
) -> Calibration:
    """``calibration.calibrate`` for a ``Checkpoint.skeleton`` model, one layer at a time (``options``: its
    ``sums``, ``holdout``, ``groups``, ``stats_dtype``); similarity only for boundary pairs at
    most ``band`` apart (the others are NaN)."""
    layers = decoder_layers(model)
    depth = max((p for _, p in pairs), default=len(layers)) if depth is None else depth
    band = band if similarity else None
    stats, batches = Accumulator.for_batches(
        model, batches, pairs, depth=depth, band=band, device=checkpoint.device, **options
    )
    down_proj = adapter_for(model).down_proj
    layers_prefix = adapter_for(model).layers + "."
    outside = [name for name, _ in model.named_parameters() if not name.startswith(layers_prefix)]
    checkpoint.load(model, outside)  # embeddings and final norm: small next to the layers
    recorders = [_Recorder(last=i == depth - 1) for i in range(max(depth, 1))]
    originals = list(layers)
    for i, recorder in enumerate(recorders):
        layers[i] = recorder
    try:
        for batch in batches:
            with contextlib.suppress(StopForward):
                model(input_ids=batch.to(checkpoint.device), use_cache=False)
    finally:
        for i, layer in enumerate(originals[: len(recorders)]):
            layers[i] = layer
    current = [hidden for hidden, _, _ in recorders[0].calls]  # every batch's state at the layer's input
    now = [0]  # the batch in a layer's forward, for the hooks
    sink = lambda tap, k, state: stats.add_tap(tap, k, state, now[0])  # noqa: E731
    for t, hidden in enumerate(current):
        stats.add(0, hidden, t)
    for index in tqdm(range(depth), desc="calibrating layer by layer", unit="layer", disable=not progress):
        layer, names = layers[index], parameter_names(model, f"{layers_prefix}{index}.")
        checkpoint.load(model, names)
        handles = hook_taps(stats, layers, down_proj, sink, only=index)
        outputs = []
        for now[0], (hidden, (_, args, kwargs)) in enumerate(zip(current, recorders[index].calls, strict=True)):
            outputs.append(layer_output(layer(hidden, *args, **kwargs)))
        for handle in handles:
            handle.remove()
        checkpoint.release(model, names)
        recorders[index].calls.clear()  # that layer's arguments are not needed again
        for t, hidden in enumerate(outputs):
            stats.add(index + 1, hidden, t)
        current = outputs
    return stats.result()
