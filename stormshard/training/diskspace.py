"""Free space for checkpoints, checked at the start of a run and before every save.

A checkpoint that cannot be written loses every step since the previous one, so the run stops
*before* it trains steps it could not keep. The size of one checkpoint is estimated from the
model (per rank, in bytes)::

    2 x parameter bytes (the module in rank_NNNNN.pt and in rank_NNNNN.safetensors)
    + 2 x fp32 parameter bytes / ZeRO partitions (AdamW's two moments; partitions = the
      data-parallel size at ZeRO 1/2, else 1)
    + 1 MiB (metadata, RNG and data state)

summed over all ranks (one ``all_reduce`` of a scalar), and compared with the smallest free space
any rank sees in the checkpoint directory (one more ``all_reduce``), so every rank reaches the
same verdict. The previous checkpoints are deleted only after the new one is complete, so the
whole size must be free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stormshard.checkpoint.format import CheckpointError

__all__ = ["DiskSpaceError", "checkpoint_bytes_estimate", "check_checkpoint_space", "format_bytes"]

_OVERHEAD = 1 << 20


class DiskSpaceError(CheckpointError):
    """The checkpoint directory has too little free space for the next checkpoint."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def checkpoint_bytes_estimate(model: nn.Module, zero_partitions: int = 1) -> int:
    """This rank's share of one checkpoint, in bytes (see the module docstring)."""
    params = [p for p in model.parameters()]
    stored = sum(p.numel() * p.element_size() for p in params)
    moments = sum(2 * 4 * p.numel() for p in params if p.requires_grad) // max(1, zero_partitions)
    return 2 * stored + moments + _OVERHEAD


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_checkpoint_space(directory: str | Path, model: nn.Module, step: int, zero_partitions: int = 1,
                           device: torch.device | None = None, last_checkpoint: str | None = None,
                           extra_bytes: int = 0) -> int:
    """Raise :class:`DiskSpaceError` (on every rank) when ``directory`` lacks room for the checkpoint
    of ``step``; returns the estimated size of the whole checkpoint in bytes. ``extra_bytes``: this rank's state
    beyond the model and optimizer (a weight average). Collective when a process group exists."""
    mine = checkpoint_bytes_estimate(model, zero_partitions) + extra_bytes
    base = _nearest_existing(Path(directory))
    free = shutil.disk_usage(base).free
    total = mine
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([float(mine)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        f = torch.tensor([float(free)], dtype=torch.float64, device=device)
        dist.all_reduce(f, op=dist.ReduceOp.MIN)
        total, free = int(t.item()), int(f.item())
    if free < total:
        kept = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
        raise DiskSpaceError(
            f"training.output_dir: the checkpoint directory {directory} ({base}) has {format_bytes(free)} free but "
            f"the checkpoint of step {step} needs about {format_bytes(total)}: the run stops here rather than train "
            f"steps it could not save ({kept}). Free space, lower training.keep_checkpoints, or point "
            "training.output_dir at a larger file system, then start again (with --resume if a checkpoint exists)"
        )
    return total
