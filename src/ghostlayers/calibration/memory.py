"""How much memory one calibration pass may give to candidate-block statistics, read from the device.

A fixed budget was wrong both ways: 2 GiB sent a 139 GiB GPU to the slower two-pass route at the 8B
shape, and could exceed what a small machine has free. The default is half of what the device has free
once the model is loaded (a GPU's free memory, otherwise available RAM): the other half is left to the
forward pass and its temporaries.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ghostlayers.calibration.distributed import distributed_rank

UNKNOWN_FREE_BUDGET = 2 * 2**30  # bytes, when the free memory cannot be read


def free_memory(device: torch.device) -> tuple[int, str] | None:
    """Bytes free for ``device`` and what they are (a GPU's free memory, otherwise available RAM, from
    psutil or ``/proc/meminfo``); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory of {torch.cuda.get_device_name(device)}"
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo") as info:
                kib = next((int(line.split()[1]) for line in info if line.startswith("MemAvailable:")), None)
        except OSError:
            return None
        return None if kib is None else (kib * 1024, "free RAM")
    return psutil.virtual_memory().available, "free RAM"


def size_text(num_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{1 if unit == 'GiB' else 0}f} {unit}"
    return f"{num_bytes / 2**10:.0f} KiB"


def stats_budget(device: torch.device, requested: int | None) -> tuple[int, str]:
    """The bytes of candidate statistics one pass may hold, and where the figure comes from: ``requested``
    (``--stats-memory``) when given, else half of ``free_memory``, divided among the processes that share
    this machine's RAM under ``torchrun``. Every rank takes the smallest rank's figure, so all take the same
    route (a rank on another route would wait forever in the all-reduce)."""
    if requested is not None:
        return requested, "given"
    free = free_memory(device)
    if free is None:
        return UNKNOWN_FREE_BUDGET, "the free memory could not be read"
    available, what = free
    sharing = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    why = f"half of {what}" + (f", shared by {sharing} processes" if sharing > 1 else "")
    return smallest_across_ranks(available // 2 // sharing), why


def smallest_across_ranks(value: int) -> int:
    """The minimum of ``value`` over the processes under ``torch.distributed``; ``value`` outside it."""
    if distributed_rank()[1] == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MIN)
    return int(total)
