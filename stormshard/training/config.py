"""The experiment config: one JSON file per experiment, validated by pydantic before anything runs.

Sections: ``model`` (:class:`~stormshard.models.config.ModelConfig`), ``graph``
(:class:`~stormshard.graphs.builder.GraphConfig`; ``data_grid`` null = the dataset's own
coordinates), ``data``, ``parallel`` (the layout), ``training`` (steps, schedule, micro batch,
accumulation, clipping), ``optimizer`` (AdamW), ``engine`` ("deepspeed", "ddp" or "local"),
``deepspeed`` (DeepSpeed's own settings only), ``ddp``, ``compression`` and ``logging``. Unknown keys
are errors that name them; :func:`load_experiment_config` adds the file name and the fix to every
message.

One place per knob: micro batch, accumulation, clipping and the optimizer are engine-neutral and
read by all three engines. Their DeepSpeed spellings in the ``deepspeed`` section are errors naming
the field to use, except in a DeepSpeed JSON file given with ``--deepspeed_config``
(:func:`merge_deepspeed_file`): there they are moved to the engine-neutral fields, and a value that
disagrees with one the experiment config sets is an error.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stormshard.graphs.builder import GraphConfig, KNNEdges
from stormshard.models.config import ModelConfig
from stormshard.parallel.topology import ParallelLayout
from stormshard.training.engine.deepspeed_keys import check_deepspeed_section
from stormshard.training.engine.settings import (
    MOVED_DEEPSPEED_KEYS,
    AdamWSettings,
    CompressionSection,
    EngineSettings,
    check_engine_sections,
    check_precision,
    section_enabled,
)
from stormshard.training.rollout_schedule import RolloutSchedule
from stormshard.training.scaling import LossScalingSettings
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
    "merge_deepspeed_file",
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
    test: DateRange | None = Field(None, description="optional test dates; evaluated at the end of the run")
    num_workers: int = Field(2, ge=0, strict=True, description="reader workers per reading rank (0: read inline)")
    prefetch: int = Field(2, ge=1, strict=True, description="micro-batches in flight per reader worker")
    worker_type: Literal["auto", "processes", "threads"] = Field(
        "threads", description="threads (default: zarr decoding releases the GIL; 0.4% data wait in "
        "benchmarks/bench_input_pipeline.py against 11% for processes on 2 cores), processes (a fork "
        "server), or auto (processes unless this process may not start children)")
    imputation: dict[str, float | Literal["mean", "minimum", "maximum"]] = Field(
        default_factory=dict, description="NaN input fill per variable (default: the mean, normalised 0)")


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
    """Steps, schedule and the engine-neutral batch knobs (every engine reads them)."""

    max_steps: int | None = Field(None, ge=1, description="optimizer steps; or give epochs")
    epochs: int | None = Field(None, ge=1)
    rollout: int | RolloutSchedule = Field(1, description="autoregressive steps in the loss: an int or "
                                           "{start, increase_every, unit, maximum}")
    validation_rollout: int = Field(1, ge=1, strict=True, description="lead times in validation")
    loss_scaling: LossScalingSettings = LossScalingSettings()
    lr: float = Field(1e-3, gt=0, description="peak learning rate (end of warm-up)")
    lr_min: float = Field(1e-5, ge=0, description="floor of the cosine decay; at most lr")
    warmup_steps: int = Field(10, ge=0, description="optimizer steps of linear warm-up; at most the run's steps")
    micro_batch_size: int = Field(1, ge=1, strict=True, description="samples per model replica per micro-step")
    gradient_accumulation_steps: int = Field(1, ge=1, strict=True, description="micro-steps per optimizer step")
    gradient_clipping: float = Field(0.0, ge=0, description="max global gradient norm; 0 = off")
    validation_interval: int = Field(50, ge=1)
    checkpoint_interval: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    output_dir: str = "runs/quickstart"
    crps_alpha: float = Field(0.95, ge=0, le=1)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="model compute precision for every engine; bf16 keeps fp32 master weights, "
                            "optimizer moments, data, targets and loss (deepspeed.bf16 is generated from it)")

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if isinstance(self.rollout, int) and (isinstance(self.rollout, bool) or self.rollout < 1):
            raise ValueError(f"training.rollout={self.rollout!r} must be a positive integer or a schedule "
                             "{start, increase_every, unit, maximum}")
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("training: give exactly one of max_steps and epochs")
        if not math.isfinite(self.lr):
            raise ValueError(f"training.lr must be finite, got {self.lr}")
        if self.lr_min > self.lr:
            raise ValueError(
                f"training.lr_min={self.lr_min} is above training.lr={self.lr}: the cosine decays from lr down to "
                f"lr_min; set training.lr_min to at most {self.lr}"
            )
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(
                f"training.warmup_steps={self.warmup_steps} exceeds training.max_steps={self.max_steps}: warm-up is "
                f"part of the run; set training.warmup_steps to at most {self.max_steps}"
            )
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
    optimizer: AdamWSettings = AdamWSettings()
    engine: Literal["deepspeed", "ddp", "local"] = "deepspeed"
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="DeepSpeed's own settings (ZeRO, bf16, ...)")
    ddp: DDPSection = DDPSection()
    compression: CompressionSection = None
    model_parallel_grad_reduction: Literal["hooks", "bucketed"] = "hooks"
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        check_engine_sections(self.engine, self.deepspeed, self.compression)
        check_precision(self.training.precision, self.deepspeed)
        check_deepspeed_section(self.engine, self.deepspeed)  # DeepSpeed 0.19's keys; engine conflicts
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
        """The engine's settings for a run of ``total_steps`` optimizer steps: the engine-neutral
        knobs, the optimizer, the schedule, DDP knobs, compression and the DeepSpeed section.

        Raises :class:`ConfigError` when ``training.warmup_steps`` exceeds ``total_steps`` (with
        ``training.epochs`` the step count is known only once the data is read).
        """
        t = self.training
        if t.warmup_steps > total_steps:
            given = f"training.max_steps={t.max_steps}" if t.max_steps is not None else \
                f"training.epochs={t.epochs} of this data"
            raise ConfigError(
                f"training.warmup_steps={t.warmup_steps} exceeds the run's {total_steps} optimizer steps ({given}): "
                f"warm-up is part of the run; set training.warmup_steps to at most {total_steps}"
            )
        try:
            return EngineSettings(
                engine=self.engine,
                micro_batch_size=t.micro_batch_size,
                gradient_accumulation_steps=t.gradient_accumulation_steps,
                gradient_clipping=t.gradient_clipping,
                optimizer=self.optimizer,
                schedule=LRScheduleSettings(lr=t.lr, lr_min=t.lr_min, warmup_steps=t.warmup_steps,
                                            total_steps=total_steps),
                deepspeed=self.deepspeed,
                bucket_cap_mb=self.ddp.bucket_cap_mb,
                broadcast_buffers=self.ddp.broadcast_buffers,
                compression=self.compression,
                model_parallel_grad_reduction=self.model_parallel_grad_reduction,
                precision=t.precision,
            )
        except ValidationError as err:
            raise ConfigError(_format_errors(err, "engine settings")) from None

    @property
    def micro_batch(self) -> int:
        """Samples per model replica per micro-step (``training.micro_batch_size``)."""
        return self.training.micro_batch_size


def _format_errors(err: ValidationError, source: str) -> str:
    """One line per problem; a section-level check (its message names the field) is shown as it is."""
    problems = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (a typo? remove it or check the README's config reference)"
        if e["type"] == "value_error":
            msg = str(e.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
            if isinstance(value, dict):  # a model validator: its message names the fields
                problems.append(msg)
                continue
        problems.append(f"{where} = {shown}: {msg}")
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return "\n".join([f"{source}: {len(problems)} invalid setting(s):"] + [f"  - {p}" for p in problems])


def _read_json_object(source: str | os.PathLike, what: str, fix: str, holds: str) -> dict[str, Any]:
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist: {fix}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object with {holds}")
    return raw


# DeepSpeed's AdamW params -> the config field that holds them
_OPTIMIZER_PARAM_FIELDS = {"lr": "training.lr", "betas": "optimizer.betas", "eps": "optimizer.eps",
                           "weight_decay": "optimizer.weight_decay"}


def _deepspeed_optimizer_moves(opt: Any, source: str) -> list[tuple[str, str, Any]]:
    """``(deepspeed key, config field, value)`` for a DeepSpeed ``optimizer`` entry (AdamW only)."""
    if not isinstance(opt, dict):
        raise ConfigError(f"{source}: optimizer must be an object like {{'type': 'AdamW', 'params': {{...}}}}, "
                          f"got {opt!r}")
    params = dict(opt.get("params") or {})
    kind = str(opt.get("type", "AdamW")).lower()
    adam_w_mode = params.pop("adam_w_mode", kind == "adamw")
    if kind not in ("adamw", "adam") or adam_w_mode is not True:
        raise ConfigError(
            f"{source}: optimizer {opt!r} is not AdamW: every engine uses AdamW so that they take the same step; "
            "use type 'AdamW' (its betas, eps and weight_decay go to the config's optimizer section)"
        )
    unknown = sorted(set(params) - set(_OPTIMIZER_PARAM_FIELDS))
    if unknown:
        raise ConfigError(
            f"{source}: optimizer.params {unknown} are not AdamW settings stormshard takes (it builds the "
            f"optimizer: torch's AdamW on the CPU accelerator, DeepSpeed's fused AdamW on GPUs): remove them; "
            f"the known ones are {sorted(_OPTIMIZER_PARAM_FIELDS)}"
        )
    return [(f"optimizer.params.{k}", _OPTIMIZER_PARAM_FIELDS[k], v) for k, v in params.items()]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def merge_deepspeed_file(raw: dict[str, Any], deepspeed: dict[str, Any],
                         source: str = "--deepspeed_config") -> dict[str, Any]:
    """A copy of the raw config ``raw`` with a DeepSpeed JSON file ``deepspeed`` merged in.

    The rule (``launch/train.py --deepspeed_config FILE``): the file replaces the config's
    ``deepspeed`` section, except its engine-neutral keys, which move to their fields:
    ``train_micro_batch_size_per_gpu`` -> ``training.micro_batch_size``,
    ``gradient_accumulation_steps`` -> ``training.gradient_accumulation_steps``,
    ``gradient_clipping`` -> ``training.gradient_clipping``, ``optimizer`` (AdamW only) ->
    ``optimizer.{betas, eps, weight_decay}`` and ``training.lr``. A field the config sets to a
    different value is a :class:`ConfigError` naming both places; an equal one is fine.
    ``train_batch_size`` stays in the section (checked against micro batch x accumulation x
    data-parallel size when the engine is built).
    """
    if not isinstance(deepspeed, dict):
        raise ConfigError(f"{source} must hold a JSON object (a DeepSpeed config), got {type(deepspeed).__name__}")
    section = dict(deepspeed)
    moves = [(key, MOVED_DEEPSPEED_KEYS[key][1], section.pop(key))
             for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
             if key in section]
    if "optimizer" in section:
        moves += _deepspeed_optimizer_moves(section.pop("optimizer"), source)
    if isinstance(section.get("bf16"), dict):  # the section keeps it; training.precision must agree
        moves.append(("bf16.enabled", "training.precision", "bf16" if section_enabled(section["bf16"]) else "fp32"))
    out = dict(raw)
    for key, dotted, value in moves:
        name, field = dotted.split(".")
        current = out.get(name)
        if current is not None and not isinstance(current, dict):
            raise ConfigError(f"{name} must be an object, got {current!r}")
        current = dict(current or {})
        if field in current and not _same(current[field], value):
            raise ConfigError(
                f"{source} sets {key}={value!r} but the config sets {dotted}={current[field]!r}: one knob, one "
                f"place; remove one of them or make them equal"
            )
        current[field] = value
        out[name] = current
    out["deepspeed"] = section
    return out


def load_experiment_config(
    source: str | os.PathLike | dict[str, Any],
    overrides: dict[str, Any] | None = None,
    deepspeed_config: str | os.PathLike | dict[str, Any] | None = None,
) -> ExperimentConfig:
    """Read and validate a config (a JSON path or a dict). Raises :class:`ConfigError`.

    ``overrides`` replace top-level sections as they are (a ``deepspeed`` override holds DeepSpeed's
    own keys only). ``deepspeed_config`` (a DeepSpeed JSON file or dict, ``--deepspeed_config``) is
    merged by :func:`merge_deepspeed_file`: it replaces the ``deepspeed`` section and its batch,
    clipping and optimizer keys move to the engine-neutral fields.
    """
    name = "config"
    if isinstance(source, dict):
        raw = dict(source)
    else:
        name = str(Path(source))
        raw = _read_json_object(source, "config file", "pass --config configs/<name>.json",
                                "the sections model, graph, data, ...")
    raw.pop("$schema", None)
    raw.pop("description", None)
    raw.update(overrides or {})
    if deepspeed_config is not None:
        ds_name = "--deepspeed_config"
        if not isinstance(deepspeed_config, dict):
            ds_name = f"--deepspeed_config {Path(deepspeed_config)}"
            deepspeed_config = _read_json_object(deepspeed_config, "DeepSpeed config", "pass an existing JSON file",
                                                 "DeepSpeed's settings (zero_optimization, bf16, ...)")
        raw = merge_deepspeed_file(raw, deepspeed_config, ds_name)
    try:
        return ExperimentConfig(**raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, name)) from None
