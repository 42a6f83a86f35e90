"""Model configuration (pydantic): sizes validated up front, unknown keys rejected.

JSON example (the ``model`` section of an experiment config)::

    {"name": "transformer", "num_channels": 128, "multistep_input": 2, "trainable_size": 8,
     "processor": {"num_layers": 4, "num_heads": 8, "window_size": 64, "shard_strategy": "shard_sequence"},
     "encoder": {"num_heads": 8}, "decoder": {"num_heads": 8}, "activation_checkpointing": false}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ProcessorConfig", "MapperConfig", "EnsembleConfig", "ModelConfig", "MODEL_NAMES"]

MODEL_NAMES = ("transformer", "graphtransformer", "gnn", "ensemble")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProcessorConfig(_Strict):
    """The processor on the hidden nodes.

    ``window_size`` and ``shard_strategy`` apply to the sliding-window transformer (models
    ``transformer`` and ``ensemble``); ``num_chunks`` to the graph processors.
    """

    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(8, ge=1)
    mlp_ratio: int = Field(4, ge=1)
    window_size: int = Field(64, ge=0)
    shard_strategy: Literal["shard_sequence", "shard_heads", "tensor"] = "shard_sequence"
    num_chunks: int = Field(1, ge=1)
    self_projection: bool = False  # graphtransformer: anemoi's lin_self in every block


class MapperConfig(_Strict):
    """An encoder (data -> hidden) or decoder (hidden -> data) graph mapper."""

    num_heads: int = Field(8, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    num_chunks: int = Field(1, ge=1)
    self_projection: bool = False  # graph-transformer mapper: anemoi's lin_self


class EnsembleConfig(_Strict):
    """Noise injected into the processor through conditional layer norms (AIFS-CRPS)."""

    noise_channels: int = Field(8, ge=1)
    noise_std: float = Field(1.0, gt=0)


class ModelConfig(_Strict):
    """An encoder-processor-decoder model. ``name`` picks the processor (see the registry)."""

    name: Literal["transformer", "graphtransformer", "gnn", "ensemble"] = "transformer"
    num_channels: int = Field(128, ge=1)
    multistep_input: int = Field(2, ge=1)
    trainable_size: int = Field(8, ge=0)
    processor: ProcessorConfig = ProcessorConfig()
    encoder: MapperConfig = MapperConfig()
    decoder: MapperConfig = MapperConfig()
    ensemble: EnsembleConfig | None = None
    activation_checkpointing: bool = False

    @model_validator(mode="after")
    def _check_sizes(self) -> ModelConfig:
        c = self.num_channels
        for field, heads in (("processor.num_heads", self.processor.num_heads),
                             ("encoder.num_heads", self.encoder.num_heads),
                             ("decoder.num_heads", self.decoder.num_heads)):
            if self.name == "gnn" and field != "processor.num_heads" or heads == 0:
                continue
            if c % heads:
                raise ValueError(
                    f"num_channels={c} is not divisible by {field}={heads}: choose heads dividing the channels"
                )
        if self.name == "ensemble" and self.ensemble is None:
            object.__setattr__(self, "ensemble", EnsembleConfig())
        if self.name != "ensemble" and self.ensemble is not None:
            raise ValueError(f"model.ensemble is set but model.name={self.name!r}: use name='ensemble' or drop it")
        if self.processor.shard_strategy != "shard_sequence" and self.name not in ("transformer", "ensemble"):
            raise ValueError(
                f"processor.shard_strategy={self.processor.shard_strategy!r} applies to the transformer processor "
                f"only; model.name={self.name!r} shards its graph by destination nodes: drop shard_strategy"
            )
        return self

    @property
    def uses_graph_processor(self) -> bool:
        return self.name in ("graphtransformer", "gnn")
