"""The experiment config: one JSON file per experiment, validated by pydantic before anything runs.

Sections: ``model`` (:class:`~stormshard.models.config.ModelConfig`), ``graph``
(:class:`~stormshard.graphs.builder.GraphConfig`; ``data_grid`` null = the dataset's own
coordinates), ``data``, ``parallel`` (the layout), ``training``, ``engine`` ("deepspeed", "ddp"
or "local"), ``deepspeed`` (handed to DeepSpeed), ``ddp``, ``compression`` and ``logging``.
Unknown keys are errors that name them; :func:`load_experiment_config` adds the file name and the
fix to every message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stormshard.graphs.builder import GraphConfig, KNNEdges
from stormshard.models.config import ModelConfig
from stormshard.parallel.topology import ParallelLayout
from stormshard.training.engine import EngineSettings, PowerSGDSettings
from stormshard.training.schedule import LRScheduleSettings

__all__ = [
    "DataSection",
    "ParallelSection",
    "TrainingSection",
    "DDPSection",
    "LoggingSection",
    "ExperimentConfig",
    "ConfigError",
    "load_experiment_config",
]


class ConfigError(ValueError):
    """An experiment config that cannot run; the message names the field, the value and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DateRange(_Strict):
    start: str | None = None
    end: str | None = None


class DataSection(_Strict):
    """Where the samples come from. ``path``: an anemoi-layout zarr store."""

    path: str = "data/synthetic.zarr"
    forcing: list[str] = Field(default_factory=list)
    diagnostic: list[str] = Field(default_factory=list)
    timestep: str | None = Field(None, description="e.g. '6h'; a multiple of the dataset frequency (None: it)")
    train: DateRange = DateRange()
    validation: DateRange = DateRange()
    normalisation: Literal["mean-std", "std", "min-max", "max", "none"] = "mean-std"
    normalisation_methods: dict[str, Literal["mean-std", "std", "min-max", "max", "none"]] = Field(default_factory=dict)
    graph_cache: str | None = Field(None, description="graph file; default <output_dir>/graph.pt")
    validation_samples: int = Field(16, ge=1, description="validation windows per evaluation")


class ParallelSection(_Strict):
    """The parallel layout (see :class:`~stormshard.parallel.topology.ParallelLayout`)."""

    gpus_per_model: int | None = Field(None, ge=1)
    shard_strategy: Literal["shard_sequence", "shard_heads", "tensor"] | None = None
    read_group_size: int | None = Field(None, ge=1)
    gpus_per_ensemble: int | None = Field(None, ge=1)
    ensemble_size_per_device: int = Field(1, ge=1)
    tensor_model_parallel_size: int | None = Field(None, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ParallelSection:
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"parallel.pipeline_model_parallel_size={self.pipeline_model_parallel_size}: pipeline parallelism "
                "is not supported; set it to 1 and shard the model with gpus_per_model"
            )
        tp = self.tensor_model_parallel_size
        if tp is not None and self.gpus_per_model is not None and tp != self.gpus_per_model:
            raise ValueError(
                f"parallel.tensor_model_parallel_size={tp} differs from parallel.gpus_per_model={self.gpus_per_model}: "
                "tensor parallelism runs over the model group; give one of them"
            )
        if tp is not None and tp > 1 and self.shard_strategy not in (None, "tensor"):
            raise ValueError(
                f"parallel.tensor_model_parallel_size={tp} asks for tensor parallelism but parallel.shard_strategy="
                f"{self.shard_strategy!r}: drop one of them"
            )
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.gpus_per_model or self.tensor_model_parallel_size or 1

    def layout(self, world_size: int) -> ParallelLayout:
        k = self.model_parallel_size
        return ParallelLayout(
            world_size=world_size,
            gpus_per_model=k,
            read_group_size=self.read_group_size or k,
            gpus_per_ensemble=self.gpus_per_ensemble,
        )


class TrainingSection(_Strict):
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; or give epochs")
    epochs: int | None = Field(None, ge=1)
    rollout: int = Field(1, ge=1, description="autoregressive steps in the loss")
    lr: float = Field(1e-3, gt=0)
    lr_min: float = Field(1e-5, ge=0)
    warmup_steps: int = Field(10, ge=0)
    validation_interval: int = Field(50, ge=1)
    checkpoint_interval: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    output_dir: str = "runs/quickstart"
    crps_alpha: float = Field(0.95, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("training: give exactly one of max_steps and epochs")
        return self


class DDPSection(_Strict):
    """torch DDP knobs (``engine: "ddp"``), as tuned in the AIFS data-parallel poster."""

    bucket_cap_mb: float = Field(25.0, gt=0)
    broadcast_buffers: bool = False


class LoggingSection(_Strict):
    progress: bool = True
    wandb: bool = False
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "stormshard"
    log_interval: int = Field(1, ge=1)


class ExperimentConfig(_Strict):
    """Everything one training run needs."""

    name: str = "experiment"
    model: ModelConfig = ModelConfig()
    graph: GraphConfig = GraphConfig(hidden="o8", processor=KNNEdges(num_neighbours=8))
    data: DataSection = DataSection()
    parallel: ParallelSection = ParallelSection()
    training: TrainingSection = TrainingSection(max_steps=100)
    engine: Literal["deepspeed", "ddp", "local"] = "deepspeed"
    deepspeed: dict[str, Any] = Field(default_factory=lambda: {"train_micro_batch_size_per_gpu": 1})
    ddp: DDPSection = DDPSection()
    compression: PowerSGDSettings | None = None
    model_parallel_grad_reduction: Literal["hooks", "bucketed"] = "hooks"
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        strategy = self.parallel.shard_strategy
        if (self.parallel.tensor_model_parallel_size or 1) > 1:
            strategy = "tensor"
        if strategy is not None and strategy != self.model.processor.shard_strategy:
            if "shard_strategy" in self.model.processor.model_fields_set:
                raise ValueError(
                    f"parallel.shard_strategy={strategy!r} and model.processor.shard_strategy="
                    f"{self.model.processor.shard_strategy!r} disagree: set it in one place"
                )
            processor = self.model.processor.model_copy(update={"shard_strategy": strategy})
            object.__setattr__(self, "model", ModelConfig(**{**self.model.model_dump(), "processor": processor.model_dump()}))
        if self.model.name == "ensemble" and self.parallel.ensemble_size_per_device * self.ensemble_groups_factor < 2:
            raise ValueError(
                "model.name='ensemble' needs at least 2 members per initial state: raise "
                "parallel.ensemble_size_per_device or parallel.gpus_per_ensemble"
            )
        if self.model.name != "ensemble" and (self.parallel.gpus_per_ensemble or self.parallel.ensemble_size_per_device > 1):
            if self.parallel.gpus_per_ensemble not in (None, self.parallel.model_parallel_size) or \
                    self.parallel.ensemble_size_per_device > 1:
                raise ValueError(
                    f"parallel.gpus_per_ensemble / ensemble_size_per_device are set but model.name={self.model.name!r}: "
                    "ensemble members need model.name='ensemble'"
                )
        if self.data.validation_samples < 1:
            raise ValueError("data.validation_samples must be at least 1")
        return self

    @property
    def ensemble_groups_factor(self) -> int:
        """Model groups per ensemble group (members of one initial state are spread over them)."""
        ens = self.parallel.gpus_per_ensemble or self.parallel.model_parallel_size
        return max(1, ens // self.parallel.model_parallel_size)

    def engine_settings(self, total_steps: int) -> EngineSettings:
        """The engine's settings: the deepspeed section, DDP knobs, compression and the schedule."""
        t = self.training
        return EngineSettings(
            engine=self.engine,
            deepspeed=self.deepspeed,
            schedule=LRScheduleSettings(lr=t.lr, lr_min=min(t.lr_min, t.lr), warmup_steps=min(t.warmup_steps, total_steps),
                                        total_steps=total_steps),
            bucket_cap_mb=self.ddp.bucket_cap_mb,
            broadcast_buffers=self.ddp.broadcast_buffers,
            compression=self.compression,
            model_parallel_grad_reduction=self.model_parallel_grad_reduction,
        )

    @property
    def micro_batch(self) -> int:
        return int(self.deepspeed.get("train_micro_batch_size_per_gpu", 1))


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {len(err.errors())} invalid setting(s):"]
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (a typo? remove it or check the README's config reference)"
        lines.append(f"  - {where} = {shown}: {msg}")
    return "\n".join(lines)


def load_experiment_config(
    source: str | os.PathLike | dict[str, Any], overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """Read and validate a config (a JSON path or a dict). ``overrides`` replace top-level sections
    (e.g. ``{"deepspeed": {...}}`` from ``--deepspeed_config``). Raises :class:`ConfigError`."""
    name = "config"
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        name = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist: pass --config configs/<name>.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object with the sections model, graph, data, ...")
    raw.pop("$schema", None)
    raw.pop("description", None)
    raw.update(overrides or {})
    try:
        return ExperimentConfig(**raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, name)) from None
