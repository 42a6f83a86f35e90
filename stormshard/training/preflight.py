"""Everything that can fail on bad input, checked before any process group, graph or file is made.

:func:`preflight` runs on every rank from the config, the world size and the file system alone
(no communication), so every rank reaches the same verdict and a bad run stops before it
creates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import WindowedSampleDataset, split_by_dates
from stormshard.models.variables import VariableIndex
from stormshard.parallel.topology import BatchPlan, ParallelLayout, batch_arithmetic
from stormshard.training.checkpoint import latest_checkpoint
from stormshard.training.config import ConfigError, ExperimentConfig
from stormshard.training.engine import EngineSettings
from stormshard.training.tasks import task_type

__all__ = ["RunInputs", "preflight", "checkpoint_dir", "RESUME_MAY_CHANGE"]

# config fields a resumed run may change (everything else must equal the checkpoint's)
RESUME_MAY_CHANGE = ("name", "training.max_steps", "training.epochs", "training.validation_interval",
                     "training.checkpoint_interval", "training.keep_checkpoints", "training.output_dir",
                     "data.graph_cache", "data.validation_samples", "logging")


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
    ranges = {"train": (config.data.train.start, config.data.train.end),
              "validation": (config.data.validation.start, config.data.validation.end)}
    try:
        train_samples = split_by_dates(dataset, {"train": ranges["train"]}, rollout=t.rollout, **window)["train"]
        val_samples = split_by_dates(dataset, {"validation": ranges["validation"]}, rollout=1, **window)["validation"]
    except ValueError as exc:
        raise ConfigError(f"data.train / data.validation / data.timestep: {exc}") from None
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
    plan_batch = batch_arithmetic(config.micro_batch, world, settings.accumulation, layout.gpus_per_model)
    return RunInputs(layout, dataset, variables, train_samples, val_samples, replicas, members, total_steps,
                     settings, plan_batch)
