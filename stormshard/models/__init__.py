"""The model zoo: AIFS-style encoder-processor-decoder models, their config, shard plan,
parallelize step, registry (built-in names, ``"package.module:attribute"`` builders) and the
rollout update shared by training and inference."""

from __future__ import annotations

import importlib
from typing import Any

# name -> module, loaded on first use: importing the package (e.g. the torch-free model config, read by
# the experiment config) does not load torch
_EXPORTS: dict[str, str] = {
    "ModelConfig": "config",
    "EncoderProcessorDecoder": "encoder_processor_decoder",
    "EnsembleEncoderProcessorDecoder": "ensemble",
    **dict.fromkeys(("build_transformer_processor", "check_parallel_strategy", "parallelize",
                     "parallelize_processor"),
                    "parallelize"),
    **dict.fromkeys(("ModelBuilder", "build_model", "register_model"), "registry"),
    "advance_window": "rollout",
    "ModelShardPlan": "sharding",
    "VariableIndex": "variables",
}
__all__ = [
    "ModelConfig", "VariableIndex", "ModelShardPlan", "ModelBuilder", "build_model", "register_model",
    "parallelize", "check_parallel_strategy", "parallelize_processor", "build_transformer_processor",
    "EncoderProcessorDecoder", "EnsembleEncoderProcessorDecoder", "advance_window",
]


def __getattr__(name: str) -> Any:
    """An exported name (imported from its module on first use) or a submodule."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
