"""Tensor-parallel transformer block: heads and MLP channels split over a group (Megatron-style).

Layout: ``x`` is ``(batch, seq_local, channels)``. Two modes, fixed at construction by ``shard``:

- **sequence parallel** (a :class:`~stormshard.parallel.shard.SequenceShard` given, the
  processor's mode; the channels are split over ``shard.group``): ``x`` is this rank's
  ``shard.local_size`` tokens. Before the attention and before the MLP the normed shard is
  all-gathered along the sequence; after them the partial outputs of the row-parallel layer are
  reduce-scattered back to sequence shards. Per block, forward: 2 all-gathers and 2
  reduce-scatters of ``(batch, seq, channels)``; backward: the same. The replicated parameters
  (layer norms, row-parallel biases) see only this rank's tokens: their gradients are this rank's
  part, summed over the model group after backward
  (``stormshard.parallel.grads.reduce_model_parallel_gradients``) as for every sequence-sharded
  layer; the sliced parameters' gradients are complete.
- **tensor parallel only** (``shard`` None, the channels split over ``group``): ``x`` is the full
  sequence, replicated on every rank; one all-reduce after the attention and one after the MLP
  (and their adjoints in backward). Every rank computes the same output and loss, so all
  gradients are complete after backward (do not sum the replicated ones over the group in this mode).

Heads are split evenly: column-parallel ``lin_qkv`` (its outputs ordered ``(heads, 3, head_dim)``,
so a contiguous slice of rows is a contiguous group of heads), local window attention over the full
sequence, row-parallel ``projection``; column-parallel ``fc1``, GELU, row-parallel ``fc2``. A gated MLP's
``fc1`` interleaves a gate and a value row per hidden channel (:mod:`stormshard.layers.mlp`), so its
column-parallel slice holds the gates and values of the hidden channels of this rank's ``fc2`` slice. The
query / key norms (``qk_norm``) are replicated and run on this rank's heads: their weight gradients are this
rank's heads' part, summed over the group after backward with sequence parallelism (as the other replicated
parameters'); without it (every rank computes the whole output) the weights enter through ``copy_tensor``,
whose backward sums them, so their gradients are complete as every other gradient of that mode.
Parameter names equal :class:`~stormshard.layers.transformer.TransformerBlock`'s; the sliced ones
carry :class:`~stormshard.parallel.partition.Partition` metadata, so
:func:`~stormshard.parallel.tensor.full_state_dict` gives the single-process state dict.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import einops
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.kernels.dispatch import AttentionKernel, check_attention_kernel, sliding_window_attention
from stormshard.layers.attention import norm_heads, split_qkv
from stormshard.layers.mlp import MLP, mlp_hidden_width
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.norm import layer_norm
from stormshard.layers.strategy import check_split
from stormshard.layers.transformer import TransformerBlock
from stormshard.parallel.comm import copy_tensor
from stormshard.parallel.shapes import group_size
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.tensor import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "TensorParallelSlidingWindowAttention",
    "TensorParallelMLP",
    "TensorParallelTransformerBlock",
]

ProcessGroup = dist.ProcessGroup


def _tensor_group(shard: SequenceShard | None, group: ProcessGroup | None) -> ProcessGroup | None:
    """The group the channels are split over: the shard's (sequence parallel) or ``group``."""
    if shard is not None and not isinstance(shard, SequenceShard):
        raise TypeError(f"shard must be a SequenceShard or None, got {type(shard).__name__}")
    if shard is None:
        return group
    if group is None or group is shard.group or (group_size(group) == 1 and shard.world == 1):
        return shard.group
    raise ValueError(
        f"shard is split over a different process group ({shard.world} ranks) than group "
        f"({group_size(group)} ranks): with sequence parallelism the channels are split over the shard's "
        "group; pass only the shard"
    )


class TensorParallelSlidingWindowAttention(nn.Module):
    """Sliding-window self-attention with its heads split over the group.

    ``(batch, seq_local, C)`` (sequence parallel, ``shard`` given) or ``(batch, seq, C)``
    (``shard`` None, heads split over ``group``) -> same layout. This rank computes
    ``num_heads / p`` heads over the whole sequence; ``projection`` sums the heads' parts. ``q_norm`` /
    ``k_norm`` (``qk_norm``, replicated; None: none) norm this rank's heads' queries and keys.
    """

    def __init__(self, lin_qkv: nn.Linear, projection: nn.Linear, num_heads: int, window_size: int,
                 shard: SequenceShard | None = None, *, group: ProcessGroup | None = None,
                 attention_kernel: AttentionKernel = "auto", q_norm: nn.LayerNorm | None = None,
                 k_norm: nn.LayerNorm | None = None) -> None:
        super().__init__()
        group = _tensor_group(shard, group)
        check_split("tensor", group_size(group), num_heads=num_heads)
        check_attention_kernel(attention_kernel)
        self.num_heads, self.window_size = num_heads, window_size
        self.attention_kernel = attention_kernel
        self.shard, self.group = shard, group
        self.local_heads = num_heads // group_size(group)
        self.head_dim = projection.in_features // num_heads
        self.lin_qkv = ColumnParallelLinear.from_linear(lin_qkv, group, sequence_shard=shard)
        self.projection = RowParallelLinear.from_linear(projection, group, input_is_parallel=True,
                                                        sequence_shard=shard)
        self.q_norm = None if q_norm is None else copy.deepcopy(q_norm)  # replicated
        self.k_norm = None if k_norm is None else copy.deepcopy(k_norm)

    @classmethod
    def from_attention(cls, attention: nn.Module, shard: SequenceShard | None = None, *,
                       group: ProcessGroup | None = None) -> TensorParallelSlidingWindowAttention:
        """Slice a full :class:`~stormshard.layers.attention.SlidingWindowAttention` (no communication)."""
        return cls(attention.lin_qkv, attention.projection, attention.num_heads, attention.window_size, shard,
                   group=group, attention_kernel=getattr(attention, "attention_kernel", "auto"),
                   q_norm=getattr(attention, "q_norm", None), k_norm=getattr(attention, "k_norm", None))

    def _head_norm(self, norm: nn.LayerNorm | None) -> Callable[[Tensor], Tensor] | None:
        """``norm`` on this rank's heads; without sequence parallelism its weight through ``copy_tensor``
        (class docstring: its backward sums the heads' parts of the gradient over the group)."""
        if norm is None or self.shard is not None or group_size(self.group) == 1:
            return norm
        weight = copy_tensor(norm.weight, self.group)
        return lambda t: layer_norm(t, norm, weight)

    def extra_repr(self) -> str:
        return f"heads={self.local_heads}/{self.num_heads}, window_size={self.window_size}, shard={self.shard}"

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.lin_qkv(x)  # (b, seq, 3 C / p)
        q, k, v = split_qkv(qkv, self.local_heads)
        q, k = norm_heads(q, self._head_norm(self.q_norm)), norm_heads(k, self._head_norm(self.k_norm))
        heads = sliding_window_attention(q, k, v, self.window_size, kernel=self.attention_kernel)  # (b, h / p, seq, d)
        heads = einops.rearrange(heads, "b h s d -> b s (h d)")
        return self.projection(heads)


class TensorParallelMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with the hidden channels split over the group; layout as the attention's.
    ``activation``: the full MLP's (GELU, or a gated MLP's :class:`~stormshard.layers.mlp.GatedActivation`:
    ``fc1``'s interleaved gate and value rows slice in whole pairs)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, shard: SequenceShard | None = None, *,
                 group: ProcessGroup | None = None, activation: nn.Module | None = None) -> None:
        super().__init__()
        group = _tensor_group(shard, group)
        check_split("tensor", group_size(group), mlp_hidden=fc2.in_features)
        self.shard, self.group = shard, group
        self.fc1 = ColumnParallelLinear.from_linear(fc1, group, sequence_shard=shard)
        self.activation = nn.GELU() if activation is None else copy.deepcopy(activation)
        self.fc2 = RowParallelLinear.from_linear(fc2, group, input_is_parallel=True, sequence_shard=shard)

    @classmethod
    def from_mlp(cls, mlp: MLP, shard: SequenceShard | None = None, *,
                 group: ProcessGroup | None = None) -> TensorParallelMLP:
        """Slice a full :class:`~stormshard.layers.mlp.MLP` (no communication)."""
        return cls(mlp.fc1, mlp.fc2, shard, group=group, activation=mlp.activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class TensorParallelTransformerBlock(nn.Module):
    """Pre-norm block ``x + attention(norm(x)); x + mlp(norm(x))`` with heads and MLP split over the group.

    ``shard``: the sequence shard of ``x`` (sequence parallel; the channels are split over
    ``shard.group``), or None with ``group``: ``x`` is the full sequence, replicated. Fresh
    construction builds the full :class:`TransformerBlock` from torch's default generator
    (identical on every rank for the same seed) and keeps this rank's slices, so every layout and
    rank count starts from the same full model; :meth:`from_block` slices an existing block.
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int, mlp_ratio: float = 4,
                 shard: SequenceShard | None = None, *, group: ProcessGroup | None = None,
                 attention_kernel: AttentionKernel = "auto", qk_norm: bool = False,
                 mlp_kind: MLPKind = "mlp") -> None:
        super().__init__()
        world = group_size(_tensor_group(shard, group))  # checked before the full block is drawn
        check_split("tensor", world, num_heads=num_heads, mlp_hidden=mlp_hidden_width(num_channels, mlp_ratio))
        block = TransformerBlock(num_channels, num_heads, window_size, mlp_ratio, attention_kernel=attention_kernel,
                                 qk_norm=qk_norm, mlp_kind=mlp_kind)
        self._setup(block, shard, group)

    @classmethod
    def from_block(cls, block: TransformerBlock, shard: SequenceShard | None = None, *,
                   group: ProcessGroup | None = None) -> TensorParallelTransformerBlock:
        """This rank's tensor-parallel slice of the full ``block`` (no communication)."""
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"block must be a TransformerBlock, got {type(block).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(block, shard, group)
        return layer

    def _setup(self, block: TransformerBlock, shard: SequenceShard | None, group: ProcessGroup | None) -> None:
        self.shard, self.group = shard, _tensor_group(shard, group)
        self.parts = group_size(self.group)
        self.num_channels = block.norm_attention.normalized_shape[0]
        self.norm_attention = copy.deepcopy(block.norm_attention)  # replicated
        self.attention = TensorParallelSlidingWindowAttention.from_attention(block.attention, shard, group=group)
        self.norm_mlp = copy.deepcopy(block.norm_mlp)
        self.mlp = TensorParallelMLP.from_mlp(block.mlp, shard, group=group)

    def forward(self, x: Tensor) -> Tensor:
        """``x (batch, seq_local, C)`` -> same shape (``shard`` None: ``x`` is the full sequence)."""
        if x.dim() != 3 or x.shape[-1] != self.num_channels:
            raise ValueError(f"x must be (batch, seq_local, {self.num_channels}), got shape {tuple(x.shape)}")
        if self.shard is not None:
            self.shard.check_local(x, 1, "TensorParallelTransformerBlock input x")
        x = x + self.attention(self.norm_attention(x))
        return x + self.mlp(self.norm_mlp(x))
