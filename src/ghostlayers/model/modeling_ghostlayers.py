"""The recovery operator as a model module, and the model classes a pruned folder reloads with.

This file is self-contained (it imports only torch and transformers) because it is copied verbatim
into every saved model folder and named in its ``config.json`` ``auto_map``: a machine without
ghostlayers loads the folder with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``.
The library itself uses the same classes, so the in-memory model and the reloaded one share one code path.

A saved folder's ``config.json`` has ``model_type = "ghostlayers_<base>"`` and a ``ghostlayers`` entry
whose ``operators`` list names, for each inserted operator, the module it runs in front of.
"""

from __future__ import annotations

import functools

import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

CONFIG_PREFIX = "GhostLayersConfig_"
MODEL_PREFIX = "GhostLayersForCausalLM_"


class GhostOperator(nn.Module):
    """``x -> x W`` on the residual stream with ``W = I + delta``.

    Storing ``delta = W - I`` keeps the identity exact when the model runs in half precision. The map is
    one ``addmm`` (``x + x @ delta``) in the model's dtype: matmul units accumulate in float32 and round
    once, as every other layer does, and neither the input nor ``delta`` is copied (``.to`` returns
    ``delta`` itself when the dtypes agree): a float32 upcast made the operator 15x slower on a GPU.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.delta = nn.Parameter(torch.zeros(hidden_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return torch.addmm(x, x, self.delta.to(x.dtype)).view(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"hidden_size={self.delta.shape[0]}"


def _apply_operator_first(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the operator rewrites the hidden states the host module receives."""
    if args:
        return (module.ghost_operator(args[0]), *args[1:]), kwargs
    kwargs["hidden_states"] = module.ghost_operator(kwargs["hidden_states"])
    return args, kwargs


def attach_operator(model: nn.Module, host_path: str, operator: GhostOperator):
    """Make ``operator`` a child of the module at ``host_path`` (a decoder layer, or the final norm when
    the removed block ends the stack) and run it on that module's input; returns the hook's handle."""
    host = model.get_submodule(host_path)
    host.ghost_operator = operator
    operator.hook = host.register_forward_pre_hook(_apply_operator_first, with_kwargs=True)
    return operator.hook


def detach_operator(model: nn.Module, host_path: str) -> None:
    """Remove the operator at ``host_path`` and its hook: the host runs on its input unchanged again."""
    host = model.get_submodule(host_path)
    host.ghost_operator.hook.remove()
    del host.ghost_operator


def install_operators(model: nn.Module) -> None:
    """Insert a zero-initialised operator for every entry of ``config.ghostlayers['operators']`` that
    has a host module; the weights then come from the checkpoint."""
    for spec in model.config.ghostlayers.get("operators", []):
        if spec.get("host") is not None:
            attach_operator(model, spec["host"], GhostOperator(model.config.hidden_size))


@functools.cache
def ghost_classes(model_type: str) -> tuple[type, type]:
    """The (config, model) classes of a pruned ``model_type`` model, subclassing transformers' own.

    A config class of its own keeps transformers from remapping the base architecture to this model
    class for the rest of the process, which it does for remote code that reuses a native config.
    """
    base_config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    base_model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config_cls = type(
        CONFIG_PREFIX + model_type,
        (base_config,),
        {"model_type": f"ghostlayers_{model_type}", "__module__": __name__},
    )

    def __init__(self, config):  # noqa: N807
        base_model.__init__(self, config)
        install_operators(self)

    model_cls = type(
        MODEL_PREFIX + model_type,
        (base_model,),
        {"config_class": config_cls, "__init__": __init__, "__module__": __name__},
    )
    return config_cls, model_cls


def __getattr__(name: str) -> type:
    """Resolve ``auto_map`` names such as ``GhostLayersForCausalLM_llama`` on first use."""
    for prefix, index in ((CONFIG_PREFIX, 0), (MODEL_PREFIX, 1)):
        if name.startswith(prefix) and name[len(prefix) :] in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return ghost_classes(name[len(prefix) :])[index]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
