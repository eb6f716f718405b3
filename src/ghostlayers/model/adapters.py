"""Every architecture difference in one place: where the decoder layers, the final norm and the MLP
down-projection live, and how to re-index a model after layers are removed.

Adding an architecture means adding one ``Adapter`` entry to ``ADAPTERS``; nothing else in the
package looks at ``model_type``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ghostlayers.errors import GhostLayersError


@dataclass(frozen=True)
class Adapter:
    """Dotted paths (relative to the ``*ForCausalLM`` module) of the parts surgery touches."""

    layers: str
    final_norm: str
    down_proj: str | None  # inside one decoder layer; None where the MLP output is not a plain Linear's
    """Why None: gemma3 normalizes the MLP output before the residual add, so a map on that output
    cannot be folded into the projection's weight (ReplaceMe is then unavailable)."""


_LLAMA_LIKE = Adapter(layers="model.layers", final_norm="model.norm", down_proj="mlp.down_proj")

ADAPTERS: dict[str, Adapter] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "phi3": _LLAMA_LIKE,
    "gemma3_text": Adapter(layers="model.layers", final_norm="model.norm", down_proj=None),
    "gpt_neox": Adapter(
        layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm", down_proj="mlp.dense_4h_to_h"
    ),
    "opt": Adapter(layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm", down_proj="fc2"),
}


def adapter_for(model: PreTrainedModel) -> Adapter:
    """The adapter of ``model``, or a clear error naming its ``model_type``."""
    model_type = model.config.model_type
    base = getattr(model.config, "ghostlayers", {}).get("base_model_type", model_type)
    if base not in ADAPTERS:
        raise GhostLayersError(
            f"Architecture '{model_type}' is not supported. Supported model types: "
            f"{', '.join(sorted(ADAPTERS))}. Adding one is a single entry in ghostlayers/model/adapters.py."
        )
    adapter = ADAPTERS[base]
    if base == "opt" and not model.config.do_layer_norm_before:
        raise GhostLayersError(
            "OPT models with do_layer_norm_before=False (post-norm, e.g. opt-350m) are not supported: "
            "their residual stream is normalized inside each layer, so there is no boundary to patch."
        )
    return adapter


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    return model.get_submodule(adapter_for(model).layers)


def layer_output(output: torch.Tensor | tuple) -> torch.Tensor:
    """Decoder layers return a tensor in transformers 5; older layouts return a tuple."""
    return output[0] if isinstance(output, tuple) else output


class StopForward(Exception):
    """Raised by a hook to end the forward pass there: no later layer, norm or LM head runs."""


def hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden state a decoder layer receives, from its pre-hook's arguments (positional or keyword)."""
    return args[0] if args else kwargs["hidden_states"]


def set_layers(model: PreTrainedModel, layers: list[nn.Module], layer_types: list[str] | None) -> None:
    """Make ``layers`` the model's decoder layers (a ``ModuleList`` is installed as it is) and re-index
    everything that counts layers: each attention's ``layer_idx`` (KV-cache slot), ``num_hidden_layers`` and
    ``layer_types``."""
    parent_path, _, name = adapter_for(model).layers.rpartition(".")
    new = layers if isinstance(layers, nn.ModuleList) else nn.ModuleList(layers)
    setattr(model.get_submodule(parent_path), name, new)
    for new_idx, layer in enumerate(new):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    if layer_types is not None:
        model.config.layer_types = list(layer_types)
    model.config.num_hidden_layers = len(new)


def keep_layers(model: PreTrainedModel, keep: list[int]) -> None:
    """Keep only the decoder layers at (current) positions ``keep``, re-indexed (``set_layers``)."""
    old, types = decoder_layers(model), getattr(model.config, "layer_types", None)
    set_layers(model, [old[i] for i in keep], None if types is None else [types[i] for i in keep])


@contextlib.contextmanager
def layers_swapped(model: PreTrainedModel, layers: list[nn.Module], layer_types: list[str] | None) -> Iterator[None]:
    """Temporarily run ``model`` with ``layers`` as its decoder layers (``set_layers``), then put the list,
    its indices and the config's layer counts back exactly as they were."""
    before = decoder_layers(model), getattr(model.config, "layer_types", None)
    set_layers(model, layers, layer_types)
    try:
        yield
    finally:
        set_layers(model, *before)


def layer_subset(model: PreTrainedModel, keep: list[int]) -> contextlib.AbstractContextManager[None]:
    """Temporarily keep only the decoder layers at (current) positions ``keep`` (``layers_swapped``)."""
    full, types = decoder_layers(model), getattr(model.config, "layer_types", None)
    return layers_swapped(model, [full[i] for i in keep], None if types is None else [types[i] for i in keep])


@contextlib.contextmanager
def starting_at(model: PreTrainedModel, depth: int) -> Iterator[list[torch.Tensor]]:
    """Run ``model`` from decoder layer ``depth`` on: the layers before it are set aside, and layer ``depth``
    takes the state put in the yielded one-item list in place of its input (the embedding still runs, so
    positions and masks are built as in a full forward). Scoring many variants of a model that share their
    first layers then runs those layers once (``guard.prefix_states``)."""
    slot: list[torch.Tensor] = []

    def swap(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = hidden_states(args, kwargs)
        state = slot[0]
        if state.shape != given.shape:
            raise ValueError(f"the state fed to layer {depth} has shape {tuple(state.shape)}, not {tuple(given.shape)}")
        if args:
            return (state, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": state}

    with layer_subset(model, list(range(depth, model.config.num_hidden_layers))):
        handle = decoder_layers(model)[0].register_forward_pre_hook(swap, with_kwargs=True, prepend=True)
        try:
            yield slot
        finally:
            handle.remove()


def logits_at(model: PreTrainedModel, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The logits ``model``'s head gives the final ``hidden`` states (``base_model``'s output) at vocabulary
    ``indices`` only (one list per position): the head's rows gathered per token, its bias and Gemma's final
    soft-capping applied as the full head would. Scoring k tokens then costs k rows, not the vocabulary."""
    head = model.get_output_embeddings()
    logits = torch.einsum("...c,...kc->...k", hidden, head.weight[indices.long()])
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[indices.long()]
    if cap := getattr(model.config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    return logits
