"""Layers built on :mod:`stormshard.parallel`, each bound to its shard at construction
(``forward`` takes tensors only): sliding-window attention and its kernel, transformer blocks and
processor (sequence- or tensor-parallel), graph-transformer and GNN blocks, activation
checkpointing, and the rule of what each shard strategy splits (``strategy``). The parallelize
step (``build_transformer_processor`` included) is :mod:`stormshard.models.parallelize`."""

from __future__ import annotations

from stormshard.layers.attention import SlidingWindowAttention
from stormshard.layers.checkpointing import ActivationCheckpoint, checkpoint_blocks
from stormshard.layers.conditional import ConditionalTransformerBlock
from stormshard.layers.gnn import EdgeBufferPool, EdgeKernelOptions, GNNMapperBlock, GNNProcessorBlock
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock, GraphTransformerProcessorBlock
from stormshard.layers.mlp import MLP
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.layers.window import sliding_window_attention

__all__ = [
    "sliding_window_attention", "SlidingWindowAttention", "MLP", "TransformerBlock",
    "TransformerProcessor", "TensorParallelTransformerBlock", "ConditionalTransformerBlock",
    "ActivationCheckpoint", "checkpoint_blocks",
    "GraphTransformerMapperBlock", "GraphTransformerProcessorBlock", "GNNMapperBlock",
    "GNNProcessorBlock", "EdgeKernelOptions", "EdgeBufferPool",
]
