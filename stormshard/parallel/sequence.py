"""Sequence-parallel primitives: head/sequence all-to-all and the halo exchange.

Layouts: attention tensors are ``(batch, heads, seq, dim)``, token tensors ``(batch, seq, channels)``;
in both the sequence is dimension ``-2``. ``shapes`` lists every rank's local shape (or just its
local sequence length) in group-rank order; shards may be uneven (1001 tokens over 3 ranks:
334/334/333) and the sequence is laid out over the ranks in rank order.

- :func:`shard_heads`: all-to-all from sequence-sharded ``(batch, heads, seq_local, dim)`` to
  head-sharded ``(batch, heads / world, seq, dim)``; :func:`shard_sequence` is its inverse. The
  backward of each is the other.
- :func:`halo_exchange` / :func:`add_halos`: the local shard plus ``halo_size`` rows of the
  neighbouring tokens on each side (none past the ends: the sequence is not periodic). A halo
  longer than a neighbour's shard is filled from every rank that holds part of it, in the same
  single exchange, so any window works with any shard length. The backward sends the halo
  gradients back to their owners, where they are added. :func:`remove_halos` drops them again.

Every exchange here is the one row exchange of :mod:`stormshard.parallel.comm`
(:func:`~stormshard.parallel.comm.all_to_all_rows`, which also counts the bytes). The halo runs
as one ``all_to_all_single`` with zero-length chunks for ranks that share nothing
(``method="all_to_all"``, the default: the faster of the two on gloo in
``benchmarks/bench_attention.py``) or as batched ``isend``/``irecv`` (``method="p2p"``); the
head all-to-all exchanges the flattened tensors with per-rank element counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import einops
import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.parallel.comm import RowExchangePlan, RowTransport, all_gather_along, all_to_all_rows
from stormshard.parallel.shapes import balanced_offsets, group_rank, group_size, sizes_along
from stormshard.parallel.shard import check_shard_sizes

__all__ = [
    "shard_heads",
    "shard_sequence",
    "HaloPlan",
    "halo_exchange",
    "add_halos",
    "remove_halos",
    "HaloMethod",
    "DEFAULT_HALO_METHOD",
]

ProcessGroup = dist.ProcessGroup
HaloMethod = RowTransport
DEFAULT_HALO_METHOD: HaloMethod = "all_to_all"


# --------------------------------------------------------------------------------------------
# head <-> sequence all-to-all
# --------------------------------------------------------------------------------------------


def _seq_to_heads(x: Tensor, sizes: list[int], group: ProcessGroup | None) -> Tensor:
    """``(b, h, s_local, d)`` -> ``(b, h / w, S, d)``: send head group ``r`` to rank ``r``."""
    world = len(sizes)
    b, h, s, d = x.shape
    send = einops.rearrange(x, "b (w hl) s d -> (w b hl s d)", w=world).contiguous()
    chunk = b * (h // world) * d
    out = all_to_all_rows(send, [chunk * s] * world, [chunk * n for n in sizes], group)
    parts = torch.split(out, [chunk * n for n in sizes])
    parts = [p.view(b, h // world, n, d) for p, n in zip(parts, sizes, strict=True)]
    return torch.cat(parts, dim=2)


def _heads_to_seq(x: Tensor, sizes: list[int], group: ProcessGroup | None) -> Tensor:
    """``(b, h / w, S, d)`` -> ``(b, h, s_local, d)``: send sequence shard ``r`` to rank ``r``."""
    world, rank = len(sizes), group_rank(group)
    b, hl, _, d = x.shape
    chunks = torch.split(x, sizes, dim=2)
    send = torch.cat([c.reshape(-1) for c in chunks])
    chunk = b * hl * d
    out = all_to_all_rows(send, [chunk * n for n in sizes], [chunk * sizes[rank]] * world, group)
    return einops.rearrange(out, "(w b hl s d) -> b (w hl) s d", w=world, b=b, hl=hl, d=d)


class _ShardHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], group) -> Tensor:  # noqa: ANN001
        ctx.sizes, ctx.group = sizes, group
        return _seq_to_heads(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return _heads_to_seq(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], group) -> Tensor:  # noqa: ANN001
        ctx.sizes, ctx.group = sizes, group
        return _heads_to_seq(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        return _seq_to_heads(grad.contiguous(), ctx.sizes, ctx.group), None, None


def shard_heads(input_: Tensor, shapes: Sequence, mgroup: ProcessGroup | None) -> Tensor:
    """All-to-all: sequence-sharded ``(batch, heads, seq_local, dim)`` -> head-sharded ``(batch, heads/w, seq, dim)``.

    Rank ``r`` ends with heads ``[r * h/w, (r+1) * h/w)`` over the whole sequence. ``shapes``: every
    rank's shard shape (sequence at dimension -2) or sequence length. Communicates: each rank's
    shard of every other rank's heads. Backward: :func:`shard_sequence` of the gradient.
    """
    if group_size(mgroup) == 1:
        return input_
    sizes = list(check_shard_sizes(sizes_along(shapes, -2), mgroup, "shard_heads: shapes"))
    world, rank = len(sizes), group_rank(mgroup)
    if input_.dim() != 4:
        raise ValueError(f"shard_heads: input must be (batch, heads, seq_local, dim), got shape {tuple(input_.shape)}")
    if input_.shape[1] % world != 0:
        raise ValueError(
            f"shard_heads: num_heads={input_.shape[1]} is not divisible by the group size {world}; "
            f"use a head count that is a multiple of {world}, or shard_strategy='shard_sequence'"
        )
    if input_.shape[2] != sizes[rank]:
        raise ValueError(
            f"shard_heads: rank {rank} holds {input_.shape[2]} tokens but shapes say {sizes[rank]} "
            f"(shard sizes {sizes})"
        )
    return _ShardHeads.apply(input_.contiguous(), sizes, mgroup)


def shard_sequence(input_: Tensor, shapes: Sequence, mgroup: ProcessGroup | None) -> Tensor:
    """All-to-all: head-sharded ``(batch, heads/w, seq, dim)`` -> sequence-sharded ``(batch, heads, seq_local, dim)``.

    The inverse of :func:`shard_heads`; ``shapes`` as there. Communicates: each other rank's
    sequence shard of this rank's heads. Backward: :func:`shard_heads` of the gradient.
    """
    if group_size(mgroup) == 1:
        return input_
    sizes = list(check_shard_sizes(sizes_along(shapes, -2), mgroup, "shard_sequence: shapes"))
    if input_.dim() != 4:
        raise ValueError(
            f"shard_sequence: input must be (batch, heads_local, seq, dim), got shape {tuple(input_.shape)}"
        )
    if input_.shape[2] != sum(sizes):
        raise ValueError(
            f"shard_sequence: input holds {input_.shape[2]} tokens but the shard sizes {sizes} sum to {sum(sizes)}"
        )
    return _ShardSequence.apply(input_.contiguous(), sizes, mgroup)


# --------------------------------------------------------------------------------------------
# halo exchange
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HaloPlan(RowExchangePlan):
    """Who sends which rows to whom for one rank's window halos (computed once from the shard sizes).

    A :class:`~stormshard.parallel.comm.RowExchangePlan` (``rank``, ``send_counts``,
    ``recv_counts``) for a sequence split in contiguous shards: ``send_counts[r]`` rows starting
    at local row ``send_starts[r]`` go to group rank ``r``; ``recv_counts[r]`` rows come from rank
    ``r`` (ranks below this one fill the left halo, ranks above the right one, in rank order).
    ``left`` / ``right``: rows added before / after the local shard. ``offset`` is the global
    position of the first local row.
    """

    sizes: tuple[int, ...]
    halo_size: int
    offset: int
    left: int
    right: int
    send_starts: tuple[int, ...]

    @classmethod
    def build(cls, sizes: Sequence[int], rank: int, halo_size: int) -> HaloPlan:
        sizes = [int(s) for s in sizes]
        if not 0 <= rank < len(sizes):
            raise ValueError(f"rank {rank} is outside the {len(sizes)} shards {sizes}")
        if not isinstance(halo_size, int) or isinstance(halo_size, bool) or halo_size < 0:
            raise ValueError(f"halo_size must be a non-negative int, got {halo_size!r}")
        if any(s < 0 for s in sizes):
            raise ValueError(f"shard sizes must be non-negative, got {sizes}")
        offsets, total = balanced_offsets(sizes), sum(sizes)

        def reach(r: int) -> tuple[int, int]:  # global rows rank r needs: its shard plus halos
            return max(0, offsets[r] - halo_size), min(total, offsets[r] + sizes[r] + halo_size)

        start, stop = offsets[rank], offsets[rank] + sizes[rank]
        lo, hi = reach(rank)
        send_starts, send_counts, recv_counts = [], [], []
        for r, (r_start, r_size) in enumerate(zip(offsets, sizes, strict=True)):
            if r == rank:
                send_starts.append(0)
                send_counts.append(0)
                recv_counts.append(0)
                continue
            r_lo, r_hi = reach(r)
            first = max(start, r_lo)
            send_starts.append(first - start if first < stop else 0)
            send_counts.append(max(0, min(stop, r_hi) - first))
            recv_counts.append(max(0, min(r_start + r_size, hi) - max(r_start, lo)))
        return cls(rank=rank, send_counts=tuple(send_counts), recv_counts=tuple(recv_counts), sizes=tuple(sizes),
                   halo_size=halo_size, offset=start, left=start - lo, right=hi - stop,
                   send_starts=tuple(send_starts))

    @property
    def local_size(self) -> int:
        return self.sizes[self.rank]


def _add_halos_forward(x: Tensor, plan: HaloPlan, group: ProcessGroup | None, method: HaloMethod) -> Tensor:
    """``x`` with seq at dim 0 -> ``(left + local + right, ...)``."""
    parts = [x[s : s + c] for s, c in zip(plan.send_starts, plan.send_counts, strict=True) if c]
    send = torch.cat(parts) if parts else x[:0]
    got = all_to_all_rows(send, plan.send_counts, plan.recv_counts, group, transport=method)
    return torch.cat([got[: plan.left], x, got[plan.left :]])


def _add_halos_backward(grad: Tensor, plan: HaloPlan, group: ProcessGroup | None, method: HaloMethod) -> Tensor:
    """Gradient ``(left + local + right, ...)`` -> local gradient with the halo parts added by their owners."""
    local = grad[plan.left : plan.left + plan.local_size].clone()
    halos = torch.cat([grad[: plan.left], grad[plan.left + plan.local_size :]])
    back = all_to_all_rows(halos, plan.recv_counts, plan.send_counts, group, transport=method)
    row = 0
    for start, count in zip(plan.send_starts, plan.send_counts, strict=True):
        if count:
            local[start : start + count] += back[row : row + count]
            row += count
    return local


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: HaloPlan, dim: int, group, method: HaloMethod) -> Tensor:  # noqa: ANN001
        ctx.plan, ctx.dim, ctx.group, ctx.method = plan, dim, group, method
        moved = x.movedim(dim, 0).contiguous()
        return _add_halos_forward(moved, plan, group, method).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        moved = grad.movedim(ctx.dim, 0).contiguous()
        local = _add_halos_backward(moved, ctx.plan, ctx.group, ctx.method)
        return local.movedim(0, ctx.dim).contiguous(), None, None, None, None


def _gather_lengths(x: Tensor, dim: int, group: ProcessGroup | None) -> list[int]:
    mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    return [int(s) for s in all_gather_along(mine, 0, [1] * group_size(group), group).tolist()]


def add_halos(
    x: Tensor,
    halo_size: int,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None = None,
    *,
    dim: int = -2,
    method: HaloMethod = DEFAULT_HALO_METHOD,
) -> tuple[Tensor, HaloPlan]:
    """The local shard with up to ``halo_size`` neighbouring rows on each side, and the plan used.

    ``x``: the local shard, sequence along ``dim`` (``(batch, seq_local, channels)`` or
    ``(batch, heads, seq_local, dim)``). ``sizes``: every rank's local length in rank order
    (gathered with a tiny all-gather when None). Returns ``(x_with_halos, plan)``; the first local
    row of ``x_with_halos`` is ``plan.left``. Communicates: the halo rows, from every rank that
    owns part of them (one exchange). Backward: halo gradients go back to their owners and are added.
    """
    if method not in ("all_to_all", "p2p"):
        raise ValueError(f"method must be 'all_to_all' or 'p2p', got {method!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    world, rank = group_size(group), group_rank(group)
    if sizes is None:
        sizes = [x.shape[dim]] if world == 1 else _gather_lengths(x, dim, group)
    sizes = list(check_shard_sizes(sizes, group, "sizes"))
    if sizes[rank] != x.shape[dim]:
        raise ValueError(
            f"rank {rank} holds {x.shape[dim]} rows along dim {dim} but sizes {sizes} say {sizes[rank]}"
        )
    plan = HaloPlan.build(sizes, rank, halo_size)
    if world == 1 or (plan.left == 0 and plan.right == 0 and not any(plan.send_counts)):
        return x, plan
    return _HaloExchange.apply(x, plan, dim, group, method), plan


def halo_exchange(
    x: Tensor,
    halo_size: int,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None = None,
    *,
    dim: int = -2,
    method: HaloMethod = DEFAULT_HALO_METHOD,
) -> Tensor:
    """:func:`add_halos` without the plan: the local shard with ``halo_size`` neighbour rows on each side."""
    return add_halos(x, halo_size, group, sizes, dim=dim, method=method)[0]


def remove_halos(x: Tensor, plan: HaloPlan, *, dim: int = -2) -> Tensor:
    """Drop the ``plan.left`` / ``plan.right`` halo rows that :func:`add_halos` added along ``dim``."""
    expect = plan.left + plan.local_size + plan.right
    if x.shape[dim] != expect:
        raise ValueError(
            f"remove_halos: dim {dim} has {x.shape[dim]} rows but the plan expects {expect} "
            f"({plan.left} + {plan.local_size} + {plan.right})"
        )
    return x.narrow(dim, plan.left, plan.local_size)
