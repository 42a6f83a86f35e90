"""The experiment config: one JSON file per experiment, validated by pydantic before anything runs.

Sections: ``model`` (:class:`~stormshard.models.config.ModelConfig`), ``graph``
(:class:`~stormshard.graphs.builder.GraphConfig`; ``data_grid`` null = the dataset's own
coordinates), ``data``, ``parallel`` (the layout), ``training`` (steps, schedule, micro batch,
accumulation, clipping), ``optimizer`` (AdamW), ``engine`` ("deepspeed", "ddp" or "local"),
``deepspeed`` (DeepSpeed's own settings only), ``ddp``, ``compression`` and ``logging``. Unknown keys
are errors that name them; :func:`load_experiment_config` adds the file name and the fix to every
message. It reads the file strictly and applies ``dotted.key=value`` command-line overrides
(:mod:`stormshard.training.config_file`). This module and the schema modules it reads import no torch
(``launch/train.py`` validates a config before torch or DeepSpeed loads: a bad one fails at once).

One place per knob: micro batch, accumulation, clipping and the optimizer are engine-neutral and
read by all three engines. Their DeepSpeed spellings in the ``deepspeed`` section are errors naming
the field to use, except in a DeepSpeed JSON file given with ``--deepspeed_config``
(:func:`merge_deepspeed_file`): there they are moved to the engine-neutral fields, and a value that
disagrees with one the experiment config sets is an error.

One home per choice: the processor's split over the model group is ``parallel.shard_strategy``, the
precision is ``training.precision``. Their older spellings are read once, on the raw dict before
validation (:func:`read_old_spellings`), each with a :class:`ConfigDeprecationWarning` naming the
old key and the new one: ``model.processor.shard_strategy`` and ``parallel.tensor_model_parallel_size``
(N > 1 meant ``"tensor"``; N is ``parallel.gpus_per_model``) move to ``parallel``, a ``deepspeed.bf16`` /
``deepspeed.fp16`` block's ``enabled`` to ``training.precision`` (:func:`move_deepspeed_precision`,
also the ``--deepspeed_config`` path). An old key that disagrees with the new one is an error naming
both. Derived values are computed (``ParallelSection.model_parallel_size``,
``ExperimentConfig.engine_settings``), never written back into another section.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stormshard.graphs.config import GraphConfig, KNNEdges
from stormshard.models.config import ModelConfig
from stormshard.models.loss_weights import LossScalingSettings
from stormshard.parallel.shard_strategy import ShardStrategy
from stormshard.training.config_file import ConfigError, apply_overrides, read_json_object, validate_config
from stormshard.training.deepspeed_file import deepspeed_optimizer_moves, same_value
from stormshard.training.engine.deepspeed_keys import check_deepspeed_section
from stormshard.training.engine.settings import (
    MOVED_DEEPSPEED_KEYS,
    AdamWSettings,
    CompressionSection,
    EngineSettings,
    check_engine_sections,
)
from stormshard.training.loss_kinds import LossKind
from stormshard.training.rollout_schedule import RolloutSchedule
from stormshard.training.schedule import LRScheduleSettings
from stormshard.training.weight_averaging_config import WeightAveragingSettings

if TYPE_CHECKING:  # this module imports no torch: launch/train.py validates a config before torch loads
    from stormshard.parallel.topology import ParallelLayout

__all__ = [
    "stored_config_dump",
    "DataSection",
    "ParallelSection",
    "TrainingSection",
    "DDPSection",
    "LoggingSection",
    "ExperimentConfig",
    "ConfigError",
    "ConfigDeprecationWarning",
    "load_experiment_config",
    "merge_deepspeed_file",
    "read_old_spellings",
    "move_deepspeed_precision",
]


class ConfigDeprecationWarning(FutureWarning):
    """A config key read under its old spelling; the message names the old key and the new one.

    A ``FutureWarning`` (Python's category for deprecations aimed at the user) rather than a
    ``DeprecationWarning``, which Python hides outside ``__main__``: the person who wrote the config
    is the one to see it. Shown once per message and process (Python's default filter)."""


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
    graph_file: str | None = Field(
        None, description="a fixed graph file used as it is, never rebuilt (an imported bundle's graph.pt; "
                          "its data nodes must be the dataset's cells); the graph section is then unused")
    statistics: str | None = Field(
        None, description="a statistics.json (per variable: mean, stdev, minimum, maximum; a bundle's) that "
                          "normalises instead of the dataset's statistics")
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
    """The parallel layout (see :class:`~stormshard.parallel.topology.ParallelLayout`, which checks
    the sizes against the world) and how the processor is split over a model group."""

    gpus_per_model: int | None = Field(None, ge=1, description="ranks that shard one model (None: 1)")
    shard_strategy: ShardStrategy = Field(
        "shard_sequence", description="the processor's split over the model group: shard_sequence, shard_heads or "
                                      "tensor (stormshard.parallel.shard.ShardStrategy)")
    read_group_size: int | None = Field(None, ge=1)
    gpus_per_ensemble: int | None = Field(None, ge=1)
    ensemble_size_per_device: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1, description="must be 1 (checked by the layout)")

    @property
    def model_parallel_size(self) -> int:
        return self.gpus_per_model or 1

    def layout(self, world_size: int) -> ParallelLayout:
        """The validated layout of ``world_size`` ranks (raises ``LayoutError`` naming the fix)."""
        from stormshard.parallel.topology import ParallelLayout

        k = self.model_parallel_size
        return ParallelLayout(
            world_size=world_size,
            gpus_per_model=k,
            read_group_size=self.read_group_size or k,
            gpus_per_ensemble=self.gpus_per_ensemble,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
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
    init_weights: str | None = Field(
        None, description="start from these weights (a stormshard bundle, an anemoi inference checkpoint or a "
                          "stormshard training checkpoint) with a fresh optimizer and schedule; parameters that "
                          "match by name and shape load, the others keep their fresh initialisation")
    init_weights_partial: bool = Field(False, strict=True, description="allow init_weights that match only some "
                                       "parameters (another architecture): the others start fresh, with a warning")
    freeze: list[str] = Field(default_factory=list, description="parameter name prefixes not trained "
                              "(e.g. [\"encoder\", \"processor.blocks.0\"]); each must match a parameter")
    weight_averaging: WeightAveragingSettings | None = None  # null, or ema / swa: training/weight_averaging_config.py
    loss: LossKind = Field(
        "mse", description="the deterministic models' pointwise loss, area- and variable-weighted: mse, mae, huber, "
        "logcosh or rmse (anemoi-training's losses of those names); ensembles train the almost-fair CRPS")
    huber_delta: float = Field(1.0, gt=0, allow_inf_nan=False, description="the Huber loss's threshold "
                               "(training.loss 'huber'; normalised units)")
    crps_alpha: float = Field(0.95, ge=0, le=1)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="model compute precision for every engine; bf16 keeps fp32 master weights, "
                            "optimizer moments, data, targets and loss (deepspeed.bf16.enabled is generated "
                            "from it)")
    compile: Literal[True, False, "auto"] = Field(
        "auto", description="torch.compile each processor block, the encoder and the decoder "
        "(stormshard.models.compile.compile_blocks; names and numbers unchanged): true, false, or 'auto' (the "
        "default: on CUDA, where it measured 1.3-1.6x faster per step; not on a CPU, where a step is mostly "
        "compile-free python)")
    cuda_graphs: bool = Field(
        False, strict=True, description="record the compiled blocks' forward and backward as CUDA graphs and "
        "replay them (torch.compile mode 'reduce-overhead'; stormshard.models.compile): one launch per block "
        "instead of one per kernel. Needs a CUDA device and compiled blocks (training.compile true or 'auto'); "
        "off by default until measured on a GPU")

    @field_validator("compile", mode="before")
    @classmethod
    def _check_compile(cls, value: object) -> object:
        if value is True or value is False or value == "auto":
            return value
        raise ValueError("must be true, false or \"auto\" (the default: compile on CUDA, not on a CPU)")

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
    # seconds between progress lines when standard error is not a terminal (a log file): no tqdm frames there
    log_every_s: float = Field(30.0, gt=0, allow_inf_nan=False)


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
    model_parallel_grad_reduction: Literal["auto", "hooks", "bucketed"] = "auto"
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="before")
    @classmethod
    def _read_old_spellings(cls, data: Any) -> Any:
        return read_old_spellings(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        check_engine_sections(self.engine, self.deepspeed, self.compression, self.training.precision,
                              "training.precision")
        check_deepspeed_section(self.engine, self.deepspeed)  # DeepSpeed 0.19's keys; engine conflicts
        if self.model.residual == "truncated" and self.graph.truncation is None and self.data.graph_file is None:
            raise ValueError(
                "model.residual='truncated' needs a truncation grid in the graph: set graph.truncation (e.g. "
                "{\"grid\": \"o32\", \"num_neighbours\": 3, \"sigma\": 1.0}), or data.graph_file to a graph that "
                "has one, or set model.residual='last_step'"
            )
        if self.model.name == "ensemble" and self.parallel.ensemble_size_per_device * self.ensemble_groups_factor < 2:
            raise ValueError(
                "model.name='ensemble' needs at least 2 members per initial state: raise "
                "parallel.ensemble_size_per_device or parallel.gpus_per_ensemble"
            )
        if self.model.name == "ensemble" and self.training.loss != "mse":
            raise ValueError(
                f"training.loss={self.training.loss!r} with model.name='ensemble': an ensemble trains the almost-fair "
                "CRPS (training.crps_alpha sets it); remove training.loss, or train a deterministic model"
            )
        if self.model.name != "ensemble" and (self.parallel.gpus_per_ensemble or self.parallel.ensemble_size_per_device > 1):
            if self.parallel.gpus_per_ensemble not in (None, self.parallel.model_parallel_size) or \
                    self.parallel.ensemble_size_per_device > 1:
                raise ValueError(
                    f"parallel.gpus_per_ensemble / ensemble_size_per_device are set but model.name={self.model.name!r}: "
                    "ensemble members need model.name='ensemble'"
                )
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
        # the config checked these fields with EngineSettings' own rules (check_engine_sections) when it was
        # validated: the derived settings are assembled, not checked a second time
        return EngineSettings.model_construct(
            engine=self.engine,
            micro_batch_size=t.micro_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            gradient_clipping=t.gradient_clipping,
            optimizer=self.optimizer,
            schedule=LRScheduleSettings(lr=t.lr, lr_min=t.lr_min, warmup_steps=t.warmup_steps, total_steps=total_steps),
            deepspeed=self.deepspeed,
            bucket_cap_mb=self.ddp.bucket_cap_mb,
            broadcast_buffers=self.ddp.broadcast_buffers,
            compression=self.compression,
            model_parallel_grad_reduction=self.model_parallel_grad_reduction,
            precision=t.precision,
        )

    @property
    def micro_batch(self) -> int:
        """Samples per model replica per micro-step (``training.micro_batch_size``)."""
        return self.training.micro_batch_size


# old spellings read_old_spellings moves (accepted as command-line override keys too)
DEPRECATED_KEYS = ("parallel.tensor_model_parallel_size", "model.processor.shard_strategy")


def _deprecated(old: str, new: str) -> str:
    return f"{old} is a deprecated spelling, read as {new}: write that instead (the old key will stop being read)"


def _explicit(section: Any, field: str) -> tuple[bool, Any]:
    """Whether a raw section (a dict, or an already validated section) sets ``field``, and its value;
    a null counts as unset (configs stored by older versions write unset fields as null)."""
    if isinstance(section, dict):
        return section.get(field) is not None, section.get(field)
    if isinstance(section, BaseModel):
        return field in section.model_fields_set, getattr(section, field, None)
    return False, None


def _as_dict(section: Any) -> dict[str, Any] | None:
    """A raw section as a new dict of the fields it sets (None when it is neither dict nor section)."""
    if section is None:
        return {}
    if isinstance(section, dict):
        return dict(section)
    if isinstance(section, BaseModel):
        return {name: getattr(section, name) for name in section.model_fields_set}
    return None


def _move_shard_strategy(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``parallel.tensor_model_parallel_size`` and ``model.processor.shard_strategy`` -> ``parallel``;
    the deprecation messages."""
    par = _as_dict(raw.get("parallel"))
    if par is None:  # not an object: validation names it
        return raw, []
    notes = []
    old_size = par.pop("tensor_model_parallel_size", None)
    if "shard_strategy" in par and par["shard_strategy"] is None:  # null (older stored configs): unset
        del par["shard_strategy"]
    strategy_from = f"parallel.shard_strategy={par.get('shard_strategy')!r}"
    if old_size is not None:
        if isinstance(old_size, bool) or not isinstance(old_size, int) or old_size < 1:
            raise ConfigError(f"parallel.tensor_model_parallel_size={old_size!r} must be a positive integer; better, "
                              "remove it and set parallel.gpus_per_model")
        gpus = par.get("gpus_per_model")
        if gpus is not None and gpus != old_size:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size={old_size} (deprecated) and parallel.gpus_per_model={gpus} "
                "disagree: tensor parallelism runs over the model group; remove parallel.tensor_model_parallel_size "
                "and set parallel.gpus_per_model (and parallel.shard_strategy='tensor')"
            )
        par["gpus_per_model"] = old_size
        new = f"parallel.gpus_per_model={old_size}"
        if old_size > 1:
            if par.get("shard_strategy", "tensor") != "tensor":
                raise ConfigError(
                    f"parallel.tensor_model_parallel_size={old_size} (deprecated) asks for tensor parallelism but "
                    f"{strategy_from}: remove parallel.tensor_model_parallel_size and keep parallel.shard_strategy"
                )
            par["shard_strategy"] = "tensor"
            strategy_from = f"parallel.tensor_model_parallel_size={old_size} (parallel.shard_strategy='tensor')"
            new += " and parallel.shard_strategy='tensor'"
        notes.append(_deprecated(f"parallel.tensor_model_parallel_size={old_size}", new))
    out = {**raw, "parallel": par}
    model = raw.get("model")
    processor = model.get("processor") if isinstance(model, dict) else None
    if not isinstance(processor, dict) or "shard_strategy" not in processor:
        return out, notes
    old = processor["shard_strategy"]
    out["model"] = {**model, "processor": {k: v for k, v in processor.items() if k != "shard_strategy"}}
    if old is None:
        return out, notes
    if par.get("shard_strategy", old) != old:
        raise ConfigError(
            f"model.processor.shard_strategy={old!r} (deprecated) and {strategy_from} disagree: the strategy is set "
            "in one place, parallel.shard_strategy; remove model.processor.shard_strategy"
        )
    par["shard_strategy"] = old
    notes.append(_deprecated(f"model.processor.shard_strategy={old!r}", f"parallel.shard_strategy={old!r}"))
    return out, notes


def move_deepspeed_precision(raw: dict[str, Any], section: dict[str, Any], source: str | None = None
                             ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``(raw, section, notes)``: the precision a DeepSpeed ``section`` states moved to ``training.precision``.

    The one reader of DeepSpeed's precision keys, for both paths: the config's own ``deepspeed``
    section (``source`` None: a deprecated spelling; ``notes`` holds its deprecation message) and a
    ``--deepspeed_config`` file (``source`` names it: DeepSpeed's own format, moved without a note).
    ``bf16.enabled`` becomes ``training.precision`` ('bf16' or 'fp32'; DeepSpeed's other ``bf16`` keys
    stay in the section); a disabled ``fp16`` block is dropped. A ``training.precision`` the config
    sets differently, an enabled ``fp16``, or an engine other than ``deepspeed`` (it reads no
    section) is a :class:`ConfigError` naming both keys. Neither argument is modified.
    """
    where = "deepspeed." if source is None else ""
    of = "" if source is None else f" of {source}"
    section, notes = dict(section), []
    fp16 = section.get("fp16")
    if isinstance(fp16, dict):
        if fp16.get("enabled", False):
            raise ConfigError(
                f"{where}fp16.enabled={fp16['enabled']!r}{of} asks for fp16, which stormshard does not support (no loss "
                "scaling): remove it and set training.precision='bf16' (or 'fp32')"
            )
        del section["fp16"]  # a disabled fp16 block states nothing training.precision does not
        if source is None:
            notes.append(_deprecated("deepspeed.fp16 (disabled)", "nothing: the precision is training.precision "
                                     "('fp32' or 'bf16'); remove deepspeed.fp16"))
    bf16 = section.get("bf16")
    if not isinstance(bf16, dict) or "enabled" not in bf16:
        return raw, section, notes
    key = f"{where}bf16.enabled{of}"
    enabled = bf16["enabled"]
    if not isinstance(enabled, bool):
        raise ConfigError(f"{key}={enabled!r} must be true or false; better, remove it and set training.precision")
    precision = "bf16" if enabled else "fp32"
    rest = {k: v for k, v in bf16.items() if k != "enabled"}
    if rest:
        section["bf16"] = rest
    else:
        del section["bf16"]
    engine = raw.get("engine", "deepspeed")
    if engine != "deepspeed":
        raise ConfigError(
            f"{key}={enabled} is set but engine={engine!r} does not read the deepspeed section: set "
            f"training.precision={precision!r} (read by every engine) and remove {key}"
        )
    is_set, current = _explicit(raw.get("training"), "precision")
    if is_set and current != precision:
        raise ConfigError(
            f"{key}={enabled} but training.precision={current!r}: the precision is set in one place, "
            f"training.precision ('fp32' or 'bf16', read by every engine; deepspeed.bf16.enabled is generated from "
            f"it); remove {key} or make them agree"
        )
    training = _as_dict(raw.get("training", ExperimentConfig.model_fields["training"].default))
    if training is None:  # not an object: validation names it
        return raw, section, notes
    if source is None:
        notes.append(_deprecated(f"deepspeed.bf16.enabled={str(enabled).lower()}", f"training.precision={precision!r}"))
    return {**raw, "training": {**training, "precision": precision}}, section, notes


def read_old_spellings(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of a raw config with its deprecated spellings moved to their one home (each with a
    :class:`ConfigDeprecationWarning`; an old key that disagrees with the new one is a
    :class:`ConfigError` naming both): ``parallel.tensor_model_parallel_size`` N -> ``parallel.gpus_per_model``
    N (and N > 1 -> ``parallel.shard_strategy='tensor'``), ``model.processor.shard_strategy`` ->
    ``parallel.shard_strategy``, the ``deepspeed`` section's ``bf16.enabled`` / ``fp16`` ->
    ``training.precision`` (:func:`move_deepspeed_precision`). ``raw`` is not modified; the messages
    are given once every old key was read without a conflict."""
    out, notes = _move_shard_strategy(raw)
    if isinstance(out.get("deepspeed"), dict):
        out, section, precision_notes = move_deepspeed_precision(out, out["deepspeed"])
        out, notes = {**out, "deepspeed": section}, notes + precision_notes
    for note in notes:
        warnings.warn(note, ConfigDeprecationWarning, stacklevel=2)
    return out


def merge_deepspeed_file(raw: dict[str, Any], deepspeed: dict[str, Any],
                         source: str = "--deepspeed_config") -> dict[str, Any]:
    """A copy of the raw config ``raw`` with a DeepSpeed JSON file ``deepspeed`` merged in.

    The rule (``launch/train.py --deepspeed_config FILE``): the file replaces the config's
    ``deepspeed`` section, except its engine-neutral keys, which move to their fields:
    ``train_micro_batch_size_per_gpu`` -> ``training.micro_batch_size``,
    ``gradient_accumulation_steps`` -> ``training.gradient_accumulation_steps``,
    ``gradient_clipping`` -> ``training.gradient_clipping``, ``optimizer`` (AdamW only) ->
    ``optimizer.{betas, eps, weight_decay}`` and ``training.lr``, ``bf16.enabled`` ->
    ``training.precision`` (:func:`move_deepspeed_precision`). A field the config sets to a
    different value is a :class:`ConfigError` naming both places; an equal one is fine.
    ``train_batch_size`` stays in the section (checked against micro batch x accumulation x
    data-parallel size before anything starts: ``check_engine_layout``).
    """
    if not isinstance(deepspeed, dict):
        raise ConfigError(f"{source} must hold a JSON object (a DeepSpeed config), got {type(deepspeed).__name__}")
    section = dict(deepspeed)
    moves = [(key, MOVED_DEEPSPEED_KEYS[key][1], section.pop(key))
             for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
             if key in section]
    if "optimizer" in section:
        moves += deepspeed_optimizer_moves(section.pop("optimizer"), source)
    out, section, _ = move_deepspeed_precision(dict(raw), section, source)  # a DeepSpeed file: no notes
    for key, dotted, value in moves:
        name, field = dotted.split(".")
        current = out.get(name)
        if current is not None and not isinstance(current, dict):
            raise ConfigError(f"{name} must be an object, got {current!r}")
        current = dict(current or {})
        if field in current and not same_value(current[field], value):
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
    cli_overrides: Sequence[str] = (),
) -> ExperimentConfig:
    """Read and validate a config (a JSON path or a dict). Raises :class:`ConfigError`.

    A JSON file is read strictly (:func:`~stormshard.training.config_file.read_json_object`: a
    directory, bad JSON or a key given twice is an error naming the file). ``overrides`` replace
    top-level sections as they are (a ``deepspeed`` override holds DeepSpeed's own keys only);
    ``cli_overrides`` are ``dotted.key=value`` items (``launch/train.py``'s positional arguments,
    :func:`~stormshard.training.config_file.apply_overrides`: keys checked against this schema with
    a did-you-mean, values JSON or strings), set after ``overrides``. ``deepspeed_config`` (a DeepSpeed JSON file or dict, ``--deepspeed_config``) is
    merged by :func:`merge_deepspeed_file`: it replaces the ``deepspeed`` section and its batch,
    clipping and optimizer keys move to the engine-neutral fields.
    """
    name = "config"
    if isinstance(source, dict):
        raw = dict(source)
    else:
        name = str(Path(source))
        raw = read_json_object(source, "config file", "pass --config configs/<name>.json",
                               "the sections model, graph, data, ...")
    raw.pop("$schema", None)
    raw.pop("description", None)
    raw.update(overrides or {})
    if cli_overrides:
        raw = apply_overrides(raw, cli_overrides, ExperimentConfig, also=DEPRECATED_KEYS)
    if deepspeed_config is not None:
        ds_name = "--deepspeed_config"
        if not isinstance(deepspeed_config, dict):
            ds_name = f"--deepspeed_config {Path(deepspeed_config)}"
            deepspeed_config = read_json_object(deepspeed_config, "DeepSpeed config", "pass an existing JSON file",
                                                "DeepSpeed's settings (zero_optimization, bf16, ...)")
        raw = merge_deepspeed_file(raw, deepspeed_config, ds_name)
    return validate_config(ExperimentConfig, raw, name, cli_overrides)  # an empty value or a bad override named


def stored_config_dump(raw: Any) -> dict[str, Any]:
    """A checkpoint's stored config in today's validated form, for comparison at ``--resume``: old
    spellings (a checkpoint of an earlier release) moved to their one home, silently (the run's
    own config already said so), defaults filled in. A stored config that no longer validates is
    returned as it is, so the comparison lists its differences field by field."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            return ExperimentConfig(**read_old_spellings(dict(raw))).model_dump(mode="json")
    except (ValueError, TypeError):
        return dict(raw)
