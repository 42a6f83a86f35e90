"""Message-passing GNN blocks (interaction network): edge MLP, sum aggregation, node MLP, residuals.

For an edge ``j -> i`` with features ``e_ji``::

    m_ji = MLP_e([x_j, x_i, e_ji])          (edge_channels)
    x_i <- x_i + MLP_n([x_i, sum_j m_ji])   (sum over the edges into i: index_add_)
    e_ji <- e_ji + m_ji

Each MLP is Linear, GELU, Linear, LayerNorm. Layouts: node features ``(num_nodes, [*batch,]
channels)``, ``edge_attr`` ``(num_edges, edge_channels)`` (or ``(num_edges, *batch,
edge_channels)``), edges numbered by the block's plan.

- :class:`GNNMapperBlock`: bipartite (encoder data -> hidden, decoder hidden -> data);
  ``forward(x_src, x_dst, edge_attr)`` returns the updated destinations only, like every mapper
  block (the edge update is not computed: a mapper's edges feed nothing after it).
- :class:`GNNProcessorBlock`: one node set (hidden -> hidden); ``forward(x, edge_attr)`` returns
  ``(x', edge_attr')`` like every processor block, so that the processor chains edge updates.

Graph and shard context: the block takes its :class:`~stormshard.parallel.graph.GraphShardPlan`
once, at construction (edge index and process group; ``GraphShardPlan.build(edge_index,
num_nodes)`` for one process). Node inputs are this rank's slices, ``edge_attr`` the plan's local
edges in plan order (``plan.shard_edges``); the source features cross one halo exchange over the
plan's group (forward and backward) and the outputs are this rank's destination slice (and local
edges, plan order). ``num_chunks > 1`` processes the edges in destination-node chunks with
activation checkpointing per chunk; results are equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stormshard.layers.chunking import check_num_chunks, map_destination_chunks
from stormshard.layers.graph_kernels import segment_sum
from stormshard.layers.graph_transformer import (
    _check_positive,
    check_local_rows,
    check_node_and_edge_shapes,
    check_plan,
)
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["GNNMapperBlock", "GNNProcessorBlock"]


def _mlp(in_channels: int, hidden: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_channels, hidden), nn.GELU(), nn.Linear(hidden, out_channels), nn.LayerNorm(out_channels)
    )


class _GNNBase(nn.Module):
    def __init__(
        self, src_channels: int, dst_channels: int, edge_channels: int, mlp_ratio: float, num_chunks: int
    ) -> None:
        super().__init__()
        for name, value in (("src_channels", src_channels), ("dst_channels", dst_channels),
                            ("edge_channels", edge_channels)):
            _check_positive(name, value)
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got {mlp_ratio}")
        self.src_channels, self.dst_channels, self.edge_channels = src_channels, dst_channels, edge_channels
        self.num_chunks = check_num_chunks(num_chunks)
        edge_in = src_channels + dst_channels + edge_channels
        self.edge_mlp = _mlp(edge_in, max(1, round(edge_channels * mlp_ratio)), edge_channels)
        self.node_mlp = _mlp(dst_channels + edge_channels, max(1, round(dst_channels * mlp_ratio)), dst_channels)

    def _check_channels(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> None:
        check_node_and_edge_shapes(x_src, x_dst, edge_attr, self.src_channels, self.dst_channels, self.edge_channels)

    def _message_pass(
        self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor, edge_index: Tensor, update_edges: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``(x_dst', edge_attr' or None)``; ``x_src`` ``(num_src_ext, C_src)`` (local rows + halo
        when sharded); the edge update only when ``update_edges``."""
        num_dst = x_dst.shape[0]
        edge_index = edge_index.to(x_dst.device)
        # edge attributes are often a module buffer, which bf16 engines leave in fp32: compute in the nodes' dtype
        edge_attr = edge_attr.to(x_dst.dtype)
        # the edge MLP's first linear on [x_j, x_i, e_ji] is W_s x_j + W_d x_i + W_e e_ji: project
        # the nodes once (N rows) and gather the projections, instead of a GEMM over E concatenated rows
        first_linear = self.edge_mlp[0]
        w_src, w_dst, w_attr = first_linear.weight.split([self.src_channels, self.dst_channels, self.edge_channels], 1)
        p_src, p_dst = F.linear(x_src, w_src), F.linear(x_dst, w_dst, first_linear.bias)

        def chunk(ids: Tensor | None, first: int, end: int) -> tuple[Tensor, ...]:
            index, attr = (edge_index, edge_attr) if ids is None else (edge_index[:, ids], edge_attr[ids])
            src, dst = index[0], index[1]
            hidden = p_src.index_select(0, src) + p_dst.index_select(0, dst)
            attr_b = attr.reshape(attr.shape[:1] + (1,) * (hidden.dim() - attr.dim()) + attr.shape[1:])
            hidden = hidden + F.linear(attr_b, w_attr)  # broadcast: edges shared by every batch entry
            attr_b = attr_b.expand(hidden.shape[:-1] + attr.shape[-1:])
            msg = self.edge_mlp[1:](hidden)
            acc = torch.promote_types(msg.dtype, torch.float32)  # the sum over edges accumulates in fp32
            agg = segment_sum(msg.to(acc), dst - first if first else dst, end - first).to(msg.dtype)
            x = x_dst[first:end]
            x = x + self.node_mlp(torch.cat([x, agg], dim=-1))
            return (x, attr_b + msg) if update_edges else (x,)

        outs, order = map_destination_chunks(chunk, edge_index, num_dst, self.num_chunks)
        if order is None:
            return outs[0][0], outs[0][1] if update_edges else None
        nodes = torch.cat([o[0] for o in outs], dim=0)
        if not update_edges:
            return nodes, None
        # per-edge outputs come chunk by chunk: put them back in edge order
        return nodes, torch.cat([o[1] for o in outs], dim=0)[torch.argsort(order)]


class GNNMapperBlock(_GNNBase):
    """Bipartite GNN block, built with the graph's ``plan`` (``num_nodes=(num_source,
    num_destination)``). ``forward(x_src (N_src_local, [*batch,] src_channels), x_dst
    (N_dst_local, [*batch,] dst_channels), edge_attr (E_local, edge_channels))`` returns the
    updated destinations ``(N_dst_local, [*batch,] dst_channels)``. Communicates one halo exchange
    of the sources over the plan's group."""

    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 1.0,
        num_chunks: int = 1,
    ) -> None:
        super().__init__(src_channels, dst_channels, edge_channels, mlp_ratio, num_chunks)
        self.plan = check_plan(plan, processor=False)

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> Tensor:
        self._check_channels(x_src, x_dst, edge_attr)
        check_local_rows(self.plan, x_src.shape[0], x_dst.shape[0], edge_attr)
        x_src = self.plan.exchange_halo(x_src)
        return self._message_pass(x_src, x_dst, edge_attr, self.plan.edge_index, update_edges=False)[0]


class GNNProcessorBlock(_GNNBase):
    """GNN block on one node set, built with the graph's ``plan`` (``num_nodes=<int>``).
    ``forward(x (N_local, [*batch,] channels), edge_attr (E_local, [*batch,] edge_channels))``
    returns ``(x', edge_attr')``, the edges ``(E_local, [*batch,] edge_channels)`` in plan order.
    Communicates one halo exchange of the nodes over the plan's group."""

    def __init__(
        self, channels: int, edge_channels: int, plan: GraphShardPlan, mlp_ratio: float = 1.0, num_chunks: int = 1
    ) -> None:
        super().__init__(channels, channels, edge_channels, mlp_ratio, num_chunks)
        self.plan = check_plan(plan, processor=True)

    def forward(self, x: Tensor, edge_attr: Tensor) -> tuple[Tensor, Tensor]:
        self._check_channels(x, x, edge_attr)
        check_local_rows(self.plan, x.shape[0], x.shape[0], edge_attr)
        return self._message_pass(self.plan.exchange_halo(x), x, edge_attr, self.plan.edge_index, update_edges=True)
