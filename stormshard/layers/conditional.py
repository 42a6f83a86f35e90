"""Conditional layer norm and the noise-conditioned transformer block of ensemble (CRPS) models.

AIFS-CRPS injects noise into the processor through layer norms whose scale and shift are
functions of a noise embedding: ``y = LayerNorm(x) * (1 + scale(c)) + shift(c)``. The scale and
shift projections start at zero, so an untrained block is the plain pre-norm block.
"""

from __future__ import annotations

from torch import Tensor, nn

from stormshard.kernels.names import AttentionKernel
from stormshard.layers.attention import SlidingWindowAttention
from stormshard.layers.mlp import MLP
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.norm import LayerNorm
from stormshard.parallel.shard import SequenceShard, ShardStrategy

__all__ = ["ConditionalLayerNorm", "ConditionalTransformerBlock"]


class ConditionalLayerNorm(nn.Module):
    """``LayerNorm(x) * (1 + scale(c)) + shift(c)``; x ``(..., C)``, c ``(..., cond_channels)`` (token-wise)."""

    def __init__(self, num_channels: int, cond_channels: int) -> None:
        super().__init__()
        if num_channels < 1 or cond_channels < 1:
            raise ValueError(f"num_channels ({num_channels}) and cond_channels ({cond_channels}) must be positive")
        self.norm = LayerNorm(num_channels, elementwise_affine=False)
        self.scale_shift = nn.Linear(cond_channels, 2 * num_channels)
        nn.init.zeros_(self.scale_shift.weight)
        nn.init.zeros_(self.scale_shift.bias)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        scale, shift = self.scale_shift(cond).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


class ConditionalTransformerBlock(nn.Module):
    """Pre-norm sliding-window block with conditional norms.

    ``forward(x (batch, seq_local, C), cond (batch, seq_local, cond_channels))``; the sequence is
    sharded as ``shard`` (bound at construction, None: unsharded) describes. The attention and
    MLP are the processor's (same names and sharding; ``qk_norm`` and ``mlp_kind`` as there).
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int, cond_channels: int,
                 mlp_ratio: float = 4, shard_strategy: ShardStrategy = "shard_sequence",
                 shard: SequenceShard | None = None, *, attention_kernel: AttentionKernel = "auto",
                 qk_norm: bool = False, mlp_kind: MLPKind = "mlp") -> None:
        super().__init__()
        self.norm_attention = ConditionalLayerNorm(num_channels, cond_channels)
        self.attention = SlidingWindowAttention(num_channels, num_heads, window_size, shard_strategy, shard,
                                                attention_kernel=attention_kernel, qk_norm=qk_norm)
        self.norm_mlp = ConditionalLayerNorm(num_channels, cond_channels)
        self.mlp = MLP(num_channels, mlp_ratio, kind=mlp_kind)

    @property
    def shard(self) -> SequenceShard | None:
        return self.attention.shard

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        x = x + self.attention(self.norm_attention(x, cond))
        return x + self.mlp(self.norm_mlp(x, cond))
