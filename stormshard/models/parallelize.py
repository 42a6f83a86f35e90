"""The parallelize step: apply a model's parallelism after it is built, in one place, in a fixed order.

The model classes build the single-device-looking model on this rank's node slices (every layer
bound once to its shard: the :class:`~stormshard.models.sharding.ModelShardPlan`, the hidden
:class:`~stormshard.parallel.shard.SequenceShard`). :func:`parallelize` then, in this order (as
torchtitan's ``parallelize_llama``):

1. checks the parallel strategy (:func:`check_parallel_strategy`, the one check of
   ``parallel.shard_strategy`` against a model; preflight calls it before any process group);
2. tensor parallelism: every :class:`~stormshard.layers.transformer.TransformerProcessor` of the
   model built for ``"tensor"`` gets its blocks swapped for
   :class:`~stormshard.layers.tensor_parallel.TensorParallelTransformerBlock` slices over its
   shard (:func:`parallelize_processor`; no communication, parameter names unchanged);
3. activation checkpointing: every block of ``model.processor.blocks`` is wrapped in
   :class:`~stormshard.layers.checkpointing.ActivationCheckpoint` once
   (``model.activation_checkpointing``: ``true`` / ``"full"`` or ``"selective"``; every processor
   kind, names unchanged), and the encoder and decoder mappers where ``model.encoder`` /
   ``model.decoder.activation_checkpointing`` say so (:func:`checkpoint_mapper`).

:func:`build_transformer_processor` builds a standalone processor and applies steps 2 and 3 to it
(a tensor-parallel processor without a whole model). :func:`~stormshard.models.registry.build_model`
calls :func:`parallelize`; training and inference get the parallelized model from there.
"""

from __future__ import annotations

import json

from torch import nn

from stormshard.kernels.dispatch import AttentionKernel, attention_kernel_problem, graph_kernel_problem
from stormshard.layers.checkpointing import ActivationCheckpoint, checkpoint_blocks, checkpoint_mode
from stormshard.layers.mlp import mlp_hidden_width
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.strategy import indivisible_sizes
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.models.config import ModelConfig
from stormshard.models.sharding import ModelShardPlan
from stormshard.parallel.shard import SHARD_STRATEGIES, SequenceShard, ShardStrategy

__all__ = ["check_parallel_strategy", "check_graph_kernel_for_device", "checkpoint_mapper", "parallelize",
           "parallelize_processor", "build_transformer_processor"]


def check_attention_kernel_for_training(config: ModelConfig, device_type: str, precision: str) -> None:
    """Raise ValueError unless ``model.processor.attention_kernel`` can train on ``device_type`` at ``precision``
    (:func:`~stormshard.kernels.dispatch.attention_kernel_problem`: flex trains on CUDA only, with head dims of
    at least 16; flash needs CUDA, bf16 and flash-attn); the key applies to the sliding-window processors
    only (a graph processor with a kernel other than ``auto`` is refused rather than ignored).
    """
    kernel = config.processor.attention_kernel
    if kernel == "auto":
        return
    if config.is_builtin and config.uses_graph_processor:
        raise ValueError(
            f"model.processor.attention_kernel={kernel!r} applies to the sliding-window transformer only; "
            f"model.name={config.name!r} has a graph processor: leave attention_kernel out (or 'auto')"
        )
    problem = attention_kernel_problem(kernel, device_type, precision=precision, backward=True,
                                       head_dim=config.num_channels // max(1, config.processor.num_heads))
    if problem is not None:
        raise ValueError(f"model.processor.attention_kernel={kernel!r} cannot train here (training.precision="
                         f"{precision!r}, {device_type}): {problem}; or use 'auto' / 'banded'")


def check_graph_kernel_for_device(config: ModelConfig, device_type: str, field: str = "model.graph_kernel") -> None:
    """Raise ValueError unless ``config.graph_kernel`` can run on ``device_type``
    (:func:`~stormshard.kernels.dispatch.graph_kernel_problem`: ``triton`` needs Triton, and CUDA or
    ``TRITON_INTERPRET=1``); the setting applies to models with graph-transformer blocks (every built-in but
    ``gnn``: a kernel other than ``auto`` there is refused rather than ignored). ``field`` names the setting in
    the message (``--graph-kernel`` for a forecast)."""
    kernel = config.graph_kernel
    if kernel == "auto":
        return
    if config.is_builtin and config.name == "gnn":
        raise ValueError(f"{field}={kernel!r} picks the graph-transformer attention kernel, but model.name='gnn' has "
                         f"no graph-transformer block: leave {field} out (or 'auto')")
    problem = graph_kernel_problem(kernel, device_type)
    if problem is not None:
        raise ValueError(f"{field}={kernel!r} cannot run here ({device_type}): {problem}; or use 'auto' (Triton on "
                         "CUDA, csr elsewhere) / 'csr'")


def check_parallel_strategy(config: ModelConfig, shard_strategy: str, group_size: int) -> None:
    """Raise ValueError unless ``shard_strategy`` can split ``config``'s model over ``group_size`` ranks.

    The one check of ``parallel.shard_strategy`` (needs no process group): a known strategy; for
    the built-in models also no ``"tensor"`` for ``ensemble``, only ``"shard_sequence"`` for the
    graph processors (they shard by destination node), whole heads per rank for ``"shard_heads"``
    and ``"tensor"``, whole MLP hidden channels per rank for ``"tensor"``. A custom builder's own
    layers check their sizes when built. The message names the fields, the values and the fix.
    """
    if shard_strategy not in SHARD_STRATEGIES:
        raise ValueError(f"parallel.shard_strategy={shard_strategy!r} is unknown: choose one of {SHARD_STRATEGIES}")
    if not config.is_builtin or shard_strategy == "shard_sequence":
        return
    if config.uses_graph_processor:
        raise ValueError(
            f"parallel.shard_strategy={shard_strategy!r} applies to the sliding-window transformer processor only; "
            f"model.name={config.name!r} shards its graph by destination nodes: set parallel.shard_strategy="
            "'shard_sequence' (or leave it out)"
        )
    if config.name == "ensemble" and shard_strategy == "tensor":
        raise ValueError(
            "parallel.shard_strategy='tensor' does not apply to model.name='ensemble' (its conditional norms are "
            "not tensor-parallel): choose 'shard_sequence' or 'shard_heads'"
        )
    p, k = config.processor, group_size
    bad = indivisible_sizes(shard_strategy, k, num_heads=p.num_heads,
                            mlp_hidden=mlp_hidden_width(config.num_channels, p.mlp_ratio))
    if "num_heads" in bad:
        raise ValueError(
            f"model.processor.num_heads={p.num_heads} is not divisible by parallel.gpus_per_model={k}: "
            f"parallel.shard_strategy={shard_strategy!r} splits whole heads over the model group; use a multiple of "
            f"{k} heads or parallel.shard_strategy='shard_sequence'"
        )
    if "mlp_hidden" in bad:
        raise ValueError(
            f"model.processor.mlp_ratio * model.num_channels = {bad['mlp_hidden']} is not divisible by "
            f"parallel.gpus_per_model={k}: parallel.shard_strategy='tensor' splits the MLP hidden channels over the "
            "model group; choose mlp_ratio or num_channels so that it is, or parallel.shard_strategy='shard_sequence'"
        )


def parallelize_processor(processor: TransformerProcessor, *,
                          activation_checkpointing: bool | str = False) -> TransformerProcessor:
    """Swap in tensor-parallel blocks (``processor.shard_strategy == "tensor"``), wrap checkpointing; in place.

    ``activation_checkpointing``: false, true (``"full"``) or ``"selective"``
    (:mod:`stormshard.layers.checkpointing`). The blocks are sliced over ``processor.shard`` (the layers check that the heads and MLP
    channels split). Returns ``processor``. Blocks already swapped or wrapped are left as they
    are, so a second call changes nothing.
    """
    if not isinstance(processor, TransformerProcessor):
        raise TypeError(f"processor must be a TransformerProcessor, got {type(processor).__name__}")
    if processor.shard_strategy == "tensor":
        for i, block in enumerate(processor.blocks):
            if isinstance(block, TransformerBlock):
                processor.blocks[i] = TensorParallelTransformerBlock.from_block(block, processor.shard)
    mode = checkpoint_mode(activation_checkpointing)
    if mode is not None:
        checkpoint_blocks(processor.blocks, mode)
    return processor


def build_transformer_processor(num_layers: int, num_channels: int, num_heads: int, window_size: int,
                                mlp_ratio: float = 4, shard_strategy: ShardStrategy = "shard_sequence",
                                shard: SequenceShard | None = None, *,
                                activation_checkpointing: bool | str = False,
                                attention_kernel: AttentionKernel = "auto", qk_norm: bool = False,
                                mlp_kind: MLPKind = "mlp") -> TransformerProcessor:
    """A :class:`~stormshard.layers.transformer.TransformerProcessor` with its parallelism applied.

    ``shard``: the sequence's :class:`~stormshard.parallel.shard.SequenceShard` (None: one
    process); ``forward(x (batch, shard.local_size, C))`` -> same shape. Fresh ``"tensor"``
    processors hold, gathered, exactly the weights of the single-process processor built from the
    same seed.
    """
    processor = TransformerProcessor(num_layers, num_channels, num_heads, window_size, mlp_ratio, shard_strategy,
                                     shard, attention_kernel=attention_kernel, qk_norm=qk_norm, mlp_kind=mlp_kind)
    return parallelize_processor(processor, activation_checkpointing=activation_checkpointing)


def parallelize(model: nn.Module, config: ModelConfig, plan: ModelShardPlan) -> nn.Module:
    """Check the strategy, swap in tensor-parallel blocks, wrap activation checkpointing; in place.

    ``model``: built from ``config`` with ``plan``. Checkpointing wraps ``model.processor.blocks``
    (a ModuleList; every built-in model has one), and ``model.encoder`` / ``model.decoder`` as their configs
    say. Returns ``model``; a second call changes nothing.
    """
    check_parallel_strategy(config, plan.shard_strategy, plan.world)
    for processor in [m for m in model.modules() if isinstance(m, TransformerProcessor)]:
        parallelize_processor(processor)
    mode = checkpoint_mode(config.activation_checkpointing)
    if mode is not None:
        blocks = getattr(getattr(model, "processor", None), "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(
                f"model.activation_checkpointing is {json.dumps(config.activation_checkpointing)} but the model of "
                f"model.name={config.name!r} has no processor.blocks (an nn.ModuleList) to checkpoint: give it one, "
                "or wrap its blocks in stormshard.layers.checkpointing.ActivationCheckpoint in the builder and set "
                "it false"
            )
        checkpoint_blocks(blocks, mode)
    for section in ("encoder", "decoder"):
        checkpoint_mapper(model, section, getattr(config, section).activation_checkpointing)
    return model


def checkpoint_mapper(model: nn.Module, section: str, setting: bool | str) -> None:
    """Wrap ``model.<section>`` (``"encoder"`` or ``"decoder"``) in
    :class:`~stormshard.layers.checkpointing.ActivationCheckpoint` of ``setting``'s mode (false: nothing), in place,
    names unchanged; a mapper already wrapped stays as it is. The encoder's saved tensors on the data nodes (its
    keys, values and norms) then live only through its own backward, not through the whole step's."""
    mode = checkpoint_mode(setting)
    if mode is None:
        return
    mapper = getattr(model, section, None)
    if not isinstance(mapper, nn.Module):
        raise ValueError(f"model.{section}.activation_checkpointing is {json.dumps(setting)} but the model has no "
                         f"{section} module to checkpoint: give it a model.{section} attribute, or set it false")
    if not isinstance(mapper, ActivationCheckpoint):
        setattr(model, section, ActivationCheckpoint(mapper, mode))
