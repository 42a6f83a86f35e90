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

**Training reads** (:class:`SliceReadPlan`, :class:`ModelSliceReader`, ``parallel.read_group_size``):
the sharded model needs only its own grid slice, never the whole sample, so the training read
hands each rank its slice instead of all-gathering. With ``r`` readers in a model group of ``k``
ranks (``r`` divides ``k``; default ``r = k``), reader ``j`` is model rank ``j * k / r``: it
reads from the store the contiguous cells of the ``k / r`` consecutive ranks it serves (about
``1/r`` of the grid: exactly their model slices), keeps its own slice and sends the others theirs
(point-to-point over the model group). Only the ``r`` readers open the store, which helps file
systems that suffer from many readers; at ``r = k`` every rank reads exactly its own slice and
nothing is communicated. Every rank ends up with the same tensor as a direct read of its slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset

from stormshard.data.dataset import WindowedSampleDataset
from stormshard.parallel.comm import all_gather_along
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes, group_rank, group_size

__all__ = ["CellShard", "cell_shard", "CellShardDataset", "gather_cells", "read_sample_sharded", "SliceReadPlan",
           "ModelSliceReader", "read_slice_block"]

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


@dataclass(frozen=True)
class SliceReadPlan:
    """Who reads what in one model group when ``readers`` of its ranks touch the store.

    ``sizes``: every model rank's number of grid cells (rank order; the slices are contiguous and
    in rank order, as :class:`~stormshard.models.sharding.ModelShardPlan` lays them out);
    ``readers``: readers per model group (``parallel.read_group_size``), dividing ``len(sizes)``;
    ``rank``: this rank's position in the model group.
    """

    sizes: tuple[int, ...]
    readers: int
    rank: int

    def __post_init__(self) -> None:
        world = len(self.sizes)
        if isinstance(self.readers, bool) or not isinstance(self.readers, int) or self.readers < 1 \
                or world % self.readers:
            raise ValueError(f"read_group_size={self.readers} must be a positive divisor of gpus_per_model={world}: "
                             f"choose one of {[d for d in range(1, world + 1) if world % d == 0]}")
        if not 0 <= self.rank < world:
            raise ValueError(f"rank {self.rank} is outside a model group of {world} ranks")

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def served(self) -> int:
        """Ranks each reader serves (itself included): ``gpus_per_model / read_group_size``."""
        return self.world // self.readers

    @property
    def reader(self) -> int:
        """Model rank of the reader that serves this rank."""
        return self.rank - self.rank % self.served

    @property
    def is_reader(self) -> bool:
        return self.rank == self.reader

    @property
    def clients(self) -> range:
        """Model ranks served by this rank's reader, in order (the reader first)."""
        return range(self.reader, self.reader + self.served)

    def cells(self, rank: int) -> slice:
        """Grid cells of model rank ``rank``'s slice."""
        start = sum(self.sizes[:rank])
        return slice(start, start + self.sizes[rank])

    @property
    def read_cells(self) -> slice:
        """The cells this rank's reader takes from the store: the slices of all its clients."""
        first, last = self.cells(self.clients[0]), self.cells(self.clients[-1])
        return slice(first.start, last.stop)


def read_slice_block(samples: WindowedSampleDataset, indices: Sequence[int], cells: slice,
                     times: int | None = None) -> Tensor:
    """The store read of a reader: ``(batch, *sample dims with cells = cells)`` of samples ``indices``
    (their first ``times`` dates; None = the whole window). Communicates nothing, touches no
    process group: safe in DataLoader worker processes and threads."""
    return torch.stack([samples.read(i, cells=cells, times=times) for i in indices])


class ModelSliceReader:
    """Reads batches of samples for one rank of a model group: its own grid slice, read by ``plan.readers``
    readers per model group (see the module docstring).

    :meth:`read` returns ``(batch, *sample dims with cells = this rank's slice)``, e.g. ``(batch, time,
    cells_local, variables)`` for ``ensemble="each"`` samples, on ``device``; every rank of the model
    group must call it with the same indices. ``store_reads`` counts this rank's reads from the store.
    Communicates (``served > 1``): the reader sends each client its slice, one point-to-point
    message per client over ``group`` (the model group).

    Split in two for prefetching (:mod:`stormshard.data.loader`): the readers' store reads
    (:func:`read_slice_block` of ``plan.read_cells``, plus any elementwise transform such as
    normalisation) run in worker processes or threads; :meth:`distribute` then runs in the
    training process and does the communication.
    """

    def __init__(self, plan: SliceReadPlan, group: ProcessGroup | None, device: torch.device | str = "cpu") -> None:
        if group_size(group) != plan.world or group_rank(group) != plan.rank:
            raise ValueError(f"the read plan is for rank {plan.rank} of {plan.world} but this rank is "
                             f"{group_rank(group)} of a model group of {group_size(group)}: build it for this group")
        self.plan, self.group, self.device = plan, group, torch.device(device)
        self.store_reads = 0

    def _global(self, model_rank: int) -> int:
        return dist.get_global_rank(self.group, model_rank)

    def read(self, samples: WindowedSampleDataset, indices: Sequence[int], times: int | None = None) -> Tensor:
        """Read (readers) and hand out (all): this rank's slice of samples ``indices``."""
        block = None
        if self.plan.is_reader:
            self.store_reads += len(indices)
            block = read_slice_block(samples, indices, self.plan.read_cells, times)
        shape = (len(indices), len(samples.offsets) if times is None else times, *samples.sample_shape[1:])
        return self.distribute(block, shape, samples.dtype)

    def distribute(self, block: Tensor | None, shape: Sequence[int], dtype: torch.dtype,
                   non_blocking: bool = False) -> Tensor:
        """This rank's slice from the reader's ``block`` (the ``plan.read_cells`` of a batch, on the
        readers; None elsewhere). ``shape``: the full-grid batch shape ``(batch, *sample dims)`` with
        the cells at dim -2; ``dtype``: the block's dtype (what non-readers receive). The block is
        moved to ``device`` first (``non_blocking`` for pinned CPU memory). Every rank of the model
        group calls it together, in the same order."""
        plan = self.plan
        if plan.is_reader:
            if block is None:
                raise ValueError("this rank is a reader: pass the block it read (read_slice_block of plan.read_cells)")
            block = block.to(self.device, non_blocking=non_blocking)
            if plan.served == 1:
                return block
            offset = plan.read_cells.start
            parts = {c: block[..., plan.cells(c).start - offset:plan.cells(c).stop - offset, :].contiguous()
                     for c in plan.clients}
            sends = [dist.isend(parts[c], self._global(c), group=self.group) for c in plan.clients[1:]]
            for work in sends:
                work.wait()
            return parts[plan.rank]
        out = torch.empty((*shape[:-2], plan.sizes[plan.rank], shape[-1]), dtype=dtype, device=self.device)
        dist.recv(out, self._global(plan.reader), group=self.group)
        return out
