"""How a sequence processor is split over its model group: the one place these values are spelled.

``shard_sequence``: each rank holds a slice of the sequence and exchanges halos; ``shard_heads``: an
all-to-all trades the sequence slice for a slice of the heads; ``tensor``: Megatron-style
column/row linears with sequence parallelism. Torch-free, so that the experiment config validates
before torch is imported (``launch/train.py`` fails fast on a bad config).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ShardStrategy", "SHARD_STRATEGIES", "ATTENTION_STRATEGIES"]

ShardStrategy = Literal["shard_sequence", "shard_heads", "tensor"]
SHARD_STRATEGIES: tuple[str, ...] = get_args(ShardStrategy)
#: The strategies an attention layer implements itself (``tensor`` is a block-level swap).
ATTENTION_STRATEGIES: tuple[str, ...] = tuple(s for s in SHARD_STRATEGIES if s != "tensor")
