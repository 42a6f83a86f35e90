"""Parameter tables of a model at a layout that is not running: build it rank by rank on the
``meta`` device (no memory, no communication) inside a fake process group.

Which parameters are sliced, and how, is decided by the model's own layers (they attach a
:class:`~stormshard.parallel.partition.Partition`); building the target model is the only way to
learn it that does not guess from parameter names. The processor shard strategy is passed next to
the :class:`~stormshard.models.config.ModelConfig` (a parallel setting, stored apart from it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.format import parameter_table
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex

__all__ = ["fake_model_group", "model_on_meta", "target_tables"]


@contextmanager
def fake_model_group(rank: int, size: int) -> Iterator[Any]:
    """A default process group of ``size`` ranks in which this process is ``rank``; collectives
    are no-ops. Yields the group (None for size 1). Needs torch.distributed uninitialised."""
    if size == 1:
        yield None
        return
    if dist.is_initialized():
        raise ConversionError(
            f"cannot lay out the model for {size} ranks: torch.distributed is already initialised in this "
            "process", fix="run checkpoint conversion in a plain single process (python launch/convert_checkpoint.py)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def model_on_meta(config: ModelConfig, shard_strategy: str, graph: HeteroGraph, variables: VariableIndex, rank: int,
                  size: int) -> nn.Module:
    """Rank ``rank``'s shard of the model for a model group of ``size`` ranks, on the meta device."""
    with fake_model_group(rank, size) as group, torch.device("meta"):
        return build_model(config, graph, variables, group, shard_strategy=shard_strategy)


def target_tables(config: ModelConfig, shard_strategy: str, graph: HeteroGraph, variables: VariableIndex,
                  size: int) -> list[list[dict]]:
    """Parameter tables (see :func:`~stormshard.checkpoint.format.parameter_table`) of the ``size``
    ranks of one model group."""
    return [parameter_table(model_on_meta(config, shard_strategy, graph, variables, r, size)) for r in range(size)]
