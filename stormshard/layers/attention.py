"""Multi-head sliding-window self-attention over a sequence sharded across a process group.

Layout: ``x`` is ``(batch, seq_local, channels)``; ``shard_sizes`` lists every rank's
``seq_local`` in rank order (None when unsharded) and the ranks hold consecutive pieces of the
sequence. Token ``i`` attends token ``j`` exactly when ``|i - j| <= window_size`` in global
positions; scale ``1 / sqrt(head_dim)``; no dropout.

Two strategies give the same numbers (and share parameter names and shapes):

- ``"shard_sequence"``: add ``window_size`` halo rows of the neighbours' (normed) input on each
  side (:func:`~stormshard.parallel.sequence.add_halos`), project q, k, v locally, attend with
  the window kernel. Communicates: the halo rows of ``x`` (``window_size * channels`` per side),
  and their gradients back in backward.
- ``"shard_heads"``: project locally, one all-to-all to head-sharded q, k, v over the whole
  sequence, attend, one all-to-all back (anemoi's original strategy). Communicates: 3/w of the
  local q, k, v out and the attention output back (per rank ``(w-1)/w`` of each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import einops
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.layers.window import sliding_window_attention
from stormshard.parallel.sequence import add_halos, remove_halos, shard_heads, shard_sequence
from stormshard.parallel.shapes import group_rank, group_size

__all__ = ["SlidingWindowAttention", "ShardStrategy", "SHARD_STRATEGIES", "check_shard_sizes"]

ProcessGroup = dist.ProcessGroup
ShardStrategy = Literal["shard_sequence", "shard_heads"]
SHARD_STRATEGIES: tuple[str, ...] = ("shard_sequence", "shard_heads")


def check_shard_sizes(x: Tensor, shard_sizes: Sequence[int] | None, group: ProcessGroup | None) -> list[int]:
    """Validate ``shard_sizes`` against the group and ``x`` ``(batch, seq_local, channels)``; return them as ints."""
    world, rank = group_size(group), group_rank(group)
    if shard_sizes is None:
        if world > 1:
            raise ValueError(
                f"shard_sizes is None but model_comm_group has {world} ranks: pass every rank's local "
                "sequence length in rank order"
            )
        return [x.shape[1]]
    sizes = [int(s) for s in shard_sizes]
    if len(sizes) != world:
        raise ValueError(
            f"shard_sizes lists {len(sizes)} shards {sizes} but model_comm_group has {world} ranks: "
            "pass one local sequence length per rank, in rank order"
        )
    if sizes[rank] != x.shape[1]:
        raise ValueError(
            f"shard_sizes[{rank}] = {sizes[rank]} but this rank's input holds {x.shape[1]} tokens "
            f"(x.shape = {tuple(x.shape)}): shard_sizes must list every rank's x.shape[1]"
        )
    return sizes


class SlidingWindowAttention(nn.Module):
    """Sliding-window multi-head self-attention, sequence-parallel by halos or by head all-to-all.

    Parameters (identical for every strategy and rank count): ``lin_qkv`` ``Linear(C, 3C)`` whose
    outputs are ordered ``(heads, 3, head_dim)``, and ``projection`` ``Linear(C, C)`` whose inputs
    are ordered ``(heads, head_dim)``.
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int,
                 shard_strategy: ShardStrategy = "shard_sequence", bias: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or num_channels % num_heads != 0:
            raise ValueError(
                f"num_channels={num_channels} must be a positive multiple of num_heads={num_heads}"
            )
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 0:
            raise ValueError(f"window_size must be a non-negative int (tokens each side), got {window_size!r}")
        if shard_strategy not in SHARD_STRATEGIES:
            raise ValueError(f"shard_strategy must be one of {SHARD_STRATEGIES}, got {shard_strategy!r}")
        self.num_channels, self.num_heads, self.window_size = num_channels, num_heads, window_size
        self.head_dim = num_channels // num_heads
        self.shard_strategy = shard_strategy
        self.lin_qkv = nn.Linear(num_channels, 3 * num_channels, bias=bias)
        self.projection = nn.Linear(num_channels, num_channels, bias=bias)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, window_size={self.window_size}, shard_strategy={self.shard_strategy}"

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(batch, seq, C)`` -> q, k, v each ``(batch, heads, seq, head_dim)``."""
        qkv = einops.rearrange(self.lin_qkv(x), "b s (h three d) -> three b h s d", h=self.num_heads, three=3)
        return qkv[0], qkv[1], qkv[2]

    def _out(self, heads: Tensor) -> Tensor:
        """``(batch, heads, seq, head_dim)`` -> ``(batch, seq, C)`` through the output projection."""
        return self.projection(einops.rearrange(heads, "b h s d -> b s (h d)"))

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None,
                model_comm_group: ProcessGroup | None = None) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` -> ``(batch, seq_local, C)``."""
        if x.dim() != 3 or x.shape[-1] != self.num_channels:
            raise ValueError(
                f"x must be (batch, seq_local, {self.num_channels}), got shape {tuple(x.shape)}"
            )
        sizes = check_shard_sizes(x, shard_sizes, model_comm_group)
        if group_size(model_comm_group) == 1:
            q, k, v = self._qkv(x)
            return self._out(sliding_window_attention(q, k, v, self.window_size))
        if self.shard_strategy == "shard_heads":
            return self._forward_shard_heads(x, sizes, model_comm_group)
        return self._forward_shard_sequence(x, sizes, model_comm_group)

    def _forward_shard_sequence(self, x: Tensor, sizes: list[int], group: ProcessGroup) -> Tensor:
        halo = min(self.window_size, sum(sizes))
        x_ext, plan = add_halos(x, halo, group, sizes, dim=1)
        q, k, v = self._qkv(x_ext)
        q = remove_halos(q, plan, dim=2)
        out = sliding_window_attention(q, k, v, self.window_size, q_offset=plan.offset,
                                       k_offset=plan.offset - plan.left)
        return self._out(out)

    def _forward_shard_heads(self, x: Tensor, sizes: list[int], group: ProcessGroup) -> Tensor:
        world = group_size(group)
        if self.num_heads % world != 0:
            raise ValueError(
                f"shard_strategy='shard_heads' needs num_heads={self.num_heads} divisible by the group size "
                f"{world}; use a multiple of {world} heads or shard_strategy='shard_sequence'"
            )
        # one all-to-all for q, k and v together: (b, heads, s_local, 3 * head_dim)
        qkv = einops.rearrange(self.lin_qkv(x), "b s (h three d) -> b h s (three d)", h=self.num_heads, three=3)
        qkv = shard_heads(qkv, sizes, group)
        q, k, v = einops.rearrange(qkv, "b h s (three d) -> three b h s d", three=3)
        out = sliding_window_attention(q, k, v, self.window_size)
        return self._out(shard_sequence(out, sizes, group))
