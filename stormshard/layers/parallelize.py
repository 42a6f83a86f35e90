"""Apply a transformer processor's parallelism after it is built, in one place and a fixed order.

:class:`~stormshard.layers.transformer.TransformerProcessor` builds the single-device form
(full-weight blocks bound to their :class:`~stormshard.parallel.shard.SequenceShard`). Then
:func:`parallelize_processor`:

1. checks the strategy once (:func:`check_processor_strategy`: heads split whole over the group
   for ``"shard_heads"`` and ``"tensor"``, the MLP hidden channels too for ``"tensor"``);
2. for ``"tensor"``, swaps every block for its
   :class:`~stormshard.layers.tensor_parallel.TensorParallelTransformerBlock` slice over the
   processor's shard (no communication; parameter names unchanged);
3. wraps every block in :class:`~stormshard.layers.checkpointing.ActivationCheckpoint` when asked
   (names unchanged).

:func:`build_transformer_processor` does construction and parallelization in one call: the
standalone way to get a tensor-parallel processor. The models' step
(:func:`stormshard.models.parallelize.parallelize`) calls :func:`parallelize_processor` too.
"""

from __future__ import annotations

from stormshard.layers.attention import check_shard_strategy
from stormshard.layers.checkpointing import checkpoint_blocks, unwrap_block
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock, check_tensor_parallel_sizes
from stormshard.layers.transformer import PROCESSOR_STRATEGIES, TransformerBlock, TransformerProcessor
from stormshard.parallel.shard import SequenceShard

__all__ = ["check_processor_strategy", "parallelize_processor", "build_transformer_processor"]


def check_processor_strategy(shard_strategy: str, num_heads: int, mlp_hidden: int, shard: SequenceShard | None) -> None:
    """Raise unless ``shard_strategy`` works with ``num_heads`` heads and ``mlp_hidden`` MLP channels over ``shard``'s group."""
    if shard_strategy not in PROCESSOR_STRATEGIES:
        raise ValueError(f"shard_strategy must be one of {PROCESSOR_STRATEGIES}, got {shard_strategy!r}")
    if shard_strategy == "tensor":
        check_tensor_parallel_sizes(num_heads, mlp_hidden, 1 if shard is None else shard.world)
    else:
        check_shard_strategy(shard_strategy, num_heads, shard)


def parallelize_processor(processor: TransformerProcessor, *,
                          activation_checkpointing: bool = False) -> TransformerProcessor:
    """Check, swap in tensor-parallel blocks (``shard_strategy="tensor"``), wrap checkpointing; in place.

    Returns ``processor``. Blocks already swapped or wrapped are left as they are, so a second
    call changes nothing.
    """
    if not isinstance(processor, TransformerProcessor):
        raise TypeError(f"processor must be a TransformerProcessor, got {type(processor).__name__}")
    first = unwrap_block(processor.blocks[0])
    if isinstance(first, TransformerBlock):
        check_processor_strategy(processor.shard_strategy, first.attention.num_heads, first.mlp.fc1.out_features,
                                 processor.shard)
    if processor.shard_strategy == "tensor":
        for i, block in enumerate(processor.blocks):
            if isinstance(block, TransformerBlock):
                processor.blocks[i] = TensorParallelTransformerBlock.from_block(block, processor.shard)
    if activation_checkpointing:
        checkpoint_blocks(processor.blocks)
    return processor


def build_transformer_processor(num_layers: int, num_channels: int, num_heads: int, window_size: int,
                                mlp_ratio: int = 4, shard_strategy: str = "shard_sequence",
                                shard: SequenceShard | None = None, *,
                                activation_checkpointing: bool = False) -> TransformerProcessor:
    """A :class:`TransformerProcessor` with its parallelism applied (:func:`parallelize_processor`).

    ``shard``: the sequence's :class:`~stormshard.parallel.shard.SequenceShard` (None: one
    process); ``forward(x (batch, shard.local_size, C))``. Fresh ``"tensor"`` processors hold,
    gathered, exactly the weights of the single-process processor built from the same seed.
    """
    processor = TransformerProcessor(num_layers, num_channels, num_heads, window_size, mlp_ratio, shard_strategy,
                                     shard)
    return parallelize_processor(processor, activation_checkpointing=activation_checkpointing)
