"""Sharded reading: the ranks of a reader group each read a slice of the grid and share it.

With a reader group of ``r`` ranks (``read_group_size``, consecutive ranks of one model group,
built by :mod:`stormshard.parallel.topology`), every rank of the group works on the same sample
index (the sampler is sharded over data-parallel ranks only). Reader rank ``i`` reads from the
store only its balanced slice of the cells (``balanced_sizes(cells, r)``: the first
``cells % r`` ranks hold one more), e.g. 1600 cells over 3 readers as 534/533/533; then the
group all-gathers the slices along the cell dim.

What each rank ends up with: the **full sample**, all times, members, cells and variables,
bit-identical on every rank of the reader group and equal to reading the sample whole; it read
only ``1/r`` of the cells from storage and sent its slice (padded to the largest) to the ``r - 1``
others (``all_gather`` in :class:`~stormshard.parallel.counter.CommCounter`). The model then
takes its own grid shard from that, as anemoi does after its ``allgather_batch``.

Split in two so it fits a DataLoader: :class:`CellShardDataset` reads the slice (no
communication, safe in worker processes), :func:`gather_cells` runs the all-gather in the
training process on the (batched) slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset

from stormshard.data.dataset import WindowedSampleDataset
from stormshard.parallel.comm import all_gather_along
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes, group_rank, group_size

__all__ = ["CellShard", "cell_shard", "CellShardDataset", "gather_cells", "read_sample_sharded"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class CellShard:
    """Reader ``rank`` of ``size`` reads cells ``[start, stop)``; ``sizes`` lists every reader's count."""

    rank: int
    size: int
    sizes: tuple[int, ...]
    start: int
    stop: int

    @property
    def cells(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def num_cells(self) -> int:
        return sum(self.sizes)


def cell_shard(num_cells: int, reader_rank: int, reader_size: int) -> CellShard:
    """The balanced slice of ``num_cells`` that reader ``reader_rank`` of ``reader_size`` reads."""
    if reader_size < 1 or not 0 <= reader_rank < reader_size:
        raise ValueError(f"reader_rank {reader_rank} must be in [0, reader_size={reader_size})")
    if num_cells < reader_size:
        raise ValueError(f"{num_cells} cells cannot be shared by {reader_size} readers: every reader needs at "
                         f"least one; use a read_group_size of at most {num_cells}")
    sizes = balanced_sizes(num_cells, reader_size)
    start = balanced_offsets(sizes)[reader_rank]
    return CellShard(reader_rank, reader_size, tuple(sizes), start, start + sizes[reader_rank])


def _shard_for_group(num_cells: int, group: ProcessGroup | None) -> CellShard:
    return cell_shard(num_cells, group_rank(group), group_size(group))


class CellShardDataset(Dataset):
    """This reader's cell slice of each sample of ``samples``: reads only those cells, communicates nothing.

    Items are ``(time, ensemble, shard_cells, variables)`` (or ``(time, shard_cells, variables)``
    with ``ensemble="each"``). Holds plain ints, so it pickles into DataLoader workers.
    """

    def __init__(self, samples: WindowedSampleDataset, shard: CellShard) -> None:
        if shard.num_cells != samples.dataset.num_cells:
            raise ValueError(f"the shard splits {shard.num_cells} cells but the dataset has "
                             f"{samples.dataset.num_cells}")
        self.samples, self.shard = samples, shard

    @classmethod
    def for_group(cls, samples: WindowedSampleDataset, group: ProcessGroup | None) -> CellShardDataset:
        """The shard of this rank in the reader group ``group`` (None: one reader, the whole grid)."""
        return cls(samples, _shard_for_group(samples.dataset.num_cells, group))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tensor:
        return self.samples.read(index, cells=self.shard.cells)


def gather_cells(x: Tensor, shard: CellShard, group: ProcessGroup | None, dim: int = -2) -> Tensor:
    """All-gather the reader slices ``x`` along the cell dim ``dim`` (default -2: ``(..., cells, variables)``).

    Every rank of ``group`` passes its own slice; every rank gets the full tensor. ``x`` must be
    on the device the group's backend uses (move a DataLoader batch to the GPU first for NCCL).
    Communicates: one all-gather of this rank's slice (padded to the largest) over the reader group.
    """
    if group_size(group) != shard.size or group_rank(group) != shard.rank:
        raise ValueError(f"the shard is reader {shard.rank} of {shard.size} but this rank is "
                         f"{group_rank(group)} of a group of {group_size(group)}: build the shard for this group")
    if x.shape[dim] != shard.sizes[shard.rank]:
        raise ValueError(f"x has {x.shape[dim]} cells along dim {dim} but this reader's slice has "
                         f"{shard.sizes[shard.rank]}")
    return all_gather_along(x.contiguous(), dim, shard.sizes, group)


def read_sample_sharded(samples: WindowedSampleDataset, index: int, group: ProcessGroup | None,
                        device: torch.device | str | None = None) -> Tensor:
    """Sample ``index`` read cooperatively by the reader group: each rank reads its slice, all get the whole.

    Every rank of ``group`` must call this with the same ``index``. The slice is moved to
    ``device`` (e.g. this rank's GPU for NCCL) before the all-gather; the result lives there.
    """
    shard = _shard_for_group(samples.dataset.num_cells, group)
    part = samples.read(index, cells=shard.cells)
    if device is not None:
        part = part.to(device)
    return gather_cells(part, shard, group, dim=-2)
