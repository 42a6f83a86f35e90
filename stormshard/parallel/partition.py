"""Partition metadata carried by parallel parameters, read by checkpoint conversion.

A parameter that holds one slice of a full tensor carries a :class:`Partition`: the full tensor is
the concatenation, along ``dim``, of the ``parts`` slices held by the ranks of its group, and this
rank holds slice ``index``. Slices are balanced (sizes differ by at most one, larger first).
Parameters without a partition are replicated over the model group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from stormshard.parallel.shapes import balanced_sizes

__all__ = ["Partition", "set_partition", "get_partition", "full_shape"]

_ATTR = "_stormshard_partition"


@dataclass(frozen=True)
class Partition:
    """This parameter is slice ``index`` of ``parts`` along dimension ``dim`` of a tensor of ``full_size`` there."""

    dim: int
    parts: int
    index: int
    full_size: int

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise ValueError(f"invalid partition: index {self.index} of {self.parts} parts")

    @property
    def sizes(self) -> list[int]:
        return balanced_sizes(self.full_size, self.parts)

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.index])

    def as_dict(self) -> dict[str, int]:
        return {"dim": self.dim, "parts": self.parts, "index": self.index, "full_size": self.full_size}


def set_partition(param: Tensor, partition: Partition) -> Tensor:
    """Attach ``partition`` to ``param`` (returned for chaining)."""
    setattr(param, _ATTR, partition)
    return param


def get_partition(param: Tensor) -> Partition | None:
    """The partition ``param`` carries, or None when it is replicated."""
    return getattr(param, _ATTR, None)


def full_shape(param: Tensor) -> tuple[int, ...]:
    """Shape of the full tensor ``param`` is a slice of (its own shape when replicated)."""
    part = get_partition(param)
    shape = list(param.shape)
    if part is not None:
        shape[part.dim] = part.full_size
    return tuple(shape)
