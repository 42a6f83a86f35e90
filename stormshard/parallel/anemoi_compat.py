"""anemoi-compatible helpers, with anemoi's documented arguments and returns.

``get_memory_format(tensor)``: the memory format for receive buffers like ``tensor`` (anemoi's
name; unlike anemoi's, a contiguous tensor is never called channels-last).

Edge sorting (``get_k_hop_edges``, ``sort_edges_1hop_chunks``, ``sort_edges_1hop_sharding``):
``edge_index`` is a ``(2, num_edges)`` integer tensor, row 0 the source and row 1 the destination
node of every edge; ``edge_attr`` is ``(num_edges, channels...)``. stormshard's own layers shard
graphs with :class:`~stormshard.parallel.graph.GraphShardPlan` instead; these functions exist for
code written against anemoi. None of them communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.parallel.graph_edges import (
    check_edge_attr,
    check_edge_index,
    check_node_range,
    destination_chunk_edge_ids,
    split_num_nodes,
)
from stormshard.parallel.shapes import group_size

__all__ = ["get_k_hop_edges", "sort_edges_1hop_chunks", "sort_edges_1hop_sharding", "get_memory_format"]

ProcessGroup = dist.ProcessGroup


def get_k_hop_edges(
    nodes: Tensor, edge_attr: Tensor, edge_index: Tensor, num_hops: int = 1
) -> tuple[Tensor, Tensor]:
    """The edges of the ``num_hops``-hop neighbourhood pointing towards the destination ``nodes``.

    With ``num_hops=1``: every edge whose destination is in ``nodes``, in edge_index order. With
    more hops, torch-geometric's directed ``k_hop_subgraph`` semantics (flow source -> target).

    Returns ``(edge_index_k (2, E_k), edge_attr_k (E_k, ...))`` as documented by anemoi
    (anemoi's code returns the two the other way round).
    """
    edge_index = check_edge_index(edge_index)
    check_edge_attr(edge_attr, edge_index)
    if not isinstance(num_hops, int) or num_hops < 1:
        raise ValueError(f"num_hops must be a positive int, got {num_hops!r}")
    nodes = torch.as_tensor(nodes, dtype=edge_index.dtype, device=edge_index.device)
    if nodes.numel() == 0 or edge_index.shape[1] == 0:
        keep = torch.zeros(edge_index.shape[1], dtype=torch.bool, device=edge_index.device)
    else:
        from torch_geometric.utils import k_hop_subgraph  # loaded on use only (~100 MB resident)

        num_nodes = int(max(edge_index.max(), nodes.max())) + 1
        _, _, _, keep = k_hop_subgraph(nodes, num_hops, edge_index, num_nodes=num_nodes, directed=True)
    ids = keep.nonzero().flatten()
    return edge_index[:, ids], edge_attr[ids]


def sort_edges_1hop_chunks(
    num_nodes: int | tuple[int, int], edge_attr: Tensor, edge_index: Tensor, num_chunks: int
) -> tuple[list[Tensor], list[Tensor]]:
    """Split the edges into ``num_chunks`` 1-hop neighbourhoods of balanced destination-node chunks.

    ``num_nodes`` is the number of nodes, or ``(num_source, num_destination)`` for a bipartite
    graph; chunk ``c`` holds every edge into the ``c``-th of ``balanced_sizes(num_destination,
    num_chunks)`` contiguous destination ranges, in edge_index order (global node ids kept).

    Returns ``(edge_attr chunks, edge_index chunks)``, two lists of ``num_chunks`` tensors.
    """
    edge_index = check_edge_index(edge_index)
    check_edge_attr(edge_attr, edge_index)
    num_src, num_dst = split_num_nodes(num_nodes)
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    check_node_range(edge_index, num_dst if num_src is None else num_src, num_dst)
    ids = destination_chunk_edge_ids(edge_index[1], num_dst, num_chunks)
    return [edge_attr[i] for i in ids], [edge_index[:, i] for i in ids]


def sort_edges_1hop_sharding(
    num_nodes: int | tuple[int, int],
    edge_attr: Tensor,
    edge_index: Tensor,
    mgroup: ProcessGroup | None = None,
) -> tuple[Tensor, Tensor, list, list]:
    """Reorder the edges so that rank ``r``'s 1-hop neighbourhood (edges into its destination
    slice) is the ``r``-th contiguous block, for ``shard_tensor`` along the edge dimension.

    Returns ``(edge_index (2, E), edge_attr (E, ...), edge_index shapes, edge_attr shapes)`` as
    anemoi documents it (anemoi's code returns attributes first); with ``mgroup`` None the inputs
    come back unchanged with two empty shape lists.
    """
    if mgroup is None:
        return edge_index, edge_attr, [], []
    attr_chunks, index_chunks = sort_edges_1hop_chunks(num_nodes, edge_attr, edge_index, group_size(mgroup))
    index_shapes = [list(c.shape) for c in index_chunks]
    attr_shapes = [list(c.shape) for c in attr_chunks]
    return torch.cat(index_chunks, dim=1), torch.cat(attr_chunks, dim=0), index_shapes, attr_shapes


def get_memory_format(tensor: Tensor) -> torch.memory_format:
    """Memory format to allocate receive buffers like ``tensor``.

    A contiguous tensor is always ``contiguous_format`` (anemoi reports ``channels_last`` for
    shapes such as ``(1, 1, n, d)``, which are both, and then builds non-contiguous buffers);
    only a 4-d tensor that is channels-last and not contiguous is ``channels_last``.
    """
    if tensor.is_contiguous():
        return torch.contiguous_format
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
