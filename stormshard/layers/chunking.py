"""Edge chunking: run an edge computation over destination-node chunks to cap peak memory.

The destination nodes are split into ``num_chunks`` balanced contiguous ranges; chunk ``c``
processes exactly the edges into its range, so every per-destination reduction (softmax, sum)
sees all of its edges in one chunk and the result equals the unchunked one. While gradients are
recorded each chunk runs under activation checkpointing: its per-edge intermediates
``(E_chunk, ...)`` are freed after the forward of the chunk and rebuilt in the backward, so the
peak holds one chunk's edge tensors instead of all of them. Without checkpointing autograd would
keep every chunk's edge tensors alive and the peak would not fall.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from stormshard.parallel.graph_edges import destination_chunks

__all__ = ["map_destination_chunks", "check_num_chunks", "precompute_chunks", "chunk_edge_indices", "shared_to"]

ChunkFn = Callable[[Tensor | None, int, int], tuple[Tensor, ...]]


def check_num_chunks(num_chunks: object) -> int:
    """``num_chunks`` as an int, or a ValueError naming it."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int (1 = no chunking), got {num_chunks!r}")
    return num_chunks


# per edge index tensor (by identity, while it lives): what precompute_chunks / chunk_edge_indices / shared_to
# made of it, so that blocks sharing a plan share the tensors (and the kernels' structures cached on them)
_MADE: dict[tuple, tuple[weakref.ref, Any]] = {}


def _made_once(source: Tensor, key: tuple, make: Callable[[], Any]) -> Any:
    full = (id(source), *key)
    hit = _MADE.get(full)
    if hit is not None and hit[0]() is source:
        return hit[1]
    value = make()
    _MADE[full] = (weakref.ref(source, lambda _ref, full=full: _MADE.pop(full, None)), value)
    return value


def shared_to(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor.to(device)``, one copy per tensor and device: blocks that hold the same index tensor hold the
    same moved copy."""
    if tensor.device == device:
        return tensor
    return _made_once(tensor, ("to", str(device)), lambda: tensor.to(device))


def precompute_chunks(edge_index: Tensor, num_dst: int, num_chunks: int) -> tuple[tuple[int, int, Tensor], ...] | None:
    """The ``(first, end, edge ids)`` chunks :func:`map_destination_chunks` walks, computed once (a
    block computes them at construction from its plan's ``edge_index``; blocks sharing the plan share
    them); None for one chunk. Their sizes depend on the edges' values, so computing them inside a
    torch.compile'd block would break its graph."""
    if num_chunks == 1:
        return None
    return _made_once(edge_index, ("chunks", num_dst, num_chunks),
                      lambda: tuple(destination_chunks(edge_index, num_dst, num_chunks)))


def chunk_edge_indices(edge_index: Tensor,
                       chunks: tuple[tuple[int, int, Tensor], ...] | None) -> dict[int, Tensor] | None:
    """Per chunk of :func:`precompute_chunks`, keyed by its first destination: the ``(2, E_c)`` edge
    index of its edges with destinations counted from the chunk's first (``edge_index[:, ids]``,
    row 1 minus ``first``). Built once, so that a kernel's structures cached per index tensor are
    built once per chunk, not on every call; None for one chunk."""
    if chunks is None:
        return None
    bounds = tuple((first, end) for first, end, _ids in chunks)
    return _made_once(edge_index, ("chunk_index", bounds), lambda: {
        first: torch.stack([edge_index[0, ids], edge_index[1, ids] - first]) for first, _end, ids in chunks})


def map_destination_chunks(
    fn: ChunkFn, edge_index: Tensor, num_dst: int, num_chunks: int, use_checkpoint: bool = True,
    chunks: tuple[tuple[int, int, Tensor], ...] | None = None,
) -> tuple[list[tuple[Tensor, ...]], Tensor | None]:
    """``([fn(edge_ids, first, end) for each chunk], edge order)``.

    ``edge_ids`` ``(E_c,)`` are the ids of the edges whose destination lies in ``[first, end)``
    (``edge_index`` is ``(2, E)``, row 1 the destination). With one chunk ``fn`` gets
    ``edge_ids=None`` (all edges, in order) and runs without checkpointing; with several, each
    call is checkpointed when ``use_checkpoint`` and gradients are enabled. The edge order is the
    concatenation of the chunks' edge ids (None for one chunk): per-edge outputs concatenated
    over chunks are in that order. ``chunks``: :func:`precompute_chunks` of the same arguments
    (None: computed here).
    """
    if num_chunks == 1:
        return [fn(None, 0, num_dst)], None
    recompute = use_checkpoint and torch.is_grad_enabled()
    outs, orders = [], []
    if chunks is None:
        chunks = precompute_chunks(edge_index, num_dst, num_chunks)
    for first, end, ids in chunks:
        ids = ids.to(edge_index.device)
        orders.append(ids)
        if recompute:
            outs.append(checkpoint(fn, ids, first, end, use_reentrant=False))
        else:
            outs.append(fn(ids, first, end))
    return outs, torch.cat(orders)
