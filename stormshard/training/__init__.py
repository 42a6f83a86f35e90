"""Training: experiment config, losses, engines (DeepSpeed, DDP, local), checkpoints, schedule,
logging and the loop."""

from __future__ import annotations

from stormshard.training.checkpoint import (  # noqa: F401
    CheckpointError,
    LoadedCheckpoint,
    capture_rng_state,
    config_differences,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    parameter_table,
    restore_rng_state,
    save_checkpoint,
)
from stormshard.training.config import (  # noqa: F401
    ConfigError,
    DataSection,
    DDPSection,
    ExperimentConfig,
    LoggingSection,
    ParallelSection,
    TrainingSection,
    load_experiment_config,
)
from stormshard.training.engine import (  # noqa: F401
    AdamWSettings,
    DDPEngine,
    DeepSpeedEngine,
    EngineError,
    EngineSettings,
    LocalEngine,
    PowerSGDSettings,
    TrainingEngine,
    build_engine,
    resolve_deepspeed_config,
)
from stormshard.training.launch import (  # noqa: F401
    init_distributed,
    run_training,
)
from stormshard.training.loop import (  # noqa: F401
    RESUME_MAY_CHANGE,
    RunInputs,
    Trainer,
    TrainResult,
    preflight,
    train,
)
from stormshard.training.losses import (  # noqa: F401
    AlmostFairCRPSLoss,
    WeightedMSELoss,
    almost_fair_crps,
)
from stormshard.training.metrics_log import (  # noqa: F401
    MetricsLogger,
    format_table,
    rmse_rows,
)
from stormshard.training.schedule import (  # noqa: F401
    LRScheduleSettings,
    build_scheduler,
    lr_at,
)

__all__ = [
    "DataSection",
    "ParallelSection",
    "TrainingSection",
    "DDPSection",
    "LoggingSection",
    "ExperimentConfig",
    "ConfigError",
    "load_experiment_config",
    "WeightedMSELoss",
    "AlmostFairCRPSLoss",
    "almost_fair_crps",
    "LRScheduleSettings",
    "lr_at",
    "build_scheduler",
    "EngineError",
    "AdamWSettings",
    "PowerSGDSettings",
    "EngineSettings",
    "TrainingEngine",
    "LocalEngine",
    "DDPEngine",
    "DeepSpeedEngine",
    "build_engine",
    "resolve_deepspeed_config",
    "CheckpointError",
    "LoadedCheckpoint",
    "capture_rng_state",
    "restore_rng_state",
    "parameter_table",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "config_differences",
    "MetricsLogger",
    "format_table",
    "rmse_rows",
    "Trainer",
    "TrainResult",
    "RunInputs",
    "preflight",
    "train",
    "RESUME_MAY_CHANGE",
    "init_distributed",
    "run_training",
]
