"""Autograd-aware collectives over a model-communication group, with anemoi's names and semantics.

Layout: any tensor; ``dim`` is the sharded dimension and ``shapes`` lists every rank's shard
shape in group-rank order (uneven shards allowed: e.g. 1001 rows over 3 ranks as 334/334/333).
A group of None or of size 1 makes every function a no-op.

Forward / backward pairs (each backward is the adjoint of its forward):

================================  =============================  ==============================
function                          forward                        backward
================================  =============================  ==============================
``shard_tensor``                  keep this rank's slice         all-gather (or zero-pad)
``gather_tensor``                 all-gather                     keep this rank's slice
``reduce_tensor``                 all-reduce (sum)               identity
``copy_tensor``                   identity                       all-reduce (sum)
``sync_tensor``                   all-gather                     reduce-scatter (sum, then slice)
``reduce_shard_tensor``           reduce-scatter                 all-gather
================================  =============================  ==============================

Uneven gathers and reduce-scatters pad every shard to the largest one and use the fixed-size
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (gloo and NCCL both take them; the
list-form collectives reject uneven sizes on gloo). Every call reports to
:class:`stormshard.parallel.counter.CommCounter`.

Written as our own autograd Functions: ``torch.distributed.nn.functional`` gives wrong gradients
on subgroups that lack global rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    "split_along",
    "all_gather_along",
    "all_reduce_sum",
    "reduce_scatter_along",
]

ProcessGroup = dist.ProcessGroup


# --------------------------------------------------------------------------------------------
# kernels (no autograd)
# --------------------------------------------------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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


def all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum of ``x`` over the group (a new tensor). Communicates: a ring all-reduce of ``x``."""
    world = group_size(group)
    if world == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    record_communication("all_reduce", _nbytes(out) * 2 * (world - 1) // world)
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
