"""How a tensor is sharded along one dimension, bound to its process group once, at construction.

A :class:`SequenceShard` is computed once (from the full length, or from known per-rank sizes)
and handed to the layers that need it; their ``forward`` then takes tensors only, like
single-device code. It holds every rank's local length in rank order (``sizes``) and the group
the dimension is split over (``group``; None, or a group of one rank, means unsharded).

:func:`check_shard_sizes` is the one validator of per-rank sizes: every collective and layer
that takes sizes goes through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from stormshard.parallel.shapes import balanced_offsets, balanced_sizes, group_rank, group_size

# the processor's shard strategies are spelled once, in the torch-free shard_strategy module
from stormshard.parallel.shard_strategy import ATTENTION_STRATEGIES, SHARD_STRATEGIES, ShardStrategy

__all__ = ["SequenceShard", "check_shard_sizes", "ShardStrategy", "SHARD_STRATEGIES", "ATTENTION_STRATEGIES"]

ProcessGroup = dist.ProcessGroup


def check_shard_sizes(sizes: Sequence[int], group: ProcessGroup | None, what: str = "sizes") -> tuple[int, ...]:
    """Validate one non-negative length per rank of ``group`` (in rank order); return them as ints.

    ``what`` names the argument in the message (e.g. ``"shapes"``, ``"SequenceShard.sizes"``).
    """
    try:
        out = tuple(int(s) for s in sizes)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of ints (one length per rank), got {sizes!r}") from None
    world = group_size(group)
    if len(out) != world:
        raise ValueError(
            f"{what} lists {len(out)} shards but the process group has {world} ranks (got {list(out)}): "
            "pass one length per rank, in group-rank order"
        )
    if any(s < 0 for s in out):
        raise ValueError(f"{what} must be non-negative lengths, got {list(out)}")
    return out


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """Every rank's local length along the sharded dimension (``sizes``, rank order) and its ``group``.

    Build it with :meth:`balanced` (anemoi's split: sizes differ by at most one, the first
    ``length % world`` ranks hold one more) or from explicit sizes; :meth:`unsharded` for one
    process. The sizes are checked against the group at construction.
    """

    sizes: tuple[int, ...]
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", check_shard_sizes(self.sizes, self.group, "SequenceShard.sizes"))

    @classmethod
    def balanced(cls, length: int, group: ProcessGroup | None = None) -> SequenceShard:
        """A dimension of ``length`` split over ``group`` as evenly as possible."""
        return cls(tuple(balanced_sizes(length, group_size(group))), group)

    @classmethod
    def unsharded(cls, length: int) -> SequenceShard:
        """The whole dimension on one process."""
        return cls((int(length),), None)

    @property
    def world(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def is_sharded(self) -> bool:
        """True when the dimension is split over more than one rank."""
        return self.world > 1

    @property
    def length(self) -> int:
        """The full length (sum over ranks)."""
        return sum(self.sizes)

    @property
    def local_size(self) -> int:
        """This rank's length."""
        return self.sizes[self.rank]

    @property
    def offset(self) -> int:
        """Global index of this rank's first element."""
        return balanced_offsets(self.sizes)[self.rank]

    @property
    def local_slice(self) -> slice:
        """This rank's part of the full dimension."""
        return slice(self.offset, self.offset + self.local_size)

    def check_local(self, x: Tensor, dim: int, what: str = "x") -> None:
        """Raise unless ``x.shape[dim]`` is this rank's length."""
        if x.shape[dim] != self.local_size:
            raise ValueError(
                f"{what} has {x.shape[dim]} rows along dim {dim} (shape {tuple(x.shape)}) but its "
                f"SequenceShard gives this rank (rank {self.rank} of {self.world}) {self.local_size} of "
                f"sizes {list(self.sizes)}: build the layer with the shard of the tensor it receives"
            )

    def __repr__(self) -> str:
        return f"SequenceShard(sizes={list(self.sizes)}, world={self.world})"
