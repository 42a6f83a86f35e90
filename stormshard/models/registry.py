"""Named models: ``build_model(config, graph, variables, model_group)``.

=================  ==========================================================================
name               processor
=================  ==========================================================================
transformer        sliding-window transformer (shard_sequence / shard_heads / tensor)
graphtransformer   graph transformer over the hidden graph (sharded by destination node)
gnn                message-passing GNN (encoder, processor and decoder all GNN blocks)
ensemble           sliding-window transformer with noise through conditional layer norms
=================  ==========================================================================

A builder constructs the single-device-looking model; :func:`build_model` then applies
:func:`~stormshard.models.parallelize.parallelize` (strategy checks, tensor-parallel blocks,
activation checkpointing) and returns the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch_geometric.data import HeteroData

from stormshard.models.config import MODEL_NAMES, ModelConfig
from stormshard.models.parallelize import parallelize
from stormshard.models.variables import VariableIndex

__all__ = ["MODEL_REGISTRY", "register_model", "build_model"]

ModelBuilder = Callable[[ModelConfig, HeteroData, VariableIndex, "dist.ProcessGroup | None"], nn.Module]
MODEL_REGISTRY: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder under ``name``."""

    def add(builder: ModelBuilder) -> ModelBuilder:
        if name in MODEL_REGISTRY:
            raise ValueError(f"a model named {name!r} is registered already")
        MODEL_REGISTRY[name] = builder
        return builder

    return add


def _encoder_processor_decoder(config, graph, variables, model_group):  # noqa: ANN001, ANN202
    from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder

    return EncoderProcessorDecoder(config, graph, variables, model_group)


def _ensemble(config, graph, variables, model_group):  # noqa: ANN001, ANN202
    from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder

    return EnsembleEncoderProcessorDecoder(config, graph, variables, model_group)


for _name in ("transformer", "graphtransformer", "gnn"):
    register_model(_name)(_encoder_processor_decoder)
register_model("ensemble")(_ensemble)
if set(MODEL_REGISTRY) != set(MODEL_NAMES):  # a developer error: the config and the registry disagree
    raise RuntimeError(f"model registry {sorted(MODEL_REGISTRY)} != config names {sorted(MODEL_NAMES)}")


def build_model(
    config: ModelConfig, graph: HeteroData, variables: VariableIndex, model_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """The model ``config.name`` on ``graph``, sharded over ``model_group`` (None: one rank), parallelized."""
    if config.name not in MODEL_REGISTRY:
        raise ValueError(f"unknown model {config.name!r}: choose one of {sorted(MODEL_REGISTRY)}")
    model = MODEL_REGISTRY[config.name](config, graph, variables, model_group)
    return parallelize(model, config, model.plan)
