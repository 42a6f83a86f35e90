"""Edge-index inputs and destination-node chunks: the checks and groupings every graph helper shares.

Conventions: ``edge_index`` is a ``(2, num_edges)`` integer tensor, row 0 the source node and
row 1 the destination node of every edge; ``edge_attr`` is ``(num_edges, channels...)``;
``num_nodes`` is an int (a graph on one node set) or ``(num_source, num_destination)`` (a
bipartite graph), as anemoi spells it. Used by
:class:`~stormshard.parallel.graph.GraphShardPlan`, anemoi's edge sorting
(:mod:`stormshard.parallel.anemoi_compat`) and the layers' edge chunking. Nothing here communicates.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from stormshard.parallel.shapes import balanced_offsets, balanced_sizes

__all__ = [
    "check_edge_index",
    "check_edge_attr",
    "split_num_nodes",
    "check_node_range",
    "balanced_part_of",
    "destination_chunk_edge_ids",
    "destination_chunks",
]


def _is_sparse_tensor(x: object) -> bool:
    """A torch-sparse / torch-geometric ``SparseTensor`` (without importing torch-geometric, whose
    import alone costs ~100 MB of resident memory: one can only exist if its module is loaded)."""
    for module in ("torch_geometric.typing", "torch_sparse"):
        cls = getattr(sys.modules.get(module), "SparseTensor", None)
        if isinstance(cls, type) and isinstance(x, cls):
            return True
    return False


def check_edge_index(edge_index: object, name: str = "edge_index") -> Tensor:
    """``edge_index`` if it is a dense ``(2, num_edges)`` int64 / int32 tensor, else a TypeError or
    ValueError naming ``name`` and the fix (a ``SparseTensor`` is refused with its conversion)."""
    if _is_sparse_tensor(edge_index):
        raise TypeError(
            f"{name} is a SparseTensor; stormshard takes a dense (2, num_edges) edge index: convert "
            "an adj_t with `row, col, _ = adj_t.coo(); edge_index = torch.stack([col, row])`"
        )
    if not isinstance(edge_index, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (2, num_edges), got {type(edge_index).__name__}")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"{name} must have shape (2, num_edges) (row 0 source, row 1 destination), "
            f"got {tuple(edge_index.shape)}"
        )
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold int64 (or int32) node ids, got {edge_index.dtype}")
    return edge_index


def check_edge_attr(edge_attr: Tensor, edge_index: Tensor) -> None:
    """Raise unless ``edge_attr`` is a tensor with one row per edge of ``edge_index``."""
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor, got {type(edge_attr).__name__}")
    if edge_attr.shape[0] != edge_index.shape[1]:
        raise ValueError(
            f"edge_attr has {edge_attr.shape[0]} rows but edge_index has {edge_index.shape[1]} edges: "
            "pass one attribute row per edge, in edge_index order"
        )


def split_num_nodes(num_nodes: int | tuple[int, int]) -> tuple[int | None, int]:
    """(number of source nodes or None, number of destination nodes) from anemoi's ``num_nodes``."""
    if isinstance(num_nodes, bool):
        raise TypeError(f"num_nodes must be an int or a (source, destination) tuple, got {num_nodes!r}")
    if isinstance(num_nodes, int):
        if num_nodes < 0:
            raise ValueError(f"num_nodes must be non-negative, got {num_nodes}")
        return None, num_nodes
    if isinstance(num_nodes, (tuple, list)) and len(num_nodes) == 2 and all(isinstance(n, int) for n in num_nodes):
        if min(num_nodes) < 0:
            raise ValueError(f"num_nodes must be non-negative, got {tuple(num_nodes)}")
        return int(num_nodes[0]), int(num_nodes[1])
    raise TypeError(
        f"num_nodes must be an int (graph on one node set) or a (num_source, num_destination) tuple "
        f"(bipartite graph), got {num_nodes!r}"
    )


def check_node_range(edge_index: Tensor, num_src: int, num_dst: int) -> None:
    """Raise unless every source id is in ``[0, num_src)`` and every destination id in ``[0, num_dst)``."""
    if edge_index.numel() == 0:
        return
    lo_s, hi_s = int(edge_index[0].min()), int(edge_index[0].max())
    lo_d, hi_d = int(edge_index[1].min()), int(edge_index[1].max())
    if lo_s < 0 or hi_s >= num_src:
        raise ValueError(
            f"edge_index row 0 (sources) spans [{lo_s}, {hi_s}] but there are {num_src} source nodes: "
            "pass the right node counts, or fix the edge index"
        )
    if lo_d < 0 or hi_d >= num_dst:
        raise ValueError(
            f"edge_index row 1 (destinations) spans [{lo_d}, {hi_d}] but there are {num_dst} destination "
            "nodes: pass the right node counts, or fix the edge index"
        )


def balanced_part_of(ids: Tensor, sizes: Sequence[int]) -> Tensor:
    """Index of the contiguous part (parts of ``sizes``, in order) holding each id of ``ids``."""
    ends = torch.tensor(balanced_offsets(sizes)[1:] + [sum(sizes)], dtype=ids.dtype, device=ids.device)
    return torch.bucketize(ids, ends, right=True)


def destination_chunk_edge_ids(dst: Tensor, num_dst: int, num_chunks: int) -> list[Tensor]:
    """Edge ids per balanced destination-node chunk, each in edge order (one stable sort).

    ``dst`` ``(num_edges,)``: the destination of every edge (``edge_index[1]``).
    """
    chunk = balanced_part_of(dst, balanced_sizes(num_dst, num_chunks))
    order = torch.sort(chunk, stable=True).indices
    counts = torch.bincount(chunk, minlength=num_chunks).tolist()
    return list(order.split(counts))


def destination_chunks(edge_index: Tensor, num_dst: int, num_chunks: int) -> list[tuple[int, int, Tensor]]:
    """``(first node, end node, edge ids)`` for ``num_chunks`` balanced destination ranges.

    The edge ids of a chunk are those whose destination lies in ``[first, end)``; used by the
    layers to process edges chunk by chunk (softmax groups never straddle two chunks).
    """
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    sizes = balanced_sizes(num_dst, num_chunks)
    starts = balanced_offsets(sizes)
    ids = destination_chunk_edge_ids(edge_index[1], num_dst, num_chunks)
    return [(s, s + n, i) for s, n, i in zip(starts, sizes, ids, strict=True)]
