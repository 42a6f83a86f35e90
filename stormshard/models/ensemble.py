"""The ensemble (AIFS-CRPS-style) model: noise enters the processor through conditional norms.

``forward(x, noise=None, step=0)``: ``x`` ``(batch, time, grid_local, input_variables)`` as for the
deterministic model; ``noise`` ``(batch, hidden_local, noise_channels)`` this rank's slice of a
per-hidden-node noise field (None: drawn with :meth:`sample_noise`); ``step`` the rollout step
(read with ``ensemble.fcstep_input``). Several members of one initial state are several batch
entries with different noise (the trainer repeats the input).

The anemoi options of :class:`~stormshard.models.config.EnsembleConfig` (anemoi-models'
``AnemoiEnsModelEncProcDec``): ``noise_embedding: "anemoi"`` (its ``NoiseConditioning`` MLP, the
norms conditioned on ``noise_channels``), ``fcstep_input`` and ``condition_on_residual`` (data-node
inputs after the trainable ones, in that order, as anemoi appends them).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from stormshard.graphs.hetero import HeteroGraph
from stormshard.layers.conditional import ConditionalTransformerBlock
from stormshard.models.config import EnsembleConfig, ModelConfig
from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder
from stormshard.models.rollout import forecast_step_flag
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex

__all__ = ["EnsembleEncoderProcessorDecoder", "NoiseConditionedProcessor", "noise_embedding"]


def noise_embedding(e: EnsembleConfig, num_channels: int) -> nn.Sequential:
    """The noise embedding ``(..., noise_channels) -> (..., condition channels)`` (token-wise, no communication):
    ``"mlp"``: Linear, GELU, Linear to ``num_channels``; ``"anemoi"``: Linear to ``noise_mlp_hidden``, GELU, Linear
    back to ``noise_channels``, LayerNorm (anemoi's ``NoiseConditioning.noise_mlp``: ``mlp.0``, ``mlp.2``,
    ``layer_norm``)."""
    if e.noise_embedding == "anemoi":
        hidden = int(e.noise_mlp_hidden or 0)
        return nn.Sequential(nn.Linear(e.noise_channels, hidden), nn.GELU(), nn.Linear(hidden, e.noise_channels),
                             nn.LayerNorm(e.noise_channels))
    c = num_channels
    return nn.Sequential(nn.Linear(e.noise_channels, c), nn.GELU(), nn.Linear(c, c))


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
        cond = e.condition_channels or config.num_channels
        self.noise_embedding = noise_embedding(e, config.num_channels)
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

    def extra_data_inputs(self) -> int:
        """``fcstep_input``: 1 channel; ``condition_on_residual``: one per prognostic variable."""
        e = self.config.ensemble
        return int(e.fcstep_input) + (len(self.variables.prognostic_in_input) if e.condition_on_residual else 0)

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

    def extra_inputs(self, x: Tensor, step: int, carried: Tensor | None) -> Tensor | None:
        """The anemoi data-node inputs ``(grid_local, batch, extra_data_inputs())``: the fcstep channel, then the
        residual's prognostic variables ``carried`` ``(batch, grid_local, prognostic)``; None without them."""
        e, parts = self.config.ensemble, []
        if e.fcstep_input:
            parts.append(x.new_full((x.shape[2], x.shape[0], 1), float(forecast_step_flag(step))))
        if e.condition_on_residual and carried is not None:
            parts.append(rearrange(carried, "b g v -> g b v"))
        return torch.cat(parts, dim=-1) if parts else None

    def forward(self, x: Tensor, noise: Tensor | None = None, step: int = 0) -> Tensor:
        if noise is None:
            noise = self.sample_noise(x.shape[0], dtype=x.dtype)
        expect = (x.shape[0], self.plan.hidden_sizes[self.plan.rank], self.config.ensemble.noise_channels)
        if tuple(noise.shape) != expect:
            raise ValueError(
                f"noise has shape {tuple(noise.shape)}, expected (batch, hidden_local, noise_channels) = {expect}"
            )
        self.check_input(x)
        carried = self.carried_state(x) if self.config.ensemble.condition_on_residual else None
        x_data, x_hidden = self.encode(x, self.extra_inputs(x, step, carried))
        x_proc = self.processor(x_hidden, noise)
        if self.config.latent_skip:  # anemoi's latent skip around the processor
            x_proc = x_proc + x_hidden
        return self.decode(x_proc, x_data, x, carried)
