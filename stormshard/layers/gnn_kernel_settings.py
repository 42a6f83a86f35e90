"""How the fused GNN kernels run: their options and the pool their large buffers come from.

Both are bound to the GNN blocks (and :class:`~stormshard.layers.gnn.GNNMLP`) at construction,
never read from globals: :class:`EdgeKernelOptions` (the fused paths on or off, the edge-block
size, buffer recycling) and :class:`EdgeBufferPool` (recycled buffers, shareable by every block
of a model). The kernels themselves are in :mod:`stormshard.layers.gnn_kernels`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["EdgeKernelOptions", "EdgeBufferPool", "check_kernel_args"]


@dataclass(frozen=True)
class EdgeKernelOptions:
    """How the GNN blocks and :class:`~stormshard.layers.gnn.GNNMLP` run their per-edge (per-row)
    work on CPU; bound at construction (``kernel_options=``), never read from globals. The defaults are the measured
    best; the results do not depend on them (up to rounding order).

    - ``fused``: run the fused, row-blocked paths (:mod:`stormshard.layers.gnn_kernels`) on
      CPU in float32 / float64 without autocast; False runs plain autograd (the other devices'
      and dtypes' path, and the tests' reference).
    - ``block_bytes``: bytes of one ``(rows, channels)`` block tensor of the fused paths (a few
      live at once: sized for the core's L2 cache; 1 MiB measured best for C 256 on AMD EPYC).
      A block has at least 16 rows (``block_bytes=1``: blocks of 16 rows).
    - ``recycle``: take the fused paths' large buffers (kept pre-activations, outputs, gradients)
      from the block's :class:`EdgeBufferPool` instead of allocating fresh memory (a fresh
      multi-MB allocation is a fresh mapping whose first touch page-faults: 10-15% of a CPU
      training step).
    - ``recycle_min_bytes``: only buffers of at least this many bytes are recycled (0: all).
    - ``recycle_max_age``: when the pool allocates, it drops the free buffers not handed out in
      the last ``recycle_max_age`` requests (sizes no longer used).
    """

    fused: bool = True
    block_bytes: int = 1 << 20
    recycle: bool = True
    recycle_min_bytes: int = 1 << 22
    recycle_max_age: int = 10_000

    def __post_init__(self) -> None:
        for name in ("fused", "recycle"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"EdgeKernelOptions.{name} must be True or False, got {value!r} "
                                f"({type(value).__name__}): pass a bool")
        for name, low, fix in (
            ("block_bytes", 1, "bytes of one edge-block tensor: the default 1 << 20 (1 MiB) suits a 1-2 MiB L2 "
                               "cache; 1 gives the smallest blocks (16 rows)"),
            ("recycle_min_bytes", 0, "the smallest buffer size recycled, in bytes: 0 recycles every buffer, "
                                     "the default is 1 << 22 (4 MiB)"),
            ("recycle_max_age", 0, "the number of pool requests after which an unused free buffer is dropped: "
                                   "0 keeps only the size just requested, the default is 10000"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"EdgeKernelOptions.{name} must be an int, got {value!r} ({type(value).__name__}): "
                                f"pass an int, {fix}")
            if value < low:
                kind = "positive" if low == 1 else "non-negative"
                raise ValueError(f"EdgeKernelOptions.{name} must be {kind} (>= {low}), got {value}: {fix}")


def check_kernel_args(
    kernel_options: EdgeKernelOptions | None, buffer_pool: EdgeBufferPool | None
) -> tuple[EdgeKernelOptions, EdgeBufferPool]:
    """``(options, pool)``: the defaults (a new pool) for None; TypeError for other types."""
    if kernel_options is None:
        kernel_options = EdgeKernelOptions()
    elif not isinstance(kernel_options, EdgeKernelOptions):
        raise TypeError(f"kernel_options must be an EdgeKernelOptions (or None for the defaults), got "
                        f"{type(kernel_options).__name__}: build one, e.g. EdgeKernelOptions(fused=False)")
    if buffer_pool is None:
        buffer_pool = EdgeBufferPool()
    elif not isinstance(buffer_pool, EdgeBufferPool):
        raise TypeError(f"buffer_pool must be an EdgeBufferPool (or None for a pool of the block's own), got "
                        f"{type(buffer_pool).__name__}: pass EdgeBufferPool() (one may be shared by many blocks)")
    return kernel_options, buffer_pool


def _storage_refs(t: Tensor) -> int:
    """References to ``t``'s storage (C++ use count, plus one for the query's own storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


try:
    _FREE_REFS = _storage_refs(torch.empty(1))  # a tensor referenced once (plus the query's own reference)
except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - private API gone: allocate fresh
    _FREE_REFS = None


class EdgeBufferPool:
    """The recycled large buffers of the fused GNN paths (see ``EdgeKernelOptions.recycle``).

    Each GNN block (and each :func:`~stormshard.layers.gnn.gnn_mlp`) gets a pool of its own unless
    one is passed (``buffer_pool=``); a model passes one pool to all its GNN blocks, so that a
    buffer freed by one layer serves the next (the backward's temporaries of every layer share
    buffers). The pool holds, per size, up to the peak number of simultaneously live buffers.

    A buffer is handed out only once nothing else references its storage, so values are never
    shared: the free test is the storage's use count, read with ``torch._C._storage_Use_Count``
    (a private function, the one torch itself uses for this in ``torch._inductor``; torch 2.13 has
    no public storage use count: ``Tensor._use_count`` counts references to a tensor object, not
    to its storage, so it misses the aliases handed out here). Where that function is missing the
    pool allocates fresh memory every time (:attr:`available` is False). Not thread-safe: one
    pool per thread of execution. Copies (``copy.deepcopy``, pickling) get an empty pool.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype], list[list]] = {}  # size -> [[buffer, last request], ...]
        self._requests = 0

    #: whether buffers can be recycled with this torch (see the class docstring)
    available = _FREE_REFS is not None

    def __deepcopy__(self, memo: dict) -> EdgeBufferPool:
        return EdgeBufferPool()

    def __reduce__(self):  # noqa: ANN204 - pickled as an empty pool: buffers are process-local scratch
        return (EdgeBufferPool, ())

    def __len__(self) -> int:
        """The number of cached buffers (free or in use)."""
        return sum(len(entries) for entries in self._buffers.values())

    def __repr__(self) -> str:
        return f"EdgeBufferPool({len(self)} buffers, {self.nbytes} bytes, {self.num_free()} free)"

    @property
    def nbytes(self) -> int:
        """Bytes of the cached buffers (free or in use)."""
        return sum(n * d.itemsize * len(e) for (n, d), e in self._buffers.items())

    def sizes(self) -> set[tuple[int, torch.dtype]]:
        """The ``(numel, dtype)`` of the cached buffers."""
        return set(self._buffers)

    def num_free(self) -> int:
        """The number of cached buffers not in use."""
        return sum(_storage_refs(b[0]) == _FREE_REFS for entries in self._buffers.values() for b in entries)

    def release(self) -> None:
        """Free the cached buffers not in use (those in use stay cached)."""
        self._drop_free()

    def _drop_free(self, max_age: int = -1) -> None:
        """Forget the cached buffers not in use (and, with ``max_age >= 0``, not handed out in the
        last ``max_age`` requests)."""
        now = self._requests
        for key, entries in list(self._buffers.items()):
            kept = [b for b in entries if _storage_refs(b[0]) != _FREE_REFS or (max_age >= 0 and now - b[1] <= max_age)]
            if kept:
                self._buffers[key] = kept
            else:
                del self._buffers[key]

    def empty(self, shape: tuple[int, ...], like: Tensor, options: EdgeKernelOptions, zero: bool = False) -> Tensor:
        """``like.new_empty(shape)`` (``new_zeros`` if ``zero``), a recycled buffer when ``options``
        recycle and it is large (``recycle_min_bytes``) and on CPU."""
        numel = 1
        for n in shape:
            numel *= n
        if (not options.recycle or _FREE_REFS is None or numel * like.element_size() < options.recycle_min_bytes
                or like.device.type != "cpu"):
            return like.new_zeros(shape) if zero else like.new_empty(shape)
        self._requests += 1
        key = (numel, like.dtype)
        entry = next((b for b in self._buffers.get(key, ()) if _storage_refs(b[0]) == _FREE_REFS), None)
        if entry is None:
            self._drop_free(options.recycle_max_age)  # sizes no longer requested
            entry = [like.new_empty(numel), 0]
            self._buffers.setdefault(key, []).append(entry)
        entry[1] = self._requests
        # an alias of the buffer's storage, not a view: the outputs of an autograd Function must not be views
        out = like.new_empty(0).set_(entry[0].untyped_storage(), 0, shape)
        return out.zero_() if zero else out
