"""Processors on the hidden nodes, node-first layout ``(hidden_local, batch, channels)``.

- :class:`WindowTransformerProcessor`: the sliding-window transformer over the hidden nodes in
  their stored order (an O-grid hidden mesh is ordered ring by ring, so a window is a
  neighbourhood); sharded by sequence (halo or head all-to-all) or by tensor parallelism.
- :class:`GraphProcessor`: graph-transformer or GNN blocks over the hidden-to-hidden edges,
  sharded by destination node with the model's processor plan.
"""

from __future__ import annotations

import torch.distributed as dist
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from stormshard.layers.gnn import GNNProcessorBlock
from stormshard.layers.graph_transformer import GraphTransformerProcessorBlock
from stormshard.layers.transformer import TransformerProcessor
from stormshard.models.config import ModelConfig
from stormshard.models.sharding import ModelShardPlan

__all__ = ["WindowTransformerProcessor", "GraphProcessor"]


class WindowTransformerProcessor(nn.Module):
    """Pre-norm sliding-window transformer blocks; ``forward(x (hidden_local, batch, C))``."""

    def __init__(self, config: ModelConfig, plan: ModelShardPlan, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        p = config.processor
        self.group = group
        self.shard_sizes = list(plan.hidden_sizes) if plan.world > 1 else None
        self.processor = TransformerProcessor(
            num_layers=p.num_layers, num_channels=config.num_channels, num_heads=p.num_heads,
            window_size=p.window_size, mlp_ratio=p.mlp_ratio, shard_strategy=p.shard_strategy,
            activation_checkpointing=config.activation_checkpointing, group=group,
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.processor(rearrange(x, "n b c -> b n c"), shard_sizes=self.shard_sizes, model_comm_group=self.group)
        return rearrange(y, "b n c -> n b c")


class GraphProcessor(nn.Module):
    """Graph-transformer (``kind="graphtransformer"``) or GNN (``kind="gnn"``) blocks over the
    hidden graph; ``forward(x (hidden_local, batch, C))``. Edge attributes are this rank's edges."""

    def __init__(
        self, config: ModelConfig, plan: ModelShardPlan, group: dist.ProcessGroup | None, edge_attr: Tensor
    ) -> None:
        super().__init__()
        if plan.processor is None:
            raise ValueError("a graph processor needs the processor plan: build ModelShardPlan with processor_graph=True")
        p, c = config.processor, config.num_channels
        self.kind = config.name
        self.group, self.plan = group, plan.processor
        self.checkpointing = config.activation_checkpointing
        self.register_buffer("edge_attr", plan.processor.shard_edges(edge_attr), persistent=False)
        edge_channels = edge_attr.shape[1]
        if self.kind == "gnn":
            self.blocks = nn.ModuleList(
                GNNProcessorBlock(c, edge_channels, mlp_ratio=p.mlp_ratio, num_chunks=p.num_chunks)
                for _ in range(p.num_layers)
            )
        else:
            self.blocks = nn.ModuleList(
                GraphTransformerProcessorBlock(c, edge_channels, p.num_heads, mlp_ratio=p.mlp_ratio,
                                               num_chunks=p.num_chunks)
                for _ in range(p.num_layers)
            )

    def _run(self, block: nn.Module, x: Tensor, edge_attr: Tensor) -> tuple[Tensor, Tensor]:
        out = block(x, edge_attr, None, self.plan, self.group)
        return out if isinstance(out, tuple) else (out, edge_attr)

    def forward(self, x: Tensor) -> Tensor:
        edge_attr = self.edge_attr
        for block in self.blocks:
            if self.checkpointing and self.training:
                x, edge_attr = checkpoint(self._run, block, x, edge_attr, use_reentrant=False)
            else:
                x, edge_attr = self._run(block, x, edge_attr)
        return x
