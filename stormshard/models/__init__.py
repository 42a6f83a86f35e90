"""The model zoo: AIFS-style encoder-processor-decoder models, their config and registry."""

from __future__ import annotations

from stormshard.models.config import (  # noqa: F401
    MODEL_NAMES,
    EnsembleConfig,
    MapperConfig,
    ModelConfig,
    ProcessorConfig,
)
from stormshard.models.encoder_processor_decoder import (  # noqa: F401
    EncoderProcessorDecoder,
    coordinate_features,
)
from stormshard.models.ensemble import (  # noqa: F401
    EnsembleEncoderProcessorDecoder,
    NoiseConditionedProcessor,
)
from stormshard.models.processors import (  # noqa: F401
    GraphProcessor,
    WindowTransformerProcessor,
)
from stormshard.models.registry import (  # noqa: F401
    MODEL_REGISTRY,
    build_model,
    register_model,
)
from stormshard.models.sharding import (  # noqa: F401
    ModelShardPlan,
)
from stormshard.models.variables import (  # noqa: F401
    VariableIndex,
)

__all__ = [
    "ProcessorConfig",
    "MapperConfig",
    "EnsembleConfig",
    "ModelConfig",
    "MODEL_NAMES",
    "VariableIndex",
    "ModelShardPlan",
    "EncoderProcessorDecoder",
    "coordinate_features",
    "WindowTransformerProcessor",
    "GraphProcessor",
    "EnsembleEncoderProcessorDecoder",
    "NoiseConditionedProcessor",
    "MODEL_REGISTRY",
    "register_model",
    "build_model",
]
