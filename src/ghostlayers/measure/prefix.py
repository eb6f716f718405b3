"""The dense layers before a cut, run once for every model scored there.

Every repair of a removed block leaves the decoder layers before it as the dense model's (``guard.shared_depth``).
So the residual stream entering layer ``depth`` is the same for the dense model, plain pruning and every
method and α tried at that cut, on the same input ids. ``SharedPrefix`` keeps that state per input batch (keyed
by its token ids, so perplexity windows, held-out windows and lm-eval's zero-shot batches are all served, in
whatever order they come) and ``running`` feeds it to layer ``depth``; the layers before it do not run. A batch
not seen before is made from the model's own first ``depth`` layers, on first use.

Memory is bounded: past ``memory`` bytes, states go to files in a temporary folder, removed on ``close``; a
folder left by a killed process is removed by the next ``SharedPrefix``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ghostlayers.calibration.passes import boundary_state
from ghostlayers.model.adapters import decoder_layers, layers_swapped, starting_at

DEFAULT_MEMORY = 2 * 2**30
FOLDER_PREFIX = "ghostlayers-states-"


def _key(ids: Tensor) -> str:
    data = ids.detach().cpu().contiguous()
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16)
    digest.update(repr((tuple(data.shape), str(data.dtype))).encode())
    return digest.hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(where: Path) -> None:
    """Remove the state folders under ``where`` whose process is gone (killed before ``close``)."""
    for folder in where.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


class SharedPrefix:
    """The dense residual stream entering decoder layer ``depth``, per input batch seen (at ``depth`` 0
    nothing is shared and models run whole)."""

    def __init__(self, depth: int, memory: int = DEFAULT_MEMORY, folder: Path | None = None):
        self.depth, self.memory, self.where = depth, memory, Path(folder or tempfile.gettempdir())
        self.held: dict[str, Tensor] = {}
        self.spilled: dict[str, Path] = {}
        self.bytes, self.made, self._folder = 0, 0, None

    def __enter__(self) -> SharedPrefix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget every state and remove the folder of spilled ones."""
        self.held.clear()
        self.spilled.clear()
        self.bytes = 0
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def get(self, ids: Tensor) -> Tensor | None:
        key = _key(ids)
        if key in self.held:
            return self.held[key]
        if key in self.spilled:
            return torch.load(self.spilled[key], weights_only=True)
        return None

    def put(self, ids: Tensor, state: Tensor) -> None:
        key, size = _key(ids), state.numel() * state.element_size()
        self.made += 1
        if self.bytes + size <= self.memory:
            self.held[key], self.bytes = state, self.bytes + size
            return
        if self._folder is None:
            self.where.mkdir(parents=True, exist_ok=True)
            remove_orphans(self.where)
            self._folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=self.where))
        path = self._folder / f"{key}.pt"
        torch.save(state.cpu(), path)
        self.spilled[key] = path

    @contextlib.contextmanager
    def running(self, model: PreTrainedModel) -> Iterator[None]:
        """Run ``model`` from layer ``depth`` on, fed the shared state of each batch it is called on. Its
        layers before ``depth`` must be the dense model's (the states of unseen batches are made from them)."""
        if self.depth == 0:
            yield
            return
        first = list(decoder_layers(model))[: self.depth]
        types = getattr(model.config, "layer_types", None)
        first_types = None if types is None else list(types)[: self.depth]
        making = [False]
        with starting_at(model, self.depth) as slot:

            def feed(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                if making[0]:  # the nested call below, which makes a state
                    return
                ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
                state = self.get(ids)
                if state is None:
                    making[0] = True
                    try:
                        with layers_swapped(model, first, first_types):
                            state = boundary_state(model, ids, self.depth)
                    finally:
                        making[0] = False
                    self.put(ids, state)
                slot[:] = [state.to(ids.device)]

            handle = model.register_forward_pre_hook(feed, with_kwargs=True)
            try:
                yield
            finally:
                handle.remove()


def running(model: PreTrainedModel, prefix: SharedPrefix | None) -> contextlib.AbstractContextManager[None]:
    """``prefix.running(model)``, or the whole model when there is no prefix to share."""
    return prefix.running(model) if prefix is not None else contextlib.nullcontext()
