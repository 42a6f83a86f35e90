"""Everything that can fail on bad input, checked before any process group, graph or file is made.

:func:`preflight` is the one ordered walk over the checks; it runs on every rank from the config,
the world size and the file system alone (no communication), so every rank reaches the same
verdict and a bad run stops before it creates anything. Each check below is called once, from
there, and raises :class:`~stormshard.training.config.ConfigError` (or ``LayoutError``,
``EngineError``, ``AnemoiLayoutError``) naming the field, the value and the fix:

0. every ``STORMSHARD_*`` environment variable (:func:`check_environment_variables`: numbers finite and
   in range, switches, the compile backend, the flex kernel options);
1. the layout: :meth:`~stormshard.training.config.ParallelSection.layout`
   (:class:`~stormshard.parallel.topology.ParallelLayout`: the model group divides the world, ...);
2. the model's builder (:func:`~stormshard.models.registry.resolve_builder`: a registered name, or
   the ``"package.module:attribute"`` of the run's own config, imported here), the parallel strategy
   against the model: :func:`~stormshard.models.parallelize.check_parallel_strategy` (heads and MLP channels split
   whole over the model group for ``shard_heads`` / ``tensor``, graph processors, ensemble), and
   the attention kernel against the device and precision
   (:func:`~stormshard.models.parallelize.check_attention_kernel_for_training`);
3. ``--resume`` has a checkpoint to continue (:func:`check_resume`: the one ``latest`` names, complete;
   :func:`~stormshard.checkpoint.integrity.resume_target` stops at every kind of damage); a new run
   does not start in an ``output_dir`` that holds an earlier run
   (:func:`~stormshard.training.run_dir.check_run_directory`);
4. ``training.output_dir`` and ``data.graph_cache`` can be written (:func:`check_output_dir`);
5. the dataset opens, the forcing / diagnostic variables exist, the fine-tune fields hold
   (:func:`~stormshard.training.finetune.check_finetune_inputs`: ``training.init_weights`` is a
   bundle, an anemoi checkpoint or a training checkpoint that reads and matches the model's
   parameters (or ``training.init_weights_partial``), ``training.freeze`` prefixes name parameters
   and leave some to train, ``data.graph_file`` fits the dataset's grid, ``data.statistics`` covers
   its variables), the date ranges are disjoint (:func:`check_splits`) and hold windows;
6. every normalisation scale is finite and positive (:func:`check_normalisation_scales`), the loss
   weights and the imputation name known variables (:func:`check_loss_weights_and_imputation`);
7. the graph's kNN sizes fit its grids and every rank of a model group gets hidden nodes and grid
   cells (:func:`check_graph_sizes`);
8. one global micro-batch of samples, the run's steps (warm-up within them:
   :meth:`~stormshard.training.config.ExperimentConfig.engine_settings`) and the engine against the
   layout (:func:`~stormshard.training.engine.build.check_engine_layout`: the local engine has no
   data parallelism, ``deepspeed.train_batch_size``, what bucketed gradient sums cannot run with);
9. notes for the run log: variables with missing values, an activation-memory warning
   (:func:`check_activation_memory`).

After it, the one check that needs the process group: at ``--resume`` every rank hashes its files of
the checkpoint (:func:`~stormshard.training.checkpoint.verify_resume_files`, in ``run_training``)
before anything is written, ``config.json`` included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stormshard.checkpoint.format import METADATA, read_metadata, step_of
from stormshard.checkpoint.integrity import resume_target
from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import (
    WindowedSampleDataset,
    date_range_bounds,
    overlapping_ranges,
    split_by_dates,
)
from stormshard.data.normalisation import Normaliser, nan_fill_values
from stormshard.env import check_environment
from stormshard.errors import check_writable_directory, nearest_existing_parent
from stormshard.graphs.builder import KNNEdges, is_graph_file
from stormshard.graphs.grids import grid_from_name
from stormshard.models.config import MapperConfig, ProcessorConfig
from stormshard.models.loss_weights import variable_loss_weights
from stormshard.models.parallelize import (
    check_attention_kernel_for_training,
    check_graph_kernel_for_device,
    check_parallel_strategy,
)
from stormshard.models.registry import resolve_builder
from stormshard.models.variables import VariableIndex
from stormshard.parallel.topology import BatchPlan, ParallelLayout, batch_arithmetic
from stormshard.training.activation_memory import (
    ActivationEstimate,
    device_memory_bytes,
    estimate_activation_memory,
    hidden_nodes,
)
from stormshard.training.checkpoint import config_differences
from stormshard.training.config import ConfigError, ExperimentConfig, stored_config_dump
from stormshard.training.engine.build import check_engine_layout
from stormshard.training.engine.settings import EngineSettings
from stormshard.training.finetune import InitWeights, check_finetune_inputs
from stormshard.training.gnn_activation_memory import gnn_shape
from stormshard.training.rollout_schedule import max_rollout
from stormshard.training.run_dir import METRICS_FILE, check_run_directory
from stormshard.training.tasks import task_type

__all__ = ["RunInputs", "preflight", "checkpoint_dir", "RESUME_MAY_CHANGE", "check_environment_variables",
           "check_resume", "check_output_dir",
           "check_splits", "check_normalisation_scales", "check_loss_weights_and_imputation", "check_graph_sizes",
           "check_activation_memory", "activation_estimate", "data_notes", "window_notes", "nearest_existing_parent"]

# config fields a resumed run may change (everything else must equal the checkpoint's)
RESUME_MAY_CHANGE = ("name", "training.max_steps", "training.epochs", "training.validation_interval",
                     "training.checkpoint_interval", "training.keep_checkpoints", "training.output_dir",
                     "data.graph_cache", "data.validation_samples", "logging", "data.num_workers", "data.prefetch",
                     "data.worker_type", "data.test", "training.validation_rollout",
                     "training.init_weights", "training.init_weights_partial",  # a resumed run continues its weights
                     "training.compile", "training.cuda_graphs",
                     "model.graph_kernel", "model.lean_activations",  # how the same model runs, not what it computes
                     "training.weight_averaging")  # an average beside the trained weights (see training/weight_averaging)


def checkpoint_dir(config: ExperimentConfig) -> Path:
    """Where a run keeps its checkpoints: ``<training.output_dir>/checkpoints``."""
    return Path(config.training.output_dir) / "checkpoints"


@dataclass(frozen=True)
class RunInputs:
    """What :func:`preflight` checked and opened: everything that can fail on bad input."""

    layout: ParallelLayout
    dataset: AnemoiDataset
    variables: VariableIndex
    train_samples: WindowedSampleDataset
    val_samples: WindowedSampleDataset
    replicas: int  # independent sample streams (data-parallel replicas or ensemble groups)
    members_per_model: int  # ensemble members per model group (1 for deterministic models)
    total_steps: int
    settings: EngineSettings
    plan_batch: BatchPlan
    test_samples: WindowedSampleDataset | None = None  # data.test, when given
    steps_per_epoch: int = 1  # optimizer steps per epoch (rollout schedules counted in epochs)
    loss_weights: tuple[float, ...] = ()  # per output variable: training.loss_scaling
    notes: tuple[str, ...] = ()  # lines for the run log (warnings included)
    init_weights: InitWeights | None = None  # training.init_weights, read and matched (not on --resume)


def preflight(config: ExperimentConfig, world: int, resume: bool = False) -> RunInputs:
    """Check the config against the world size, the dataset and (``resume``) the checkpoints, before
    any process group or file is made: the ordered walk of the module docstring, each check once."""
    t = config.training
    check_environment_variables(config)  # 0.
    layout = config.parallel.layout(world)  # 1.
    try:  # 2.
        resolve_builder(config.model.name)  # the user's own config: a builder module it names is imported
        check_parallel_strategy(config.model, config.parallel.shard_strategy, layout.gpus_per_model)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        check_attention_kernel_for_training(config.model, device_type, config.training.precision)
        check_graph_kernel_for_device(config.model, device_type)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    resume_notes = check_resume(config, world) if resume else ()  # 3.
    check_run_directory(config, resume)  # 3. (no earlier run overwritten; a complete checkpoint to resume)
    check_output_dir(config)  # 4.
    dataset, variables = open_dataset(config)  # 5.
    finetune = check_finetune_inputs(config, dataset, variables, layout.gpus_per_model, resume)  # init_weights, freeze,
    dataset = finetune.dataset  # graph_file, statistics
    ranges = check_splits(config, dataset)
    window = dict(multistep_input=config.model.multistep_input, timestep=config.data.timestep, ensemble="each")

    def samples(name: str, rollout: int, rollout_field: str) -> WindowedSampleDataset:
        try:
            return split_by_dates(dataset, {name: ranges[name]}, rollout=rollout, **window)[name]
        except ValueError as exc:
            raise ConfigError(f"data.{name} (with data.timestep, model.multistep_input and {rollout_field}): "
                              f"{exc}") from None

    train_samples = samples("train", max_rollout(t.rollout), "training.rollout")
    val_samples = samples("validation", t.validation_rollout, "training.validation_rollout")
    test_samples = None if "test" not in ranges else samples("test", t.validation_rollout,
                                                             "training.validation_rollout")
    check_normalisation_scales(config, dataset)  # 6. (a zero standard deviation would make the first loss NaN)
    loss_weights = check_loss_weights_and_imputation(config, dataset, variables)
    if not config.data.graph_file:  # a fixed graph file was checked with the fine-tune fields
        check_graph_sizes(config, layout, dataset)  # 7.
    task = task_type(config)  # 8.
    replicas, members = task.replica_count(layout), task.members_per_model(config)
    if len(train_samples) < replicas * config.micro_batch:
        raise ConfigError(
            f"data.train holds {len(train_samples)} samples, fewer than one global micro-batch "
            f"({replicas} replicas x micro batch {config.micro_batch}): widen the date range"
        )
    accumulation = config.training.gradient_accumulation_steps
    per_epoch = len(train_samples) // (replicas * config.micro_batch * accumulation)
    total_steps = t.max_steps if t.max_steps is not None else max(1, per_epoch * t.epochs)
    settings = config.engine_settings(total_steps)
    check_engine_layout(settings, layout)
    plan_batch = batch_arithmetic(config.micro_batch, world, settings.accumulation, layout.gpus_per_model)
    notes = resume_notes + finetune.notes + data_notes(dataset) + window_notes(config)  # 9.
    memory = check_activation_memory(config, dataset.num_cells, layout.gpus_per_model, members)
    if memory is not None:
        notes += (memory,)
    return RunInputs(layout, dataset, variables, train_samples, val_samples, replicas, members, total_steps,
                     settings, plan_batch, test_samples=test_samples, steps_per_epoch=max(1, per_epoch),
                     loss_weights=tuple(float(w) for w in loss_weights), notes=notes,
                     init_weights=finetune.init_weights)


# ------------------------------------------------------------------------------ the checks, in walk order


def check_environment_variables(config: ExperimentConfig) -> None:
    """Every ``STORMSHARD_*`` variable read once (:func:`stormshard.env.check_environment`: numbers finite
    and in range, switches 0 / 1), ``STORMSHARD_COMPILE_BACKEND`` when the run may compile
    (:func:`~stormshard.models.compile.compile_backend`; ``training.cuda_graphs`` needs it to be inductor, a CUDA
    device and compiled blocks) and ``STORMSHARD_FLEX_KERNEL_OPTIONS``
    (:func:`~stormshard.kernels.flex.flex_options_from_env`); an
    :class:`~stormshard.env.EnvError` names the variable."""
    check_environment()
    from stormshard.models.compile import compile_backend, cuda_graphs_problem, wants_compile

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    compiles = wants_compile(config.training.compile, device_type)
    backend = compile_backend() if compiles else None
    if config.training.cuda_graphs:
        problem = cuda_graphs_problem(device_type, compiles, backend or "inductor")
        if problem:
            raise ConfigError(problem)
    from stormshard.kernels.flex import flex_options_from_env

    flex_options_from_env()


def check_resume(config: ExperimentConfig, world: int | None = None) -> tuple[str, ...]:
    """``--resume``: ``<training.output_dir>/checkpoints`` holds a checkpoint, and this run's config
    differs from the one stored with it only in fields of :data:`RESUME_MAY_CHANGE` (every other
    difference is listed in one :class:`ConfigError`; so is another world size). Returns one note
    per changed field that may change (printed at the start of the run), so no change goes unsaid."""
    directory = checkpoint_dir(config)
    found = resume_target(directory)  # the step `latest` names, complete; any damage stops here
    if found is None:
        raise ConfigError(
            f"--resume was given but {directory} holds no checkpoint (training.output_dir="
            f"{config.training.output_dir!r}): remove --resume to start a new run, or point training.output_dir "
            "at the run to continue"
        )
    target = found.path
    moved = (found.note,) if found.note else ()
    metadata = read_metadata(target)
    stored = metadata.get("config")
    if not isinstance(stored, dict):
        return moved
    diffs = config_differences(stored_config_dump(stored), config.model_dump(mode="json"))
    allowed = [d for d in diffs if d.startswith(RESUME_MAY_CHANGE)]
    kept = [d for d in diffs if not d.startswith(RESUME_MAY_CHANGE)]
    stored_world = metadata.get("world_size")
    if world is not None and isinstance(stored_world, int) and stored_world != world:
        kept.insert(0, f"world size: stored {stored_world}, now {world} (launch {stored_world} processes, or "
                       "convert the checkpoint: launch/convert_checkpoint.py reshard)")
    if kept:
        raise ConfigError(
            f"--resume: this run differs from the checkpoint {target} in {len(kept)} setting(s) a resumed run must "
            "keep:\n  - " + "\n  - ".join(kept) + "\nresume with the checkpoint's config (its copy: "
            f"{Path(config.training.output_dir) / 'config.json'}, or the 'config' of {target / 'metadata.json'}), or "
            f"start a new run in another training.output_dir; only {', '.join(RESUME_MAY_CHANGE)} may change"
        )
    return moved + tuple(f"resume: {d} (allowed on --resume)" for d in allowed)


def check_output_dir(config: ExperimentConfig) -> None:
    """``training.output_dir`` and ``data.graph_cache`` can be created and written (checked on the nearest
    existing directory; the probe directory is removed at once); what the run writes there is not taken by
    something else: ``checkpoints`` a directory, ``metrics.jsonl`` and ``config.json`` files (``config.json``
    absent or a stormshard config: the run replaces it), and the graph cache absent or a graph file (the run
    rebuilds over it: any other file would be lost)."""
    out = Path(config.training.output_dir)
    check_writable_directory(out, "training.output_dir")
    _check_not_into_an_input(config)
    if config.data.graph_cache:
        check_writable_directory(Path(config.data.graph_cache).parent, "data.graph_cache")
    for name, is_dir in (("checkpoints", True), (METRICS_FILE, False), ("config.json", False)):
        if (out / name).exists() and (out / name).is_dir() != is_dir:
            raise ConfigError(f"training.output_dir={str(out)!r} holds {out / name}, a {'file' if is_dir else 'directory'} "
                              f"where the run writes its {name} {'directory' if is_dir else 'file'}: move it aside or "
                              "set another training.output_dir; nothing was started")
    config_file = out / "config.json"
    if config_file.is_file() and not _is_experiment_config(config_file):
        raise ConfigError(f"training.output_dir={str(out)!r} holds {config_file}, which is not a stormshard config, and "
                          "the run would overwrite it with the config it resolved: move it aside or set another "
                          "training.output_dir; nothing was started")
    if config.data.graph_file:  # a fixed graph: no cache is written
        return
    cache = Path(config.data.graph_cache) if config.data.graph_cache else out / "graph.pt"
    field = f"data.graph_cache={config.data.graph_cache!r}" if config.data.graph_cache else \
        f"training.output_dir={str(out)!r} (its graph cache {cache})"
    if cache.is_dir():
        raise ConfigError(f"{field} is a directory, where the run caches its graph file: name a file (e.g. "
                          f"data.graph_cache={str(cache / 'graph.pt')!r}); nothing was started")
    if cache.exists() and not is_graph_file(cache):
        raise ConfigError(f"{field}: {cache} exists and is not a stormshard graph file, which the run would overwrite "
                          "with its graph: choose another data.graph_cache (or delete the file if it is a damaged "
                          "graph cache); nothing was started")


def _check_not_into_an_input(config: ExperimentConfig) -> None:
    """A run never writes into what it reads: ``training.output_dir`` equal to or inside the dataset
    (``data.path``), the ``training.init_weights`` directory, or a checkpoint's step directory (which its run
    deletes with its older checkpoints, this run's files with it) is a :class:`ConfigError` naming both."""
    out = Path(config.training.output_dir).resolve()
    shown = f"training.output_dir={config.training.output_dir!r}"
    for field, value in (("data.path", config.data.path), ("training.init_weights", config.training.init_weights)):
        source = Path(value).resolve() if value else None
        if source is not None and (out == source or source in out.parents):
            raise ConfigError(f"{shown} is {'' if out == source else 'inside '}{field}={value!r}: a run never writes "
                              "into what it reads (its config.json, graph.pt, metrics.jsonl and checkpoints would "
                              "land there); set another training.output_dir; nothing was started")
    step = next((p for p in (out, *out.parents) if step_of(p.name) is not None and (p / METADATA).is_file()), None)
    if step is not None:
        raise ConfigError(f"{shown} is {'' if out == step else 'inside '}the checkpoint {step}: its run deletes it "
                          "with its older checkpoints, and this run's files with it; set another "
                          "training.output_dir; nothing was started")


def _is_experiment_config(path: Path) -> bool:
    """Whether ``path`` reads as a stormshard experiment config (a JSON object of its sections only), such as
    the ``config.json`` an earlier start of the run wrote, which the run may replace."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and set(raw) <= set(ExperimentConfig.model_fields)


def open_dataset(config: ExperimentConfig) -> tuple[AnemoiDataset, VariableIndex]:
    """The dataset at ``data.path`` and its variables split by ``data.forcing`` / ``data.diagnostic``."""
    data_path = Path(config.data.path)
    if config.data.path.startswith("SET-ME/"):  # anemoi_import.FINETUNE_DATA_PLACEHOLDER (not imported: torch)
        raise ConfigError(f"data.path={config.data.path!r} is the placeholder of a bundle's finetune_config.json: point "
                          "it at the anemoi dataset to fine-tune on (the model's grid and variables), e.g. "
                          "`python launch/train.py --config BUNDLE/finetune_config.json data.path=DATASET.zarr`")
    if not data_path.exists():
        raise ConfigError(
            f"data.path={config.data.path!r} does not exist: generate one with `python -m "
            "stormshard.data.synthetic --out data/synthetic.zarr` or point to an anemoi-layout dataset"
        )
    dataset = AnemoiDataset.open(data_path)
    if config.graph.data_grid is None:  # the graph is built on the dataset's own coordinates: they must exist
        dataset.check_coordinates()
    try:
        variables = VariableIndex.build(dataset.variables, config.data.forcing, config.data.diagnostic)
    except ValueError as exc:
        raise ConfigError(f"data.forcing / data.diagnostic: {exc}") from None
    return dataset, variables


def check_splits(config: ExperimentConfig, dataset: AnemoiDataset) -> dict[str, tuple]:
    """The ``(start, end)`` of data.train, data.validation and (when given) data.test; a
    :class:`ConfigError` when two of them share a date (validating on training dates)."""
    d = config.data
    ranges = {"train": (d.train.start, d.train.end), "validation": (d.validation.start, d.validation.end)}
    if d.test is not None:
        ranges["test"] = (d.test.start, d.test.end)
    first, last = dataset.start_date, dataset.end_date
    for name, (start, end) in ranges.items():
        try:
            lo, hi = date_range_bounds(dataset, start, end)
        except ValueError as exc:
            raise ConfigError(f"data.{name} = {{start: {start!r}, end: {end!r}}}: {exc}") from None
        given = f"data.{name} ({'start ' + str(start) if start is not None else 'from the first date'}, " \
                f"{'end ' + str(end) if end is not None else 'to the last date'})"
        if lo > last or hi < first:
            raise ConfigError(
                f"{given} lies {'after the last' if lo > last else 'before the first'} date of the dataset "
                f"{d.path!r}, which holds {first} to {last}: choose data.{name} dates inside it"
            )
        if hi < lo:
            raise ConfigError(f"{given} ends ({hi}) before it starts ({lo}): swap or fix data.{name}.start / end")
    try:
        clashes = overlapping_ranges(dataset, ranges)
    except ValueError as exc:
        raise ConfigError(f"data.train / data.validation / data.test: {exc}") from None
    if clashes:
        a, b = clashes[0]
        (lo_a, hi_a), (lo_b, hi_b) = date_range_bounds(dataset, *ranges[a]), date_range_bounds(dataset, *ranges[b])
        raise ConfigError(
            f"data.{a} ({lo_a} to {hi_a}) and data.{b} ({lo_b} to {hi_b}) overlap: a run must not "
            f"{'validate' if 'validation' in (a, b) else 'test'} on dates it trains on; give them disjoint ranges "
            f"(a null start or end means the dataset's first or last date, {dataset.start_date} / {dataset.end_date})"
        )
    return ranges


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


def check_loss_weights_and_imputation(config: ExperimentConfig, dataset: AnemoiDataset,
                                      variables: VariableIndex) -> list[float]:
    """The per-output loss weights of ``training.loss_scaling``; checks ``data.imputation`` names."""
    try:
        weights = variable_loss_weights(variables.output_names, config.training.loss_scaling)
        normaliser = Normaliser.from_statistics(dataset.statistics, dataset.variables,
                                                variables=variables.input_names,
                                                methods=dict(config.data.normalisation_methods),
                                                default=config.data.normalisation)
        nan_fill_values(dataset.statistics, dataset.variables, normaliser, config.data.imputation)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return list(weights)


def _data_cells(config: ExperimentConfig, dataset: AnemoiDataset) -> int:
    if config.graph.data_grid is None:
        return int(dataset.num_cells)
    return len(grid_from_name(config.graph.data_grid)[0])


def check_graph_sizes(config: ExperimentConfig, layout: ParallelLayout, dataset: AnemoiDataset) -> None:
    """The graph's kNN sizes fit its grids (encoder, processor, decoder), and the hidden nodes and the
    grid cells split over the ``layout.gpus_per_model`` ranks of a model group (every rank gets some)."""
    g, k = config.graph, layout.gpus_per_model
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
    if g.truncation is not None:
        coarse = grid_from_name(g.truncation.grid)[0].size
        limit = min(coarse, data)
        if g.truncation.num_neighbours > limit:
            raise ConfigError(
                f"graph.truncation.num_neighbours={g.truncation.num_neighbours} exceeds the {coarse} nodes of the "
                f"truncation grid {g.truncation.grid!r} or the {data} cells of the data grid: lower it to at most "
                f"{limit}, or use a finer graph.truncation.grid"
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


def window_notes(config: ExperimentConfig) -> tuple[str, ...]:
    """A warning when the transformer's window is wider than its hidden grid: a window of (hidden nodes
    - 1) is already full attention, so a wider one trains the same model, only slower."""
    m = config.model
    if m.name not in ("transformer", "ensemble"):
        return ()
    nodes = hidden_nodes(config.graph.hidden)
    if m.processor.window_size <= nodes - 1:
        return ()
    return (f"warning: model.processor.window_size={m.processor.window_size} is wider than the hidden grid "
            f"graph.hidden={config.graph.hidden!r} ({nodes} nodes): a window of {nodes - 1} (nodes - 1) or more is "
            f"already full attention, so this run trains the same model as window_size={nodes - 1}, only slower; set "
            f"model.processor.window_size={nodes - 1}",)


def data_notes(dataset: AnemoiDataset) -> tuple[str, ...]:
    """What the run log says about the data: variables with missing values."""
    nans = dataset.variables_with_nans
    if not nans:
        return ()
    return (f"data:   variables with missing values (NaN inputs imputed, NaN targets skipped in loss and "
            f"validation): {', '.join(nans)}",)


def activation_estimate(config: ExperimentConfig, data_cells: int, gpus_per_model: int,
                        members: int) -> ActivationEstimate:
    """The activation memory of one rank at the maximum rollout (:mod:`~stormshard.training.activation_memory`)."""
    m = config.model

    def kept_ratio(section: ProcessorConfig | MapperConfig) -> float:  # a gated MLP keeps fc1's gate and value too
        return section.mlp_ratio * (1 if section.mlp_implementation == "mlp" else 2)

    hidden = hidden_nodes(config.graph.hidden)
    return estimate_activation_memory(
        data_cells=data_cells, hidden=hidden, gpus_per_model=gpus_per_model,
        num_channels=m.num_channels, num_layers=m.processor.num_layers, mlp_ratio=kept_ratio(m.processor),
        mapper_mlp_ratio=max(kept_ratio(m.encoder), kept_ratio(m.decoder)),
        activation_checkpointing=m.activation_checkpointing, samples=config.micro_batch * members,
        rollout=max_rollout(config.training.rollout),
        bytes_per_element=2 if config.training.precision == "bf16" else 4,
        graph_mappers=m.name != "gnn", lean=m.lean_activations,
        encoder_checkpointing=m.encoder.activation_checkpointing,
        gnn=gnn_shape(m, config.graph, data_cells, hidden) if m.name == "gnn" else None)


def check_activation_memory(config: ExperimentConfig, data_cells: int, gpus_per_model: int, members: int,
                            device_bytes: int | None = None) -> str | None:
    """A warning when the activations at the maximum rollout exceed the device's memory, else None."""
    estimate = activation_estimate(config, data_cells, gpus_per_model, members)
    if device_bytes is None:
        device_bytes, name = device_memory_bytes()
    else:
        name = "the device"
    if device_bytes <= 0 or estimate.total <= device_bytes:
        return None
    return (f"warning: about {estimate.describe()}, more than {name}'s {device_bytes / 2**30:.1f} GiB: the run may "
            f"run out of memory once the rollout reaches {estimate.rollout}; enable model.activation_checkpointing, "
            "raise parallel.gpus_per_model, lower training.micro_batch_size or the rollout maximum")
