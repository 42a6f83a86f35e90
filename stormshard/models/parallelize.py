"""The parallelize step: apply a model's parallelism after it is built, in one place, in a fixed order.

The model classes build the single-device-looking model on this rank's node slices (every layer
bound once to its shard: the :class:`~stormshard.models.sharding.ModelShardPlan`, the hidden
:class:`~stormshard.parallel.shard.SequenceShard`). :func:`parallelize` then, in this order:

1. checks the parallel strategy once (:func:`check_parallel_strategy`): the processor's heads
   split whole over the model group for ``"shard_heads"`` and ``"tensor"``, the MLP hidden
   channels too for ``"tensor"``; ``"tensor"`` is rejected for the ensemble model;
2. swaps the window processor's blocks for
   :class:`~stormshard.layers.tensor_parallel.TensorParallelTransformerBlock` slices over the
   hidden shard (``shard_strategy="tensor"``; no communication, parameter names unchanged);
3. wraps every processor block in :class:`~stormshard.layers.checkpointing.ActivationCheckpoint`
   once (``activation_checkpointing``; every processor kind, names unchanged).

:func:`~stormshard.models.registry.build_model` calls it; training and inference get the
parallelized model from there.
"""

from __future__ import annotations

from torch import nn

from stormshard.layers.checkpointing import checkpoint_blocks
from stormshard.layers.parallelize import check_processor_strategy, parallelize_processor
from stormshard.models.config import ModelConfig
from stormshard.models.processors import WindowTransformerProcessor
from stormshard.models.sharding import ModelShardPlan

__all__ = ["parallelize", "check_parallel_strategy"]


def check_parallel_strategy(config: ModelConfig, plan: ModelShardPlan) -> None:
    """Raise unless ``config``'s processor strategy works over ``plan``'s model group; the message names the field."""
    p = config.processor
    if config.name == "ensemble" and p.shard_strategy == "tensor":
        raise ValueError(
            "model.name='ensemble' supports processor.shard_strategy 'shard_sequence' or 'shard_heads', not "
            "'tensor': its conditional norms are not tensor-parallel; choose one of the two"
        )
    if config.uses_graph_processor:
        return
    try:
        check_processor_strategy(p.shard_strategy, p.num_heads, p.mlp_ratio * config.num_channels, plan.hidden_shard)
    except ValueError as err:
        raise ValueError(
            f"model.processor.shard_strategy={p.shard_strategy!r} over a model group of {plan.world} ranks: {err}"
        ) from err


def parallelize(model: nn.Module, config: ModelConfig, plan: ModelShardPlan) -> nn.Module:
    """Check the strategy, swap in tensor-parallel blocks, wrap activation checkpointing; in place.

    ``model``: an encoder-processor-decoder built from ``config`` with ``plan`` (its
    ``processor`` has a ``blocks`` ModuleList). Returns ``model``.
    """
    check_parallel_strategy(config, plan)
    processor = model.processor
    if isinstance(processor, WindowTransformerProcessor):  # the tensor swap, over plan.hidden_shard
        parallelize_processor(processor.processor)
    if config.activation_checkpointing:
        checkpoint_blocks(processor.blocks)
    return model
