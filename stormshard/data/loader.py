"""The training input pipeline: micro-batches read (and normalised) ahead of the step that uses them.

Who does what, per rank of a model group:

1. **The plan** (training process): :func:`micro_batch_keys` turns the sampler's order into an
   endless stream of :class:`BatchKey` s, one per micro-batch, in the order the steps consume
   them: the sample indices, how many dates to read (``multistep_input`` + the rollout of the step
   the micro-batch belongs to, :mod:`stormshard.training.rollout_schedule`), and where the sampler
   stands once the micro-batch is used (epoch, position). The stream is a pure function of the
   sampler state it starts from, so a checkpoint stores the key of the last micro-batch *used* and
   a resumed run continues exactly there, however far the workers had read ahead.
2. **The store reads** (workers): a reader rank's :class:`SliceBatchReader` reads the cells of
   ``plan.read_cells`` (its own slice and those of the ranks it serves) with
   :func:`~stormshard.data.sharded_read.read_slice_block` and normalises them in float64 (the
   :class:`Normaliser`'s exact arithmetic), returning float32 (float64 for a float64 run). It
   communicates nothing, so it runs in DataLoader worker processes (``data.num_workers``, each
   holding ``data.prefetch`` micro-batches in flight), or in threads where processes cannot be
   started (inside a daemonic process, e.g. a test harness), or inline (``num_workers=0``).
   Worker processes come from a fork server (:func:`worker_context`), never from forking the
   threaded training process.
   On CUDA the batches arrive in pinned memory.
3. **The hand-out** (training process): :meth:`ModelSliceReader.distribute
   <stormshard.data.sharded_read.ModelSliceReader.distribute>` copies the block to the device
   (``non_blocking`` from pinned memory) and sends the other ranks their slices over the model
   group. Ranks that do not read (``read_group_size < gpus_per_model``) run no workers: they
   receive.

:class:`PrefetchLoader` yields ``(key, block)`` in key order (``block`` None on non-readers) and
counts the time the training process waited for data.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset
from stormshard.data.sharded_read import read_slice_block

__all__ = ["BatchKey", "micro_batch_keys", "finite_keys", "SliceBatchReader", "PrefetchLoader", "resolve_worker_type",
           "worker_context"]

WorkerType = Literal["auto", "processes", "threads"]


@dataclass(frozen=True)
class BatchKey:
    """One micro-batch: sample ``indices``, the first ``times`` dates of each window, the optimizer
    ``step`` and ``micro``-batch it is for, and the sampler position once it is used (``epoch``,
    ``position`` = samples of that epoch consumed by this rank)."""

    indices: tuple[int, ...]
    times: int
    step: int
    micro: int
    epoch: int
    position: int


def micro_batch_keys(sampler: ResumableSampler, micro_batch: int, accumulation: int, start_step: int,
                     times_at: Callable[[int], int]) -> Iterator[BatchKey]:
    """The endless stream of micro-batch keys from the sampler's current state (epoch and resume
    position, see :meth:`ResumableSampler.load_state_dict`). Epoch ``e`` yields this rank's
    ``sampler.indices(e)``; a micro-batch may straddle two epochs. ``times_at(step)``: dates to
    read for optimizer step ``step``. Reads no data and leaves ``sampler`` untouched."""
    epoch = sampler.epoch
    order = sampler.indices(epoch)
    position = len(order) - len(sampler.remaining())
    for k in itertools.count():
        indices = []
        while len(indices) < micro_batch:
            if position >= len(order):
                epoch, position = epoch + 1, 0
                order = sampler.indices(epoch)
            indices.append(order[position])
            position += 1
        step = start_step + k // accumulation
        yield BatchKey(tuple(indices), int(times_at(step)), step, k % accumulation, epoch, position)


class SliceBatchReader:
    """The worker side of a reader rank: reads ``cells`` of a key's samples and normalises them.

    ``offset`` / ``scale``: float64 ``(variables,)`` (the dataset normaliser's buffers, on the
    CPU); ``out_dtype``: the dtype handed to the training process. Returns ``(batch, time, [ensemble,]
    cells, variables)``. Holds only the samples (which pickle by path) and two small tensors.
    """

    def __init__(self, samples: WindowedSampleDataset, cells: slice, offset: Tensor, scale: Tensor,
                 out_dtype: torch.dtype = torch.float32) -> None:
        self.samples, self.cells, self.out_dtype = samples, cells, out_dtype
        self.offset = offset.detach().to("cpu", torch.float64).clone()
        self.scale = scale.detach().to("cpu", torch.float64).clone()

    def __call__(self, key: BatchKey) -> Tensor:
        block = read_slice_block(self.samples, key.indices, self.cells, key.times)
        return ((block.to(torch.float64) - self.offset) / self.scale).to(self.out_dtype)


class _KeyedDataset(Dataset):
    """A map-style view for DataLoader: item ``key`` is ``(key, read(key))``."""

    def __init__(self, read: SliceBatchReader) -> None:
        self.read = read

    def __getitem__(self, key: BatchKey) -> tuple[BatchKey, Tensor]:
        return key, self.read(key)


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)


def worker_context() -> mp.context.BaseContext:
    """Where worker processes come from: a fork server (started once per process, with torch and
    this module preloaded), not a fork of the training process. Forking a process that runs
    threads (zarr's I/O loop, the communication backend's, other loaders' threads) can leave a
    child waiting forever on a lock held at the fork; the fork server has no threads, and its
    children start in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "stormshard.data.loader"])
    return ctx


def resolve_worker_type(worker_type: WorkerType) -> Literal["processes", "threads"]:
    """``auto``: processes, unless this process is daemonic (it may not start children): threads."""
    if worker_type not in ("auto", "processes", "threads"):
        raise ValueError(f"data.worker_type={worker_type!r} must be 'auto', 'processes' or 'threads'")
    if worker_type != "auto":
        return worker_type
    return "threads" if mp.current_process().daemon else "processes"


class PrefetchLoader:
    """Yields ``(key, block)`` for every key of ``keys``, in order, reading ahead.

    ``read``: the worker function (None on ranks that do not read: ``block`` is None and nothing
    runs in the background). ``num_workers`` 0 reads inline; otherwise ``num_workers`` workers of
    ``worker_type`` keep ``num_workers * prefetch`` micro-batches in flight. ``pin_memory``: hand
    out pinned CPU tensors (CUDA). ``wait_time``: seconds the caller spent blocked in ``next``.
    Call :meth:`close` (or use it as a context manager) to stop the workers.
    """

    def __init__(self, keys: Iterable[BatchKey], read: SliceBatchReader | None, *, num_workers: int = 0,
                 prefetch: int = 2, worker_type: WorkerType = "auto", pin_memory: bool = False) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers!r} must be an integer >= 0 (0 = read in the training loop)")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"data.prefetch={prefetch!r} must be an integer >= 1 (micro-batches in flight per worker)")
        self.read, self.num_workers, self.prefetch, self.pin_memory = read, num_workers, prefetch, pin_memory
        self.kind = "inline" if read is None or num_workers == 0 else resolve_worker_type(worker_type)
        self.wait_time = 0.0
        self._keys = iter(keys)
        self._loader: Iterator | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: queue.SimpleQueue[tuple[BatchKey, Future]] = queue.SimpleQueue()
        self._in_flight = 0
        if self.kind == "processes":
            loader = DataLoader(_KeyedDataset(read), sampler=_Once(self._keys), batch_size=None,
                                num_workers=num_workers, prefetch_factor=prefetch, pin_memory=pin_memory,
                                worker_init_fn=_one_thread, collate_fn=_identity,
                                multiprocessing_context=worker_context())
            self._loader = iter(loader)
        elif self.kind == "threads":
            self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="stormshard-read")
            self._fill()

    # ---------------------------------------------------------------- threads
    def _task(self, key: BatchKey) -> Tensor:
        block = self.read(key)
        return block.pin_memory() if self.pin_memory else block

    def _fill(self) -> None:
        while self._in_flight < self.num_workers * self.prefetch:
            key = next(self._keys, None)
            if key is None:
                return
            self._pending.put((key, self._pool.submit(self._task, key)))
            self._in_flight += 1

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> PrefetchLoader:
        return self

    def __next__(self) -> tuple[BatchKey, Tensor | None]:
        tic = time.perf_counter()
        try:
            if self.kind == "processes":
                key, block = next(self._loader)
            elif self.kind == "threads":
                if self._in_flight == 0:
                    raise StopIteration
                key, future = self._pending.get()
                self._in_flight -= 1
                block = future.result()
                self._fill()
            else:
                key = next(self._keys)
                block = None if self.read is None else self.read(key)
            return key, block
        finally:
            self.wait_time += time.perf_counter() - tic

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # in-flight reads finish: the read count stays deterministic
            self._pool = None
        if self._loader is not None:
            shutdown = getattr(self._loader, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._loader = None

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Once:
    """An iterable over an iterator (a DataLoader sampler is iterated once here: the stream is endless)."""

    def __init__(self, items: Iterator) -> None:
        self.items = items

    def __iter__(self) -> Iterator:
        return self.items


def _identity(item):  # noqa: ANN001, ANN202
    return item


def finite_keys(indices: Sequence[int], micro_batch: int, times: int) -> list[BatchKey]:
    """Keys for a fixed list of samples (validation): ``micro_batch`` samples per key, step -1."""
    chunks = [tuple(indices[i:i + micro_batch]) for i in range(0, len(indices), micro_batch)]
    return [BatchKey(c, times, -1, j, 0, 0) for j, c in enumerate(chunks)]

