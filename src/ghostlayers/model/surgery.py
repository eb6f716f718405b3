"""Model surgery: fold ReplaceMe maps and refits into down-projections, drop layers, insert operators.

Works in place on the model it is given (no copy). Each operator becomes a ``GhostOperator`` child of
the module that receives the patched stream: the next kept decoder layer, or the final norm when the
removed block ends the stack. ``config.ghostlayers`` records what was done, so a saved folder can be
rebuilt with ``modeling_ghostlayers``, whose classes the pruned model takes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ghostlayers.model.adapters import (
    adapter_for,
    decoder_layers,
    keep_layers,
    layer_subset,
    layers_swapped,
    set_layers,
)
from ghostlayers.model.modeling_ghostlayers import (
    CONFIG_PREFIX,
    MODEL_PREFIX,
    GhostOperator,
    attach_operator,
    detach_operator,
    ghost_classes,
)
from ghostlayers.model.record import PruneRecord
from ghostlayers.registry.methods import method as method_record


@torch.no_grad()
def fold_into_down_proj(
    model: PreTrainedModel, layer: int, t: Tensor, method: str = "replaceme"
) -> tuple[str, dict[str, Tensor]]:
    """Rewrite layer ``layer``'s down-projection ``z = W a + b`` with the operator ``t`` as the folded
    method's ``Method.fold`` says (ReplaceMe: weight ``Tᵀ W``, bias ``b T``; refit: weight ``W + Eᵀ``).
    Returns its path and its parameters as they were before, by name (what ``scale_repair`` needs)."""
    adapter = adapter_for(model)
    path = f"{adapter.layers}.{layer}.{adapter.down_proj}"
    proj = model.get_submodule(path)
    before = {name: p.detach().clone() for name, p in proj.named_parameters()}
    t = t.to(device=proj.weight.device, dtype=torch.float64)
    bias = proj.bias.double() if proj.bias is not None else None
    weight, bias = method_record(method).fold(proj.weight.double(), bias, t)
    proj.weight.copy_(weight.to(proj.weight.dtype))
    if bias is not None:
        proj.bias.copy_(bias.to(proj.bias.dtype))
    return path, before


def host_path(model: PreTrainedModel, keep: list[int], post: int, num_layers: int) -> str:
    """Where the operator of a run ending before original layer ``post`` runs once ``keep`` remain: the
    kept layer ``post`` at its new index, or the final norm when the run ends the stack."""
    adapter = adapter_for(model)
    return adapter.final_norm if post >= num_layers else f"{adapter.layers}.{keep.index(post)}"


def insert_operator(model: PreTrainedModel, path: str, w: Tensor):
    """A ``GhostOperator`` holding ``W − I`` in the model's dtype, attached at ``path``; returns its hook handle."""
    param = next(model.parameters())
    operator = GhostOperator(model.config.hidden_size, dtype=param.dtype).to(param.device)
    operator.delta.copy_(w - torch.eye(w.shape[0], dtype=w.dtype, device=w.device))
    return attach_operator(model, path, operator)


@torch.no_grad()
def apply_pruning(
    model: PreTrainedModel,
    removed: list[int],
    method: str,
    operators: dict[tuple[int, int], Tensor],
) -> tuple[list[dict], dict[str, Tensor]]:
    """Remove ``removed`` (original indices) and install one operator per run ``(pre, post)``. Returns each
    run's operator record (what ``PruneRecord.operators`` saves) and the weights folding replaced, by their
    parameter names in the pruned model (``scale_repair``). The record is written by ``record_pruning``, once
    the guard has settled α."""
    num_layers = model.config.num_hidden_layers
    keep = [i for i in range(num_layers) if i not in set(removed)]
    specs = []
    unfolded: dict[str, Tensor] = {}
    streams = []
    for (pre, post), op in sorted(operators.items()):
        spec = {"kind": method, "removed": list(range(pre, post)), "boundary": [pre, post], "host": None}
        folded, stream = method_record(method).parts(op)
        if folded is not None:
            adapter = adapter_for(model)
            spec["merged_into"], before = fold_into_down_proj(model, pre - 1, folded, method)
            renamed = f"{adapter.layers}.{keep.index(pre - 1)}.{adapter.down_proj}"  # its path once pruned
            unfolded |= {f"{renamed}.{k}": v for k, v in before.items()}
        if stream is not None:
            spec["host"] = host_path(model, keep, post, num_layers)
            streams.append((spec["host"], stream))
        specs.append(spec)
    keep_layers(model, keep)
    for host, stream in streams:
        insert_operator(model, host, stream)
    return specs, unfolded


def record_pruning(model: PreTrainedModel, record: PruneRecord) -> None:
    """Write what pruning did (``config.ghostlayers``), once, and give the model the ``modeling_ghostlayers``
    classes of its architecture, so that it saves and reloads as what it now is."""
    model.config.ghostlayers = record.to_dict()
    become_ghost_model(model, record.base_model_type)


@contextlib.contextmanager
@torch.no_grad()
def patched_view(
    model: PreTrainedModel, operators: dict[tuple[int, int], Tensor], method: str = "ghost"
) -> Iterator[dict[str, Tensor]]:
    """Temporarily run ``model`` with the runs ``(pre, post)`` of ``operators`` removed and repaired by
    ``method`` (stream operators in place, or ReplaceMe maps folded into the down-projections), then
    restore the dense model exactly (sequential fitting and method scoring need both). Yields the weights
    folding replaced, by their names in the view, as ``apply_pruning`` returns them (``repair_scaled``)."""
    num_layers = model.config.num_hidden_layers
    keep = [i for i in range(num_layers) if not any(pre <= i < post for pre, post in operators)]
    unfolded: dict[str, Tensor] = {}
    hosts: list[str] = []
    with layer_subset(model, keep):
        try:
            for (pre, post), op in operators.items():
                folded, stream = method_record(method).parts(op)
                if folded is not None:
                    path, before = fold_into_down_proj(model, keep.index(pre - 1), folded, method)
                    unfolded |= {f"{path}.{k}": v for k, v in before.items()}
                if stream is not None:
                    hosts.append(host_path(model, keep, post, num_layers))
                    insert_operator(model, hosts[-1], stream)
            yield unfolded
        finally:
            for host in hosts:
                detach_operator(model, host)
            params = dict(model.named_parameters())
            for name, value in unfolded.items():
                params[name].copy_(value)


@torch.no_grad()
def scale_repair(model: PreTrainedModel, alpha: float, unfolded: dict[str, Tensor]) -> Callable[[], None]:
    """Shrink every repair of a pruned model toward plain pruning: each operator ``W = I + M`` becomes
    ``I + αM``, each ReplaceMe projection ``Tᵀ W₀`` becomes ``(I + α(T − I))ᵀ W₀ = (1 − α) W₀ + α Tᵀ W₀``
    and each refit ``W₀ + Eᵀ`` becomes ``W₀ + αEᵀ``, the same interpolation
    (``unfolded``: the projections' weights before folding, by parameter name). α = 0 is plain pruning,
    α = 1 leaves the model as it is. Returns a function that restores the model."""
    operators = [m for m in model.modules() if isinstance(m, GhostOperator)]
    params = dict(model.named_parameters())
    saved = [op.delta.clone() for op in operators] + [params[name].clone() for name in unfolded]
    for op in operators:
        op.delta.mul_(alpha)
    for name, before in unfolded.items():
        params[name].lerp_(before.to(params[name]), 1.0 - alpha)

    targets = [op.delta for op in operators] + [params[name] for name in unfolded]

    def restore() -> None:
        with torch.no_grad():
            for target, value in zip(targets, saved, strict=True):
                target.copy_(value)

    return restore


def drop_operators(model: PreTrainedModel, specs: list[dict]) -> list[dict]:
    """Remove every stream operator ``apply_pruning`` installed (``specs``, its operator records); returns the
    records without hosts. At α = 0 the repair is plain pruning, saved as a plain checkpoint of its base."""
    for spec in specs:
        if spec.get("host") is not None:
            detach_operator(model, spec["host"])
    return [{**spec, "host": None} for spec in specs]


@contextlib.contextmanager
def repair_scaled(model: PreTrainedModel, alpha: float, unfolded: dict[str, Tensor]) -> Iterator[None]:
    """Temporarily run a pruned model with its repairs scaled by ``alpha`` (0: plain pruning, so the effect
    of the repair is measured on the very same model)."""
    restore = scale_repair(model, alpha, unfolded)
    try:
        yield
    finally:
        restore()


def become_ghost_model(model: PreTrainedModel, base: str) -> None:
    """Give the model (and its config) the ``modeling_ghostlayers`` classes of its architecture, which only
    add operator installation, so ``save_pretrained`` writes exactly what those classes load: the
    ``ghostlayers_<base>`` model type, its ``auto_map``, and weight names without the base class's legacy
    renames (custom classes get none on load either)."""
    config_cls, model_cls = ghost_classes(base)
    model.config.__class__ = config_cls
    model.__class__ = model_cls
    model.config.architectures = [model_cls.__name__]
    model.config.auto_map = {
        "AutoConfig": f"modeling_ghostlayers.{CONFIG_PREFIX}{base}",
        "AutoModelForCausalLM": f"modeling_ghostlayers.{MODEL_PREFIX}{base}",
    }


@contextlib.contextmanager
def plain_view(model: PreTrainedModel) -> Iterator[None]:
    """Temporarily give a pruned model without stream operators (``none``, ``replaceme``, ``refit``) its base
    architecture's own classes and a config without ghostlayers fields, so ``save_pretrained`` writes a
    plain checkpoint that any serving stack loads without remote code."""
    config = model.config
    saved = (model.__class__, config.__class__, config.architectures)
    extras = {k: config.__dict__.pop(k) for k in ("ghostlayers", "auto_map") if k in config.__dict__}
    config_cls, model_cls = (cls.__bases__[0] for cls in ghost_classes(extras["ghostlayers"]["base_model_type"]))
    model.__class__, config.__class__ = model_cls, config_cls
    config.architectures = [model_cls.__name__]
    try:
        yield
    finally:
        model.__class__, config.__class__, config.architectures = saved
        config.__dict__.update(extras)


@dataclass(frozen=True)
class DenseLayers:
    """A model's decoder layers and layer types before pruning, held by reference (nothing is copied), so the
    pruned model can run as the dense one again (``dense_view``)."""

    layers: list[nn.Module]
    layer_types: list[str] | None

    @classmethod
    def of(cls, model: PreTrainedModel) -> DenseLayers:
        types = getattr(model.config, "layer_types", None)
        return cls(list(decoder_layers(model)), None if types is None else list(types))


@contextlib.contextmanager
def dense_view(model: PreTrainedModel, dense: DenseLayers) -> Iterator[None]:
    """Temporarily run a pruned model with its original decoder layers and no stream operators: the dense
    model's cost, so both can be timed in turn in one process (``speed.measure_speeds``). Repairs folded into
    a kept layer's weights keep their values there: the same shapes, the same cost."""
    hosts = [s["host"] for s in getattr(model.config, "ghostlayers", {}).get("operators", []) if s.get("host")]
    operators = {host: model.get_submodule(host).ghost_operator for host in hosts}
    for host in hosts:
        detach_operator(model, host)
    try:
        with layers_swapped(model, dense.layers, dense.layer_types):
            yield
    finally:
        for host, operator in operators.items():
            attach_operator(model, host, operator)


@contextlib.contextmanager
@torch.no_grad()
def pruning_undone(model: PreTrainedModel, pairs: list[tuple[int, int]]) -> Iterator[None]:
    """Let the block inside prune ``model`` in place (``pipeline.apply_plan``) for the runs ``pairs``, then
    make it the dense model again, exactly: its decoder layers (held by reference, nothing copied), the
    down-projections a repair folds into (saved: one per run), its classes and config, and no operators. A
    sweep then fits and scores every depth and method on the one model it loaded."""
    dense, config = DenseLayers.of(model), model.config
    classes, architectures, keys = (model.__class__, config.__class__), config.architectures, set(config.__dict__)
    adapter = adapter_for(model)
    hosts = [f"{adapter.layers}.{pre - 1}.{adapter.down_proj}" for pre, _ in pairs if pre > 0 and adapter.down_proj]
    saved = [(p, p.detach().clone()) for host in hosts for p in model.get_submodule(host).parameters(recurse=False)]
    try:
        yield
    finally:
        for name, module in list(model.named_modules()):
            if hasattr(module, "ghost_operator"):
                detach_operator(model, name)
        set_layers(model, dense.layers, dense.layer_types)
        for param, value in saved:
            param.copy_(value)
        model.__class__, config.__class__ = classes
        config.architectures = architectures
        for key in set(config.__dict__) - keys:
            del config.__dict__[key]
