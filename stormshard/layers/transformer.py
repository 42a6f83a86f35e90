"""Pre-norm transformer blocks of sliding-window attention and an MLP: the weather models' processor.

Layout: ``x`` ``(batch, seq_local, channels)``; the sequence is sharded as the
:class:`~stormshard.parallel.shard.SequenceShard` the layer was built with describes (None:
unsharded). Each block computes ``x = x + attention(norm_attention(x)); x = x + mlp(norm_mlp(x))``;
``qk_norm`` layer-norms each head's queries and keys (:mod:`stormshard.layers.attention`), ``mlp_kind`` picks
the MLP (GELU or gated: :mod:`stormshard.layers.mlp`).

This module builds the single-device-looking processor only. Tensor parallelism (swapping in
:class:`~stormshard.layers.tensor_parallel.TensorParallelTransformerBlock`) and activation
checkpointing are applied afterwards, in one place: :func:`stormshard.models.parallelize.parallelize_processor`
(or :func:`~stormshard.models.parallelize.build_transformer_processor`, which builds and
parallelizes in one call).
"""

from __future__ import annotations

from torch import Tensor, nn

from stormshard.kernels.names import AttentionKernel
from stormshard.layers.attention import SlidingWindowAttention
from stormshard.layers.mlp import MLP
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.norm import LayerNorm
from stormshard.layers.strategy import check_strategy_name
from stormshard.parallel.shard import SequenceShard, ShardStrategy

__all__ = ["TransformerBlock", "TransformerProcessor"]


class TransformerBlock(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))``; the attention's strategy sets the communication.

    ``shard``: the sequence's shard (None: unsharded); ``forward(x)`` takes this rank's tokens.
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int, mlp_ratio: float = 4,
                 shard_strategy: ShardStrategy = "shard_sequence", shard: SequenceShard | None = None, *,
                 attention_kernel: AttentionKernel = "auto", qk_norm: bool = False,
                 mlp_kind: MLPKind = "mlp") -> None:
        super().__init__()
        self.norm_attention = LayerNorm(num_channels)
        self.attention = SlidingWindowAttention(num_channels, num_heads, window_size, shard_strategy, shard,
                                                attention_kernel=attention_kernel, qk_norm=qk_norm)
        self.norm_mlp = LayerNorm(num_channels)
        self.mlp = MLP(num_channels, mlp_ratio, kind=mlp_kind)

    @property
    def shard(self) -> SequenceShard | None:
        return self.attention.shard

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` -> same shape."""
        x = x + self.attention(self.norm_attention(x))
        return x + self.mlp(self.norm_mlp(x))


class TransformerProcessor(nn.Module):
    """``num_layers`` transformer blocks over a sequence sharded as ``shard`` describes (None: unsharded).

    ``shard_strategy``: ``"shard_sequence"`` (halo exchange), ``"shard_heads"`` (two all-to-alls
    per block) or ``"tensor"`` (Megatron-style tensor + sequence parallelism over ``shard.group``).
    The constructor builds the single-device form for every strategy: full-weight
    :class:`TransformerBlock` s; for ``"tensor"`` their attention runs halo-sharded until
    :func:`stormshard.models.parallelize.parallelize_processor` swaps in the tensor-parallel blocks
    (same numbers, same parameter names; use
    :func:`~stormshard.models.parallelize.build_transformer_processor` to do both at once).
    No final norm: blocks only.
    """

    def __init__(self, num_layers: int, num_channels: int, num_heads: int, window_size: int,
                 mlp_ratio: float = 4, shard_strategy: ShardStrategy = "shard_sequence",
                 shard: SequenceShard | None = None, *, attention_kernel: AttentionKernel = "auto",
                 qk_norm: bool = False, mlp_kind: MLPKind = "mlp") -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        check_strategy_name(shard_strategy)
        self.shard_strategy = shard_strategy
        self.shard = shard
        attention_strategy = "shard_sequence" if shard_strategy == "tensor" else shard_strategy
        self.blocks = nn.ModuleList(
            TransformerBlock(num_channels, num_heads, window_size, mlp_ratio, attention_strategy, shard,
                             attention_kernel=attention_kernel, qk_norm=qk_norm, mlp_kind=mlp_kind)
            for _ in range(num_layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` -> same shape."""
        for block in self.blocks:
            x = block(x)
        return x
