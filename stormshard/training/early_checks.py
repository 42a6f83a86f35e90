"""Checks that used to fail only after work had started, moved before any process group or file.

Called by :func:`stormshard.training.preflight.preflight` (every rank, same verdict, no
communication); each raises :class:`~stormshard.training.config.ConfigError` naming the field, the
value and the fix:

- :func:`check_model_layout`: kNN neighbours that exceed the grid they pick from (encoder,
  processor, decoder), fewer hidden nodes or grid cells than ranks in a model group, heads or MLP
  channels that do not split over the group (``shard_heads``, ``tensor``);
- :func:`check_normalisation_scales`: a variable whose normalisation divides by zero (zero standard
  deviation, ``maximum == minimum``, ``maximum == 0``) or by a non-finite statistic;
- :func:`check_deepspeed_batch`: ``deepspeed.train_batch_size`` (e.g. from a ``--deepspeed_config``
  file without ``train_micro_batch_size_per_gpu``) against micro batch x accumulation x data-parallel size;
- :func:`check_output_dir`: ``training.output_dir`` (and ``data.graph_cache``) can be created and written
  (a probe directory is made and removed in the nearest existing ancestor).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.graphs.builder import KNNEdges
from stormshard.parallel.topology import ParallelLayout
from stormshard.training.activation_memory import hidden_nodes
from stormshard.training.config import ConfigError, ExperimentConfig
from stormshard.training.engine import EngineSettings

__all__ = ["check_model_layout", "check_normalisation_scales", "check_deepspeed_batch", "check_output_dir",
           "nearest_existing_parent"]


def _data_cells(config: ExperimentConfig, dataset: AnemoiDataset) -> int:
    if config.graph.data_grid is None:
        return int(dataset.num_cells)
    from stormshard.graphs.grids import grid_from_name

    return len(grid_from_name(config.graph.data_grid)[0])


def check_model_layout(config: ExperimentConfig, layout: ParallelLayout, dataset: AnemoiDataset) -> None:
    """The graph's kNN sizes fit its grids and the model splits over ``layout.gpus_per_model`` ranks."""
    g, m, k = config.graph, config.model, layout.gpus_per_model
    hidden, data = hidden_nodes(g.hidden), _data_cells(config, dataset)
    grid_of = f"graph.hidden={g.hidden!r} ({hidden} nodes)"
    data_of = f"the data grid ({data} cells)"
    for field, spec, sources, what in (("graph.encoder", g.encoder, data, data_of),
                                       ("graph.processor", g.processor, hidden - 1, f"{grid_of} less the node itself"),
                                       ("graph.decoder", g.decoder, hidden, grid_of)):
        if isinstance(spec, KNNEdges) and spec.num_neighbours > sources:
            raise ConfigError(
                f"{field}.num_neighbours={spec.num_neighbours} exceeds the {sources} source nodes of {what}: "
                f"lower it to at most {sources}, or use a finer graph.hidden"
            )
    if hidden < k:
        raise ConfigError(
            f"{grid_of} has fewer nodes than the {k} ranks of a model group (parallel.gpus_per_model={k}): every "
            "rank needs hidden nodes; use a finer graph.hidden or a smaller parallel.gpus_per_model"
        )
    if data < k:
        raise ConfigError(
            f"{data_of} has fewer cells than the {k} ranks of a model group (parallel.gpus_per_model={k}): lower "
            "parallel.gpus_per_model"
        )
    if m.uses_graph_processor or k == 1:
        return
    strategy, heads = m.processor.shard_strategy, m.processor.num_heads
    if strategy in ("shard_heads", "tensor") and heads % k:
        raise ConfigError(
            f"model.processor.num_heads={heads} is not divisible by parallel.gpus_per_model={k}: "
            f"shard_strategy={strategy!r} splits whole heads over the model group; use a multiple of {k} heads "
            f"or shard_strategy='shard_sequence'"
        )


def check_normalisation_scales(config: ExperimentConfig, dataset: AnemoiDataset) -> None:
    """Every variable's normalisation scale is finite and positive (else the first loss is inf/NaN).

    The scale of each method (see :mod:`stormshard.data.normalisation`) is computed from the dataset
    statistics here, so the message names the variable, the method, the statistic and the fix.
    """
    methods = dict(config.data.normalisation_methods)
    stats = dataset.statistics
    what = {"mean-std": "its standard deviation", "std": "its standard deviation",
            "min-max": "maximum - minimum", "max": "its maximum"}
    for i, name in enumerate(dataset.variables):
        method = methods.get(name, config.data.normalisation)
        if method == "none":
            continue
        if method in ("mean-std", "std"):
            scale, offset = float(stats.stdev[i]), float(stats.mean[i]) if method == "mean-std" else 0.0
        elif method == "min-max":
            scale, offset = float(stats.maximum[i]) - float(stats.minimum[i]), float(stats.minimum[i])
        else:
            scale, offset = float(stats.maximum[i]), 0.0
        if not (np.isfinite(scale) and np.isfinite(offset) and scale > 0):
            raise ConfigError(
                f"variable {name!r} of data.path={config.data.path!r} cannot be normalised with {method!r}: "
                f"{what[method]} is {scale:g} in the dataset statistics, so every value would become inf or NaN; "
                f"set data.normalisation_methods={{{name!r}: 'none'}} (or a method whose statistic is positive), "
                "or recompute the dataset's statistics"
            )


def check_deepspeed_batch(config: ExperimentConfig, layout: ParallelLayout, settings: EngineSettings) -> None:
    """``deepspeed.train_batch_size``, when given, equals micro batch x accumulation x data-parallel size."""
    if config.engine != "deepspeed" or "train_batch_size" not in config.deepspeed:
        return
    given = config.deepspeed["train_batch_size"]
    micro, acc, dp = settings.micro_batch_size, settings.accumulation, layout.data_parallel_size
    if given != micro * acc * dp:
        raise ConfigError(
            f"deepspeed.train_batch_size={given!r} but training.micro_batch_size {micro} x "
            f"training.gradient_accumulation_steps {acc} x data-parallel size {dp} (world {layout.world_size} / "
            f"gpus_per_model {layout.gpus_per_model}) = {micro * acc * dp}: remove train_batch_size (it is "
            "generated), or set training.micro_batch_size (a --deepspeed_config file sets it with "
            "train_micro_batch_size_per_gpu)"
        )


def nearest_existing_parent(path: Path) -> Path:
    """``path`` itself when it exists, else its closest existing ancestor."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_directory(path: Path, field: str) -> None:
    base = nearest_existing_parent(path)
    if not base.is_dir():
        raise ConfigError(
            f"{field}={str(path)!r} cannot be created: {base} is a file, not a directory; choose another path"
        )
    reason = None if os.access(base, os.W_OK | os.X_OK) else "it does not allow writing for this user"
    if reason is None:  # permissions can lie (root, read-only or virtual file systems): probe, then remove
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".stormshard-probe-", dir=base))
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
    if reason is not None:
        raise ConfigError(
            f"{field}={str(path)!r} is not writable ({base}: {reason}): fix its permissions or choose another "
            "path; nothing was started"
        )


def check_output_dir(config: ExperimentConfig) -> None:
    """``training.output_dir`` and ``data.graph_cache`` can be created and written (checked on the nearest
    existing directory; the probe directory is removed at once)."""
    _check_directory(Path(config.training.output_dir), "training.output_dir")
    if config.data.graph_cache:
        _check_directory(Path(config.data.graph_cache).parent, "data.graph_cache")
