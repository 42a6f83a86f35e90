"""Processors on the hidden nodes, node-first layout ``(hidden_local, batch, channels)``.

- :class:`WindowTransformerProcessor`: the sliding-window transformer over the hidden nodes in
  their stored order (an O-grid hidden mesh is ordered ring by ring, so a window is a
  neighbourhood); sharded by sequence (halo or head all-to-all) or by tensor parallelism.
- :class:`GraphProcessor`: graph-transformer or GNN blocks over the hidden-to-hidden edges,
  sharded by destination node with the model's processor plan.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from stormshard.layers.gnn import EdgeBufferPool, GNNProcessorBlock
from stormshard.layers.graph_transformer import GraphTransformerProcessorBlock
from stormshard.layers.transformer import TransformerProcessor
from stormshard.models.config import ModelConfig
from stormshard.models.sharding import ModelShardPlan
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["WindowTransformerProcessor", "GraphProcessor", "TrainableEdges"]

class TrainableEdges(nn.Module):
    """Fixed edge attributes of this rank's edges, with ``size`` trainable features per edge appended
    (anemoi's ``edge_trainable_parameters``; ``size`` 0: the fixed attributes alone).

    The trainable tensor ``trainable`` ``(num_edges, size)`` covers every edge of the graph (replicated
    over the model group like the node embeddings); a rank reads its edges' rows (``plan.edge_ids``),
    so the gradients summed over the group are the single-process ones. ``forward()`` returns
    ``(local_edges, edge_channels + size)``.
    """

    def __init__(self, edge_attr: Tensor, plan: GraphShardPlan, size: int) -> None:
        super().__init__()
        self.register_buffer("edge_attr", plan.shard_edges(edge_attr), persistent=False)
        self.register_buffer("edge_ids", plan.edge_ids.clone(), persistent=False)
        self.trainable = nn.Parameter(torch.zeros(edge_attr.shape[0], size)) if size else None
        self.channels = edge_attr.shape[1] + size

    def forward(self) -> Tensor:
        if self.trainable is None:
            return self.edge_attr
        local = self.trainable.index_select(0, self.edge_ids)
        return torch.cat([self.edge_attr.to(local.dtype), local], dim=-1)



class WindowTransformerProcessor(nn.Module):
    """Pre-norm sliding-window transformer blocks over the hidden nodes, sharded as ``plan.hidden_shard``
    with ``plan.shard_strategy``.

    ``forward(x (hidden_local, batch, C)) -> (hidden_local, batch, C)``. Built in its
    single-device form (full-weight blocks); :func:`stormshard.models.parallelize.parallelize`
    swaps in tensor-parallel blocks (``shard_strategy="tensor"``) and wraps checkpointing.
    """

    def __init__(self, config: ModelConfig, plan: ModelShardPlan) -> None:
        super().__init__()
        p = config.processor
        self.processor = TransformerProcessor(
            num_layers=p.num_layers, num_channels=config.num_channels, num_heads=p.num_heads,
            window_size=p.window_size, mlp_ratio=p.mlp_ratio, shard_strategy=plan.shard_strategy,
            shard=plan.hidden_shard, attention_kernel=p.attention_kernel, qk_norm=p.qk_norm,
            mlp_kind=p.mlp_implementation,
        )

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks (``processor.blocks``)."""
        return self.processor.blocks

    def forward(self, x: Tensor) -> Tensor:
        y = self.processor(rearrange(x, "n b c -> b n c"))
        return rearrange(y, "b n c -> n b c")


class GraphProcessor(nn.Module):
    """Graph-transformer (``config.name == "graphtransformer"``) or GNN (``"gnn"``) blocks over the
    hidden graph, built with the model's processor plan (edge index and model group, bound once).

    ``forward(x (hidden_local, batch, C)) -> (hidden_local, batch, C)``. The edge attributes are
    this rank's edges of the processor graph (``plan.processor.shard_edges``), held as a buffer;
    every block takes and returns ``(x, edge_attr)`` (GNN blocks update the edges, graph-transformer
    blocks pass them on). Each block exchanges one halo of hidden nodes over the model group.
    GNN blocks share one :class:`~stormshard.layers.gnn.EdgeBufferPool` (``buffer_pool``: the
    model's, or None for one of the processor's own), so that layers reuse each other's buffers.
    Activation checkpointing is not applied here: the parallelize step
    (:func:`stormshard.models.parallelize.parallelize`) wraps ``blocks`` once.
    """

    def __init__(self, config: ModelConfig, plan: ModelShardPlan, edge_attr: Tensor, *,
                 buffer_pool: EdgeBufferPool | None = None) -> None:
        super().__init__()
        if plan.processor is None:
            raise ValueError("a graph processor needs the processor plan: build ModelShardPlan with processor_graph=True")
        p, c, graph_plan = config.processor, config.num_channels, plan.processor
        self.kind = config.name
        if p.trainable_edge_size:  # anemoi's trainable edge features (parameter "edges.trainable")
            self.edges = TrainableEdges(edge_attr, graph_plan, p.trainable_edge_size)
            edge_channels = self.edges.channels
        else:
            self.register_buffer("edge_attr", graph_plan.shard_edges(edge_attr), persistent=False)
            edge_channels = edge_attr.shape[1]
        if self.kind == "gnn":
            pool = EdgeBufferPool() if buffer_pool is None else buffer_pool
            # edge_embedding: the first block embeds the raw edges to num_channels, the others read its edges
            width = c if p.edge_embedding else edge_channels
            self.blocks = nn.ModuleList(
                GNNProcessorBlock(c, width, graph_plan, mlp_ratio=p.mlp_ratio, num_chunks=p.num_chunks,
                                  mlp_hidden_layers=p.mlp_hidden_layers,
                                  edge_in_channels=edge_channels if p.edge_embedding and i == 0 else None,
                                  aggregate_updated_edges=p.aggregate_updated_edges, edge_mlp_ratio=p.edge_mlp_ratio,
                                  buffer_pool=pool)
                for i in range(p.num_layers)
            )
        else:
            self.blocks = nn.ModuleList(
                GraphTransformerProcessorBlock(c, edge_channels, p.num_heads, graph_plan, mlp_ratio=p.mlp_ratio,
                                               num_chunks=p.num_chunks, self_projection=p.self_projection,
                                               graph_kernel=config.graph_kernel, lean=config.lean_activations,
                                               qk_norm=p.qk_norm, mlp_kind=p.mlp_implementation)
                for _ in range(p.num_layers)
            )

    def forward(self, x: Tensor) -> Tensor:
        edges = getattr(self, "edges", None)
        edge_attr = edges() if edges is not None else self.edge_attr
        for block in self.blocks:
            x, edge_attr = block(x, edge_attr)
        return x
