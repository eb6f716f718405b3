"""Data-parallel calibration: statistics are sums, so ranks split the batches and all-reduce."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def init_from_env() -> tuple[int, str | None]:
    """Join the process group ``torchrun`` describes (nccl on GPUs, gloo on CPU); returns the rank and,
    on GPUs, this rank's device. Outside ``torchrun``: ``(0, None)``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return distributed_rank()[0], None
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    return dist.get_rank(), device
