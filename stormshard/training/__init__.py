"""Training: experiment config, preflight checks, tasks (deterministic, ensemble), engines
(DeepSpeed, DDP, local), losses, checkpoints and the loop."""

from __future__ import annotations

from stormshard.training.config import ConfigError, ExperimentConfig, load_experiment_config
from stormshard.training.diskspace import DiskSpaceError
from stormshard.training.engine import EngineSettings, build_engine
from stormshard.training.launch import (
    LaunchEnvironment,
    LaunchError,
    detect_launch,
    init_distributed,
    run_training,
)
from stormshard.training.loop import Trainer, TrainResult, train
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedMSELoss
from stormshard.training.preflight import preflight
from stormshard.training.rollout_schedule import RolloutSchedule, rollout_at
from stormshard.training.scaling import LossScalingSettings, PressureLevelScaling, variable_loss_weights
from stormshard.training.tasks import EnsembleForecastTask, ForecastTask
from stormshard.training.watchdog import RankFailure

__all__ = [
    "ExperimentConfig", "ConfigError", "load_experiment_config", "preflight", "ForecastTask",
    "EnsembleForecastTask", "build_engine", "EngineSettings", "WeightedMSELoss", "AlmostFairCRPSLoss",
    "Trainer", "TrainResult", "train", "init_distributed", "run_training",
    "RolloutSchedule", "rollout_at", "LossScalingSettings", "PressureLevelScaling", "variable_loss_weights",
    "LaunchEnvironment", "LaunchError", "detect_launch", "RankFailure", "DiskSpaceError",
]
