"""Layers built on :mod:`stormshard.parallel` and :mod:`stormshard.kernels`, each bound to its shard at
construction (``forward`` takes tensors only): sliding-window attention, transformer blocks and
processor (sequence- or tensor-parallel), graph-transformer and GNN blocks, activation
checkpointing, and the rule of what each shard strategy splits (``strategy``). The parallelize
step (``build_transformer_processor`` included) is :mod:`stormshard.models.parallelize`."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module, loaded on first use (the kernels and their names: stormshard.kernels)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("SlidingWindowAttention", "set_attention_kernel", "split_qkv"), "attention"),
    **dict.fromkeys(("ActivationCheckpoint", "checkpoint_blocks"), "checkpointing"),
    "ConditionalTransformerBlock": "conditional",
    **dict.fromkeys(("EdgeBufferPool", "EdgeKernelOptions", "GNNMapperBlock", "GNNProcessorBlock"), "gnn"),
    **dict.fromkeys(("GraphTransformerMapperBlock", "GraphTransformerProcessorBlock", "set_graph_kernel"),
                    "graph_transformer"),
    "MLP": "mlp",
    "TensorParallelTransformerBlock": "tensor_parallel",
    **dict.fromkeys(("TransformerBlock", "TransformerProcessor"), "transformer"),
    "TruncatedResidual": "truncation",
}
__all__ = [
    "SlidingWindowAttention", "MLP", "TransformerBlock",
    "TransformerProcessor", "TensorParallelTransformerBlock", "ConditionalTransformerBlock",
    "ActivationCheckpoint", "checkpoint_blocks",
    "GraphTransformerMapperBlock", "GraphTransformerProcessorBlock", "GNNMapperBlock",
    "GNNProcessorBlock", "EdgeKernelOptions", "EdgeBufferPool", "set_attention_kernel", "set_graph_kernel",
    "split_qkv", "TruncatedResidual",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
