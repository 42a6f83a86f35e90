"""Layers built on :mod:`stormshard.parallel`, each bound to its shard at construction
(``forward`` takes tensors only): sliding-window attention and its kernels, transformer blocks and
processor (sequence- or tensor-parallel), graph-transformer and GNN blocks, activation
checkpointing, and the rule of what each shard strategy splits (``strategy``). The parallelize
step (``build_transformer_processor`` included) is :mod:`stormshard.models.parallelize`."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module, loaded on first use: the torch-free kernel names (read by the model config) do not
# load torch and the layers
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("SlidingWindowAttention", "set_attention_kernel"), "attention"),
    **dict.fromkeys(("ActivationCheckpoint", "checkpoint_blocks"), "checkpointing"),
    "ConditionalTransformerBlock": "conditional",
    **dict.fromkeys(("EdgeBufferPool", "EdgeKernelOptions", "GNNMapperBlock", "GNNProcessorBlock"), "gnn"),
    **dict.fromkeys(("GraphTransformerMapperBlock", "GraphTransformerProcessorBlock"), "graph_transformer"),
    "MLP": "mlp",
    "TensorParallelTransformerBlock": "tensor_parallel",
    **dict.fromkeys(("TransformerBlock", "TransformerProcessor"), "transformer"),
    "sliding_window_attention": "window",
    **dict.fromkeys(("ATTENTION_KERNELS", "AttentionKernel"), "kernel_names"),
}
__all__ = [
    "sliding_window_attention", "SlidingWindowAttention", "MLP", "TransformerBlock",
    "TransformerProcessor", "TensorParallelTransformerBlock", "ConditionalTransformerBlock",
    "ActivationCheckpoint", "checkpoint_blocks",
    "GraphTransformerMapperBlock", "GraphTransformerProcessorBlock", "GNNMapperBlock",
    "GNNProcessorBlock", "EdgeKernelOptions", "EdgeBufferPool", "set_attention_kernel", "AttentionKernel",
    "ATTENTION_KERNELS",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
