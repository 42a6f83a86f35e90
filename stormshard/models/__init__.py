"""The model zoo: AIFS-style encoder-processor-decoder models, their config, shard plan,
parallelize step, registry (built-in names, ``"package.module:attribute"`` builders) and the
rollout update shared by training and inference."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

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
    **dict.fromkeys(("compile_blocks", "compiled_block_names"), "compile"),
    "ModelShardPlan": "sharding",
    "VariableIndex": "variables",
    **dict.fromkeys(("LossScalingSettings", "PressureLevelScaling", "variable_loss_weights"), "loss_weights"),
}
__all__ = [
    "ModelConfig", "VariableIndex", "ModelShardPlan", "ModelBuilder", "build_model", "register_model",
    "parallelize", "check_parallel_strategy", "parallelize_processor", "build_transformer_processor",
    "EncoderProcessorDecoder", "EnsembleEncoderProcessorDecoder", "advance_window", "compile_blocks",
    "compiled_block_names", "LossScalingSettings", "PressureLevelScaling", "variable_loss_weights",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
