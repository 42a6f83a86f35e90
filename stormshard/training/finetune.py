"""Fine-tuning and transfer learning: ``training.init_weights``, ``training.freeze``,
``data.graph_file`` and ``data.statistics``.

- :func:`check_finetune_inputs` (called by the preflight, before any process group or file): the
  init-weights path exists, is one of the three kinds (:func:`init_weights_kind`) and reads (a damaged
  file is an error naming ``training.init_weights``), its tensors match the model's parameters by name
  and shape (:func:`match_init_weights`: a partial match, another architecture, is an error unless
  ``training.init_weights_partial``; then a warning with the counts), ``training.freeze`` names
  parameters and leaves some to train, the statistics file covers the dataset's variables, the graph
  file's data nodes are the dataset's cells. The weights read here reach the trainer
  (:class:`InitWeights`), so the file is read once.
- :func:`read_init_weights`: the full (unsharded) tensors of a stormshard bundle, an anemoi inference
  checkpoint (restricted unpickler + the import mapping, nothing in the file runs) or a stormshard
  training checkpoint (consolidated on the fly, any layout it was saved at).
- :func:`load_init_weights`: each parameter of this rank's (possibly sharded) model that matches by
  name and full shape gets its slice of the full tensor (its partition, as the inference loader
  does); the others keep their fresh initialisation. Returns a :class:`TransferReport` (loaded,
  fresh, unused names) that rank 0 prints at the start of the run.
- :func:`freeze_parameters`: ``requires_grad`` False by name prefix, before the engine is built (the
  engines optimise only parameters that require gradients); a prefix matching nothing is an error.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import BUNDLE_FORMAT
from stormshard.checkpoint.format import CheckpointError
from stormshard.data.anemoi_layout import AnemoiDataset, Statistics
from stormshard.graphs.builder import load_graph
from stormshard.models.variables import VariableIndex
from stormshard.parallel.partition import get_partition
from stormshard.parallel.tensor import slice_partition
from stormshard.training.config import ConfigError, ExperimentConfig

__all__ = ["TransferReport", "FinetuneInputs", "InitWeights", "GraphDependentMismatch", "check_finetune_inputs",
           "init_weights_kind",
           "read_init_weights", "match_init_weights", "load_init_weights", "check_transfer", "freeze_parameters",
           "statistics_from_file"]

_KINDS_FIX = ("give an exported or imported stormshard bundle (a directory with metadata.json), an anemoi "
              "inference checkpoint (inference-*.ckpt) or a stormshard training checkpoint (a step_NNNNNNNN "
              "directory or a run's checkpoints directory)")


def _anemoi_zip(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith(("anemoi-metadata/anemoi.json", "ai-models.json")) for n in z.namelist())


def init_weights_kind(path: str | os.PathLike) -> str:
    """``"bundle"``, ``"anemoi"`` or ``"checkpoint"``; a :class:`ConfigError` naming
    ``training.init_weights`` when ``path`` does not exist or is none of them."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"training.init_weights={str(path)!r} does not exist: {_KINDS_FIX}")
    if (p / "metadata.json").is_file():
        try:
            if json.loads((p / "metadata.json").read_text()).get("format") == BUNDLE_FORMAT:
                return "bundle"
        except (OSError, ValueError, AttributeError):
            pass
    if p.is_file() and _anemoi_zip(p):
        return "anemoi"
    if p.is_dir():
        from stormshard.checkpoint.consolidate import resolve_checkpoint

        try:
            resolve_checkpoint(p)
            return "checkpoint"
        except (ConversionError, CheckpointError):
            pass
    raise ConfigError(f"training.init_weights={str(path)!r} is not a stormshard bundle, an anemoi inference "
                      f"checkpoint or a stormshard training checkpoint: {_KINDS_FIX}")


def read_init_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The full tensors (stormshard parameter names) of ``training.init_weights``."""
    kind = init_weights_kind(path)
    if kind == "bundle":
        from safetensors.torch import load_file

        return load_file(str(Path(path) / "model.safetensors"))
    if kind == "anemoi":
        from stormshard.checkpoint.anemoi_import import read_anemoi

        return read_anemoi(path).weights
    from stormshard.checkpoint.averaged_weights import choose_weights
    from stormshard.checkpoint.consolidate import load_any

    ckpt = load_any(path)  # its weight average (training.weight_averaging) where it has one, as export takes it
    return choose_weights(ckpt.model, ckpt.average, None, str(path))[0]


def statistics_from_file(path: str | os.PathLike, dataset: AnemoiDataset) -> Statistics:
    """``data.statistics`` for the dataset's variables, in its order (``has_nans`` kept from the dataset)."""
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.statistics={str(path)!r} cannot be read ({exc}): give a statistics.json "
                          "(per variable: mean, stdev, minimum, maximum), e.g. a bundle's") from None
    missing = [v for v in dataset.variables if not isinstance(stats.get(v), dict) or
               any(not isinstance(stats[v].get(s), (int, float)) for s in ("mean", "stdev", "minimum", "maximum"))]
    if missing:
        raise ConfigError(f"data.statistics={str(path)!r} has no mean / stdev / minimum / maximum for the dataset "
                          f"variable(s) {missing}: use the statistics of a model with the dataset's variables")
    columns = (np.array([float(stats[v][s]) for v in dataset.variables]) for s in ("mean", "stdev", "minimum", "maximum"))
    return Statistics(*columns, has_nans=dataset.statistics.has_nans)


def _check_graph_file(config: ExperimentConfig, dataset: AnemoiDataset, gpus_per_model: int) -> Any:
    path = config.data.graph_file
    try:
        graph = load_graph(path)
    except Exception as exc:  # noqa: BLE001 - missing, damaged or foreign: all the same to the user
        raise ConfigError(f"data.graph_file={path!r} cannot be read as a stormshard graph ({type(exc).__name__}: "
                          f"{exc}): give a graph.pt (an imported bundle's), or unset it to build one") from None
    x = graph["data"].x.double()
    if x.shape[0] != dataset.num_cells:
        raise ConfigError(f"data.graph_file={path!r} has {x.shape[0]} data nodes but the dataset at data.path has "
                          f"{dataset.num_cells} cells: fine-tune on a dataset of the model's grid")
    lat, lon = np.radians(dataset.latitudes), np.radians(dataset.longitudes)
    ours = np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], -1)
    glat, glon = x[:, 0].numpy(), x[:, 1].numpy()
    theirs = np.stack([np.cos(glat) * np.cos(glon), np.cos(glat) * np.sin(glon), np.sin(glat)], -1)
    off = float(np.abs(ours - theirs).max(initial=0.0))
    if off > 1e-4:
        raise ConfigError(f"data.graph_file={path!r}: its data nodes are not the dataset's cells (largest "
                          f"difference {np.degrees(off):.3g} degrees): fine-tune on a dataset of the model's grid")
    if config.model.residual == "truncated" and "truncation" not in graph.node_types:
        raise ConfigError(f"data.graph_file={path!r} has no truncation grid but model.residual='truncated': give a "
                          "graph with one (a bundle imported from a model with a truncated residual) or set "
                          "model.residual='last_step'")
    for node in ("data", "hidden"):
        if graph[node].x.shape[0] < gpus_per_model:
            raise ConfigError(f"data.graph_file={path!r} has {graph[node].x.shape[0]} {node} nodes, fewer than "
                              f"parallel.gpus_per_model={gpus_per_model}: lower parallel.gpus_per_model")
    return graph


def _meta_shapes(config: ExperimentConfig, variables: VariableIndex, graph: Any) -> dict[str, tuple[int, ...]]:
    from stormshard.checkpoint.groups import model_on_meta

    model = model_on_meta(config.model, config.parallel.shard_strategy, graph, variables, 0, 1)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _parameter_shapes(config: ExperimentConfig, variables: VariableIndex, graph: Any = None,
                      dataset: AnemoiDataset | None = None) -> tuple[dict[str, tuple[int, ...]], frozenset[str]] | None:
    """The model's parameters with their full shapes, from a build on the meta device, and the names
    whose shape depends on the graph's edges (trainable edge embeddings; unknown until the graph is
    built). On ``graph`` (a fixed ``data.graph_file``) every shape is exact; otherwise two tiny
    stand-in graphs tell the graph-dependent shapes apart (names do not depend on the grid), and those
    that follow a node count (trainable node embeddings) get the run's counts from its grids
    (:func:`~stormshard.graphs.builder.graph_node_counts`, no edges searched). None when such a build
    is not possible for this model (the trainer then checks on the real one)."""
    from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph, graph_node_counts

    try:
        if graph is not None:
            return _meta_shapes(config, variables, graph), frozenset()
        stand_ins = [build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4))),
                     build_graph(GraphConfig(data_grid="o6", hidden="o3", processor=KNNEdges(num_neighbours=5)))]
        a, b = (_meta_shapes(config, variables, g) for g in stand_ins)
    except Exception:  # noqa: BLE001 - a model the stand-in cannot hold: checked later on the real one
        return None
    dependent = {n for n in a if b.get(n) != a[n]}
    counts = None
    if dependent and dataset is not None:
        latlon = (dataset.latitudes, dataset.longitudes) if config.graph.data_grid is None else None
        try:
            counts = graph_node_counts(config.graph, latlon)
        except Exception:  # noqa: BLE001 - a graph config the builder refuses: its own error comes later
            counts = None
    shapes = dict(a)
    for name in sorted(dependent):
        for nodes in ("data", "hidden"):
            if counts is not None and a[name][1:] == b[name][1:] and all(
                    shape[0] == g[nodes].num_nodes for shape, g in ((a[name], stand_ins[0]), (b[name], stand_ins[1]))):
                shapes[name] = (counts[nodes], *a[name][1:])  # a node embedding: its exact shape, now
                dependent.discard(name)
                break
    return shapes, frozenset(dependent)


class InitWeights:
    """``training.init_weights`` as the preflight read and matched it: handed to the trainer once
    (:meth:`take`), so the file is read once and its tensors are not kept for the whole run."""

    def __init__(self, source: str, tensors: dict[str, Tensor]) -> None:
        self.source = source
        self._tensors: dict[str, Tensor] | None = tensors

    def take(self) -> dict[str, Tensor]:
        """The full tensors (read again from ``source`` if already taken)."""
        tensors, self._tensors = self._tensors, None
        return tensors if tensors is not None else read_init_weights(self.source)


@dataclass(frozen=True)
class FinetuneInputs:
    """What :func:`check_finetune_inputs` found: the dataset (with ``data.statistics`` in place), the
    init weights read (None without ``training.init_weights`` or on ``--resume``) and run-log lines."""

    dataset: AnemoiDataset
    init_weights: InitWeights | None = None
    notes: tuple[str, ...] = field(default=())


def _few(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def match_init_weights(path: str, full: dict[str, Tensor], shapes: dict[str, tuple[int, ...]],
                       graph_dependent: frozenset[str] = frozenset(), partial: bool = False) -> str | None:
    """Which of the model's parameters (``shapes``: full shapes) the tensors ``full`` of
    ``training.init_weights`` set (by name and shape; a ``graph_dependent`` shape is compared when the
    graph is built). A :class:`ConfigError` when some do not match (another architecture), listing
    how many matched and a few that did not, unless ``partial`` (``training.init_weights_partial``):
    then the warning to print, with the counts; also an error when none match. None when all match."""
    missing = [f"{n} (not in the file)" for n in shapes if n not in full]
    other = [f"{n} (file {list(full[n].shape)}, model {list(s)})" for n, s in shapes.items()
             if n in full and n not in graph_dependent and tuple(full[n].shape) != tuple(s)]
    fresh = missing + other
    matched = len(shapes) - len(fresh)
    if not fresh:
        return None
    counts = f"matches {matched} of the model's {len(shapes)} parameters by name and shape"
    if matched == 0:
        raise ConfigError(f"training.init_weights={path!r} {counts}: it holds another model ({_few(fresh)}); "
                          "give the weights of this model's architecture, or leave training.init_weights out")
    if not partial:
        raise ConfigError(f"training.init_weights={path!r} {counts}; {len(fresh)} do not: {_few(fresh)}: it holds "
                          "another architecture or size. Give the weights of this model, or set "
                          "training.init_weights_partial=true to load the ones that match and start the others "
                          "fresh (transfer learning)")
    return (f"warning: training.init_weights={path!r} {counts} (training.init_weights_partial=true): {len(fresh)} "
            f"start fresh: {_few(fresh)}")


def check_finetune_inputs(config: ExperimentConfig, dataset: AnemoiDataset, variables: VariableIndex,
                          gpus_per_model: int, resume: bool = False) -> FinetuneInputs:
    """The preflight's checks of the fine-tune fields (see the module docstring), before any file; a
    resumed run does not read ``training.init_weights`` (it continues its own weights)."""
    t = config.training
    graph = _check_graph_file(config, dataset, gpus_per_model) if config.data.graph_file else None
    init, notes = None, ()
    found = _parameter_shapes(config, variables, graph, dataset) if (t.init_weights and not resume) or t.freeze \
        else None
    if t.init_weights and not resume:
        init_weights_kind(t.init_weights)
        try:
            tensors = read_init_weights(t.init_weights)
        except Exception as exc:  # noqa: BLE001 - damaged or foreign: named with the field, before any file
            message = str(exc).strip().replace("\n", " ")[:400] or type(exc).__name__
            raise ConfigError(f"training.init_weights={t.init_weights!r} cannot be read ({message}): it is damaged; "
                              "give an intact bundle or checkpoint (an earlier step_NNNNNNNN, a re-export)") from None
        if found is not None:
            warning = match_init_weights(t.init_weights, tensors, *found, partial=t.init_weights_partial)
            notes = (warning,) if warning else ()
        init = InitWeights(t.init_weights, tensors)
    if t.freeze and found is not None:
        _check_freeze(list(t.freeze), list(found[0]))
    if config.data.statistics:
        dataset = replace(dataset, statistics=statistics_from_file(config.data.statistics, dataset))
    return FinetuneInputs(dataset, init, notes)


@dataclass(frozen=True)
class TransferReport:
    """Which parameters ``training.init_weights`` set: ``loaded`` (name and shape matched), ``fresh``
    (kept their initialisation) and ``unused`` (in the file, not in this model or another shape)."""

    source: str
    loaded: tuple[str, ...]
    fresh: tuple[str, ...]
    unused: tuple[str, ...]

    def lines(self, shown: int = 8) -> str:
        def names(items: tuple[str, ...]) -> str:
            more = f", ... ({len(items) - shown} more)" if len(items) > shown else ""
            return ", ".join(items[:shown]) + more

        out = [f"init:   weights from {self.source}: {len(self.loaded)} parameters loaded, {len(self.fresh)} "
               "freshly initialised"]
        if self.fresh:
            out.append(f"init:   freshly initialised: {names(self.fresh)}")
        if self.unused:
            out.append(f"init:   in the file but not used (no such parameter or another shape): {names(self.unused)}")
        if self.loaded:
            out.append(f"init:   loaded: {names(self.loaded)}")
        return "\n".join(out)


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, full: dict[str, Tensor], source: str) -> TransferReport:
    """Copy into ``model`` (this rank's shard) the slice of each full tensor of ``full`` whose name and
    full shape match a parameter; the others keep their fresh initialisation."""
    from stormshard.checkpoint.sources import full_shapes

    shapes = full_shapes(model)
    loaded, fresh = [], []
    for name, p in model.named_parameters():
        w = full.get(name)
        if w is None or tuple(w.shape) != tuple(shapes[name]):
            fresh.append(name)
            continue
        part = get_partition(p)
        p.copy_((w if part is None else slice_partition(w, part)).to(p.dtype))
        loaded.append(name)
    used = set(loaded)
    unused = tuple(n for n in full if n not in used)
    return TransferReport(str(source), tuple(loaded), tuple(fresh), unused)


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix.rstrip(".") + ".")


def _check_freeze(prefixes: list[str], names: list[str]) -> None:
    """Every prefix of ``training.freeze`` names a parameter, and some parameter is left to train."""
    unknown = [p for p in prefixes if not any(_matches(n, p) for n in names)]
    tops = sorted({n.split(".")[0] for n in names})
    if unknown:
        raise ConfigError(f"training.freeze: {unknown} match(es) no parameter of this model: give parameter name "
                          f"prefixes such as {tops}")
    if names and all(any(_matches(n, p) for p in prefixes) for n in names):
        raise ConfigError(f"training.freeze={prefixes} freezes all {len(names)} parameters of the model: nothing "
                          f"would train; freeze fewer (the model's top-level parts are {tops})")


class GraphDependentMismatch(ConfigError):
    """``training.init_weights`` does not match shapes known only once the graph is built: raised by
    :func:`check_transfer` alike on every rank (the full shapes are the same everywhere)."""


def check_transfer(report: TransferReport, partial: bool) -> None:
    """On the built model (the shapes that depend on the graph known): the :func:`match_init_weights` rule
    for what the preflight could not compare; a :class:`GraphDependentMismatch` when a parameter starts
    fresh and ``training.init_weights_partial`` is not set."""
    if report.fresh and not partial:
        raise GraphDependentMismatch(f"training.init_weights={report.source!r} matches {len(report.loaded)} of the model's "
                          f"{len(report.loaded) + len(report.fresh)} parameters by name and shape; {len(report.fresh)} "
                          f"do not: {_few(list(report.fresh))}: set training.init_weights_partial=true to start them "
                          "fresh, or give the weights of this model")


def freeze_parameters(model: torch.nn.Module, prefixes: list[str]) -> list[str]:
    """``requires_grad`` False for every parameter whose name is or starts with a prefix (``encoder``
    matches ``encoder.*``, not ``encoder_edges``); returns the frozen names. A prefix that matches no
    parameter, or prefixes that leave nothing to train, are a :class:`ConfigError` naming them."""
    _check_freeze(prefixes, [n for n, _ in model.named_parameters()])
    frozen = []
    for name, p in model.named_parameters():
        if any(_matches(name, prefix) for prefix in prefixes):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen
