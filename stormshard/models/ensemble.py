"""The ensemble (AIFS-CRPS-style) model: noise enters the processor through conditional norms.

``forward(x, noise=None)``: ``x`` ``(batch, time, grid_local, input_variables)`` as for the
deterministic model; ``noise`` ``(batch, hidden_local, noise_channels)`` this rank's slice of a
per-hidden-node noise field (None: drawn with :meth:`sample_noise`). Several members of one
initial state are several batch entries with different noise (the trainer repeats the input).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from stormshard.graphs.hetero import HeteroGraph
from stormshard.layers.conditional import ConditionalTransformerBlock
from stormshard.models.config import ModelConfig
from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex

__all__ = ["EnsembleEncoderProcessorDecoder", "NoiseConditionedProcessor"]


class NoiseConditionedProcessor(nn.Module):
    """Sliding-window blocks with conditional norms over the hidden nodes, sharded as ``shard``.

    ``forward(x (hidden_local, batch, C), noise (batch, hidden_local, noise_channels))``, sharded
    as ``plan.hidden_shard`` with ``plan.shard_strategy``: only the sequence strategies apply
    (``"tensor"`` is rejected by :func:`~stormshard.models.parallelize.check_parallel_strategy`);
    checkpointing is wrapped by :func:`stormshard.models.parallelize.parallelize`.
    """

    def __init__(self, config: ModelConfig, plan: ModelShardPlan) -> None:
        super().__init__()
        p, e = config.processor, config.ensemble
        cond = config.num_channels
        self.noise_embedding = nn.Sequential(nn.Linear(e.noise_channels, cond), nn.GELU(), nn.Linear(cond, cond))
        self.blocks = nn.ModuleList(
            ConditionalTransformerBlock(config.num_channels, p.num_heads, p.window_size, cond, p.mlp_ratio,
                                        plan.shard_strategy, plan.hidden_shard, attention_kernel=p.attention_kernel,
                                        qk_norm=p.qk_norm, mlp_kind=p.mlp_implementation)
            for _ in range(p.num_layers)
        )

    def forward(self, x: Tensor, noise: Tensor) -> Tensor:
        h = rearrange(x, "n b c -> b n c")
        cond = self.noise_embedding(noise.to(h.dtype))
        for block in self.blocks:
            h = block(h, cond)
        return rearrange(h, "b n c -> n b c")


class EnsembleEncoderProcessorDecoder(EncoderProcessorDecoder):
    """The encoder-processor-decoder with a noise-conditioned processor."""

    def __init__(self, config: ModelConfig, graph: HeteroGraph, variables: VariableIndex,
                 plan: ModelShardPlan) -> None:
        super().__init__(config, graph, variables, plan)

    def build_processor(self, graph: HeteroGraph) -> nn.Module:
        return NoiseConditionedProcessor(self.config, self.plan)

    def sample_noise(self, batch: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype | None = None) -> Tensor:
        """This rank's slice ``(batch, hidden_local, noise_channels)`` of a full-grid noise field.

        The full field is drawn on every rank and sliced, so every layout sees the same noise for
        the same generator state.
        """
        e = self.config.ensemble
        full = torch.randn(batch, self.plan.num_hidden, e.noise_channels, generator=generator,
                           device=self.hidden_coords.device, dtype=dtype or torch.float32)
        return full[:, self.plan.hidden_slice] * e.noise_std

    def forward(self, x: Tensor, noise: Tensor | None = None) -> Tensor:
        if noise is None:
            noise = self.sample_noise(x.shape[0], dtype=x.dtype)
        expect = (x.shape[0], self.plan.hidden_sizes[self.plan.rank], self.config.ensemble.noise_channels)
        if tuple(noise.shape) != expect:
            raise ValueError(
                f"noise has shape {tuple(noise.shape)}, expected (batch, hidden_local, noise_channels) = {expect}"
            )
        x_data, x_hidden = self.encode(x)
        return self.decode(self.processor(x_hidden, noise), x_data, x)
