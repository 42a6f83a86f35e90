"""What conversion needs besides the tensors: the stored config's sections (validated, see
:mod:`stormshard.checkpoint.stored_config`), the dataset's variables and the graph the model was
trained on, and a check of a full state dict against the model."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.stored_config import StoredConfig
from stormshard.data.anemoi_layout import AnemoiDataset, Statistics
from stormshard.graphs.builder import graph_hash, load_graph, load_or_build_graph
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.variables import VariableIndex
from stormshard.parallel.partition import full_shape

__all__ = ["ModelSources", "model_sources", "state_differences", "full_shapes"]


@dataclass(frozen=True)
class ModelSources:
    """The stored config's validated sections, the dataset it trained on, its variables and graph."""

    config: StoredConfig
    dataset: AnemoiDataset
    variables: VariableIndex
    graph: HeteroGraph
    graph_path: Path


def _candidates(config: StoredConfig, checkpoint: Path) -> list[Path]:
    out = []
    if config.data.graph_cache:
        out.append(Path(config.data.graph_cache))
    out.append(Path(config.output_dir) / "graph.pt")
    for parent in checkpoint.resolve().parents[:3]:  # run/checkpoints/step_X -> run/graph.pt
        out.append(parent / "graph.pt")
    return out


def _statistics_file(path: Path, ds: AnemoiDataset) -> Statistics:
    try:
        stats = json.loads(path.read_text())
        columns = [np.array([float(stats[v][s]) for v in ds.variables]) for s in ("mean", "stdev", "minimum", "maximum")]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConversionError(f"the statistics file {path} (data.statistics of the checkpoint's config) cannot be "
                              f"read for the dataset's variables ({type(exc).__name__}: {exc})",
                              fix="restore it (the statistics.json of the bundle the run fine-tuned)") from None
    return Statistics(*columns, has_nans=ds.statistics.has_nans)


def model_sources(config: Mapping[str, Any] | StoredConfig, checkpoint: str | os.PathLike,
                  dataset: str | os.PathLike | None = None, graph: str | os.PathLike | None = None) -> ModelSources:
    """Open the dataset of ``config`` (a stored experiment config, plain or read; or ``dataset``) and
    find its graph: ``graph`` if given, else the graph cache / ``<run>/graph.pt`` next to
    ``checkpoint``, else rebuilt from the config (the rebuild is deterministic). A graph built from
    other settings is an error."""
    cfg = config if isinstance(config, StoredConfig) else StoredConfig.read(config)
    data_path = Path(dataset) if dataset is not None else Path(cfg.data.path)
    if not data_path.exists():
        raise ConversionError(f"the dataset {data_path} (data.path of the checkpoint's config) does not exist",
                              fix="pass --dataset PATH: the variables and coordinates come from it")
    ds = AnemoiDataset.open(data_path)
    try:
        variables = VariableIndex.build(ds.variables, cfg.data.forcing, cfg.data.diagnostic)
    except ValueError as exc:
        raise ConversionError(f"the dataset {data_path} does not fit the checkpoint's config: {exc}") from None
    if cfg.data.statistics:  # the run normalised with these (a fine-tuned imported model's)
        ds = replace(ds, statistics=_statistics_file(Path(cfg.data.statistics), ds))
    latlon = (ds.latitudes, ds.longitudes) if cfg.graph.data_grid is None else None
    digest = graph_hash(cfg.graph, latlon)
    if graph is None and cfg.data.graph_file:  # a fixed graph file: the run used it as it is
        gpath = Path(cfg.data.graph_file)
        if not gpath.is_file():
            raise ConversionError(f"the graph file {gpath} (data.graph_file of the checkpoint's config) does not exist",
                                  fix="pass --graph PATH: the graph.pt of the bundle the run fine-tuned")
        return ModelSources(cfg, ds, variables, load_graph(gpath), gpath)
    if graph is not None:
        gpath = Path(graph)
        if not gpath.is_file():
            raise ConversionError(f"--graph {gpath} does not exist")
        g = load_graph(gpath)
        if g.config_hash != digest:
            raise ConversionError(f"the graph {gpath} was built from other settings than the checkpoint's config",
                                  fix="pass the graph the model was trained on, or leave --graph out to rebuild it")
        return ModelSources(cfg, ds, variables, g, gpath)
    for cand in _candidates(cfg, Path(checkpoint)):
        if cand.is_file():
            try:
                g = load_graph(cand)
            except Exception:  # noqa: BLE001 - a foreign file: try the next one
                continue
            if g.config_hash == digest:
                return ModelSources(cfg, ds, variables, g, cand)
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="stormshard-graph-")) / "graph.pt"
    return ModelSources(cfg, ds, variables, load_or_build_graph(cfg.graph, tmp, data_latlon=latlon), tmp)


def full_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Full (single-process) shape of every parameter of ``model`` (sliced ones included)."""
    return {name: full_shape(p) for name, p in model.named_parameters()}


def state_differences(state: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Missing, extra and mis-shaped tensors of ``state`` against the model's ``shapes``."""
    out = [f"{n}: missing from the checkpoint (the model has {list(shapes[n])})" for n in sorted(set(shapes) - set(state))]
    out += [f"{n}: in the checkpoint ({list(state[n].shape)}) but not in the model" for n in sorted(set(state) - set(shapes))]
    out += [f"{n}: shape {list(state[n].shape)} in the checkpoint, {list(shapes[n])} in the model"
            for n in sorted(set(state) & set(shapes)) if tuple(state[n].shape) != tuple(shapes[n])]
    return out
