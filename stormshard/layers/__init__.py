"""Layers built on :mod:`stormshard.parallel`: sliding-window attention and its kernel, MLP,
transformer blocks (sequence- or tensor-parallel), graph-transformer and GNN blocks."""

from __future__ import annotations

from stormshard.layers.attention import (  # noqa: F401
    SHARD_STRATEGIES,
    ShardStrategy,
    SlidingWindowAttention,
    check_shard_sizes,
)
from stormshard.layers.chunking import (  # noqa: F401
    check_num_chunks,
    map_destination_chunks,
)
from stormshard.layers.conditional import (  # noqa: F401
    ConditionalLayerNorm,
    ConditionalTransformerBlock,
)
from stormshard.layers.gnn import (  # noqa: F401
    GNNMapperBlock,
    GNNProcessorBlock,
)
from stormshard.layers.graph_transformer import (  # noqa: F401
    GraphTransformerMapperBlock,
    GraphTransformerProcessorBlock,
    graph_attention,
)
from stormshard.layers.mlp import (  # noqa: F401
    MLP,
)
from stormshard.layers.tensor_parallel import (  # noqa: F401
    TensorParallelMLP,
    TensorParallelSlidingWindowAttention,
    TensorParallelTransformerBlock,
)
from stormshard.layers.transformer import (  # noqa: F401
    PROCESSOR_STRATEGIES,
    TransformerBlock,
    TransformerProcessor,
)
from stormshard.layers.window import (  # noqa: F401
    default_block_size,
    dense_window_attention,
    sliding_window_attention,
)

__all__ = [
    "sliding_window_attention",
    "dense_window_attention",
    "default_block_size",
    "SlidingWindowAttention",
    "ShardStrategy",
    "SHARD_STRATEGIES",
    "check_shard_sizes",
    "MLP",
    "TransformerBlock",
    "TransformerProcessor",
    "PROCESSOR_STRATEGIES",
    "TensorParallelSlidingWindowAttention",
    "TensorParallelMLP",
    "TensorParallelTransformerBlock",
    "ConditionalLayerNorm",
    "ConditionalTransformerBlock",
    "GraphTransformerMapperBlock",
    "GraphTransformerProcessorBlock",
    "graph_attention",
    "GNNMapperBlock",
    "GNNProcessorBlock",
    "map_destination_chunks",
    "check_num_chunks",
]
