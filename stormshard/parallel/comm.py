"""The collectives of :mod:`stormshard.parallel`, in one vocabulary and one place.

Three layers, as Megatron's ``tensor_parallel/mappings.py`` and anemoi's
``distributed/primitives.py`` are laid out:

1. raw collectives (no autograd), each written once and each reporting the bytes it sends to
   :class:`~stormshard.parallel.counter.CommCounter`: :func:`all_gather_along`,
   :func:`all_reduce_sum`, :func:`all_reduce_`, :func:`reduce_scatter_along` and the one row
   exchange, :func:`all_to_all_rows` (or :func:`start_all_to_all_rows`, asynchronous), described
   by a :class:`RowExchangePlan`; plus :func:`split_along` (this rank's slice, no communication);
2. autograd Functions over them (each backward the adjoint of its forward);
3. the public functions: anemoi's names and signatures, and :func:`exchange_rows`.

Layout: any tensor; ``dim`` is the sharded dimension and ``shapes`` lists every rank's shard
shape (or just its length along ``dim``) in group-rank order; uneven shards are allowed (1001
rows over 3 ranks: 334/334/333). A group of None or of size 1 makes every function a no-op.

=======================  ==================  ========================  ==========================================
function                 forward             backward                  Megatron's region mapping
=======================  ==================  ========================  ==========================================
``shard_tensor``         keep own slice      all-gather (or zero-pad)  ``scatter_to_tensor_parallel_region``
``gather_tensor``        all-gather          keep own slice            ``gather_from_tensor_parallel_region``
``reduce_tensor``        all-reduce (sum)    identity                  ``reduce_from_tensor_parallel_region``
``copy_tensor``          identity            all-reduce (sum)          ``copy_to_tensor_parallel_region``
``sync_tensor``          all-gather          reduce-scatter (sum)      ``gather_from_sequence_parallel_region``
``reduce_shard_tensor``  reduce-scatter      all-gather                ``reduce_scatter_to_sequence_parallel_region``
``exchange_rows``        all-to-all of rows  the rows' gradients back  (anemoi's halo exchange)
=======================  ==================  ========================  ==========================================

The tensor-parallel linears (:mod:`stormshard.parallel.tensor`) call these functions under
their anemoi names; the table gives Megatron's name of each.

Transport: uneven gathers and reduce-scatters pad every shard to the largest one and use the
fixed-size ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the row exchange is one
``all_to_all_single`` with per-rank split sizes (or batched ``isend``/``irecv``). gloo and NCCL
both take these forms; gloo's list-form collectives reject uneven sizes.

Bytes counted (this rank's sends, bandwidth-optimal algorithms; kinds as
:mod:`stormshard.parallel.counter` lists them): all-gather, the padded shard to each other rank;
all-reduce, ``2 (w - 1) / w`` of the tensor (:func:`ring_all_reduce_bytes`); reduce-scatter,
``(w - 1) / w`` of the padded tensor; row exchange, the rows addressed to other ranks
(:func:`rows_sent_bytes`; kind ``"send"`` for the point-to-point transport).

Written as our own autograd Functions: ``torch.distributed.nn.functional`` gives wrong gradients
on subgroups that lack global rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.parallel.counter import record_communication
from stormshard.parallel.shapes import group_rank, group_size, sizes_along
from stormshard.parallel.shard import check_shard_sizes

# torch >= 2.13 renames the fixed-size collectives; older releases only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "shard_tensor",
    "gather_tensor",
    "reduce_tensor",
    "copy_tensor",
    "sync_tensor",
    "reduce_shard_tensor",
    "exchange_rows",
    "split_along",
    "all_gather_along",
    "all_reduce_sum",
    "all_reduce_",
    "reduce_scatter_along",
    "all_to_all_rows",
    "start_all_to_all_rows",
    "PendingRows",
    "RowTransport",
    "RowExchangePlan",
    "ring_all_reduce_bytes",
    "rows_sent_bytes",
]

ProcessGroup = dist.ProcessGroup
#: How :func:`all_to_all_rows` moves rows: one ``all_to_all_single`` or batched ``isend``/``irecv``.
RowTransport = Literal["all_to_all", "p2p"]


# --------------------------------------------------------------------------------------------
# byte accounting
# --------------------------------------------------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def ring_all_reduce_bytes(numel: int, element_size: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements: ``2 (w - 1) / w`` of them."""
    return numel * element_size * 2 * (world - 1) // world


def rows_sent_bytes(rows: Tensor, send_counts: Sequence[int], rank: int) -> int:
    """Bytes of the rows of ``rows`` (``send_counts[r]`` to rank ``r``) that leave ``rank``."""
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    return (sum(send_counts) - send_counts[rank]) * row_bytes


# --------------------------------------------------------------------------------------------
# raw collectives (no autograd)
# --------------------------------------------------------------------------------------------


def split_along(x: Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """This rank's slice of the full tensor ``x`` along ``dim``; no communication."""
    sizes = list(check_shard_sizes(sizes, group, "shapes"))
    if x.shape[dim] != sum(sizes):
        raise ValueError(
            f"cannot split dimension {dim} of length {x.shape[dim]} into shards {sizes} "
            f"(they sum to {sum(sizes)}): the shapes do not describe this tensor"
        )
    rank = group_rank(group)
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).contiguous()


def all_gather_along(x: Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (shard sizes ``sizes``, possibly uneven).

    Communicates: each rank's shard (padded to the largest) to every other rank.
    """
    sizes = list(check_shard_sizes(sizes, group, "shapes"))
    world, rank = len(sizes), group_rank(group)
    if world == 1:
        return x
    if x.shape[dim] != sizes[rank]:
        raise ValueError(
            f"rank {rank} holds {x.shape[dim]} elements along dimension {dim} but shapes say {sizes[rank]}"
        )
    moved = x.movedim(dim, 0)
    largest = max(sizes)
    if moved.shape[0] < largest:
        padded = moved.new_zeros((largest,) + tuple(moved.shape[1:]))
        padded[: moved.shape[0]] = moved
    else:
        padded = moved.contiguous()
    out = padded.new_empty((world * largest,) + tuple(moved.shape[1:]))
    _all_gather_single(out, padded, group=group)
    record_communication("all_gather", _nbytes(padded) * (world - 1))
    if all(s == largest for s in sizes):
        full = out
    else:
        full = torch.cat([out[r * largest : r * largest + s] for r, s in enumerate(sizes)], dim=0)
    return full.movedim(0, dim).contiguous()


def all_reduce_(flat: Tensor, group: ProcessGroup | None, async_op: bool = False) -> dist.Work | None:
    """Sum ``flat`` over the group in place; the work handle when ``async_op``, else None.

    Communicates: a ring all-reduce of ``flat``; nothing for a group of None or size 1.
    """
    world = group_size(group)
    if world == 1:
        return None
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    record_communication("all_reduce", ring_all_reduce_bytes(flat.numel(), flat.element_size(), world))
    return work


def all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum of ``x`` over the group (a new tensor). Communicates: a ring all-reduce of ``x``."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    all_reduce_(out, group)
    return out


def reduce_scatter_along(x: Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``.

    Communicates: a reduce-scatter of ``x`` with every shard padded to the largest one.
    """
    sizes = list(check_shard_sizes(sizes, group, "shapes"))
    world, rank = len(sizes), group_rank(group)
    if world == 1:
        return x
    if x.shape[dim] != sum(sizes):
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of length {x.shape[dim]} into shards {sizes}"
        )
    moved = x.movedim(dim, 0)
    largest = max(sizes)
    rest = tuple(moved.shape[1:])
    if all(s == largest for s in sizes):
        send = moved.contiguous()
    else:
        send = moved.new_zeros((world * largest,) + rest)
        start = 0
        for r, s in enumerate(sizes):
            send[r * largest : r * largest + s] = moved[start : start + s]
            start += s
    out = send.new_empty((largest,) + rest)
    _reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
    record_communication("reduce_scatter", _nbytes(send) * (world - 1) // world)
    return out[: sizes[rank]].movedim(0, dim).contiguous()


# --------------------------------------------------------------------------------------------
# the row exchange (halos, head <-> sequence all-to-all)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RowExchangePlan:
    """One rank's part of a row exchange over its group: ``send_counts[r]`` rows go to group rank
    ``r`` and ``recv_counts[r]`` rows come from it (rank order; zero for this rank itself).

    The base of the two halo plans. :class:`~stormshard.parallel.sequence.HaloPlan` is the window
    halo of a sequence split in contiguous shards (rows sent are contiguous ranges, the halo splits
    into a left and a right part, derived from the shard sizes alone and bound to no group);
    :class:`~stormshard.parallel.graph.GraphShardPlan` is a destination-node partition of a graph
    (rows sent are an index list, with the edges renumbered onto own rows plus halo, and it holds
    its group). They describe different things; what they share, the exchange, is this class and
    :func:`all_to_all_rows`.
    """

    rank: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]

    @property
    def num_received(self) -> int:
        """Rows this rank receives (its halo)."""
        return sum(self.recv_counts)

    @property
    def hops(self) -> int:
        """How many ranks away the farthest received row comes from (1: direct neighbours only)."""
        far = [abs(r - self.rank) for r, c in enumerate(self.recv_counts) if c > 0]
        return max(far, default=0)

    def halo_bytes(self, row_bytes: int) -> int:
        """Bytes this rank sends in one forward exchange of rows of ``row_bytes`` bytes."""
        return (sum(self.send_counts) - self.send_counts[self.rank]) * row_bytes


class PendingRows:
    """A row exchange in flight (:func:`start_all_to_all_rows`); :meth:`wait` returns the rows received."""

    def __init__(self, received: Tensor, works: Sequence[dist.Work]) -> None:
        self._received, self._works = received, list(works)

    def wait(self) -> Tensor:
        """Block until the exchange has finished; the received rows ``(sum(recv_counts), ...)``."""
        for work in self._works:
            work.wait()
        self._works = []
        return self._received


def _check_counts(rows: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], world: int
                  ) -> tuple[list[int], list[int]]:
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != world or len(recv) != world:
        raise ValueError(f"a row exchange over {world} ranks needs {world} send and receive counts, got "
                         f"{len(send)} and {len(recv)}")
    if sum(send) != rows.shape[0]:
        raise ValueError(f"the send counts {send} sum to {sum(send)} rows but {rows.shape[0]} rows were given")
    return send, recv


def start_all_to_all_rows(
    rows: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: ProcessGroup | None,
    *,
    transport: RowTransport = "all_to_all",
    async_op: bool = True,
) -> PendingRows:
    """Start sending the rows of ``rows`` (dim 0, grouped by destination rank: ``send_counts[r]``
    rows to rank ``r``) and receiving ``recv_counts[r]`` rows from each rank ``r``.

    ``rows``: ``(sum(send_counts), ...)``, any trailing layout. Returns a :class:`PendingRows`
    whose ``wait()`` gives ``(sum(recv_counts), ...)``, the received rows in rank order; with
    ``async_op=False`` the exchange has finished on return. Communicates: one
    ``all_to_all_single`` with these split sizes (``transport="all_to_all"``; gloo-safe for
    uneven counts), or batched ``isend``/``irecv`` with the ranks that share rows (``"p2p"``).
    Counts the rows addressed to other ranks (kind ``"all_to_all"`` or ``"send"``). A group of
    None or size 1 returns ``rows`` itself.
    """
    world = group_size(group)
    send, recv = _check_counts(rows, send_counts, recv_counts, world)
    # under torch.compile the exchange is traced as a functional collective (dynamo has no async
    # work handles): issued synchronously, its wait placed by the compiler
    async_op = async_op and not torch.compiler.is_compiling()
    if world == 1:
        if send != recv:
            raise ValueError(f"one rank can only receive the rows it sends: send {send}, receive {recv}")
        return PendingRows(rows, [])
    rank = group_rank(group)
    rows = rows.contiguous()
    received = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    if transport == "all_to_all":
        work = dist.all_to_all_single(received, rows, output_split_sizes=recv, input_split_sizes=send, group=group,
                                      async_op=async_op)
        record_communication("all_to_all", rows_sent_bytes(rows, send, rank))
        return PendingRows(received, [work] if async_op else [])
    if transport != "p2p":
        raise ValueError(f"transport must be 'all_to_all' or 'p2p', got {transport!r}")
    ops, send_off, recv_off = [], 0, 0
    for r, (sc, rc) in enumerate(zip(send, recv, strict=True)):
        if r == rank:
            received[recv_off : recv_off + rc].copy_(rows[send_off : send_off + sc])
        else:
            peer = dist.get_global_rank(group, r)
            if rc:
                ops.append(dist.P2POp(dist.irecv, received[recv_off : recv_off + rc], peer, group))
            if sc:
                ops.append(dist.P2POp(dist.isend, rows[send_off : send_off + sc].contiguous(), peer, group))
        send_off, recv_off = send_off + sc, recv_off + rc
    works = dist.batch_isend_irecv(ops) if ops else []
    record_communication("send", rows_sent_bytes(rows, send, rank))
    pending = PendingRows(received, works)
    if not async_op:
        pending.wait()
    return pending


def all_to_all_rows(
    rows: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: ProcessGroup | None,
    *,
    transport: RowTransport = "all_to_all",
) -> Tensor:
    """:func:`start_all_to_all_rows`, finished: the received rows ``(sum(recv_counts), ...)`` in rank order."""
    return start_all_to_all_rows(rows, send_counts, recv_counts, group, transport=transport, async_op=False).wait()


# --------------------------------------------------------------------------------------------
# autograd Functions
# --------------------------------------------------------------------------------------------


class _ShardParallelSection(torch.autograd.Function):
    """Forward: keep this rank's slice. Backward: all-gather the slices (or zero-pad locally)."""

    @staticmethod
    def forward(ctx, input_: Tensor, dim: int, sizes: list[int], gather_in_backward: bool, group):  # noqa: ANN001
        ctx.dim, ctx.sizes, ctx.gather_in_backward, ctx.group = dim, sizes, gather_in_backward, group
        return split_along(input_, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        if ctx.gather_in_backward:
            full = all_gather_along(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group)
        else:
            rank = group_rank(ctx.group)
            shape = list(grad.shape)
            shape[ctx.dim] = sum(ctx.sizes)
            full = grad.new_zeros(shape)
            full.narrow(ctx.dim, sum(ctx.sizes[:rank]), ctx.sizes[rank]).copy_(grad)
        return full, None, None, None, None


class _GatherParallelSection(torch.autograd.Function):
    """Forward: all-gather. Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, input_: Tensor, dim: int, sizes: list[int], group):  # noqa: ANN001
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return all_gather_along(input_, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return split_along(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _ReduceParallelSection(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, input_: Tensor, group):  # noqa: ANN001
        return all_reduce_sum(input_, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return grad, None


class _CopyParallelSection(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, input_: Tensor, group):  # noqa: ANN001
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return all_reduce_sum(grad, ctx.group), None


class _SyncParallelSection(torch.autograd.Function):
    """Forward: all-gather. Backward: reduce-scatter (all-reduce, then keep this rank's slice)."""

    @staticmethod
    def forward(ctx, input_: Tensor, dim: int, sizes: list[int], group):  # noqa: ANN001
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return all_gather_along(input_, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return reduce_scatter_along(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group), None, None, None


class _ReduceShardParallelSection(torch.autograd.Function):
    """Forward: reduce-scatter (all-reduce, then keep this rank's slice). Backward: all-gather."""

    @staticmethod
    def forward(ctx, input_: Tensor, dim: int, sizes: list[int], group):  # noqa: ANN001
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return reduce_scatter_along(input_, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return all_gather_along(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group), None, None, None


class _ExchangeRows(torch.autograd.Function):
    """Forward: send rows to the ranks that read them. Backward: send their gradients back."""

    @staticmethod
    def forward(ctx, rows: Tensor, send_counts: list[int], recv_counts: list[int], group):  # noqa: ANN001
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return all_to_all_rows(rows, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return all_to_all_rows(grad, ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


# --------------------------------------------------------------------------------------------
# public API (anemoi's names and arguments)
# --------------------------------------------------------------------------------------------


def _sizes(shapes: Sequence, dim: int, input_: Tensor, mgroup: ProcessGroup | None) -> list[int]:
    return list(check_shard_sizes(sizes_along(shapes, dim % input_.dim()), mgroup, "shapes"))


def shard_tensor(
    input_: Tensor, dim: int, shapes: Sequence, mgroup: ProcessGroup | None, gather_in_backward: bool = True
) -> Tensor:
    """Keep this rank's part of the full ``input_`` along ``dim``.

    Backward all-gathers the gradient slices (``gather_in_backward=True``), or places this rank's
    gradient slice in a zero tensor without communication (``False``: for inputs whose other
    slices get their gradients elsewhere).
    """
    if group_size(mgroup) == 1:
        return input_
    return _ShardParallelSection.apply(input_, dim % input_.dim(), _sizes(shapes, dim, input_, mgroup),
                                       gather_in_backward, mgroup)


def gather_tensor(input_: Tensor, dim: int, shapes: Sequence, mgroup: ProcessGroup | None) -> Tensor:
    """All-gather the shards along ``dim``; backward keeps this rank's slice of the gradient.

    Use when the computation after the gather is the same on every rank.
    """
    if group_size(mgroup) == 1:
        return input_
    return _GatherParallelSection.apply(input_, dim % input_.dim(), _sizes(shapes, dim, input_, mgroup), mgroup)


def reduce_tensor(input_: Tensor, mgroup: ProcessGroup | None) -> Tensor:
    """Sum ``input_`` over the group; backward passes the gradient through unchanged."""
    if group_size(mgroup) == 1:
        return input_
    return _ReduceParallelSection.apply(input_, mgroup)


def copy_tensor(input_: Tensor, mgroup: ProcessGroup | None) -> Tensor:
    """Identity; backward sums the gradient over the group (Megatron's copy-to-region)."""
    if group_size(mgroup) == 1:
        return input_
    return _CopyParallelSection.apply(input_, mgroup)


def sync_tensor(input_: Tensor, dim: int, shapes: Sequence, mgroup: ProcessGroup | None) -> Tensor:
    """All-gather along ``dim``; backward all-reduces the gradient and keeps this rank's slice.

    Use when the computation after the gather differs between ranks.
    """
    if group_size(mgroup) == 1:
        return input_
    return _SyncParallelSection.apply(input_, dim % input_.dim(), _sizes(shapes, dim, input_, mgroup), mgroup)


def reduce_shard_tensor(input_: Tensor, dim: int, shapes: Sequence, mgroup: ProcessGroup | None) -> Tensor:
    """All-reduce, then keep this rank's slice along ``dim``; backward all-gathers the gradient."""
    if group_size(mgroup) == 1:
        return input_
    return _ReduceShardParallelSection.apply(input_, dim % input_.dim(), _sizes(shapes, dim, input_, mgroup),
                                             mgroup)


def exchange_rows(
    rows: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: ProcessGroup | None
) -> Tensor:
    """:func:`all_to_all_rows` with autograd: ``rows`` ``(sum(send_counts), ...)``, grouped by
    destination rank, go to their ranks; returns the rows received ``(sum(recv_counts), ...)``, in
    rank order. Backward: the gradients of the received rows go back to the ranks that sent them
    (counts swapped), one exchange each way.
    """
    if group_size(group) == 1:
        return rows
    return _ExchangeRows.apply(rows, [int(c) for c in send_counts], [int(c) for c in recv_counts], group)
