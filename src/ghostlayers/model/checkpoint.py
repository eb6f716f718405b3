"""A safetensors checkpoint read one layer at a time: the model built without weights (``skeleton``), and
the weights of named parameters read in or released (``--offload``; ``calibration.offload`` streams the
calibration through it)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from ghostlayers.errors import GhostLayersError
from ghostlayers.model.adapters import adapter_for


class Checkpoint:
    """The tensors of a model folder's safetensors files (one file or shards), read by name on demand."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.folder, self.dtype, self.device = Path(folder), dtype, device
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise GhostLayersError(
                f"--offload reads weights from safetensors files, and {self.folder} has none: convert the "
                "checkpoint (load it and save_pretrained) or run without --offload."
            )
        self.stored: dict[str, Path] = {}  # checkpoint key → file
        for file in files:
            with safe_open(file, framework="pt") as handle:
                self.stored.update(dict.fromkeys(handle.keys(), file))
        self.keys: dict[str, str] = {}  # model parameter name → checkpoint key, set by skeleton()

    def skeleton(self) -> PreTrainedModel:
        """The model with its parameters on the meta device (no memory) and real buffers."""
        try:
            config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        except ValueError as error:  # a config that needs the folder's own code, which is never run
            raise GhostLayersError(
                f"--offload cannot read {self.folder}/config.json: it needs code of its own (auto_map), and "
                "ghostlayers never runs code from a model folder."
            ) from error
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        adapter_for(model)  # unsupported architectures fail here, before any reading
        model.tie_weights()  # tied parameters are one name, read once
        # the key renames transformers applies when loading (e.g. gpt_neox's embed_out → lm_head)
        renames = [
            (re.compile(source), rule.target_patterns[0])
            for rule in get_model_conversion_mapping(model)
            if type(rule) is WeightRenaming
            for source in rule.source_patterns
        ]
        for key in self.stored:
            name = key
            for pattern, target in renames:
                name = pattern.sub(target, name)
            self.keys[name] = key
        self.check_keys(model)
        return model.eval()

    def check_keys(self, model: PreTrainedModel) -> None:
        """The files hold every parameter and nothing else: a config.json naming more or fewer layers than
        the weights would otherwise be pruned as it says, with layers missing or dropped."""
        names = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        missing = [n for n, _ in model.named_parameters() if n not in self.keys]
        unexpected = [n for n in self.keys if n not in names]
        problems = [
            f"{len(v)} {k} tensors ({', '.join(sorted(v)[:2])}, …)"
            for k, v in (("missing", missing), ("unexpected", unexpected))
            if v
        ]
        if problems:
            raise GhostLayersError(
                f"The weights of {self.folder} do not fit its config.json: {'; '.join(problems)}. The folder is "
                "damaged, its config.json was edited, or its tensors have names --offload does not read: restore "
                "the model's own files, or run without --offload."
            )

    def load(self, model: nn.Module, names: Sequence[str]) -> None:
        """Read the parameters ``names`` (the model's own names) from the files onto the device."""
        missing = [name for name in names if name not in self.keys]
        if missing:
            raise GhostLayersError(
                f"--offload reads tensors by the model's parameter names, and {missing[:3]} are not in the "
                f"safetensors files of {self.folder} (the checkpoint uses other names): run without --offload."
            )
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.stored[self.keys[name]], []).append(name)
        for file, group in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in group:
                    value = handle.get_tensor(self.keys[name])
                    set_module_tensor_to_device(model, name, self.device, value=value, dtype=self.dtype)
        if isinstance(model, PreTrainedModel):
            model.tie_weights()  # reading replaced the tied source parameter: tie its targets to it again

    def release(self, model: nn.Module, names: Sequence[str]) -> None:
        for name in names:
            set_module_tensor_to_device(model, name, "meta")


def parameter_names(model: nn.Module, prefix: str) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.startswith(prefix)]


def materialize(model: PreTrainedModel, checkpoint: Checkpoint, removed: Sequence[int] = ()) -> None:
    """Read every parameter still on the meta device except those of the ``removed`` layers."""
    skip = tuple(f"{adapter_for(model).layers}.{i}." for i in removed)
    checkpoint.load(model, [n for n, p in model.named_parameters() if p.is_meta and not n.startswith(skip)])
