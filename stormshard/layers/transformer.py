"""Pre-norm transformer blocks of sliding-window attention and an MLP: the weather models' processor.

Layout: ``x`` ``(batch, seq_local, channels)``, ``shard_sizes`` every rank's ``seq_local`` in rank
order (None when unsharded), ``model_comm_group`` the group the sequence is sharded over.
Each block computes ``x = x + attention(norm_attention(x)); x = x + mlp(norm_mlp(x))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from stormshard.layers.attention import SHARD_STRATEGIES, ShardStrategy, SlidingWindowAttention
from stormshard.layers.mlp import MLP

__all__ = ["TransformerBlock", "TransformerProcessor", "PROCESSOR_STRATEGIES"]

ProcessGroup = dist.ProcessGroup
PROCESSOR_STRATEGIES: tuple[str, ...] = SHARD_STRATEGIES + ("tensor",)


class TransformerBlock(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))``; the attention's strategy sets the communication."""

    def __init__(self, num_channels: int, num_heads: int, window_size: int, mlp_ratio: int = 4,
                 shard_strategy: ShardStrategy = "shard_sequence") -> None:
        super().__init__()
        self.norm_attention = nn.LayerNorm(num_channels)
        self.attention = SlidingWindowAttention(num_channels, num_heads, window_size, shard_strategy)
        self.norm_mlp = nn.LayerNorm(num_channels)
        self.mlp = MLP(num_channels, mlp_ratio)

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None,
                model_comm_group: ProcessGroup | None = None) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` -> same shape."""
        x = x + self.attention(self.norm_attention(x), shard_sizes, model_comm_group)
        return x + self.mlp(self.norm_mlp(x))


class TransformerProcessor(nn.Module):
    """``num_layers`` transformer blocks over a sequence sharded across ``model_comm_group``.

    ``shard_strategy``: ``"shard_sequence"`` (halo exchange), ``"shard_heads"`` (two all-to-alls
    per block) or ``"tensor"`` (Megatron-style tensor parallelism over ``group``, built from
    :class:`stormshard.layers.tensor_parallel.TensorParallelTransformerBlock`; its weights are
    sliced at construction, so ``group`` must be the group later passed as ``model_comm_group``).
    ``activation_checkpointing`` recomputes each block in backward (communication included)
    instead of keeping its activations. No final norm: blocks only.
    """

    def __init__(self, num_layers: int, num_channels: int, num_heads: int, window_size: int,
                 mlp_ratio: int = 4, shard_strategy: str = "shard_sequence",
                 activation_checkpointing: bool = False, group: ProcessGroup | None = None) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        if shard_strategy not in PROCESSOR_STRATEGIES:
            raise ValueError(f"shard_strategy must be one of {PROCESSOR_STRATEGIES}, got {shard_strategy!r}")
        self.shard_strategy = shard_strategy
        self.activation_checkpointing = activation_checkpointing
        if shard_strategy == "tensor":
            from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock

            blocks = [TensorParallelTransformerBlock(num_channels, num_heads, window_size, mlp_ratio=mlp_ratio,
                                                     group=group)
                      for _ in range(num_layers)]
        else:
            blocks = [TransformerBlock(num_channels, num_heads, window_size, mlp_ratio, shard_strategy)
                      for _ in range(num_layers)]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None,
                model_comm_group: ProcessGroup | None = None) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` -> same shape."""
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, shard_sizes, model_comm_group, use_reentrant=False)
            else:
                x = block(x, shard_sizes, model_comm_group)
        return x
