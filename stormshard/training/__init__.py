"""Training: experiment config, preflight checks, tasks (deterministic, ensemble), engines
(DeepSpeed, DDP, local), losses, checkpoints and the loop."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module, loaded on first use: importing the package (e.g. stormshard.training.config, which
# launch/train.py validates before anything else) does not load torch or DeepSpeed
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("ConfigError", "ExperimentConfig", "load_experiment_config"), "config"),
    "DiskSpaceError": "diskspace",
    **dict.fromkeys(("EngineSettings", "build_engine"), "engine"),
    **dict.fromkeys(("LaunchEnvironment", "LaunchError", "detect_launch", "init_distributed", "run_training"),
                    "launch"),
    **dict.fromkeys(("Trainer", "TrainResult", "train"), "loop"),
    **dict.fromkeys(("AlmostFairCRPSLoss", "WeightedMSELoss", "WeightedPointwiseLoss"), "losses"),
    "preflight": "preflight",
    **dict.fromkeys(("RolloutSchedule", "rollout_at"), "rollout_schedule"),
    **dict.fromkeys(("EnsembleForecastTask", "ForecastTask"), "tasks"),
    "RankFailure": "watchdog",
}
__all__ = [
    "ExperimentConfig", "ConfigError", "load_experiment_config", "preflight", "ForecastTask",
    "EnsembleForecastTask", "build_engine", "EngineSettings", "WeightedMSELoss", "WeightedPointwiseLoss",
    "AlmostFairCRPSLoss",
    "Trainer", "TrainResult", "train", "init_distributed", "run_training",
    "RolloutSchedule", "rollout_at",
    "LaunchEnvironment", "LaunchError", "detect_launch", "RankFailure", "DiskSpaceError",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
