"""Graph sharding by destination node: :class:`GraphShardPlan`, and its halo exchange.

Conventions: ``edge_index`` is a ``(2, num_edges)`` integer tensor, row 0 the source node and
row 1 the destination node of every edge; ``edge_attr`` is ``(num_edges, channels)``; node
features are ``(num_nodes, channels...)`` with the node dimension first.

:class:`GraphShardPlan` is the plan for sharding a (directed, possibly bipartite) graph by
destination nodes. Each rank of a group owns a balanced contiguous slice of the destination
nodes and of the source nodes (``balanced_sizes``, the way the model shards node features), the
edges into its destination nodes, and receives through one ``all_to_all_single`` with uneven
splits exactly the remote source rows those edges read (its *halo*), not an all-gather of the
whole source set. The backward pass sends the halo gradients back to their owners, which add
them to their own rows. One process is the one-rank case of the same plan (``group`` None).

The plan is computed once per graph and layout, on every rank, from the full ``edge_index``;
every rank derives every other rank's needs itself, so building it needs no communication. It
holds its process group, so layers receive it once, at construction, and their ``forward`` takes
tensors only. The exchange is the one row exchange of :mod:`stormshard.parallel.comm`
(:func:`~stormshard.parallel.comm.exchange_rows`); the edge-index checks and destination chunks
are in :mod:`stormshard.parallel.graph_edges`, anemoi's edge-sorting helpers in
:mod:`stormshard.parallel.anemoi_compat`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.parallel.comm import RowExchangePlan, exchange_rows
from stormshard.parallel.graph_edges import (
    balanced_part_of,
    check_edge_index,
    check_node_range,
    split_num_nodes,
)
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes, group_rank, group_size

__all__ = ["GraphShardPlan"]

ProcessGroup = dist.ProcessGroup


# plan -> {device: the plan moved there}, kept while the plan lives (GraphShardPlan.to)
_MOVED_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class GraphShardPlan(RowExchangePlan):
    """Destination-node sharding of one graph over one process group (computed once, then reused).

    ``group`` is the group the plan was built for (:meth:`build`); None for one process, and for
    plans of another rank built with :meth:`for_rank` to inspect a layout (those cannot exchange
    halos when ``world > 1``). The layers take the plan once, at construction: it binds both their
    edge index and their group.

    A :class:`~stormshard.parallel.comm.RowExchangePlan` (``rank``, ``send_counts``,
    ``recv_counts``: the halo rows sent to / received from each rank). Node slices: rank ``r``
    owns source rows ``[src_offsets[r], src_offsets[r] + src_sizes[r])`` and destination rows
    likewise (``balanced_sizes``). Local tensors:

    - ``edge_ids`` ``(E_r,)``: global ids of this rank's edges (all edges into its destination
      rows), sorted by destination (stable); ``edge_attr_local = edge_attr[edge_ids]``;
    - ``edge_index`` ``(2, E_r)``: those edges re-numbered: row 0 in ``[0, num_src_local +
      num_halo)`` (own source rows first, then the halo in receive order), row 1 in
      ``[0, num_dst_local)``;
    - ``send_index`` ``(sum(send_counts),)``: local source rows sent to each other rank (grouped by
      rank, ascending ids within a group); ``recv_counts``: halo rows received from each rank;
    - ``halo_ids`` ``(num_halo,)``: global ids of the halo rows, in receive order.

    Communicated by :meth:`exchange_halo`: ``sum(send_counts)`` rows forward, ``num_halo`` rows
    backward (one ``all_to_all_single`` each way); nothing when no rank of the layout needs a halo.
    """

    num_src: int
    num_dst: int
    world: int
    src_sizes: tuple[int, ...]
    dst_sizes: tuple[int, ...]
    edge_ids: Tensor
    edge_index: Tensor
    send_index: Tensor
    halo_ids: Tensor
    edges_per_rank: tuple[int, ...]
    halo_per_rank: tuple[int, ...]
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.group is not None and (group_size(self.group) != self.world or group_rank(self.group) != self.rank):
            raise ValueError(
                f"GraphShardPlan.group is rank {group_rank(self.group)} of {group_size(self.group)} but the plan "
                f"describes rank {self.rank} of {self.world}: build it with GraphShardPlan.build(edge_index, "
                "num_nodes, group), or use for_rank(...) without a group to inspect another rank"
            )

    # ----------------------------------------------------------------------------------------
    # construction
    # ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        edge_index: Tensor,
        num_nodes: int | tuple[int, int],
        group: ProcessGroup | None = None,
    ) -> GraphShardPlan:
        """The plan for this rank of ``group``, holding ``group`` (None: one rank holding everything).

        ``num_nodes``: the node count of a graph on one node set (processor), or
        ``(num_source, num_destination)`` for a bipartite graph (encoder, decoder).
        """
        plan = cls.for_rank(edge_index, num_nodes, group_size(group), group_rank(group))
        return replace(plan, group=group)

    @classmethod
    def for_rank(
        cls, edge_index: Tensor, num_nodes: int | tuple[int, int], world: int, rank: int
    ) -> GraphShardPlan:
        """The plan of rank ``rank`` of a ``world``-rank layout, without a process group.

        For inspecting any rank's share of a layout (tests, benchmarks, reference plans); such a
        plan slices tensors and reports sizes, but only a one-rank plan can also run the layers
        (:meth:`exchange_halo` needs the group, from :meth:`build`, when ``world > 1``).
        """
        edge_index = check_edge_index(edge_index).long()
        num_src, num_dst = split_num_nodes(num_nodes)
        num_src = num_dst if num_src is None else num_src
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
        check_node_range(edge_index, num_src, num_dst)

        src_sizes, dst_sizes = balanced_sizes(num_src, world), balanced_sizes(num_dst, world)
        src0, dst0 = balanced_offsets(src_sizes)[rank], balanced_offsets(dst_sizes)[rank]
        src, dst = edge_index[0], edge_index[1]
        edge_rank = balanced_part_of(dst, dst_sizes)  # owner of each edge = owner of its destination

        # every (needing rank, source node) pair once, sorted by rank then node id
        need = torch.unique(edge_rank * num_src + src)
        need_rank, need_node = need // num_src, need % num_src
        node_owner = balanced_part_of(need_node, src_sizes)
        remote = node_owner != need_rank
        halo_per_rank = torch.bincount(need_rank[remote], minlength=world).tolist()

        mine = need_rank == rank  # what this rank needs: sorted by node id = grouped by owner
        halo_ids = need_node[mine & remote]
        recv_counts = torch.bincount(node_owner[mine & remote], minlength=world).tolist()
        sent = remote & (node_owner == rank)  # what the others need from this rank, by needing rank
        send_index = need_node[sent] - src0
        send_counts = torch.bincount(need_rank[sent], minlength=world).tolist()

        own = (edge_rank == rank).nonzero().flatten()
        own = own[torch.sort(dst[own], stable=True).indices]
        e_src, e_dst = src[own], dst[own]
        local_src = e_src - src0
        in_halo = (e_src < src0) | (e_src >= src0 + src_sizes[rank])
        local_src[in_halo] = src_sizes[rank] + torch.searchsorted(halo_ids, e_src[in_halo])
        local_index = torch.stack([local_src, e_dst - dst0])

        return cls(
            num_src=num_src, num_dst=num_dst, world=world, rank=rank,
            src_sizes=tuple(src_sizes), dst_sizes=tuple(dst_sizes),
            edge_ids=own, edge_index=local_index, send_index=send_index,
            send_counts=tuple(send_counts), recv_counts=tuple(recv_counts), halo_ids=halo_ids,
            edges_per_rank=tuple(torch.bincount(edge_rank, minlength=world).tolist()),
            halo_per_rank=tuple(halo_per_rank),
        )

    def to(self, device: torch.device | str) -> GraphShardPlan:
        """The same plan with its index tensors on ``device``; one copy per plan and device (the blocks that
        share a plan share its moved copy, so kernel structures cached per edge index are built once)."""
        if self.edge_index.device == torch.device(device):
            return self
        copies = _MOVED_PLANS.setdefault(self, {})
        key = str(torch.device(device))
        if key not in copies:
            copies[key] = replace(
                self, edge_ids=self.edge_ids.to(device), edge_index=self.edge_index.to(device),
                send_index=self.send_index.to(device), halo_ids=self.halo_ids.to(device),
            )
        return copies[key]

    # ----------------------------------------------------------------------------------------
    # sizes
    # ----------------------------------------------------------------------------------------

    @property
    def num_src_local(self) -> int:
        return self.src_sizes[self.rank]

    @property
    def num_dst_local(self) -> int:
        return self.dst_sizes[self.rank]

    @property
    def num_halo(self) -> int:
        return int(self.halo_ids.numel())

    @property
    def num_edges_local(self) -> int:
        return int(self.edge_ids.numel())

    @property
    def src_offset(self) -> int:
        return balanced_offsets(self.src_sizes)[self.rank]

    @property
    def dst_offset(self) -> int:
        return balanced_offsets(self.dst_sizes)[self.rank]

    def all_gather_bytes(self, row_bytes: int) -> int:
        """Bytes this rank would send to all-gather the whole source set instead (the baseline)."""
        return self.num_src_local * row_bytes * (self.world - 1)

    # ----------------------------------------------------------------------------------------
    # slicing helpers (no communication)
    # ----------------------------------------------------------------------------------------

    def shard_src(self, x: Tensor) -> Tensor:
        """This rank's rows ``(num_src_local, ...)`` of full source-node features ``(num_src, ...)``."""
        self._check_rows(x, self.num_src, "source-node features")
        return x.narrow(0, self.src_offset, self.num_src_local)

    def shard_dst(self, x: Tensor) -> Tensor:
        """This rank's rows ``(num_dst_local, ...)`` of full destination-node features."""
        self._check_rows(x, self.num_dst, "destination-node features")
        return x.narrow(0, self.dst_offset, self.num_dst_local)

    def shard_edges(self, edge_attr: Tensor) -> Tensor:
        """This rank's edge rows ``(E_r, ...)`` of full edge attributes ``(E, ...)``, plan order."""
        self._check_rows(edge_attr, sum(self.edges_per_rank), "edge attributes")
        return edge_attr.index_select(0, self.edge_ids)

    def _check_rows(self, x: Tensor, rows: int, what: str) -> None:
        if x.shape[0] != rows:
            raise ValueError(f"{what} have {x.shape[0]} rows but the plan's graph has {rows}")

    # ----------------------------------------------------------------------------------------
    # communication
    # ----------------------------------------------------------------------------------------

    def check_source_rows(self, x_src: Tensor) -> None:
        """Raise unless ``x_src`` is this rank's source rows and the plan can exchange halos."""
        if x_src.shape[0] != self.num_src_local:
            raise ValueError(
                f"x_src has {x_src.shape[0]} rows but rank {self.rank} owns {self.num_src_local} source "
                f"nodes in this plan (sizes {list(self.src_sizes)}): pass this rank's slice (plan.shard_src)"
            )
        if self.group is None and self.world > 1:
            raise ValueError(
                f"this plan (rank {self.rank} of {self.world}) has no process group, so it cannot exchange "
                "halos: it was built with for_rank; build it with GraphShardPlan.build(edge_index, "
                "num_nodes, group)"
            )

    def exchange_halo(self, x_src: Tensor) -> Tensor:
        """``(num_src_local + num_halo, ...)``: this rank's source rows followed by its halo.

        ``x_src`` is ``(num_src_local, ...)``. Communicates over the plan's group one
        ``all_to_all_single`` with uneven splits (only the rows other ranks' edges read); its
        backward returns the halo gradients to their owners, where they are added to the local
        rows' gradients. Nothing is communicated when no rank of the layout needs a halo.
        """
        self.check_source_rows(x_src)
        if sum(self.halo_per_rank) == 0:  # every rank knows this, so all skip the collective together
            return x_src
        rows = x_src.index_select(0, self.send_index.to(x_src.device))
        halo = exchange_rows(rows, self.send_counts, self.recv_counts, self.group)
        return torch.cat([x_src, halo], dim=0)
