"""Work that rank 0 does first while the other ranks wait (the graph build): its failure ends every rank.

With a plain barrier, a rank 0 that raises leaves the other ranks waiting at the barrier until the
process-group timeout. :func:`rank_zero_first` replaces the barrier with a broadcast of rank 0's
outcome: on failure rank 0 raises its own exception and every other rank raises
:class:`RankZeroBadInput` (rank 0's error was bad input) or :class:`RankZeroFailed`, carrying rank
0's message (:class:`RankZeroFailed` is a :class:`~stormshard.errors.ReportedByRank` whose reporter
is rank 0). Entry points print only rank 0's message (``stormshard.cli``). Communication: one
``broadcast_object_list`` of a small tuple from rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from stormshard.errors import BAD_INPUT, ReportedByRank
from stormshard.training.config import ConfigError

__all__ = ["RankZeroBadInput", "RankZeroFailed", "rank_zero_first"]

T = TypeVar("T")


class RankZeroFailed(ReportedByRank):
    """Rank 0 failed in work every rank waited for; rank 0 reports it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reporter=0)


class RankZeroBadInput(ConfigError):
    """Rank 0 stopped on bad input in work every rank waited for; rank 0 reports it."""


def rank_zero_first(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0, then (if it succeeded) on every other rank; ``what`` names the work in the
    other ranks' message ("building the graph"). Without a process group, just ``fn()``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    rank = dist.get_rank()
    error: BaseException | None = None
    result = None
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is broadcast
            error = exc
    box = [None if error is None else (isinstance(error, BAD_INPUT), f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        if rank == 0:
            raise error
        bad, text = box[0]
        raise (RankZeroBadInput if bad else RankZeroFailed)(f"rank 0 failed while {what}: {text}")
    return result if rank == 0 else fn()
