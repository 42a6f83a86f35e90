"""Message-passing GNN blocks (interaction network): edge MLP, sum aggregation, node MLP, residuals.

For an edge ``j -> i`` with features ``e_ji``::

    m_ji = MLP_e([x_j, x_i, e_ji])          (edge_channels)
    x_i <- x_i + MLP_n([x_i, sum_j m_ji])   (sum over the edges into i: index_add_)
    e_ji <- e_ji + m_ji

Each MLP is Linear, GELU, Linear, LayerNorm by default; ``mlp_hidden_layers`` hidden (Linear,
GELU) pairs before the output Linear in general (:func:`gnn_mlp`). Layouts: node features
``(num_nodes, [*batch,] channels)``, ``edge_attr`` ``(num_edges, edge_channels)`` (or
``(num_edges, *batch, edge_channels)``), edges numbered by the block's plan.

Options (defaults: the formulas above):

- ``mlp_hidden_layers``: the depth of every MLP of the block (hidden layers before the output
  linear; 1 by default). anemoi-models' GNN with ``mlp_extra_layers=m`` is ``m + 2``.
- ``edge_in_channels``: the block's ``edge_attr`` input has this many channels and is embedded
  to ``edge_channels`` first, ``e_ji <- MLP_emb(e_ji)`` (an MLP of the same shape), e.g. raw edge
  attributes (length, direction) lifted to the node width; anemoi embeds the edges so in its
  first GNN processor layer and in its GNN mappers.
- ``aggregate_updated_edges``: sum the updated edges, ``x_i <- x_i + MLP_n([x_i, sum_j (e_ji +
  m_ji)])``, instead of the messages (anemoi's ``GraphConv``; needs ``edge_channels`` equal to the
  aggregated width, as always).
- ``edge_mlp_ratio``: the edge MLP's hidden width is ``edge_channels x edge_mlp_ratio`` (None:
  ``mlp_ratio``, as the node MLP and the edge embedding); anemoi's ``GraphConv`` keeps its edge MLP
  at ratio 1 whatever its ``mlp_hidden_ratio``.
- :meth:`GNNMapperBlock.update_sources`: the sources updated with the block's node MLP,
  ``x_j <- x_j + MLP_n([x_j, x_j])`` (anemoi's ``update_src_nodes`` of its forward mapper; needs
  ``src_channels == dst_channels == edge_channels``), per node, no communication.

- :class:`GNNMapperBlock`: bipartite (encoder data -> hidden, decoder hidden -> data);
  ``forward(x_src, x_dst, edge_attr)`` returns the updated destinations only, like every mapper
  block (the edge update is not computed: a mapper's edges feed nothing after it).
- :class:`GNNProcessorBlock`: one node set (hidden -> hidden); ``forward(x, edge_attr)`` returns
  ``(x', edge_attr')`` like every processor block, so that the processor chains edge updates.

Graph and shard context: the block takes its :class:`~stormshard.parallel.graph.GraphShardPlan`
once, at construction (edge index and process group; ``GraphShardPlan.build(edge_index,
num_nodes)`` for one process). Node inputs are this rank's slices, ``edge_attr`` the plan's local
edges in plan order (``plan.shard_edges``); the source features cross one halo exchange over the
plan's group (forward and backward), overlapped with the local rows' projection
(:func:`~stormshard.parallel.halo_projection.halo_linear`: only the projected sources are used),
and the outputs are this rank's destination slice (and local edges, plan order).
``num_chunks > 1`` processes the edges in destination-node chunks with activation checkpointing
per chunk; results are equal.

Implementation: the first linear of the edge MLP on ``[x_j, x_i, e_ji]`` is split into per-node
projections (N rows) gathered per edge plus the edge part. On CPU in float32 / float64 (no
autocast), the per-edge work (the edge embedding, the edge MLP, the aggregation) runs in the fused
kernel of :mod:`stormshard.layers.gnn_kernels`: one pass over cache-sized edge blocks forward and
backward, keeping only the pre-activations for the backward (GELU outputs and embedded edges are
recomputed), its large buffers recycled from step to step. Elsewhere (GPU, bf16, autocast,
``fused=False``) plain autograd runs the same math, here.

Kernel settings are bound at construction, never read from globals (every block, and
:func:`gnn_mlp`, takes them as keywords):

- ``kernel_options``: an :class:`EdgeKernelOptions` (None: the defaults): ``fused`` (the fused
  paths on or off), ``block_bytes`` (edge-block size), ``recycle``, ``recycle_min_bytes``,
  ``recycle_max_age`` (buffer recycling);
- ``buffer_pool``: the :class:`EdgeBufferPool` the recycled buffers come from (None: a pool of
  the block's own). Pass one pool to every block of a model, so that layers reuse each other's
  buffers (the models do); ``pool.release()`` frees its buffers not in use.

Both are defined in :mod:`stormshard.layers.gnn_kernel_settings` and importable from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stormshard.kernels.graph_csr import segment_sum
from stormshard.layers.chunking import check_num_chunks, map_destination_chunks, precompute_chunks
from stormshard.layers.gnn_kernel_settings import EdgeBufferPool, EdgeKernelOptions, check_kernel_args
from stormshard.layers.gnn_kernels import fusable, fused_edge_mlp, fused_mlp
from stormshard.layers.graph_inputs import (
    PlanFollowsModule,
    check_local_rows,
    check_node_and_edge_shapes,
    check_plan,
    check_positive_int,
)
from stormshard.layers.norm import LayerNorm
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.halo_projection import halo_linear

__all__ = ["GNNMapperBlock", "GNNProcessorBlock", "GNNMLP", "gnn_mlp", "EdgeKernelOptions", "EdgeBufferPool"]


class GNNMLP(nn.Sequential):
    """The GNN blocks' MLP (:func:`gnn_mlp`): an ``nn.Sequential`` of Linear, GELU, ..., Linear,
    LayerNorm on the last dimension. On CPU in float32 / float64 (no autocast) its forward and
    backward run row-blocked (:func:`~stormshard.layers.gnn_kernels.fused_mlp`: cache-sized
    blocks, only the pre-activations kept for the backward); elsewhere, or with
    ``EdgeKernelOptions(fused=False)``, the modules in turn. ``kernel_options`` (None: the defaults) and ``buffer_pool`` (None: a pool of its own)
    are bound here; slices (``mlp[1:]``) share them."""

    def __init__(
        self, *layers: nn.Module, kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
    ) -> None:
        super().__init__(*layers)
        self.kernel_options, self.buffer_pool = check_kernel_args(kernel_options, buffer_pool)

    def __getitem__(self, idx):  # noqa: ANN001, ANN204
        out = super().__getitem__(idx)
        if isinstance(out, GNNMLP) and out is not self:  # a slice: the same options and pool
            out.kernel_options, out.buffer_pool = self.kernel_options, self.buffer_pool
        return out

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.numel() == 0 or not fusable(self, self.kernel_options, x):
            return super().forward(x)
        return fused_mlp(self, x, self.kernel_options, self.buffer_pool)


def gnn_mlp(
    in_channels: int, hidden: int, out_channels: int, hidden_layers: int = 1, *,
    kernel_options: EdgeKernelOptions | None = None, buffer_pool: EdgeBufferPool | None = None,
) -> GNNMLP:
    """``hidden_layers`` (Linear, GELU) pairs (the first ``in_channels -> hidden``, the others
    ``hidden -> hidden``), then Linear ``hidden -> out_channels`` and LayerNorm: the GNN blocks'
    MLP. ``hidden_layers=1`` is Linear, GELU, Linear, LayerNorm; anemoi-models' ``MLP`` with
    ``n_extra_layers=n`` is ``hidden_layers=n + 1``. ``kernel_options`` / ``buffer_pool``: see
    :class:`GNNMLP`."""
    check_positive_int("hidden_layers", hidden_layers)
    layers: list[nn.Module] = [nn.Linear(in_channels, hidden), nn.GELU()]
    for _ in range(hidden_layers - 1):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    return GNNMLP(*layers, nn.Linear(hidden, out_channels), LayerNorm(out_channels),
                  kernel_options=kernel_options, buffer_pool=buffer_pool)


class _GNNBase(PlanFollowsModule):
    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        mlp_ratio: float,
        num_chunks: int,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
        edge_mlp_ratio: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("src_channels", src_channels), ("dst_channels", dst_channels),
                            ("edge_channels", edge_channels), ("mlp_hidden_layers", mlp_hidden_layers)):
            check_positive_int(name, value)
        if edge_in_channels is not None:
            check_positive_int("edge_in_channels", edge_in_channels)
        for name, ratio in (("mlp_ratio", mlp_ratio), ("edge_mlp_ratio", edge_mlp_ratio)):
            if ratio is not None and not ratio > 0:
                raise ValueError(f"{name} must be positive, got {ratio}")
        self.src_channels, self.dst_channels, self.edge_channels = src_channels, dst_channels, edge_channels
        self.edge_in_channels = edge_in_channels
        self.aggregate_updated_edges = bool(aggregate_updated_edges)
        self.num_chunks = check_num_chunks(num_chunks)
        # plain attributes, not state: the kernel options and the (possibly shared) buffer pool
        self.kernel_options, self.buffer_pool = check_kernel_args(kernel_options, buffer_pool)
        kernel = dict(kernel_options=self.kernel_options, buffer_pool=self.buffer_pool)
        edge_hidden = max(1, round(edge_channels * mlp_ratio))
        message_hidden = edge_hidden if edge_mlp_ratio is None else max(1, round(edge_channels * edge_mlp_ratio))
        edge_in = src_channels + dst_channels + edge_channels
        self.edge_mlp = gnn_mlp(edge_in, message_hidden, edge_channels, mlp_hidden_layers, **kernel)
        self.node_mlp = gnn_mlp(dst_channels + edge_channels, max(1, round(dst_channels * mlp_ratio)), dst_channels,
                                mlp_hidden_layers, **kernel)
        # registered only when used: the default block's parameters (and state_dict keys) are unchanged
        if edge_in_channels is not None:
            self.edge_embedding = gnn_mlp(edge_in_channels, edge_hidden, edge_channels, mlp_hidden_layers, **kernel)
        else:
            self.edge_embedding = None

    def _check_channels(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> None:
        edge_in = self.edge_channels if self.edge_in_channels is None else self.edge_in_channels
        check_node_and_edge_shapes(x_src, x_dst, edge_attr, self.src_channels, self.dst_channels, edge_in)

    def _fused(self, *tensors: Tensor) -> bool:
        """Whether the fused edge MLP (:func:`~stormshard.layers.gnn_kernels.fused_edge_mlp`) runs:
        CPU, float32 / float64, the blocks' own MLPs."""
        options = self.kernel_options
        return fusable(self.edge_mlp, options, *tensors) and fusable(self.edge_embedding, options, *tensors)

    def _fused_chunk(
        self, p_src: Tensor, p_dst: Tensor, w_attr: Tensor, x_dst: Tensor, attr: Tensor, src: Tensor, dst: Tensor,
        first: int, end: int, update_edges: bool,
    ) -> tuple[Tensor, ...]:
        """The chunk's edges through :func:`~stormshard.layers.gnn_kernels.fused_edge_mlp` (the
        embedding too, if any), then the node
        MLP. Batch dims ``(*batch)`` of the nodes become rows: node ``n``, batch entry ``b`` is row
        ``n * B + b`` (edges the same); edge attributes shared by the batch are expanded (so with
        ``B > 1`` the edge embedding runs per batch entry)."""
        batch = tuple(x_dst.shape[1:-1])
        num_edges, num_rows = attr.shape[0], end - first
        nb = 1
        for b in batch:
            nb *= b
        dst_local = dst - first if first else dst
        if nb != 1:
            ar = torch.arange(nb, device=src.device)
            src, dst, dst_local = ((i.unsqueeze(1) * nb + ar).reshape(-1) for i in (src, dst, dst_local))
        width = attr.shape[-1]
        if attr.dim() == 2 and batch:  # edges shared by every batch entry
            attr = attr.reshape((num_edges,) + (1,) * len(batch) + (width,)).expand((num_edges, *batch, width))
        hidden = p_src.shape[-1]
        edges, agg = fused_edge_mlp(
            self.edge_mlp, self.edge_embedding, attr.reshape(-1, width), p_src.reshape(-1, hidden),
            p_dst.reshape(-1, hidden), w_attr, src, dst, dst_local, num_rows * nb,
            "edges" if self.aggregate_updated_edges else "msg", update_edges, self.kernel_options, self.buffer_pool,
        )
        x = x_dst[first:end]
        c = self.edge_channels
        x = x + self.node_mlp(torch.cat([x, agg.reshape((num_rows, *batch, c))], dim=-1))
        return (x, edges.reshape((num_edges, *batch, c))) if update_edges else (x,)

    def _message_pass(
        self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor, update_edges: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``(x_dst', edge_attr' or None)``; ``x_src`` ``(num_src_local, [*batch,] C_src)`` (this
        rank's rows: the halo is exchanged here, overlapped with their projection); the edge update
        only when ``update_edges``."""
        num_dst = x_dst.shape[0]
        edge_index = self.plan.edge_index.to(x_dst.device)
        # edge attributes are often a module buffer, which bf16 engines leave in fp32: compute in the nodes' dtype
        edge_attr = edge_attr.to(x_dst.dtype)
        # the edge MLP's first linear on [x_j, x_i, e_ji] is W_s x_j + W_d x_i + W_e e_ji: project
        # the nodes once (N rows) and gather the projections, instead of a GEMM over E concatenated rows.
        # Only the sources' projection needs the halo: the raw halo rows are exchanged behind the
        # local rows' product (halo_linear: the bytes of exchange_halo) and used nowhere else
        first_linear = self.edge_mlp[0]
        w_src, w_dst, w_attr = first_linear.weight.split([self.src_channels, self.dst_channels, self.edge_channels], 1)
        p_src = halo_linear(self.plan, x_src, (w_src,), (None,))[0]
        p_dst = F.linear(x_dst, w_dst, first_linear.bias)

        def chunk(ids: Tensor | None, first: int, end: int) -> tuple[Tensor, ...]:
            index, attr = (edge_index, edge_attr) if ids is None else (edge_index[:, ids], edge_attr[ids])
            src, dst = index[0], index[1]
            if self._fused(x_src, x_dst, attr, p_src, p_dst):
                return self._fused_chunk(p_src, p_dst, w_attr, x_dst, attr, src, dst, first, end, update_edges)
            if self.edge_embedding is not None:  # inside the chunk: checkpointed chunks recompute it
                attr = self.edge_embedding(attr)
            hidden = p_src.index_select(0, src) + p_dst.index_select(0, dst)
            attr_b = attr.reshape(attr.shape[:1] + (1,) * (hidden.dim() - attr.dim()) + attr.shape[1:])
            hidden = hidden + F.linear(attr_b, w_attr)  # broadcast: edges shared by every batch entry
            attr_b = attr_b.expand(hidden.shape[:-1] + attr.shape[-1:])
            msg = self.edge_mlp[1:](hidden)
            new_edges = attr_b + msg if update_edges or self.aggregate_updated_edges else None
            summed = new_edges if self.aggregate_updated_edges else msg
            acc = torch.promote_types(summed.dtype, torch.float32)  # the sum over edges accumulates in fp32
            agg = segment_sum(summed.to(acc), dst - first if first else dst, end - first).to(summed.dtype)
            x = x_dst[first:end]
            x = x + self.node_mlp(torch.cat([x, agg], dim=-1))
            return (x, new_edges) if update_edges else (x,)

        outs, order = map_destination_chunks(chunk, edge_index, num_dst, self.num_chunks, chunks=self.edge_chunks)
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
    of the sources over the plan's group, overlapped with their projection.
    ``kernel_options`` / ``buffer_pool``: see the module docstring."""

    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 1.0,
        num_chunks: int = 1,
        *,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
        edge_mlp_ratio: float | None = None,
    ) -> None:
        super().__init__(src_channels, dst_channels, edge_channels, mlp_ratio, num_chunks, mlp_hidden_layers,
                         edge_in_channels, aggregate_updated_edges, kernel_options, buffer_pool, edge_mlp_ratio)
        self.plan = check_plan(plan, processor=False)
        # the edge chunks, once (not inside a compiled forward: their sizes depend on the edges)
        self.edge_chunks = precompute_chunks(self.plan.edge_index, self.plan.num_dst_local, self.num_chunks)

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> Tensor:
        self._check_channels(x_src, x_dst, edge_attr)
        check_local_rows(self.plan, x_src.shape[0], x_dst.shape[0], edge_attr)
        return self._message_pass(x_src, x_dst, edge_attr, update_edges=False)[0]

    def update_sources(self, x_src: Tensor) -> Tensor:
        """``x_src + node_mlp([x_src, x_src])``: this rank's sources ``(N_src_local, [*batch,] src_channels)``
        updated by the block's node MLP (anemoi's forward mapper with ``update_src_nodes``, whose decoder
        then reads them); per node, no communication. Needs ``src_channels == dst_channels == edge_channels``."""
        if not self.src_channels == self.dst_channels == self.edge_channels:
            raise ValueError(
                f"update_sources needs src_channels == dst_channels == edge_channels (the node MLP reads [x_src, "
                f"x_src] where it reads [x_dst, aggregated edges]), got {self.src_channels}, {self.dst_channels}, "
                f"{self.edge_channels}: embed the edges to the node width (edge_in_channels)")
        if x_src.shape[-1] != self.src_channels:
            raise ValueError(f"x_src has {x_src.shape[-1]} channels, expected {self.src_channels}")
        return x_src + self.node_mlp(torch.cat([x_src, x_src], dim=-1))


class GNNProcessorBlock(_GNNBase):
    """GNN block on one node set, built with the graph's ``plan`` (``num_nodes=<int>``).
    ``forward(x (N_local, [*batch,] channels), edge_attr (E_local, [*batch,] edge_channels))``
    returns ``(x', edge_attr')``, the edges ``(E_local, [*batch,] edge_channels)`` in plan order.
    Communicates one halo exchange of the nodes over the plan's group, overlapped with their
    projection. ``kernel_options`` / ``buffer_pool``: see the module docstring."""

    def __init__(
        self,
        channels: int,
        edge_channels: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 1.0,
        num_chunks: int = 1,
        *,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
        edge_mlp_ratio: float | None = None,
    ) -> None:
        super().__init__(channels, channels, edge_channels, mlp_ratio, num_chunks, mlp_hidden_layers,
                         edge_in_channels, aggregate_updated_edges, kernel_options, buffer_pool, edge_mlp_ratio)
        self.plan = check_plan(plan, processor=True)
        # the edge chunks, once (not inside a compiled forward: their sizes depend on the edges)
        self.edge_chunks = precompute_chunks(self.plan.edge_index, self.plan.num_dst_local, self.num_chunks)

    def forward(self, x: Tensor, edge_attr: Tensor) -> tuple[Tensor, Tensor]:
        self._check_channels(x, x, edge_attr)
        check_local_rows(self.plan, x.shape[0], x.shape[0], edge_attr)
        return self._message_pass(x, x, edge_attr, update_edges=True)
