"""Model builders by name, and ``build_model``: builder, shard plan and parallelize step in one call.

=================  ==========================================================================
name               processor
=================  ==========================================================================
transformer        sliding-window transformer (shard_sequence / shard_heads / tensor)
graphtransformer   graph transformer over the hidden graph (sharded by destination node)
gnn                message-passing GNN (encoder, processor and decoder all GNN blocks)
ensemble           sliding-window transformer with noise through conditional layer norms
=================  ==========================================================================

``model.name`` is one of these, a name added with :func:`register_model`, or
``"package.module:attribute"``: a :data:`ModelBuilder` of the user's own, imported by
:func:`resolve_builder` (``examples/custom_architecture.py: build``). The config checks only the
name's form and never calls the registry; a training run resolves its own config's name in its
preflight, and a loader resolves a stored config's name only after
:func:`~stormshard.models.trust.check_model_code` (a module named by a stored file needs the
user's ``trust_model_code``).

A builder constructs the single-device-looking model on this rank's node slices (``plan``:
:class:`~stormshard.models.sharding.ModelShardPlan`, which holds the model group and the shard
strategy): ``forward(x (batch, time, grid_local, input_variables))`` returns ``(batch, grid_local,
output_variables)``, sharded like the input. :func:`build_model` checks the strategy, builds the
plan, calls the builder and applies :func:`~stormshard.models.parallelize.parallelize`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import builder_module
from stormshard.models.parallelize import check_parallel_strategy, parallelize
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex
from stormshard.parallel.shapes import group_size

if TYPE_CHECKING:
    from stormshard.models.config import ModelConfig

__all__ = ["ModelBuilder", "MODEL_REGISTRY", "register_model", "resolve_builder", "build_model"]

#: ``builder(config, graph, variables, plan) -> nn.Module``: the model on this rank's node slices.
ModelBuilder = Callable[["ModelConfig", HeteroGraph, VariableIndex, ModelShardPlan], nn.Module]
MODEL_REGISTRY: dict[str, ModelBuilder] = {}

_FIX = ("name a registered model ({names}) or your own builder as 'package.module:function' (a function "
        "(config, graph, variables, plan) -> nn.Module in a module on PYTHONPATH)")


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder under ``name`` (then ``model.name`` may be ``name``)."""
    if ":" in name:
        raise ValueError(f"model name {name!r} contains ':', which marks 'package.module:attribute' names")

    def add(builder: ModelBuilder) -> ModelBuilder:
        if name in MODEL_REGISTRY:
            raise ValueError(f"a model named {name!r} is registered already")
        MODEL_REGISTRY[name] = builder
        return builder

    return add


def _import_builder(name: str) -> object:
    """The object ``"package.module:attribute"`` names; ValueError naming ``model.name`` otherwise."""
    builder_module(name)  # ValueError naming model.name when the form is wrong
    module_name, _, attribute = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model.name={name!r}: module {module_name!r} cannot be imported ({err}): put it on PYTHONPATH or "
            "install it (launch/train.py adds the repository root), or fix model.name"
        ) from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"model.name={name!r}: module {module_name!r} has no attribute {attribute!r}: define the builder "
                "there, or fix the name after ':'"
            )
        obj = getattr(obj, part)
    return obj


def resolve_builder(name: str) -> ModelBuilder:
    """The builder of ``model.name``: a registered name, or ``"package.module:attribute"`` (imported here).

    Raises ValueError naming ``model.name``, the value and the fix when the name is unknown, the
    module cannot be imported, the attribute is missing, not callable, or does not take
    ``(config, graph, variables, plan)``.
    """
    if name in MODEL_REGISTRY:
        return MODEL_REGISTRY[name]
    if ":" not in name:
        raise ValueError(f"model.name={name!r} is unknown: {_FIX.format(names=sorted(MODEL_REGISTRY))}")
    builder = _import_builder(name)
    if not callable(builder):
        raise ValueError(
            f"model.name={name!r} names a value of type {type(builder).__name__}, not a callable: point it at a builder "
            "function (config, graph, variables, plan) -> nn.Module"
        )
    try:
        inspect.signature(builder).bind(None, None, None, None)
    except TypeError as err:
        raise ValueError(
            f"model.name={name!r}: the builder cannot be called as builder(config, graph, variables, plan) ({err}): "
            "give it those four positional parameters"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): called as it is
        pass
    return builder


def _encoder_processor_decoder(config: ModelConfig, graph: HeteroGraph, variables: VariableIndex,
                               plan: ModelShardPlan) -> nn.Module:
    from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder

    return EncoderProcessorDecoder(config, graph, variables, plan)


def _ensemble(config: ModelConfig, graph: HeteroGraph, variables: VariableIndex, plan: ModelShardPlan) -> nn.Module:
    from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder

    return EnsembleEncoderProcessorDecoder(config, graph, variables, plan)


for _name in ("transformer", "graphtransformer", "gnn"):
    register_model(_name)(_encoder_processor_decoder)
register_model("ensemble")(_ensemble)


def build_model(config: ModelConfig, graph: HeteroGraph, variables: VariableIndex,
                model_group: dist.ProcessGroup | None = None, *,
                shard_strategy: str = "shard_sequence") -> nn.Module:
    """The model ``config.name`` on ``graph``, sharded over ``model_group`` (None: one rank), parallelized.

    ``shard_strategy`` (``parallel.shard_strategy``) is checked against the model first
    (:func:`~stormshard.models.parallelize.check_parallel_strategy`, before anything is built),
    then bound into the :class:`~stormshard.models.sharding.ModelShardPlan` the builder receives.
    The returned model carries that plan as ``model.plan`` (set here when the builder did not).
    """
    builder = resolve_builder(config.name)
    check_parallel_strategy(config, shard_strategy, group_size(model_group))
    plan = ModelShardPlan.build(graph, model_group, processor_graph=config.uses_graph_processor,
                                shard_strategy=shard_strategy)
    model = builder(config, graph, variables, plan)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.name={config.name!r}: the builder returned a {type(model).__name__}, not an "
                         "nn.Module: return the model")
    if getattr(model, "plan", None) is None:
        model.plan = plan
    return parallelize(model, config, plan)
