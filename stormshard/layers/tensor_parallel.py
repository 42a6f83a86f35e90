"""Tensor-parallel transformer block: heads and MLP channels split over a group (Megatron-style).

Layout: ``x`` is ``(batch, seq_local, channels)``. Two modes, chosen per call by ``shard_sizes``:

- **sequence parallel** (``shard_sizes`` given, the processor's mode): ``x`` is this rank's
  sequence shard. Before the attention and before the MLP the normed shard is all-gathered along
  the sequence; after them the partial outputs of the row-parallel layer are reduce-scattered back
  to sequence shards. Per block, forward: 2 all-gathers and 2 reduce-scatters of
  ``(batch, seq, channels)``; backward: the same. The replicated parameters (layer norms,
  row-parallel biases) see only this rank's tokens: their gradients are this rank's part, summed
  over the model group after backward (``stormshard.parallel.grads.reduce_model_parallel_gradients``)
  as for every sequence-sharded layer; the sliced parameters' gradients are complete.
- **tensor parallel only** (``shard_sizes`` None): ``x`` is the full sequence, replicated on every
  rank; one all-reduce after the attention and one after the MLP (and their adjoints in backward).
  Every rank computes the same output and loss, so all gradients are complete after backward (do
  not sum the replicated ones over the group in this mode).

Heads are split evenly: column-parallel ``lin_qkv`` (its outputs ordered ``(heads, 3, head_dim)``,
so a contiguous slice of rows is a contiguous group of heads), local window attention over the full
sequence, row-parallel ``projection``; column-parallel ``fc1``, GELU, row-parallel ``fc2``.
Parameter names equal :class:`~stormshard.layers.transformer.TransformerBlock`'s; the sliced ones
carry :class:`~stormshard.parallel.partition.Partition` metadata, so
:func:`~stormshard.parallel.tensor.full_state_dict` gives the single-process state dict.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import einops
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.layers.mlp import MLP
from stormshard.layers.transformer import TransformerBlock
from stormshard.layers.window import sliding_window_attention
from stormshard.parallel.shapes import group_rank, group_size
from stormshard.parallel.tensor import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "TensorParallelSlidingWindowAttention",
    "TensorParallelMLP",
    "TensorParallelTransformerBlock",
]

ProcessGroup = dist.ProcessGroup


def _check_heads(num_heads: int, group: ProcessGroup | None) -> None:
    world = group_size(group)
    if num_heads % world != 0:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the tensor-parallel group size {world}: heads are "
            f"split whole over the ranks; use a multiple of {world} heads or a group whose size divides {num_heads}"
        )


def _check_hidden(hidden: int, group: ProcessGroup | None) -> None:
    world = group_size(group)
    if hidden % world != 0:
        raise ValueError(
            f"the MLP hidden size mlp_ratio * num_channels = {hidden} is not divisible by the tensor-parallel "
            f"group size {world}: choose mlp_ratio or num_channels so that it is"
        )


class TensorParallelSlidingWindowAttention(nn.Module):
    """Sliding-window self-attention with its heads split over ``group``.

    ``(batch, seq_local, C)`` (sequence parallel) or ``(batch, seq, C)`` -> same layout. This rank
    computes ``num_heads / p`` heads over the whole sequence; ``projection`` sums the heads' parts.
    """

    def __init__(self, lin_qkv: nn.Linear, projection: nn.Linear, num_heads: int, window_size: int,
                 group: ProcessGroup | None) -> None:
        super().__init__()
        _check_heads(num_heads, group)
        self.num_heads, self.window_size = num_heads, window_size
        self.local_heads = num_heads // group_size(group)
        self.head_dim = projection.in_features // num_heads
        self.lin_qkv = ColumnParallelLinear.from_linear(lin_qkv, group, sequence_parallel=True)
        self.projection = RowParallelLinear.from_linear(projection, group, input_is_parallel=True,
                                                        sequence_parallel=True)

    @classmethod
    def from_attention(cls, attention: nn.Module, group: ProcessGroup | None) -> TensorParallelSlidingWindowAttention:
        """Slice a full :class:`~stormshard.layers.attention.SlidingWindowAttention` (no communication)."""
        return cls(attention.lin_qkv, attention.projection, attention.num_heads, attention.window_size, group)

    def extra_repr(self) -> str:
        return f"heads={self.local_heads}/{self.num_heads}, window_size={self.window_size}"

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None) -> Tensor:
        sequence_parallel = shard_sizes is not None
        qkv = self.lin_qkv(x, shard_sizes, sequence_parallel=sequence_parallel)  # (b, seq, 3 C / p)
        q, k, v = einops.rearrange(qkv, "b s (h three d) -> three b h s d", h=self.local_heads, three=3)
        heads = sliding_window_attention(q, k, v, self.window_size)  # (b, h / p, seq, d)
        heads = einops.rearrange(heads, "b h s d -> b s (h d)")
        return self.projection(heads, shard_sizes, sequence_parallel=sequence_parallel)


class TensorParallelMLP(nn.Module):
    """``fc2(GELU(fc1(x)))`` with the hidden channels split over ``group``; layout as the attention's."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, group: ProcessGroup | None) -> None:
        super().__init__()
        _check_hidden(fc1.out_features, group)
        self.fc1 = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=True)
        self.activation = nn.GELU()
        self.fc2 = RowParallelLinear.from_linear(fc2, group, input_is_parallel=True, sequence_parallel=True)

    @classmethod
    def from_mlp(cls, mlp: MLP, group: ProcessGroup | None) -> TensorParallelMLP:
        """Slice a full :class:`~stormshard.layers.mlp.MLP` (no communication)."""
        return cls(mlp.fc1, mlp.fc2, group)

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None) -> Tensor:
        sequence_parallel = shard_sizes is not None
        hidden = self.activation(self.fc1(x, shard_sizes, sequence_parallel=sequence_parallel))
        return self.fc2(hidden, shard_sizes, sequence_parallel=sequence_parallel)


class TensorParallelTransformerBlock(nn.Module):
    """Pre-norm block ``x + attention(norm(x)); x + mlp(norm(x))`` with heads and MLP split over ``group``.

    Fresh construction builds the full :class:`TransformerBlock` from torch's default generator
    (identical on every rank for the same seed) and keeps this rank's slices, so every layout and
    rank count starts from the same full model. ``group`` must be the group later passed as
    ``model_comm_group``.
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int, mlp_ratio: int = 4,
                 group: ProcessGroup | None = None) -> None:
        super().__init__()
        _check_heads(num_heads, group)
        _check_hidden(mlp_ratio * num_channels, group)
        self._setup(TransformerBlock(num_channels, num_heads, window_size, mlp_ratio), group)

    @classmethod
    def from_block(cls, block: TransformerBlock, group: ProcessGroup | None = None) -> TensorParallelTransformerBlock:
        """This rank's tensor-parallel slice of the full ``block`` (no communication)."""
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"block must be a TransformerBlock, got {type(block).__name__}")
        _check_heads(block.attention.num_heads, group)
        _check_hidden(block.mlp.fc1.out_features, group)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(block, group)
        return layer

    def _setup(self, block: TransformerBlock, group: ProcessGroup | None) -> None:
        self.group, self.parts = group, group_size(group)
        self.num_channels = block.norm_attention.normalized_shape[0]
        self.norm_attention = copy.deepcopy(block.norm_attention)  # replicated
        self.attention = TensorParallelSlidingWindowAttention.from_attention(block.attention, group)
        self.norm_mlp = copy.deepcopy(block.norm_mlp)
        self.mlp = TensorParallelMLP.from_mlp(block.mlp, group)

    def _check_group(self, model_comm_group: ProcessGroup | None) -> None:
        if model_comm_group is None or model_comm_group is self.group:
            return
        if group_size(model_comm_group) == 1 and self.parts == 1:
            return
        raise ValueError(
            f"model_comm_group (rank {group_rank(model_comm_group)} of {group_size(model_comm_group)}) is not the "
            f"group this block's weights were split over ({self.parts} ranks): build the block (or the "
            "TransformerProcessor) with group=model_comm_group"
        )

    def forward(self, x: Tensor, shard_sizes: Sequence[int] | None = None,
                model_comm_group: ProcessGroup | None = None) -> Tensor:
        """``x (batch, seq_local, C)`` -> same shape; ``shard_sizes`` None: ``x`` is the full sequence."""
        self._check_group(model_comm_group)
        if x.dim() != 3 or x.shape[-1] != self.num_channels:
            raise ValueError(f"x must be (batch, seq_local, {self.num_channels}), got shape {tuple(x.shape)}")
        x = x + self.attention(self.norm_attention(x), shard_sizes)
        return x + self.mlp(self.norm_mlp(x), shard_sizes)
