"""Inference bundles: everything a forecast needs, loadable with one call, without DeepSpeed.

Layout of a bundle directory (written atomically: temp dir, then rename)::

    <bundle>/
      metadata.json      format "stormshard-bundle"; step; the model config; the experiment config
                         it was trained with (as stored in the checkpoint: its parallel section holds
                         the processor shard strategy); variable roles (dataset order, forcing,
                         diagnostic); normalisation methods; timestep; the parameter table
      model.safetensors  full (single-process) weights
      statistics.json    per dataset variable: mean, stdev, minimum, maximum
      graph.pt           the graph (stormshard.graphs.builder.save_graph format)

``load_model(path)`` returns an :class:`InferenceModel`: the model on CPU in eval mode (one
process, no process group), the input and output normalisers, the variable roles and the graph.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from stormshard.checkpoint.averaged_weights import check_weight_choice, choose_weights
from stormshard.checkpoint.consolidate import (
    atomic_directory,
    check_output_free,
    check_output_path,
    load_any,
    resolve_checkpoint,
    save_safetensors,
)
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.groups import model_on_meta
from stormshard.checkpoint.integrity import FILES, record_files
from stormshard.checkpoint.sources import full_shapes, model_sources, state_differences
from stormshard.checkpoint.stored_config import (
    check_checkpoint_builder,
    check_model_builder,
    stored_model_config,
    stored_shard_strategy,
)
from stormshard.data.anemoi_layout import Statistics
from stormshard.data.normalisation import Normaliser
from stormshard.graphs.builder import load_graph
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex

__all__ = ["BUNDLE_FORMAT", "InferenceModel", "export_bundle", "load_model", "build_normalisers",
           "bundle_shard_strategy", "check_bundle_metadata", "read_bundle_metadata", "write_bundle_metadata"]

BUNDLE_FORMAT = "stormshard-bundle"
_STATS = ("mean", "stdev", "minimum", "maximum")


@dataclass(frozen=True)
class InferenceModel:
    """What :func:`load_model` returns. ``model`` maps a normalised input
    ``(batch, multistep_input, grid, input_variables)`` to the next normalised state
    ``(batch, grid, output_variables)``."""

    model: nn.Module
    normaliser: Normaliser  # over variables.input_names
    output_normaliser: Normaliser  # over variables.output_names
    variables: VariableIndex
    graph: HeteroGraph
    config: ModelConfig
    timestep: str | None
    metadata: dict[str, Any]

    @property
    def multistep_input(self) -> int:
        return self.config.multistep_input

    @torch.no_grad()
    def predict(self, states: Tensor, noise: Tensor | None = None, step: int = 0) -> Tensor:
        """Physical input states ``(batch, multistep_input, grid, input_variables)`` -> the next
        physical state ``(batch, grid, output_variables)``. An ensemble model (one member per batch
        entry) takes its ``noise`` ``(batch, hidden, noise_channels)`` (None: drawn) and the rollout
        ``step`` (its ``fcstep_input``); other models take neither."""
        x = self.normaliser.normalise(states.double()).float()
        if self.config.name != "ensemble":
            if noise is not None or step:
                raise ValueError(f"noise / step are for ensemble models; this model is {self.config.name!r}")
            return self.output_normaliser.denormalise(self.model(x).double())
        noise = None if noise is None else noise.float()
        return self.output_normaliser.denormalise(self.model(x, noise, step=step).double())


def export_bundle(source: str | os.PathLike, out: str | os.PathLike, *, dataset: str | os.PathLike | None = None,
                  graph: str | os.PathLike | None = None, overwrite: bool = False,
                  trust_model_code: bool = False, weights: str | None = None) -> Path:
    """Write an inference bundle from a training or consolidated checkpoint (any layout); never into
    the source (:func:`~stormshard.checkpoint.consolidate.check_output_path`). A builder the stored
    config names as ``"package.module:attribute"`` is imported only with ``trust_model_code``. ``weights``:
    ``"averaged"`` (the checkpoint's weight average, the default where it has one), ``"trained"`` (the default
    without one); the bundle's ``metadata.json`` says which (``weights``, ``weight_average``)."""
    check_weight_choice(weights)
    check_output_path(source, out, overwrite)
    check_output_free(out, overwrite)  # before the checkpoint is read
    check_checkpoint_builder(source, trust_model_code)
    ckpt = load_any(source)
    src = model_sources(ckpt.config, resolve_checkpoint(source), dataset, graph)
    cfg = src.config
    target = model_on_meta(cfg.model, cfg.shard_strategy, src.graph, src.variables, 0, 1)
    tensors, which = choose_weights(ckpt.model, ckpt.average, weights, str(source))
    problems = state_differences(tensors, full_shapes(target))
    if problems:
        raise ConversionError(f"{source} does not match the model of its config:", problems,
                              fix="export with the config, dataset and graph the checkpoint was trained with")
    ds, v = src.dataset, src.variables
    meta = {
        "format": BUNDLE_FORMAT, "version": 1, "step": ckpt.step, "time": time.time(), "source": str(source),
        "model": cfg.model.model_dump(mode="json"), "experiment": cfg.raw,
        "variables": {"dataset": list(v.variables), "forcing": list(v.forcing), "diagnostic": list(v.diagnostic)},
        "normalisation": {"default": cfg.data.normalisation, "methods": dict(cfg.data.normalisation_methods)},
        "timestep": cfg.data.timestep, "dataset": {"path": str(ds.path), "resolution": ds.resolution},
        "parameters": [{"name": n, "shape": list(t.shape)} for n, t in tensors.items()],
        "weights": which, "weight_average": ckpt.average_info if which == "averaged" else None,
    }
    stats = {name: {s: float(getattr(ds.statistics, s)[i]) for s in _STATS} for i, name in enumerate(ds.variables)}
    with atomic_directory(out, overwrite) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", {"step": str(ckpt.step)})
        (tmp / "statistics.json").write_text(json.dumps(stats, indent=1))
        shutil.copyfile(src.graph_path, tmp / "graph.pt")
        write_bundle_metadata(tmp, meta, ("model.safetensors", "statistics.json", "graph.pt"))
    return Path(out)


def write_bundle_metadata(directory: Path, meta: dict[str, Any], files: tuple[str, ...]) -> None:
    """``metadata.json`` of the bundle being written in ``directory``, last, with the size and sha256 of each of its
    ``files`` (``meta["files"]``: what ``inspect --verify`` checks; a file a user edits, such as
    ``finetune_config.json``, is left out)."""
    meta[FILES] = record_files(directory / name for name in files)
    (directory / "metadata.json").write_text(json.dumps(meta, indent=1))


def check_bundle_metadata(meta: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``meta`` (a bundle's parsed ``metadata.json`` at ``path``) holds the sections loading reads (``model``,
    ``normalisation``, ``variables`` with its three lists of names); else a :class:`ConversionError` listing
    each that is missing or mistyped."""
    problems = [f"{key}: {type(meta[key]).__name__ if key in meta else 'missing'}, expected a JSON object"
                for key in ("model", "variables", "normalisation") if not isinstance(meta.get(key), dict)]
    roles = meta.get("variables")
    if isinstance(roles, dict):
        problems += [f"variables.{role}: {str(roles.get(role))[:40]!r}, expected a list of variable names"
                     for role in ("dataset", "forcing", "diagnostic")
                     if not (isinstance(roles.get(role), list) and all(isinstance(v, str) for v in roles[role]))]
    if problems:
        raise ConversionError(f"{path} is not the metadata of a stormshard bundle:", problems,
                              fix="the bundle is damaged or was edited: export it again")
    return meta


def read_bundle_metadata(directory: str | os.PathLike, *, trust_model_code: bool = False,
                         other_formats: bool = False) -> dict[str, Any] | None:
    """The bundle ``metadata.json`` in ``directory``, read and checked: JSON, format ``stormshard-bundle``,
    the sections loading reads (:func:`check_bundle_metadata`) and the model builder it names (imported only
    with ``trust_model_code``). A file of another format (a training checkpoint's ``metadata.json``) gives
    None with ``other_formats``, else a :class:`ConversionError`, as does a missing or unreadable file."""
    p = Path(directory)
    path = p / "metadata.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ConversionError(f"{p} is not a stormshard inference bundle: {path}: {exc}",
                              fix="export one (again, if this one is damaged) with "
                                  "`python launch/convert_checkpoint.py export CHECKPOINT --out DIR`") from None
    if not isinstance(meta, dict) or meta.get("format") != BUNDLE_FORMAT:
        if other_formats:
            return None
        found = meta.get("format") if isinstance(meta, dict) else f"none (a JSON {type(meta).__name__})"
        raise ConversionError(f"{path} has format {found!r}, not {BUNDLE_FORMAT!r}")
    check_bundle_metadata(meta, path)
    check_model_builder(meta.get("model"), str(path), trust_model_code)
    return meta


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
               trust_model_code: bool = False) -> InferenceModel:
    """Load an inference bundle written by :func:`export_bundle`: the model (CPU, eval mode,
    single process, no DeepSpeed) plus normalisers, variables and graph. A builder the bundle names
    as ``"package.module:attribute"`` is imported only with ``trust_model_code=True`` (an
    :class:`~stormshard.models.trust.UntrustedModelCode` error otherwise, before anything is read)."""
    from safetensors.torch import load_file

    p = Path(path)
    meta = read_bundle_metadata(p, trust_model_code=trust_model_code)
    reading = p / "model.safetensors"
    try:
        weights = load_file(str(reading))
        reading = p / "statistics.json"
        stats_json = json.loads(reading.read_text())
        reading = p / "graph.pt"
        graph = load_graph(reading)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"{reading}: cannot be read ({type(exc).__name__}: {str(exc)[:160]})",
                              fix="the bundle is damaged: export it again") from None
    config = stored_model_config(meta["model"])
    roles = meta["variables"]
    variables = VariableIndex.build(roles["dataset"], roles["forcing"], roles["diagnostic"])
    model = build_model(config, graph, variables, None, shard_strategy=bundle_shard_strategy(meta))
    problems = state_differences(weights, full_shapes(model))
    if problems:
        raise ConversionError(f"{p}/model.safetensors does not match the model:", problems)
    model.load_state_dict(weights)
    model.to(dtype).eval()
    statistics = Statistics(*(np.array([stats_json[n][s] for n in variables.variables]) for s in _STATS))
    normaliser, output_normaliser = build_normalisers(statistics, variables, meta["normalisation"])
    return InferenceModel(
        model=model, normaliser=normaliser, output_normaliser=output_normaliser,
        variables=variables, graph=graph, config=config, timestep=meta.get("timestep"), metadata=meta,
    )


def bundle_shard_strategy(meta: dict[str, Any]) -> str:
    """The processor shard strategy a bundle's model trained with (its stored experiment config)."""
    return stored_shard_strategy(meta.get("experiment") or {"model": meta["model"]})


def build_normalisers(statistics: Statistics, variables: VariableIndex,
                      normalisation: dict[str, Any]) -> tuple[Normaliser, Normaliser]:
    """The input and output normalisers of a model from the dataset ``statistics`` (dataset
    variable order) and the bundle's ``normalisation`` (``{"default": ..., "methods": {...}}``)."""
    kw = {"methods": normalisation["methods"], "default": normalisation["default"]}
    return (Normaliser.from_statistics(statistics, variables.variables, variables.input_names, **kw),
            Normaliser.from_statistics(statistics, variables.variables, variables.output_names, **kw))
