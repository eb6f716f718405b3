"""Healing: train a pruned model a little toward the dense model's next-token distribution, starting from the
closed-form repair, and keep the result only where held-out text says it helps.

The closed forms fit hidden states by least squares, which is not what accuracy measures (issue #41). The loss
here is LinearPatch's: KL from the teacher's top-k next-token distribution, renormalised over those k tokens,
to the student's over the same k tokens. Cost decides the shape: the teacher runs once, and its top-k logits and
the residual stream entering the first layer the pruning changed are cached on disk (``cache_teacher``); the
layers before that boundary are the same in both models, so each step runs only the layers from the boundary on
and the head (``adapters.starting_at``). What trains is the stream operator (``GhostOperator.delta``) and/or
LoRA adapters (PEFT) on the kept layers from the boundary on, merged into the weights afterwards so plain
methods stay plain checkpoints. The guard then compares healed, unhealed and plain pruning per held-out domain;
a heal worse than the closed form on any domain is undone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghostlayers.calibration.distributed import barrier, distributed_rank, from_rank_zero, sum_across_ranks
from ghostlayers.config.recipes import HealSettings
from ghostlayers.config.settings import DEFAULT_BATCH_SIZE
from ghostlayers.errors import GhostLayersError
from ghostlayers.files.reading import read_json
from ghostlayers.measure.prefix import SharedPrefix
from ghostlayers.model.adapters import adapter_for, decoder_layers, hidden_states, logits_at, starting_at
from ghostlayers.model.modeling_ghostlayers import GhostOperator
from ghostlayers.model.record import Heal, update_record
from ghostlayers.model.surgery import DenseLayers, dense_view, repair_scaled
from ghostlayers.repair.guard import domain_perplexity, shared_depth, worse

LORA_RANK = 8


def topk_kl(logits: Tensor, values: Tensor, indices: Tensor | None = None) -> Tensor:
    """Mean over tokens of ``KL(p ‖ q)``, ``p`` the softmax of the teacher's top-k logits ``values`` and ``q``
    the softmax of the student's ``logits`` at the same vocabulary ``indices`` (LinearPatch's loss: both
    renormalised over the k tokens; ``indices`` None: ``logits`` are already those k), in float32 at least
    (float64 models: in float64, for gradient checks)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    chosen = logits if indices is None else logits.gather(-1, indices.long())
    student = torch.log_softmax(chosen.to(dtype), dim=-1)
    teacher = torch.log_softmax(values.to(dtype), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@torch.no_grad()
def teacher_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The teacher's ``k`` largest logits per token (float32) and their vocabulary indices (int32 on disk)."""
    values, indices = logits.float().topk(k, dim=-1)
    return values, indices.int()


def pruned_runs(model: PreTrainedModel) -> list[tuple[int, int]]:
    """The removed runs ``(pre, post)`` (original indices) of a pruned model, from its record."""
    record = getattr(model.config, "ghostlayers", None)
    if not record or not record.get("operators"):
        raise GhostLayersError("This model is not pruned by ghostlayers: there is nothing to heal.")
    return [tuple(spec["boundary"]) for spec in record["operators"]]


def heal_depth(model: PreTrainedModel) -> int:
    """The first decoder layer healing changes: the one after the first removed run, or the one before it when a
    repair was folded into that layer's down-projection (ReplaceMe, refit). The layers before it run on the
    teacher's cached state; a run ending the stack starts at the last kept layer (its operator is the norm's)."""
    record = model.config.ghostlayers
    first = min(pre for pre, _ in pruned_runs(model))
    folded = any(spec.get("merged_into") and spec["boundary"][0] == first for spec in record["operators"])
    return max(0, min(first - folded, len(decoder_layers(model)) - 1))


def operators(model: nn.Module) -> list[GhostOperator]:
    return [m for m in model.modules() if isinstance(m, GhostOperator)]


@dataclass
class CacheEntry:
    """One calibration batch as the student needs it: its tokens, the state entering layer ``depth`` and the
    teacher's top-k logits."""

    ids: Tensor
    state: Tensor
    values: Tensor
    indices: Tensor


@dataclass
class TeacherCache:
    """The teacher's outputs, one file per batch in ``folder``, read back one batch at a time. ``sizes`` gives
    every batch's tokens; ``held`` the batches this process cached (all of them but under ``torchrun``)."""

    folder: Path
    depth: int
    topk: int
    sizes: list[int] = field(default_factory=list)  # tokens per batch
    held: list[int] | None = None

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def indices(self) -> list[int]:
        return list(range(len(self.sizes))) if self.held is None else self.held

    def path(self, index: int) -> Path:
        return self.folder / f"{index:06d}.pt"

    def load(self, index: int) -> CacheEntry:
        return CacheEntry(**torch.load(self.path(index), weights_only=True))

    def intact(self, index: int) -> bool:
        """Whether batch ``index``'s file is one ``cache_teacher`` wrote for this cache: a regular file of its
        tokens, the state entering ``depth`` and the top-k logits, in their shapes (read by memory map: the
        headers, not the tensors). Anything else (damaged, planted, another cache's) is made again."""
        path = self.path(index)
        if path.is_symlink() or not path.is_file():
            return False
        try:
            entry = torch.load(path, weights_only=True, mmap=True)
        except Exception:  # any unreadable file, whatever torch's reader raises for it
            return False
        if not (isinstance(entry, dict) and set(entry) == {"ids", "state", "values", "indices"}):
            return False
        if not all(isinstance(t, Tensor) for t in entry.values()) or entry["ids"].dim() != 2:
            return False
        ids, topk = tuple(entry["ids"].shape), (*entry["ids"].shape, self.topk)
        return (
            entry["ids"].numel() == self.sizes[index]
            and tuple(entry["state"].shape[:2]) == ids
            and entry["state"].dim() == 3
            and tuple(entry["values"].shape) == topk
            and tuple(entry["indices"].shape) == topk
        )


@torch.no_grad()
def cache_teacher(
    teacher: PreTrainedModel,
    batches: Sequence[Tensor],
    depth: int,
    topk: int,
    folder: Path,
    progress: bool = True,
    indices: Sequence[int] | None = None,
) -> TeacherCache:
    """Run the teacher once over ``batches`` (only those of ``indices`` when given): each batch's state entering
    layer ``depth`` and its top-k logits, written to ``folder`` (nothing of the epoch is held in memory). A file
    is complete once it has its name (written beside, then renamed), so a killed run's files can be kept."""
    if topk > teacher.config.vocab_size:
        raise GhostLayersError(f"--heal-topk {topk} is more than the vocabulary ({teacher.config.vocab_size}).")
    device = next(teacher.parameters()).device
    todo = range(len(batches)) if indices is None else indices
    cache = TeacherCache(folder, depth, topk, [b.numel() for b in batches], None if indices is None else list(todo))
    captured: list[Tensor] = []
    layer = decoder_layers(teacher)[depth]
    handle = layer.register_forward_pre_hook(lambda m, a, kw: captured.append(hidden_states(a, kw)), with_kwargs=True)
    try:
        for i in tqdm(todo, desc="teacher", unit="batch", disable=not progress):
            captured.clear()
            logits = teacher(input_ids=batches[i].to(device), use_cache=False).logits
            values, indices_ = teacher_topk(logits, topk)
            entry = {"ids": batches[i].cpu(), "state": captured[0].cpu(), "values": values.cpu(),
                     "indices": indices_.cpu()}  # fmt: skip
            partial = folder / f".{i:06d}.{distributed_rank()[0]}.partial"
            torch.save(entry, partial)
            partial.replace(cache.path(i))
    finally:
        handle.remove()
    return cache


@contextlib.contextmanager
def dense_teacher(model: PreTrainedModel, dense: DenseLayers, unfolded: dict[str, Tensor]) -> Iterator[PreTrainedModel]:
    """Run a pruned model as the dense one it was, exactly: its folded projections back (``repair_scaled`` at
    α = 0, in the pruned model's names) and its original layers without operators (``dense_view``). The teacher
    then costs no second copy of the model."""
    with repair_scaled(model, 0.0, unfolded), dense_view(model, dense):
        yield model


def lora_targets(model: PreTrainedModel, depth: int) -> list[str]:
    """Every Linear of the decoder layers from ``depth`` on, by its full name."""
    layers = adapter_for(model).layers
    return [
        f"{layers}.{i}.{name}"
        for i, layer in enumerate(decoder_layers(model))
        if i >= depth
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    ]


def make_trainable(model: PreTrainedModel, params: Sequence[str], depth: int, seed: int = 0) -> list[nn.Parameter]:
    """Freeze everything, then give the operators' ``delta`` and/or fresh LoRA adapters (rank ``LORA_RANK``,
    B = 0: the model is unchanged until trained) on the layers from ``depth`` on their gradients."""
    for p in model.parameters():
        p.requires_grad_(False)
    if "lora" in params:
        config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                            target_modules=lora_targets(model, depth))  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model)
    trained = [op.delta for op in operators(model)] if "operator" in params else []
    trained += [p for name, p in model.named_parameters() if "lora_" in name]
    for p in trained:
        p.requires_grad_(True)
    return trained


def remove_lora(model: nn.Module, merge: bool) -> dict[str, Tensor]:
    """Put each LoRA layer's base Linear back in its place, its adapter merged into the weight (``merge``) or
    dropped; returns the weights before merging by parameter name (what ``scale_repair`` lerps back to)."""
    before: dict[str, Tensor] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if merge:
                before[f"{name}.weight"] = base.weight.detach().clone()
                module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, base)
    return before


class Student(nn.Module):
    """The pruned model scoring only the teacher's top-k tokens: its final states and then the head's rows of
    those k tokens per position (``adapters.logits_at``), so the full-vocabulary head, as costly as several
    decoder layers, runs neither forward nor backward. One module, so DistributedDataParallel can wrap it."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, indices: Tensor) -> Tensor:
        hidden = self.model.base_model(input_ids=ids, use_cache=False)[0]
        return logits_at(self.model, hidden, indices)


def cached_loss(student: nn.Module, slot: list[Tensor], entry: CacheEntry) -> Tensor:
    """The loss of one cached batch, inside ``starting_at(model, depth)`` (``slot``): only the layers from the
    boundary on and the teacher's top-k rows of the head run (``student``: a ``Student`` or its
    DistributedDataParallel wrapper)."""
    device = next(student.parameters()).device
    slot[:] = [entry.state.to(device)]
    logits = student(entry.ids.to(device), entry.indices.to(device))
    return topk_kl(logits, entry.values.to(device))


def naive_loss(student: PreTrainedModel, teacher: PreTrainedModel, batch: Tensor, topk: int) -> Tensor:
    """The same loss without a cache: the teacher and the whole student run on ``batch`` (what a plain
    distillation loop does every step; tests and the benchmark compare the two)."""
    with torch.no_grad():
        values, indices = teacher_topk(teacher(input_ids=batch, use_cache=False).logits, topk)
    return topk_kl(student(input_ids=batch, use_cache=False).logits, values, indices)


def _epochs(shard: list[int], seed: int) -> Iterator[int]:
    """The batches of ``shard``, epoch after shuffled epoch, without end."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from (shard[k] for k in torch.randperm(len(shard), generator=generator).tolist())


def step_order(sizes: Sequence[int], tokens: int, seed: int, group: int = 1) -> list[list[int]]:
    """The batches of each step until ``tokens`` tokens are reached: one from each of ``group`` streams (every
    ``group``-th batch, each shuffled epoch after epoch on its own), so that a step's batches split evenly over
    processes and each process caches the teacher for its own streams only (``my_streams`` checks there are
    enough batches)."""
    streams = [_epochs(list(range(g, len(sizes), group)), seed + g) for g in range(group)]
    order, done = [], 0
    while done < tokens:
        order.append([next(stream) for stream in streams])
        done += sum(sizes[i] for i in order[-1])
    return order


def my_streams(settings: HealSettings, count: int) -> tuple[int, list[int]]:
    """The streams of a step (``step_order``'s ``group``: ``settings.accumulate`` per process) and this process's,
    refused when the ``count`` calibration batches cannot give each stream one."""
    rank, world = distributed_rank()
    group = world * settings.accumulate
    if count < group:
        raise GhostLayersError(
            f"{count} calibration batches cannot give each of {group} processes (or accumulated batches) its "
            "own: pass more --num-samples, a smaller --batch-size, or fewer processes."
        )
    return group, [g for g in range(group) if g % world == rank]


CHECKPOINT_EVERY = 16  # steps between checkpoints (and one on Ctrl-C)


def data_parallel(model: PreTrainedModel, trained: list[nn.Parameter]) -> nn.Module:
    """The ``Student`` of ``model``; under ``torch.distributed``, wrapped in DistributedDataParallel, which
    averages the trained parameters' gradients over the processes (they start equal: rank 0's are broadcast)."""
    student = Student(model)
    if distributed_rank()[1] == 1:
        return student
    with torch.no_grad():
        for p in trained:
            torch.distributed.broadcast(p.data, src=0)
    device = next(model.parameters()).device
    return nn.parallel.DistributedDataParallel(
        student, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False, init_sync=False
    )


def step_loss(forward: nn.Module, slot: list[Tensor], cache: TeacherCache, batches: list[int]) -> float:
    """Gradients of the mean loss over this process's ``batches`` of a step (the processes' gradients averaged
    once, on the last backward); returns the step's mean loss over every process."""
    total = 0.0
    for k, index in enumerate(batches):
        last = k == len(batches) - 1
        apart = forward.no_sync() if isinstance(forward, nn.parallel.DistributedDataParallel) and not last else None
        with apart or contextlib.nullcontext():
            loss = cached_loss(forward, slot, cache.load(index)) / len(batches)
            loss.backward()
        total += loss.item()
    world = distributed_rank()[1]
    return sum_across_ranks([total], next(forward.parameters()).device)[0] / world


def train(
    model: PreTrainedModel,
    cache: TeacherCache,
    trained: list[nn.Parameter],
    settings: HealSettings,
    progress: bool = True,
    checkpoint: Path | None = None,
    every: int | None = None,
) -> tuple[list[float], int]:
    """AdamW (no weight decay: it would pull the repair toward plain pruning) with a cosine schedule over the
    token budget; returns each step's loss and the tokens of all its steps. A step is one batch of each stream
    (``step_order``): under ``torchrun`` each process runs its own and DistributedDataParallel averages the
    gradients. With
    ``checkpoint``, the trained parameters, the optimizer, the schedule, the RNG, the step and the losses are
    saved there (by rank 0) every ``every`` steps and on Ctrl-C (unless it struck inside an update), and a run
    that finds one goes on from it, ending as one that never stopped."""
    group, mine = my_streams(settings, len(cache.sizes))
    order, every = step_order(cache.sizes, settings.tokens, settings.seed, group), every or CHECKPOINT_EVERY
    optimizer = torch.optim.AdamW(trained, lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(order))
    losses, start = resume(checkpoint, trained, optimizer, schedule, len(order))
    tokens = [sum(cache.sizes[i] for i in step) for step in order]
    bar = tqdm(total=sum(tokens), initial=sum(tokens[:start]), desc="heal", unit="tok", disable=not progress)
    forward, updating = data_parallel(model, trained), False
    write = checkpoint is not None and distributed_rank()[0] == 0
    try:
        with starting_at(model, cache.depth) as slot, bar:
            for step in range(start, len(order)):
                optimizer.zero_grad(set_to_none=True)
                loss = step_loss(forward, slot, cache, [order[step][g] for g in mine])
                if not math.isfinite(loss):
                    raise GhostLayersError("The healing loss is not finite: lower --heal-lr or use --dtype float32.")
                updating = True
                optimizer.step()
                schedule.step()
                losses.append(loss)
                updating = False
                if write and (step + 1) % every == 0:
                    save_checkpoint(checkpoint, trained, optimizer, schedule, step + 1, losses)
                bar.update(tokens[step])
                bar.set_postfix(loss=f"{loss:.4f}")
    except KeyboardInterrupt:
        if write and not updating:  # else the last periodic checkpoint stands
            save_checkpoint(checkpoint, trained, optimizer, schedule, len(losses), losses)
        raise
    return losses, sum(tokens)


def save_checkpoint(path: Path, trained: list[nn.Parameter], optimizer, schedule, step: int, losses: list[float]):
    """Everything a heal needs to go on from ``step``, written whole (a file beside it, then renamed)."""
    state = {
        "params": [p.detach().cpu().clone() for p in trained],
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
        "losses": list(losses),
    }
    partial = path.with_name(f".{path.name}.partial")
    torch.save(state, partial)
    partial.replace(path)


def resume(path: Path | None, trained: list[nn.Parameter], optimizer, schedule, steps: int) -> tuple[list, int]:
    """The losses so far and the step to go on from, with the parameters, optimizer, schedule and RNG put back
    as ``save_checkpoint`` left them (rank 0 reads the file, every process gets its state); nothing done when
    there is no checkpoint (or one of another heal)."""
    state = None
    if path is not None and distributed_rank()[0] == 0:
        state = _checkpoint(path, trained, steps)
    state = from_rank_zero(state) if path is not None else None
    if state is None:
        return [], 0
    with torch.no_grad():
        for p, saved in zip(trained, state["params"], strict=True):
            p.copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"])
    return list(state["losses"]), int(state["step"])


def _checkpoint(path: Path, trained: list[nn.Parameter], steps: int) -> dict | None:
    """The state ``save_checkpoint`` left at ``path`` for these parameters and steps; None where there is none,
    or what is there is damaged, planted or another heal's (the heal then starts from its closed form)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception:  # any unreadable file, whatever torch's reader raises for it
        return None
    if not (isinstance(state, dict) and isinstance(state.get("params"), list) and type(state.get("step")) is int):
        return None
    if not (isinstance(state.get("losses"), list) and all(isinstance(p, Tensor) for p in state["params"])):
        return None
    shapes = [tuple(p.shape) for p in state["params"]] == [tuple(p.shape) for p in trained]
    return state if shapes and 0 <= state["step"] <= steps else None


@torch.no_grad()
def cache_loss(model: PreTrainedModel, cache: TeacherCache) -> float:
    """The mean loss over every cached batch, weighted by tokens (how far the model is from the teacher there);
    under ``torchrun`` each process adds its own batches."""
    total, tokens = 0.0, 0
    with starting_at(model, cache.depth) as slot:
        for i in cache.indices:
            total += float(cached_loss(Student(model), slot, cache.load(i))) * cache.sizes[i]
            tokens += cache.sizes[i]
    total, tokens = sum_across_ranks([total, tokens], next(model.parameters()).device)
    return total / tokens


def what_trains(model: PreTrainedModel, settings: HealSettings) -> tuple[str, ...]:
    """``settings.trained`` for the model's method; a repair the guard shrank to α = 0 has no operator left, so
    ``auto`` then trains LoRA and an explicit ``operator`` is refused."""
    params = settings.trained(model.config.ghostlayers["method"])
    if "operator" in params and not operators(model):
        if settings.params != "auto":
            raise GhostLayersError(
                "--heal-params operator: the guard kept α = 0 (plain pruning), so no operator is left to train. "
                "Use --heal-params lora."
            )
        params = ("lora",)
    return params


def heal(
    model: PreTrainedModel,
    cache: TeacherCache,
    settings: HealSettings,
    heldout: dict[str, Tensor] | None = None,
    unfolded: dict[str, Tensor] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    checkpoint: Path | None = None,
    scored: dict[str, dict[str, float]] | None = None,
) -> Heal:
    """Heal the pruned ``model`` in place on ``cache`` (``cache_teacher``) as ``settings`` say, then the guard:
    plain pruning (α = 0 of ``unfolded``, the weights folding replaced), the closed form and the healed model on
    ``heldout``; a heal worse than the closed form on a domain is undone (``guard.worse``, the guard's one rule).
    ``scored``: plain pruning's and the closed form's held-out scores where the guard already has them, so they
    are not scored twice. LoRA is merged into the weights when kept, and its base weights added to ``unfolded`` so
    that α = 0 is still plain pruning. Under ``torchrun`` every process trains and rank 0 alone guards."""
    start, unfolded = time.perf_counter(), unfolded if unfolded is not None else {}
    heldout = heldout if distributed_rank()[0] == 0 else None
    params = what_trains(model, settings)
    prefix = SharedPrefix(shared_depth(pruned_runs(model)))
    scores: dict[str, dict[str, float]] = dict(scored or {}) if heldout else {}

    def score(label: str) -> None:
        scores[label] = domain_perplexity(model, heldout, batch_size, progress, label, prefix)

    if heldout and "plain pruning" not in scores:
        with repair_scaled(model, 0.0, unfolded):
            score("plain pruning")
    if heldout and "closed form" not in scores:
        score("closed form")
    grads = {p: p.requires_grad for p in model.parameters()}
    deltas = [op.delta.detach().clone() for op in operators(model)]
    loss_before = cache_loss(model, cache)
    trained = make_trainable(model, params, cache.depth, settings.seed)
    losses, tokens = train(model, cache, trained, settings, progress, checkpoint)
    loss_after = cache_loss(model, cache)
    hurt: list[str] = []
    if heldout:
        score("healed")
        hurt = worse(scores["healed"], scores["closed form"])
    prefix.close()
    kept = not hurt
    before = remove_lora(model, merge=kept)
    unfolded.update({k: v for k, v in before.items() if k not in unfolded})
    if not kept:
        with torch.no_grad():
            for op, delta in zip(operators(model), deltas, strict=True):
                op.delta.copy_(delta)
    for p, flag in grads.items():
        p.grad = None  # the operators' gradients would otherwise outlive training
        p.requires_grad_(flag)
    result = Heal(list(params), tokens, len(losses), loss_before, loss_after, kept, scores, hurt,
                  time.perf_counter() - start)  # fmt: skip
    update_record(model, heal=result.to_dict())
    return result


def work_folder(output: str | Path) -> Path:
    """Where the heal of a run writing ``output`` keeps the teacher's cache and its checkpoint: beside it, under
    the run's lock (``folders.Claim``), so the same command after a kill finds them."""
    output = Path(output).absolute()
    return output.with_name(f".{output.name}.ghostlayers-heal")


def _batches_digest(batches: Sequence[Tensor]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(repr(tuple(batch.shape)).encode() + batch.cpu().numpy().tobytes())
    return digest.hexdigest()


def heal_pruned(
    model: PreTrainedModel,
    batches: Sequence[Tensor],
    settings: HealSettings,
    work: Path,
    teacher: Callable[[], contextlib.AbstractContextManager[PreTrainedModel]],
    identity: dict | None = None,
    keep_cache: bool = False,
    **guard: Any,
) -> Heal:
    """The one healing path (``prune --heal``, ``ghostlayers heal``, the benchmark): the teacher (``teacher()``:
    a context giving the dense model, ``dense_teacher`` or a model of its own) runs once over ``batches`` into a
    cache in ``work``, then ``heal`` trains from it (``guard``: held-out windows, unfolded weights, batch size,
    progress), checkpointing there. The same call after a kill goes on where it stopped: a complete cache of the
    same inputs (``identity``: the models' digests and recipe; the depth, top-k and the batches' tokens) is read
    back and training resumes from the checkpoint of the same settings; anything else in ``work`` is cleared.
    A finished heal removes ``work`` (``keep_cache``: only its checkpoint, so further heals reuse the cache)."""
    what_trains(model, settings)  # refused before the teacher runs
    depth, progress = heal_depth(model), guard.get("progress", True)
    cached = {"identity": identity or {}, "depth": depth, "topk": settings.topk, "batches": _batches_digest(batches)}
    run = json.dumps([cached, asdict(settings), model.config.ghostlayers.get("operators")], sort_keys=True)
    checkpoint = work / f"checkpoint-{hashlib.sha256(run.encode()).hexdigest()[:16]}.pt"
    group, mine = my_streams(settings, len(batches))  # refused before the teacher runs
    held = sorted(i for g in mine for i in range(g, len(batches), group))
    folder, key = work / "teacher", work / "teacher.json"
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        raise GhostLayersError(f"{work} is not a folder ghostlayers made: remove it, then heal again.")

    def tidy() -> None:  # what another heal left, or anything planted, is cleared; this heal's files are kept
        work.mkdir(parents=True, exist_ok=True)
        for stale in work.glob("checkpoint-*.pt"):
            if stale != checkpoint or stale.is_symlink() or not stale.is_file():
                _removed(stale)  # another heal's (its settings are not these), or no file of ours
        noted = None
        with contextlib.suppress(GhostLayersError):  # a record unreadable as ours: the cache is made again
            noted = read_json(key, "the heal's cache record")
        if not (isinstance(noted, dict) and noted.get("key") == cached and _folder(folder)):
            _removed(key)
            _removed(folder)
            folder.mkdir()
            key.write_text(json.dumps({"key": cached}))

    try:
        rank = distributed_rank()[0]
        if rank == 0:
            tidy()
        barrier()  # rank 0 first: on a shared disk the others then find its folder as it should be
        if rank != 0:
            tidy()
        cache = TeacherCache(folder, depth, settings.topk, [b.numel() for b in batches], held)
        missing = [i for i in held if not cache.intact(i)]  # a file is whole once named, unless tampered with
        if missing:
            for i in missing:
                _removed(cache.path(i))
            with teacher() as dense:
                cache_teacher(dense, batches, depth, settings.topk, folder, progress, missing)
        done = heal(model, cache, settings, checkpoint=checkpoint, **guard)
    except OSError as error:
        raise GhostLayersError(
            f"Cannot write the heal's cache in {work} ({error.strerror or error}): free space there (it holds the "
            "teacher's top-k logits and the states entering the cut for every calibration token), then heal again."
        ) from None
    if keep_cache:
        checkpoint.unlink(missing_ok=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return done


def _folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _removed(path: Path) -> None:
    """Whatever is at ``path`` is gone: a file, a link (not what it points to), a FIFO or a folder."""
    if _folder(path):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def check_teacher(dense: PreTrainedModel, pruned: PreTrainedModel, name: str) -> None:
    """Refuse a teacher that is not the model ``pruned`` was pruned from: its architecture, vocabulary, width
    and layer count are the record's, and the weights no repair or heal touches (the embedding, and the layers
    before the first removed run, less the one a repair folds into) are the teacher's, exactly."""
    record, config = pruned.config.ghostlayers, dense.config
    base = getattr(config, "ghostlayers", {}).get("base_model_type", config.model_type)
    shape = {
        "architecture": (base, record["base_model_type"]),
        "vocabulary": (config.vocab_size, pruned.config.vocab_size),
        "hidden size": (config.hidden_size, pruned.config.hidden_size),
        "layer count": (len(decoder_layers(dense)), record["original_num_hidden_layers"]),
    }
    differ = [f"{what} {theirs} where the folder's source had {ours}" for what, (theirs, ours) in shape.items()
              if theirs != ours]  # fmt: skip
    if not differ:
        untouched = [("embedding", dense.get_input_embeddings(), pruned.get_input_embeddings())]
        first = min(pre for pre, _ in pruned_runs(pruned))
        untouched += [(f"layer {i}", decoder_layers(dense)[i], decoder_layers(pruned)[i]) for i in range(first - 1)]
        differ = [f"its {what} weights" for what, a, b in untouched if not _same(a, b)]
    if differ:
        source = record.get("source_model", "the model it was pruned from")
        raise GhostLayersError(
            f"--model {name} is not the model this folder was pruned from ({'; '.join(differ[:3])}): healing toward "
            f"it would train toward another network. Pass --model {source}, the folder's source."
        )


def folded_weights(dense: PreTrainedModel, pruned: PreTrainedModel) -> dict[str, Tensor]:
    """The dense model's down-projections a saved folder's repairs were folded into, by their names in the
    pruned model (what ``scale_repair`` needs for plain pruning, which a saved folder no longer holds)."""
    record, adapter = pruned.config.ghostlayers, adapter_for(pruned)
    keep = [i for i in range(record["original_num_hidden_layers"]) if i not in set(record["removed_layers"])]
    out = {}
    for spec in record["operators"]:
        if spec.get("merged_into"):
            renamed = f"{adapter.layers}.{keep.index(spec['boundary'][0] - 1)}.{adapter.down_proj}"
            params = dense.get_submodule(spec["merged_into"]).named_parameters()
            out |= {f"{renamed}.{k}": v.detach().clone() for k, v in params}
    return out
