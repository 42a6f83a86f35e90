"""Sliding-window attention through ``torch.nn.attention.flex_attention`` with a block mask.

Same definition as :func:`stormshard.layers.window.sliding_window_attention`: query ``i`` at global
position ``q_offset + i`` attends key ``j`` at ``k_offset + j`` exactly when
``|pos_q - pos_k| <= window_size``; a query with no key in reach returns zeros. Layout: ``q``
``(batch, heads, Lq, dim)``, ``k`` and ``v`` ``(batch, heads, Lk, dim)``.

The mask is a block mask over ``(Lq, Lk)`` built from the band's tiles (:func:`band_blocks`: tiles
outside the band skipped, tiles inside it unmasked, only the band's edges evaluate the mask), so time grows linearly with the sequence, and the halo offsets of
``shard_sequence`` enter as a shift ``q_offset - k_offset``. The shift and the window are captured
as 0-dim tensors, so one compiled kernel serves every rank's offsets; block masks are cached per
``(Lq, Lk, shift, window, device)``. The kernel is ``torch.compile(flex_attention, dynamic=True)``,
compiled once per process (a first call costs seconds to tens of seconds; further shapes reuse it).

torch 2.13's flex attention has a CPU forward but no CPU backward: on a CPU this kernel serves
forecasts and forward checks, and asking for a gradient through it raises a ValueError before any
work. On CUDA it trains (Triton kernels, softmax statistics in fp32 for bf16 inputs).

Nothing is communicated here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["flex_attention_unavailable", "flex_unusable", "flex_window_attention", "window_block_mask", "band_blocks"]

_MASK_CACHE_SIZE = 64
_BLOCK = 128  # flex attention's default tile


_PROBE: list = []  # [reason or None] once probed (a list, not lru_cache: torch.compile only reads it)
_COMPILED: list = []  # [the compiled flex_attention]


def flex_attention_unavailable() -> str | None:
    """None when flex attention can run in this process, else why not (a sentence); decided once."""
    if not _PROBE:
        try:
            from torch.nn.attention import flex_attention as _flex  # noqa: F401
            _PROBE.append(None)
        except ImportError as err:  # torch < 2.5
            _PROBE.append(f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({err}); it needs "
                          "torch >= 2.5")
    return _PROBE[0]


_PRECISION_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def flex_unusable(q: Tensor, v: Tensor, backward: bool = False) -> str | None:
    """None when flex attention can compute ``q`` / ``v`` here (with a backward: ``backward``), else why
    not: :func:`~stormshard.layers.window.attention_kernel_problem` on the tensors' device, dtype and head dim."""
    from stormshard.layers.window import attention_kernel_problem

    return attention_kernel_problem("flex", q.device.type, precision=_PRECISION_OF.get(q.dtype),
                                    head_dim=min(q.shape[-1], v.shape[-1]), backward=backward)


def _flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process; inside a compiled graph the plain function (the
    enclosing torch.compile compiles it)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED[0]


_block_masks: OrderedDict[tuple, object] = OrderedDict()


def window_block_mask(num_q: int, num_k: int, shift: int, window_size: int, device: torch.device) -> object:
    """The band ``|i + shift - j| <= window_size`` over ``(num_q, num_k)`` as a flex ``BlockMask``.

    Cached (least recently used, 64 entries) per ``(num_q, num_k, shift, window_size, device)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    key = (num_q, num_k, shift, window_size, str(device))
    compiling = torch.compiler.is_compiling()  # inside a compiled graph: no cache (its mutation is a side effect)
    mask = None if compiling else _block_masks.get(key)
    if mask is not None:
        _block_masks.move_to_end(key)
        return mask
    shift_t = torch.tensor(shift, device=device)
    window_t = torch.tensor(window_size, device=device)

    def in_window(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        return (q_idx + shift_t - k_idx).abs() <= window_t

    partial, full = band_blocks(num_q, num_k, shift, window_size, _BLOCK)
    counts, indices = _kv_block_lists(partial)
    full_counts, full_indices = _kv_block_lists(full)
    mask = BlockMask.from_kv_blocks(counts.to(device), indices.to(device), full_counts.to(device),
                                    full_indices.to(device), BLOCK_SIZE=_BLOCK, mask_mod=in_window,
                                    seq_lengths=(num_q, num_k))
    if compiling:
        return mask
    _block_masks[key] = mask
    if len(_block_masks) > _MASK_CACHE_SIZE:
        _block_masks.popitem(last=False)
    return mask


def band_blocks(num_q: int, num_k: int, shift: int, window_size: int, block: int) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` boolean ``(q_blocks, k_blocks)`` maps of the band's ``block x block`` tiles.

    A tile is *full* when every query of it reaches every key of it (and both blocks are whole, not
    the sequences' ragged ends): flex skips the mask there. *Partial* tiles hold some reachable
    pairs; the mask is evaluated on them. Computed from the block bounds, never from an
    ``(Lq, Lk)`` mask (40,320^2 entries at the AIFS shape).
    """
    q_start = torch.arange(0, num_q, block)
    k_start = torch.arange(0, num_k, block)
    q_last = torch.clamp(q_start + block, max=num_q) - 1
    k_last = torch.clamp(k_start + block, max=num_k) - 1
    # query i reaches keys [i + shift - w, i + shift + w]: a tile has a pair in reach when its key
    # interval meets the union of its queries' intervals
    some = (k_start[None, :] <= q_last[:, None] + shift + window_size) & \
        (k_last[None, :] >= q_start[:, None] + shift - window_size)
    every = (q_last[:, None] + shift - k_start[None, :] <= window_size) & \
        (k_last[None, :] - q_start[:, None] - shift <= window_size)
    whole = ((q_last - q_start + 1) == block)[:, None] & ((k_last - k_start + 1) == block)[None, :]
    full = some & every & whole
    return some & ~full, full


def _kv_block_lists(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """flex's ``(kv_num_blocks (1, 1, q_blocks), kv_indices (1, 1, q_blocks, k_blocks))`` of a tile map:
    per query block the count of its tiles and their key-block indices first, in order."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), order[None, None].contiguous()


def flex_window_attention(q: Tensor, k: Tensor, v: Tensor, window_size: int, q_offset: int = 0,
                          k_offset: int = 0, *, scale: float) -> Tensor:
    """``softmax(q k^T * scale + band) v`` by flex attention; ``(batch, heads, Lq, dim)`` out, q's dtype.

    Inputs are checked by the caller (:func:`stormshard.layers.window.sliding_window_attention`).
    Raises ValueError when a gradient is asked for on a CPU (torch has no CPU backward for it).
    """
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    reason = flex_unusable(q, v, backward)
    if reason is not None:
        raise ValueError(f"attention_kernel 'flex' cannot run: {reason}; use attention_kernel 'banded' or 'auto'"
                         + (", or run this forward under torch.no_grad() (forecasts)" if backward else ""))
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    shift = int(q_offset) - int(k_offset)
    mask = window_block_mask(q.shape[-2], k.shape[-2], shift, window_size, q.device)
    return _flex_attention()(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask, scale=scale)
