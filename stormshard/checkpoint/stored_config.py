"""The experiment config a checkpoint stores, read without training: the sections conversion and
inference need, each validated by its own small config.

``metadata.json`` holds the experiment config as plain JSON (a bundle: ``experiment`` and ``model``).
:meth:`StoredConfig.read` takes from it

- ``model``: a :class:`~stormshard.models.config.ModelConfig` (:func:`stored_model_config`: the
  old key ``model.processor.shard_strategy`` removed first);
- the processor shard strategy (:func:`stored_shard_strategy`: ``parallel.shard_strategy``, else the
  old ``model.processor.shard_strategy``, else ``"tensor"`` when
  ``parallel.tensor_model_parallel_size > 1``, else ``"shard_sequence"``);
- ``graph``: a :class:`~stormshard.graphs.builder.GraphConfig`;
- ``data``: :class:`DataFiles` (dataset path, variable roles, normalisation, timestep, graph cache);
- ``training.output_dir`` (where the run's graph cache is);

and keeps the whole dict as ``raw`` (written back as it is, e.g. by reshard). :func:`stored_layout`
reads a :class:`~stormshard.parallel.topology.ParallelLayout` from its ``parallel`` section.

Validating a stored config imports nothing. Before a loader reads the weights of a bundle or
checkpoint, :func:`check_model_builder` (:func:`check_checkpoint_builder` for a checkpoint path)
refuses a ``model.name`` that names a module unless the user trusts the file
(:func:`~stormshard.models.trust.check_model_code`), then resolves the builder, so that an unknown
name fails before any work.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stormshard.checkpoint.consolidate import checked_metadata, resolve_checkpoint
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.format import METADATA
from stormshard.data.normalisation import METHODS
from stormshard.errors import format_validation_errors
from stormshard.graphs.builder import GraphConfig
from stormshard.models.config import ModelConfig
from stormshard.models.registry import resolve_builder
from stormshard.models.trust import check_model_code
from stormshard.parallel.shard import SHARD_STRATEGIES
from stormshard.parallel.topology import LayoutError, ParallelLayout

__all__ = ["DataFiles", "StoredConfig", "stored_shard_strategy", "stored_model_config", "stored_layout",
           "check_model_builder", "check_checkpoint_builder", "checkpoint_model_section"]

_OLD_STRATEGY_KEY = "shard_strategy"  # under model.processor, before parallel.shard_strategy held it


class DataFiles(BaseModel):
    """The stored ``data`` section's fields a model needs besides its weights (the others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    path: str
    forcing: list[str]
    diagnostic: list[str]
    timestep: str | None
    normalisation: str
    normalisation_methods: dict[str, str] = Field(default_factory=dict)
    graph_cache: str | None = None
    graph_file: str | None = None  # a fixed graph (an imported model's): used as it is
    statistics: str | None = None  # a statistics.json that normalised instead of the dataset's

    @field_validator("normalisation")
    @classmethod
    def _method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"normalisation method {value!r} is unknown: use one of {METHODS}")
        return value


def stored_shard_strategy(raw: Mapping[str, Any]) -> str:
    """The processor shard strategy of the stored experiment config ``raw`` (see the module docstring)."""
    parallel = raw.get("parallel") or {}
    old = ((raw.get("model") or {}).get("processor") or {}).get(_OLD_STRATEGY_KEY)
    strategy = parallel.get("shard_strategy") or old
    if strategy is None:
        strategy = "tensor" if (parallel.get("tensor_model_parallel_size") or 1) > 1 else "shard_sequence"
    if strategy not in SHARD_STRATEGIES:
        raise ConversionError(f"the stored config's shard strategy {strategy!r} is unknown",
                              fix=f"set parallel.shard_strategy to one of {SHARD_STRATEGIES}")
    return strategy


def _section(kind: type[BaseModel], raw: Mapping[str, Any], name: str) -> Any:
    try:
        return kind(**raw[name])
    except ValidationError as exc:
        raise ConversionError(format_validation_errors(exc, f"the stored config's {name} section"),
                              fix="convert with the config the checkpoint was trained with") from None


def stored_model_config(model: Mapping[str, Any]) -> ModelConfig:
    """A stored ``model`` section (a checkpoint's or a bundle's) as a ModelConfig, without the old
    ``processor.shard_strategy`` key (read it with :func:`stored_shard_strategy`)."""
    section = copy.deepcopy(dict(model))
    if isinstance(section.get("processor"), dict):
        section["processor"].pop(_OLD_STRATEGY_KEY, None)
    return _section(ModelConfig, {"model": section}, "model")


def check_model_builder(model: Any, where: str, trust_model_code: bool) -> None:
    """Before anything of a bundle or checkpoint is read: the builder its stored ``model`` section names
    may be a module only with ``trust_model_code`` (else
    :class:`~stormshard.models.trust.UntrustedModelCode` naming ``where``, the file); it is resolved
    here (a trusted module is imported), so an unknown name is a :class:`ConversionError` now."""
    name = model.get("name") if isinstance(model, Mapping) else None
    check_model_code(name, where, trust_model_code)
    if not isinstance(name, str):
        return  # the section's validation names it
    try:
        resolve_builder(name)
    except ValueError as exc:
        raise ConversionError(f"{where}: {exc}") from None


def checkpoint_model_section(checkpoint: str | os.PathLike) -> tuple[Any, Path]:
    """The stored ``model`` section of a training or consolidated checkpoint (a step directory, a run's
    checkpoints directory or a consolidated one) and the metadata.json holding it; nothing else is read."""
    path = resolve_checkpoint(checkpoint)
    config = checked_metadata(path).get("config")
    return (config.get("model") if isinstance(config, dict) else None), path / METADATA


def check_checkpoint_builder(checkpoint: str | os.PathLike, trust_model_code: bool) -> None:
    """:func:`check_model_builder` on the stored config of a checkpoint (:func:`checkpoint_model_section`)."""
    model, where = checkpoint_model_section(checkpoint)
    check_model_builder(model, str(where), trust_model_code)


def stored_layout(raw: Mapping[str, Any], world_size: int) -> ParallelLayout:
    """The layout the stored config's ``parallel`` section gives at ``world_size`` ranks."""
    par = raw.get("parallel") or {}
    k = par.get("gpus_per_model") or par.get("tensor_model_parallel_size") or 1
    try:
        return ParallelLayout(world_size=world_size, gpus_per_model=k, read_group_size=par.get("read_group_size") or k,
                              gpus_per_ensemble=par.get("gpus_per_ensemble"),
                              pipeline_model_parallel_size=par.get("pipeline_model_parallel_size") or 1)
    except (LayoutError, ValueError, TypeError) as exc:
        raise ConversionError(f"the layout of the config's parallel section at world_size {world_size}: {exc}") from None


@dataclass(frozen=True)
class StoredConfig:
    """The validated sections of a stored experiment config, plus the whole of it as plain JSON."""

    raw: dict[str, Any]
    model: ModelConfig
    shard_strategy: str
    graph: GraphConfig
    data: DataFiles
    output_dir: str

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> StoredConfig:
        """Validate the sections of ``raw`` (a stored experiment config); :class:`ConversionError` names
        the first invalid or missing one."""
        raw = copy.deepcopy(dict(raw))
        for section in ("model", "graph", "data", "training"):
            if not isinstance(raw.get(section), dict):
                raise ConversionError(f"the stored config has no {section!r} section (got {raw.get(section)!r})",
                                      fix="convert a checkpoint written by launch/train.py")
        model = stored_model_config(raw["model"])
        strategy = stored_shard_strategy(raw)
        graph = _section(GraphConfig, raw, "graph")
        data = _section(DataFiles, raw, "data")
        output_dir = raw["training"].get("output_dir")
        if not isinstance(output_dir, str):
            raise ConversionError(f"the stored config's training.output_dir is {output_dir!r}, not a path",
                                  fix="convert a checkpoint written by launch/train.py")
        return cls(raw, model, strategy, graph, data, output_dir)
