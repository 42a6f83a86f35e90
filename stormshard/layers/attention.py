"""Multi-head sliding-window self-attention over a sequence sharded across a process group.

Layout: ``x`` is ``(batch, seq_local, channels)``. The layer is built with the
:class:`~stormshard.parallel.shard.SequenceShard` of the sequence it receives (every rank's
``seq_local`` in rank order and the group; None: unsharded, any length) and the ranks hold
consecutive pieces of the sequence; ``forward`` takes ``x`` only. Token ``i`` attends token ``j`` exactly when ``|i - j| <= window_size`` in global
positions; scale ``1 / sqrt(head_dim)``; no dropout.

Two strategies give the same numbers (and share parameter names and shapes):

- ``"shard_sequence"``: add ``window_size`` halo rows of the neighbours' (normed) input on each
  side (:func:`~stormshard.parallel.sequence.add_halos`), project q, k, v locally, attend with
  the window kernel. Communicates: the halo rows of ``x`` (``window_size * channels`` per side),
  and their gradients back in backward.
- ``"shard_heads"``: project locally, one all-to-all to head-sharded q, k, v over the whole
  sequence, attend, one all-to-all back (anemoi's original strategy). Communicates: 3/w of the
  local q, k, v out and the attention output back (per rank ``(w-1)/w`` of each).

These are ``ATTENTION_STRATEGIES`` (:mod:`stormshard.parallel.shard`); the third processor
strategy, ``"tensor"``, swaps whole blocks (:mod:`stormshard.layers.tensor_parallel`).

``qk_norm=True`` (anemoi-models' ``qk_norm``): the queries and keys of each head are layer-normed over
``head_dim`` before the attention (``q_norm`` / ``k_norm``: a ``LayerNorm(head_dim)`` without bias, its weight
shared by the heads, anemoi's default ``QueryNorm`` / ``KeyNorm``). The norm is per token and head, so it runs
wherever the strategy holds q and k: on the halo-extended tokens (``shard_sequence``), on this rank's heads after
the all-to-all (``shard_heads``), on this rank's heads over the whole sequence (``tensor``).
"""

from __future__ import annotations

from collections.abc import Callable

import einops
from torch import Tensor, nn

from stormshard.kernels.dispatch import AttentionKernel, check_attention_kernel, sliding_window_attention
from stormshard.layers.norm import LayerNorm
from stormshard.layers.strategy import check_split, check_strategy_name
from stormshard.parallel.sequence import add_halos, remove_halos, shard_heads, shard_sequence
from stormshard.parallel.shard import ATTENTION_STRATEGIES, SequenceShard, ShardStrategy

__all__ = ["SlidingWindowAttention", "split_qkv", "qk_norms", "norm_heads"]


def split_qkv(qkv: Tensor, num_heads: int, heads_first: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``lin_qkv``'s output, per head its q, k and v channels ``(h three d)``, as q, k, v ``(batch, heads,
    seq, head_dim)``: views, nothing copied.

    ``qkv`` is ``(batch, seq, (heads 3 head_dim))``, or with ``heads_first`` ``(batch, heads, seq, (3
    head_dim))`` (after the head-sharding all-to-all). The views keep ``qkv``'s memory order, in which flex
    attention writes its output and its q, k, v gradients (and flash-attn reads ``(batch, seq, heads, d)``):
    the output projection then reads the attention output as it is, and the backward stacks the three
    gradients into ``qkv``'s layout with one copy (indexing ``qkv[0]`` instead makes three zero-filled
    ``qkv``-sized gradients and sums them; contiguous copies of q, k, v cost three more copies each way).
    """
    if heads_first:
        parts = einops.rearrange(qkv, "b h s (three d) -> b h s three d", three=3).unbind(dim=3)
        return parts[0], parts[1], parts[2]
    parts = einops.rearrange(qkv, "b s (h three d) -> b s h three d", h=num_heads, three=3).unbind(dim=3)
    return parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2)


def qk_norms(head_dim: int, qk_norm: bool) -> tuple[LayerNorm | None, LayerNorm | None]:
    """``(q_norm, k_norm)``: anemoi's ``QueryNorm`` / ``KeyNorm`` (``LayerNorm(head_dim)``, no bias, shared by the
    heads) with ``qk_norm``, else ``(None, None)`` (no parameters)."""
    if not qk_norm:
        return None, None
    return LayerNorm(head_dim, bias=False), LayerNorm(head_dim, bias=False)


def norm_heads(t: Tensor, norm: Callable[[Tensor], Tensor] | None) -> Tensor:
    """``norm`` over the last dim of q or k ``(batch, heads, seq, head_dim)`` (None: ``t`` itself). Where the heads
    are inner to the tokens in memory (:func:`split_qkv`'s views of one projection) the normed copy keeps that
    order, ``(batch, seq, heads, head_dim)`` (flash-attn's and flex's layout), seen as ``(batch, heads, seq,
    head_dim)``."""
    if norm is None:
        return t
    if t.stride(1) < t.stride(2):
        return norm(t.transpose(1, 2)).transpose(1, 2)
    return norm(t)


def _check_shard(shard: object) -> None:
    if shard is not None and not isinstance(shard, SequenceShard):
        raise TypeError(f"shard must be a SequenceShard or None (unsharded), got {type(shard).__name__}")


class SlidingWindowAttention(nn.Module):
    """Sliding-window multi-head self-attention, sequence-parallel by halos or by head all-to-all.

    Parameters (identical for every strategy and rank count): ``lin_qkv`` ``Linear(C, 3C)`` whose
    outputs are ordered ``(heads, 3, head_dim)``, and ``projection`` ``Linear(C, C)`` whose inputs
    are ordered ``(heads, head_dim)``; with ``qk_norm`` also ``q_norm`` / ``k_norm`` (``(head_dim,)`` weights).
    """

    def __init__(self, num_channels: int, num_heads: int, window_size: int,
                 shard_strategy: ShardStrategy = "shard_sequence", shard: SequenceShard | None = None,
                 *, bias: bool = True, attention_kernel: AttentionKernel = "auto", qk_norm: bool = False) -> None:
        super().__init__()
        if num_heads < 1 or num_channels % num_heads != 0:
            raise ValueError(
                f"num_channels={num_channels} must be a positive multiple of num_heads={num_heads}"
            )
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 0:
            raise ValueError(f"window_size must be a non-negative int (tokens each side), got {window_size!r}")
        _check_shard(shard)
        check_attention_kernel(attention_kernel)
        check_strategy_name(shard_strategy, ATTENTION_STRATEGIES)
        check_split(shard_strategy, 1 if shard is None else shard.world, num_heads=num_heads)
        self.num_channels, self.num_heads, self.window_size = num_channels, num_heads, window_size
        self.head_dim = num_channels // num_heads
        self.shard_strategy = shard_strategy
        self.shard = shard
        self.attention_kernel = attention_kernel
        self.lin_qkv = nn.Linear(num_channels, 3 * num_channels, bias=bias)
        self.projection = nn.Linear(num_channels, num_channels, bias=bias)
        self.q_norm, self.k_norm = qk_norms(self.head_dim, qk_norm)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, window_size={self.window_size}, shard_strategy={self.shard_strategy}, "
                f"attention_kernel={self.attention_kernel}, shard={self.shard}")

    def _normed(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q and k through ``q_norm`` / ``k_norm`` (``qk_norm``; else unchanged)."""
        return norm_heads(q, self.q_norm), norm_heads(k, self.k_norm), v

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(batch, seq, C)`` -> q, k, v each ``(batch, heads, seq, head_dim)``: views (:func:`split_qkv`; q and k
        normed copies with ``qk_norm``)."""
        return self._normed(*split_qkv(self.lin_qkv(x), self.num_heads))

    def _out(self, heads: Tensor) -> Tensor:
        """``(batch, heads, seq, head_dim)`` -> ``(batch, seq, C)`` through the output projection."""
        return self.projection(einops.rearrange(heads, "b h s d -> b s (h d)"))

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(batch, seq_local, C)`` (this rank's ``shard.local_size`` tokens) -> same shape."""
        if x.dim() != 3 or x.shape[-1] != self.num_channels:
            raise ValueError(
                f"x must be (batch, seq_local, {self.num_channels}), got shape {tuple(x.shape)}"
            )
        shard = self.shard
        if shard is None or not shard.is_sharded:
            if shard is not None:
                shard.check_local(x, 1, "SlidingWindowAttention input x")
            q, k, v = self._qkv(x)
            return self._out(sliding_window_attention(q, k, v, self.window_size, kernel=self.attention_kernel))
        shard.check_local(x, 1, "SlidingWindowAttention input x")
        if self.shard_strategy == "shard_heads":
            return self._forward_shard_heads(x, shard)
        return self._forward_shard_sequence(x, shard)

    def _forward_shard_sequence(self, x: Tensor, shard: SequenceShard) -> Tensor:
        halo = min(self.window_size, shard.length)
        x_ext, plan = add_halos(x, halo, shard.group, shard.sizes, dim=1)
        q, k, v = self._qkv(x_ext)
        q = remove_halos(q, plan, dim=2)
        out = sliding_window_attention(q, k, v, self.window_size, q_offset=plan.offset,
                                       k_offset=plan.offset - plan.left, kernel=self.attention_kernel)
        return self._out(out)

    def _forward_shard_heads(self, x: Tensor, shard: SequenceShard) -> Tensor:
        # one all-to-all for q, k and v together: (b, heads, s_local, 3 * head_dim)
        qkv = einops.rearrange(self.lin_qkv(x), "b s (h three d) -> b h s (three d)", h=self.num_heads, three=3)
        qkv = shard_heads(qkv, shard.sizes, shard.group)
        q, k, v = self._normed(*split_qkv(qkv, self.num_heads, heads_first=True))
        out = sliding_window_attention(q, k, v, self.window_size, kernel=self.attention_kernel)
        return self._out(shard_sequence(out, shard.sizes, shard.group))


def window_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The sliding-window attention layers of ``model`` (tensor-parallel ones too): the modules with an
    ``attention_kernel`` and a ``window_size``."""
    return [m for m in model.modules() if hasattr(m, "attention_kernel") and hasattr(m, "window_size")]


def set_attention_kernel(model: nn.Module, kernel: AttentionKernel) -> int:
    """Switch every sliding-window attention in ``model`` (tensor-parallel ones too) to ``kernel``.

    For a forecast that runs another kernel than the one the model was trained with (the numbers
    agree to round-off; parameters are untouched). Returns how many attention layers changed kernel.
    """
    check_attention_kernel(kernel)
    layers = window_attention_layers(model)
    for layer in layers:
        layer.attention_kernel = kernel
    return len(layers)
