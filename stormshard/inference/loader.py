"""Load a forecast model sharded over a model group, from an exported bundle or from a training
(or consolidated) checkpoint of any layout.

Two steps, so that every request can be checked before any process group or model exists:

1. :func:`open_model_source` reads what the model is (config, variable roles, graph,
   normalisation statistics, the precision it trained in) and where its full weights are: a
   bundle's ``model.safetensors`` (read lazily), or a checkpoint consolidated from its partition
   metadata (:func:`stormshard.checkpoint.consolidate.load_any`; any ``gpus_per_model``, shard
   strategy and ZeRO stage). The stored config's sections are read and validated by
   :class:`~stormshard.checkpoint.stored_config.StoredConfig`; nothing here needs training. A
   builder the stored config names as ``"package.module:attribute"`` is imported only with
   ``trust_model_code=True`` (:func:`~stormshard.checkpoint.stored_config.check_model_builder`,
   before any weight is read).
2. :func:`build_forecaster` builds the model with a
   :class:`~stormshard.models.sharding.ModelShardPlan` over ``model_group`` (K ranks, unrelated
   to the layout it trained at) and loads this rank's slice of every parameter: the full tensor
   for replicated ones, ``slice_partition`` along its :class:`~stormshard.parallel.partition.Partition`
   for tensor-parallel ones (a bundle reads only that slice from disk), with the processor shard
   strategy the model trained with. Nothing is communicated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.checkpoint.averaged_weights import check_weight_choice
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import (
    InferenceModel,
    build_normalisers,
    bundle_shard_strategy,
    read_bundle_metadata,
)
from stormshard.checkpoint.sources import full_shapes, state_differences
from stormshard.checkpoint.stored_config import (
    check_checkpoint_builder,
    stored_model_config,
)
from stormshard.data.anemoi_layout import Statistics
from stormshard.graphs.builder import load_graph
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex
from stormshard.parallel.partition import get_partition

__all__ = ["PRECISIONS", "ModelSource", "open_model_source", "build_forecaster", "load_forecaster"]

PRECISIONS: dict[str, torch.dtype] = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16,
                                      "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """What a forecast model is, without its weights in memory.

    ``read_slice(name, partition)`` returns the full tensor ``name`` (``partition`` None) or the
    slice a partition describes. ``train_range``: the ``(start, end)`` of the training period
    (None ends: the dataset's); ``precision``: the precision it trained in (``training.precision``);
    ``shard_strategy``: the processor shard strategy it trained with (used at any model group size).
    """

    path: Path
    kind: str  # "bundle" or "checkpoint"
    config: ModelConfig
    shard_strategy: str
    variables: VariableIndex
    graph: HeteroGraph
    statistics: dict[str, dict[str, float]]  # per dataset variable: mean, stdev, minimum, maximum
    normalisation: dict[str, Any]  # {"default": ..., "methods": {...}}
    timestep: str | None
    train_range: tuple[str | None, str | None]
    precision: str
    step: int | None
    metadata: dict[str, Any]
    read_slice: Callable[[str, Any], Tensor]
    names: tuple[str, ...]  # the full state's parameter names
    shapes: dict[str, tuple[int, ...]]  # and shapes


def _precision_of(experiment: dict[str, Any]) -> str:
    """``training.precision`` of the experiment (older configs: DeepSpeed's ``bf16.enabled``)."""
    declared = (experiment.get("training") or {}).get("precision")
    if declared in PRECISIONS:
        return declared
    bf16 = (experiment.get("deepspeed") or {}).get("bf16") or {}
    return "bf16" if isinstance(bf16, dict) and bf16.get("enabled") else "fp32"


def _train_range(experiment: dict[str, Any]) -> tuple[str | None, str | None]:
    train = (experiment.get("data") or {}).get("train") or {}
    return train.get("start"), train.get("end")


def _open_bundle(p: Path, meta: dict[str, Any]) -> ModelSource:
    from safetensors import safe_open

    weights = p / "model.safetensors"
    reading = weights
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = tuple(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        reading = p / "statistics.json"
        statistics = json.loads(reading.read_text())
        reading = p / "graph.pt"
        graph = load_graph(reading)
    except Exception as exc:  # noqa: BLE001 - any read error means a damaged bundle
        raise ConversionError(f"{reading}: this bundle file cannot be read ({type(exc).__name__}: {str(exc)[:160]})",
                              fix="the bundle is damaged: export it again (`python launch/convert_checkpoint.py "
                                  f"inspect {p} --verify` lists every damaged file)") from None

    def read_slice(name: str, part: Any) -> Tensor:
        with safe_open(str(weights), framework="pt") as f:
            if part is None:
                return f.get_tensor(name)
            index = [slice(None)] * len(shapes[name])
            index[part.dim] = slice(part.offset, part.offset + part.sizes[part.index])
            return f.get_slice(name)[tuple(index)]

    roles = meta["variables"]
    experiment = meta.get("experiment", {})
    return ModelSource(p, "bundle", stored_model_config(meta["model"]), bundle_shard_strategy(meta),
                       VariableIndex.build(roles["dataset"], roles["forcing"], roles["diagnostic"]), graph, statistics,
                       meta["normalisation"], meta.get("timestep"), _train_range(experiment),
                       _precision_of(experiment), meta.get("step"), meta, read_slice, names, shapes)


def _open_checkpoint(path: Path, dataset: str | os.PathLike | None, graph: str | os.PathLike | None,
                     weights: str | None = None) -> ModelSource:
    from stormshard.checkpoint.averaged_weights import choose_weights
    from stormshard.checkpoint.consolidate import load_any, resolve_checkpoint
    from stormshard.checkpoint.sources import model_sources
    from stormshard.parallel.tensor import slice_partition

    ckpt = load_any(path)
    src = model_sources(ckpt.config, resolve_checkpoint(path), dataset, graph)
    cfg, ds = src.config, src.dataset
    stats = {name: {s: float(getattr(ds.statistics, s)[i]) for s in ("mean", "stdev", "minimum", "maximum")}
             for i, name in enumerate(ds.variables)}
    full, which = choose_weights(ckpt.model, ckpt.average, weights, str(path))  # the average by default

    def read_slice(name: str, part: Any) -> Tensor:
        return full[name] if part is None else slice_partition(full[name], part)

    experiment = cfg.raw
    meta = {"format": "stormshard-checkpoint", "step": ckpt.step, "source": str(path), "experiment": experiment,
            "source_layout": ckpt.source_layout, "weights": which}
    return ModelSource(path, "checkpoint", cfg.model, cfg.shard_strategy, src.variables, src.graph, stats,
                       {"default": cfg.data.normalisation, "methods": dict(cfg.data.normalisation_methods)},
                       cfg.data.timestep, _train_range(experiment), _precision_of(experiment), ckpt.step, meta,
                       read_slice, tuple(full), {n: tuple(t.shape) for n, t in full.items()})


def open_model_source(source: str | os.PathLike, *, dataset: str | os.PathLike | None = None,
                      graph: str | os.PathLike | None = None, trust_model_code: bool = False,
                      weights: str | None = None) -> ModelSource:
    """An exported bundle directory, or a training checkpoint (a ``step_NNNNNNNN`` directory or a
    run's ``checkpoints`` directory, any layout) or a consolidated checkpoint. ``dataset`` /
    ``graph`` replace the checkpoint config's dataset path / graph cache (checkpoints only);
    ``trust_model_code``: the stored config may name a builder module to import; ``weights``: a checkpoint's
    ``"averaged"`` weights (its ``training.weight_averaging`` average: the default where it has one) or
    ``"trained"`` ones; a bundle holds one set, and asking for the other is an error."""
    check_weight_choice(weights)
    p = Path(source)
    if not p.exists():
        raise ConversionError(f"the model source {p} does not exist",
                              fix="pass an exported bundle or a training checkpoint directory")
    if (p / "metadata.json").is_file():
        meta = read_bundle_metadata(p, trust_model_code=trust_model_code, other_formats=True)
        if meta is not None:
            held = meta.get("weights", "trained")
            if weights is not None and weights != held:
                raise ConversionError(f"--weights {weights}: the bundle {p} holds its checkpoint's {held} weights",
                                      fix="leave --weights out, or export the checkpoint again with --weights "
                                          f"{weights}")
            return _open_bundle(p, meta)
    check_checkpoint_builder(p, trust_model_code)
    return _open_checkpoint(p, dataset, graph, weights)


def build_forecaster(source: ModelSource, model_group: dist.ProcessGroup | None = None,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> InferenceModel:
    """This rank's shard of the model (``model_group``: the K ranks that hold one model; None:
    the whole model here), in eval mode and ``dtype``, with this rank's slice of the weights; the model and
    its normalisers on ``device``."""
    model = build_model(source.config, source.graph, source.variables, model_group,
                        shard_strategy=source.shard_strategy)
    problems = state_differences({n: torch.empty(s, device="meta") for n, s in source.shapes.items()}, full_shapes(model))
    if problems:
        raise ConversionError(f"the weights of {source.path} do not match the model of its config:", problems,
                              fix="use the config, dataset and graph the model was trained with")
    state = {name: source.read_slice(name, get_partition(p)) for name, p in model.named_parameters()}
    model.load_state_dict(state)
    model.to(device=device, dtype=dtype).eval()
    v = source.variables
    stats = Statistics(*(np.array([source.statistics[n][s] for n in v.variables])
                         for s in ("mean", "stdev", "minimum", "maximum")))
    normaliser, output_normaliser = (n.to(device) for n in build_normalisers(stats, v, source.normalisation))
    return InferenceModel(model=model, normaliser=normaliser, output_normaliser=output_normaliser, variables=v,
                          graph=source.graph, config=source.config, timestep=source.timestep,
                          metadata=source.metadata)


def load_forecaster(source: str | os.PathLike, model_group: dist.ProcessGroup | None = None,
                    precision: str | None = None, *, dataset: str | os.PathLike | None = None,
                    graph: str | os.PathLike | None = None, trust_model_code: bool = False,
                    weights: str | None = None) -> InferenceModel:
    """:func:`open_model_source` then :func:`build_forecaster` in ``precision`` (a key of
    :data:`PRECISIONS`; None: the precision the model trained in); ``weights``: ``"averaged"`` / ``"trained"``
    (None: a checkpoint's weight average where it has one)."""
    src = open_model_source(source, dataset=dataset, graph=graph, trust_model_code=trust_model_code, weights=weights)
    name = precision or src.precision
    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r} is unknown: use one of {sorted(PRECISIONS)}")
    return build_forecaster(src, model_group, PRECISIONS[name])
