"""Data-parallel calibration: statistics are sums, so ranks split the batches and all-reduce."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ghostlayers.errors import GhostLayersError


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share_across_ranks(batches: list) -> list:
    """This process's share under ``torch.distributed``: every ``world_size``-th batch (or batch label)."""
    rank, world = distributed_rank()
    if world > 1 and len(batches) < world:
        raise ValueError(f"{len(batches)} calibration batches cannot be shared by {world} processes")
    return batches[rank::world]


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RENDEZVOUS_TIMEOUT = "GHOSTLAYERS_RENDEZVOUS_TIMEOUT"


def rendezvous_seconds() -> float:
    """How long a process waits for the others to join (and any later collective), ``$GHOSTLAYERS_RENDEZVOUS_TIMEOUT``
    or 30 minutes: a rank started alone stops with a message instead of waiting forever."""
    given = os.environ.get(RENDEZVOUS_TIMEOUT, "").strip()
    try:
        seconds = float(given) if given else 1800.0
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 10**7:
        raise GhostLayersError(
            f"${RENDEZVOUS_TIMEOUT}={given!r} is not a number of seconds: unset it, or give e.g. 600."
        )
    return seconds


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it, or 1; refused, before any work, when it is not a count or comes
    without torchrun's other variables (the process group would wait for ranks that never start)."""
    given = os.environ.get("WORLD_SIZE", "").strip()
    if not given:
        return 1
    if not given.isdigit() or int(given) < 1:
        raise GhostLayersError(f"WORLD_SIZE={given!r} is not a process count: unset it, or start with torchrun.")
    if int(given) == 1:
        return 1
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name, "").strip()]
    if missing:
        raise GhostLayersError(
            f"WORLD_SIZE={given} is set without {', '.join(missing)}: start several processes with torchrun "
            "(torchrun --nproc-per-node N ...), or unset WORLD_SIZE to run one."
        )
    for name in ("RANK", "LOCAL_RANK"):
        if not os.environ[name].strip().isdigit() or int(os.environ[name]) >= int(given):
            raise GhostLayersError(f"{name}={os.environ[name]!r} is not a rank below WORLD_SIZE={given}.")
    return int(given)


def init_from_env() -> tuple[int, str | None]:
    """Join the process group ``torchrun`` describes (nccl on GPUs, gloo on CPU); returns the rank and,
    on GPUs, this rank's device. Outside ``torchrun``: ``(0, None)``."""
    if world_size_from_env() <= 1 or dist.is_initialized():
        return distributed_rank()[0], None
    cuda = torch.cuda.is_available()
    seconds = rendezvous_seconds()
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=seconds))
    except (RuntimeError, TimeoutError):  # torch's DistStoreError is a RuntimeError
        raise GhostLayersError(
            f"The other torchrun processes did not join within {seconds:g} s (MASTER_ADDR="
            f"{os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE')}): start all of them with torchrun, or unset WORLD_SIZE to run one. "
            f"${RENDEZVOUS_TIMEOUT} sets the wait."
        ) from None
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    return dist.get_rank(), device


def sum_across_ranks(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """``values`` added up over every process (float64, on ``device``: nccl reduces only GPU tensors); as given
    outside ``torch.distributed``."""
    if distributed_rank()[1] == 1:
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def from_rank_zero(obj: object) -> object:
    """Rank 0's ``obj`` on every process (pickled: for small states such as a checkpoint read on rank 0)."""
    if distributed_rank()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every process (nothing outside ``torch.distributed``)."""
    if distributed_rank()[1] > 1:
        dist.barrier()
