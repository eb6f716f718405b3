"""The record of what pruning did, typed and versioned, so a saved folder says how to rebuild it and which
ghostlayers wrote it.

It is stored as a plain dict: in ``config.json`` (key ``ghostlayers``) for folders that need the custom
module (``modeling_ghostlayers`` reads ``operators`` from it), and in ``ghostlayers.json`` beside the
weights for plain checkpoints of the base architecture (``none``, ``replaceme``). ``FORMAT_VERSION`` grows
when a field changes meaning; a folder of a newer format is refused, and folders written before the
record had a version (format 0: the same fields, unversioned) are read as they are. ``Heal`` is what a heal
did, returned to its caller and recorded under the key ``heal``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from ghostlayers.errors import GhostLayersError
from ghostlayers.model.adapters import ADAPTERS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORMAT_VERSION = 1


def ghostlayers_version() -> str:
    try:
        return version("ghostlayers")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


@dataclass(frozen=True)
class PruneRecord:
    """What was removed and how each removed run is repaired (``operators``: one spec per run, with the
    module it runs in front of, ``host``, or the projection it was folded into, ``merged_into``), how the
    repair was fitted (α, ridge, fit, selection) and what the guard found, each written once when pruning
    ends, and where it came from (``provenance``: source model, recipe, calibration)."""

    base_model_type: str
    original_num_hidden_layers: int
    removed_layers: list[int]
    method: str
    operators: list[dict]
    alpha: float = 1.0
    ridge: float | str | None = None  # as asked: relative (or absolute, ridge_mode) or "auto"
    ridge_mode: str | None = None
    chosen_ridges: list[float] | None = None  # ridge "auto": the one chosen for each removed run
    fit: str | None = None  # dense, sequential or chained
    selection: str | None = None  # the criterion, or "manual" for given layers
    select_range: str | None = None
    guard: dict | None = None  # Guard.verdict(): the held-out comparison with plain pruning that settled α
    heal: dict | None = None  # Heal.to_dict() of the heal that followed the closed form, if any
    provenance: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    ghostlayers_version: str = field(default_factory=ghostlayers_version)

    @property
    def needs_custom_module(self) -> bool:
        """Whether reloading needs ``modeling_ghostlayers`` (an operator on the residual stream)."""
        return any(spec.get("host") is not None for spec in self.operators)

    def to_dict(self) -> dict:
        """The record as saved, with the provenance keys at the top level (where format 0 had them)."""
        out = asdict(self)
        return {**out.pop("provenance"), **out}

    @classmethod
    def from_dict(cls, data: dict, where: str = "this folder") -> PruneRecord:
        """Read a saved record; a newer format is refused with a message naming both versions."""
        found = data.get("format_version", 0)
        if not isinstance(found, int) or found > FORMAT_VERSION:
            raise GhostLayersError(
                f"{where} was written by ghostlayers {data.get('ghostlayers_version', '?')} in record format {found}; "
                f"this ghostlayers ({ghostlayers_version()}) reads formats up to {FORMAT_VERSION}. Upgrade ghostlayers."
            )
        names = {f.name for f in fields(cls)} - {"provenance"}
        missing = {"base_model_type", "original_num_hidden_layers", "removed_layers", "method", "operators"} - set(data)
        if missing:
            raise GhostLayersError(f"{where} has a ghostlayers record without {', '.join(sorted(missing))}.")
        if (wrong := malformed(data)) is not None:
            raise GhostLayersError(
                f"{where} has a malformed ghostlayers record: {wrong}. Prune the source model again."
            )
        known = {k: v for k, v in data.items() if k in names} | {"format_version": found}
        known.setdefault("ghostlayers_version", "unknown")
        return cls(**known, provenance={k: v for k, v in data.items() if k not in names})


def update_record(model: PreTrainedModel, **changes: object) -> PruneRecord:
    """Change fields of a pruned model's record (``config.ghostlayers``) through ``PruneRecord``: what is learnt
    after pruning (a heal, by ``prune --heal`` or ``ghostlayers heal`` on a saved folder) is a field set by name."""
    record = replace(PruneRecord.from_dict(model.config.ghostlayers, "this model"), **changes)
    model.config.ghostlayers = record.to_dict()
    return record


def malformed(data: dict) -> str | None:
    """What is wrong with the shape of a saved record (edited by hand, or damaged), None when nothing is: a
    record is read before any weights, and a wrong type would surface as a traceback deep in loading."""
    types = {
        "base_model_type": (str, "a model type"),
        "original_num_hidden_layers": (int, "a layer count"),
        "method": (str, "a method name"),
        "alpha": (int | float, "a number"),
        "guard": (dict | None, "a guard's verdict"),
        "heal": (dict | None, "a heal's record"),
    }
    for key, (kind, meaning) in types.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            return f"{key} is {data[key]!r}, not {meaning}"
    if not isinstance(data["removed_layers"], list) or not all(type(i) is int for i in data["removed_layers"]):
        return f"removed_layers is {data['removed_layers']!r}, not a list of layer indices"
    operators = data["operators"]
    if not isinstance(operators, list) or not all(isinstance(spec, dict) for spec in operators):
        return f"operators is {operators!r}, not a list of operator records"
    if any(not isinstance(spec.get("host", ""), str | None) for spec in operators):
        return "an operator's host is not a module path"
    if (adapter := ADAPTERS.get(data["base_model_type"])) is not None:
        kept = data["original_num_hidden_layers"] - len(set(data["removed_layers"]))
        for host in (spec["host"] for spec in operators if spec.get("host") is not None):
            if not _is_host(host, adapter.layers, adapter.final_norm, kept):
                return (
                    f"an operator's host is {host!r}, not one of the {kept} kept decoder layers "
                    f"({adapter.layers}.N) nor the final norm ({adapter.final_norm})"
                )
    return None


def _is_host(host: str, layers: str, final_norm: str, kept: int) -> bool:
    """Whether ``host`` is where surgery puts an operator (``surgery.host_path``): a kept layer or the final norm.
    Anywhere else (the whole model, the embedding, which takes token ids) it would fail deep in the forward."""
    index = host.removeprefix(f"{layers}.")
    return host == final_norm or (index != host and index.isascii() and index.isdigit() and int(index) < kept)


@dataclass
class Heal:
    """What healing did: the parameters trained, the tokens and steps, the loss on the training windows before and
    after, held-out perplexity per domain of plain pruning, the closed form and the healed model, and whether the
    heal was kept (worse than the closed form on no domain)."""

    params: list[str]
    tokens: int
    steps: int
    loss_before: float
    loss_after: float
    kept: bool
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    hurt: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
