"""Everything that can fail on bad input, checked before any process group, graph or file is made.

:func:`preflight` runs on every rank from the config, the world size and the file system alone
(no communication), so every rank reaches the same verdict and a bad run stops before it
creates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import (
    WindowedSampleDataset,
    date_range_bounds,
    overlapping_ranges,
    split_by_dates,
)
from stormshard.data.normalisation import Normaliser, nan_fill_values
from stormshard.models.variables import VariableIndex
from stormshard.parallel.topology import BatchPlan, ParallelLayout, batch_arithmetic
from stormshard.training.activation_memory import (
    ActivationEstimate,
    device_memory_bytes,
    estimate_activation_memory,
    hidden_nodes,
)
from stormshard.training.checkpoint import latest_checkpoint
from stormshard.training.config import ConfigError, ExperimentConfig
from stormshard.training.early_checks import (
    check_deepspeed_batch,
    check_model_layout,
    check_normalisation_scales,
    check_output_dir,
)
from stormshard.training.engine import EngineSettings
from stormshard.training.rollout_schedule import max_rollout
from stormshard.training.scaling import variable_loss_weights
from stormshard.training.tasks import task_type

__all__ = ["RunInputs", "preflight", "checkpoint_dir", "RESUME_MAY_CHANGE", "check_splits", "check_activation_memory",
           "activation_estimate"]

# config fields a resumed run may change (everything else must equal the checkpoint's)
RESUME_MAY_CHANGE = ("name", "training.max_steps", "training.epochs", "training.validation_interval",
                     "training.checkpoint_interval", "training.keep_checkpoints", "training.output_dir",
                     "data.graph_cache", "data.validation_samples", "logging", "data.num_workers", "data.prefetch",
                     "data.worker_type", "data.test", "training.validation_rollout")


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


def _check_resume(config: ExperimentConfig) -> None:
    directory = checkpoint_dir(config)
    if latest_checkpoint(directory) is None:
        raise ConfigError(
            f"--resume was given but {directory} holds no checkpoint (training.output_dir="
            f"{config.training.output_dir!r}): remove --resume to start a new run, or point training.output_dir "
            "at the run to continue"
        )


def preflight(config: ExperimentConfig, world: int, resume: bool = False) -> RunInputs:
    """Check the config against the world size, the dataset and (``resume``) the checkpoints, before
    any process group or file is made; raises :class:`ConfigError` / ``LayoutError`` /
    ``AnemoiLayoutError`` naming the field and the fix."""
    t = config.training
    layout = config.parallel.layout(world)
    if resume:
        _check_resume(config)
    check_output_dir(config)
    data_path = Path(config.data.path)
    if not data_path.exists():
        raise ConfigError(
            f"data.path={config.data.path!r} does not exist: generate one with `python -m "
            "stormshard.data.synthetic --out data/synthetic.zarr` or point to an anemoi-layout dataset"
        )
    dataset = AnemoiDataset.open(data_path)
    try:
        variables = VariableIndex.build(dataset.variables, config.data.forcing, config.data.diagnostic)
    except ValueError as exc:
        raise ConfigError(f"data.forcing / data.diagnostic: {exc}") from None
    window = dict(multistep_input=config.model.multistep_input, timestep=config.data.timestep, ensemble="each")
    ranges = check_splits(config, dataset)
    try:
        train_samples = split_by_dates(dataset, {"train": ranges["train"]}, rollout=max_rollout(t.rollout),
                                       **window)["train"]
        val_samples = split_by_dates(dataset, {"validation": ranges["validation"]}, rollout=t.validation_rollout,
                                     **window)["validation"]
        test_samples = None if "test" not in ranges else split_by_dates(
            dataset, {"test": ranges["test"]}, rollout=t.validation_rollout, **window)["test"]
    except ValueError as exc:
        raise ConfigError(f"data.train / data.validation / data.test / data.timestep / training.rollout / "
                          f"training.validation_rollout: {exc}") from None
    check_normalisation_scales(config, dataset)  # a zero standard deviation would make the first loss NaN
    loss_weights = check_loss_weights_and_imputation(config, dataset, variables)
    check_model_layout(config, layout, dataset)  # kNN sizes, hidden nodes vs ranks, heads vs the model group
    if config.engine == "local" and layout.data_parallel_size > 1:
        raise ConfigError(
            f"engine='local' has no data parallelism but world {world} / gpus_per_model {layout.gpus_per_model} "
            f"gives {layout.data_parallel_size} replicas: use engine 'deepspeed' or 'ddp', or launch "
            f"{layout.gpus_per_model} processes"
        )
    task = task_type(config)
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
    check_deepspeed_batch(config, layout, settings)
    plan_batch = batch_arithmetic(config.micro_batch, world, settings.accumulation, layout.gpus_per_model)
    notes = data_notes(dataset)
    memory = check_activation_memory(config, dataset.num_cells, layout.gpus_per_model, members)
    if memory is not None:
        notes += (memory,)
    return RunInputs(layout, dataset, variables, train_samples, val_samples, replicas, members, total_steps,
                     settings, plan_batch, test_samples=test_samples, steps_per_epoch=max(1, per_epoch),
                     loss_weights=tuple(float(w) for w in loss_weights), notes=notes)


def check_splits(config: ExperimentConfig, dataset: AnemoiDataset) -> dict[str, tuple]:
    """The ``(start, end)`` of data.train, data.validation and (when given) data.test; a
    :class:`ConfigError` when two of them share a date (validating on training dates)."""
    d = config.data
    ranges = {"train": (d.train.start, d.train.end), "validation": (d.validation.start, d.validation.end)}
    if d.test is not None:
        ranges["test"] = (d.test.start, d.test.end)
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
    precision = getattr(config.training, "precision", "fp32")
    return estimate_activation_memory(
        data_cells=data_cells, hidden=hidden_nodes(config.graph.hidden), gpus_per_model=gpus_per_model,
        num_channels=m.num_channels, num_layers=m.processor.num_layers, mlp_ratio=m.processor.mlp_ratio,
        mapper_mlp_ratio=max(m.encoder.mlp_ratio, m.decoder.mlp_ratio),
        activation_checkpointing=m.activation_checkpointing, samples=config.micro_batch * members,
        rollout=max_rollout(config.training.rollout), bytes_per_element=2 if precision == "bf16" else 4)


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
