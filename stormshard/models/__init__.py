"""The model zoo: AIFS-style encoder-processor-decoder models, their config, shard plan,
parallelize step, registry and the rollout update shared by training and inference."""

from __future__ import annotations

from stormshard.models.config import ModelConfig
from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder
from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder
from stormshard.models.parallelize import parallelize
from stormshard.models.registry import build_model, register_model
from stormshard.models.rollout import advance_window
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex

__all__ = [
    "ModelConfig", "VariableIndex", "ModelShardPlan", "build_model", "register_model", "parallelize",
    "EncoderProcessorDecoder", "EnsembleEncoderProcessorDecoder", "advance_window",
]
