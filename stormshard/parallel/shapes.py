"""Shard shapes: balanced partitions of a dimension over a process group (anemoi's conventions).

A dimension of length ``n`` split over ``k`` ranks gives sizes that differ by at most one, the
first ``n % k`` ranks holding one more (``torch.tensor_split``'s rule). ``shapes`` arguments are
lists with one full tensor shape per rank, in group-rank order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

__all__ = [
    "balanced_sizes",
    "balanced_offsets",
    "get_shape_shards",
    "change_channels_in_shape",
    "sizes_along",
    "group_size",
    "group_rank",
]

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; 1 when it is None or torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's position in ``group``; 0 when it is None or torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def balanced_sizes(length: int, parts: int) -> list[int]:
    """Split ``length`` into ``parts`` sizes differing by at most one, larger ones first."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    if length < 0:
        raise ValueError(f"length must be non-negative, got {length}")
    base, extra = divmod(length, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def balanced_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each part given the part sizes."""
    offsets, acc = [], 0
    for s in sizes:
        offsets.append(acc)
        acc += int(s)
    return offsets


def get_shape_shards(tensor: Tensor, dim: int, model_comm_group: ProcessGroup | None = None) -> list[list[int]]:
    """Shapes of ``tensor``'s balanced shards along ``dim``, one per rank of ``model_comm_group``.

    Returns an empty list when the group is None (anemoi's convention: nothing to shard).
    """
    ndim = tensor.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    if model_comm_group is None:
        return []
    dim = dim % ndim
    parts = group_size(model_comm_group)
    if tensor.shape[dim] < parts:
        raise ValueError(
            f"cannot shard dimension {dim} of length {tensor.shape[dim]} over {parts} ranks: "
            f"every rank needs at least one element; use a group of at most {tensor.shape[dim]} ranks"
        )
    shapes = []
    for size in balanced_sizes(tensor.shape[dim], parts):
        shape = list(tensor.shape)
        shape[dim] = size
        shapes.append(shape)
    return shapes


def change_channels_in_shape(shape_list: list[list[int]], channels: int) -> list[list[int]]:
    """Copy of ``shape_list`` with the last (channel) dimension of every shape set to ``channels``."""
    return [list(shape[:-1]) + [channels] for shape in shape_list] if shape_list else []


def sizes_along(shapes: Sequence[Sequence[int]] | Sequence[int], dim: int) -> list[int]:
    """Per-rank sizes along ``dim`` from a list of shard shapes (or a list of sizes, passed through)."""
    if len(shapes) == 0:
        raise ValueError("shapes is empty: pass one shard shape (or size) per rank of the group")
    first = shapes[0]
    if isinstance(first, int):
        return [int(s) for s in shapes]  # type: ignore[arg-type]
    return [int(shape[dim]) for shape in shapes]  # type: ignore[index]
