"""Edge builders between two node sets on the unit sphere.

Nodes are unit vectors ``(nodes, 3)``; neighbours are found with ``scipy.spatial.cKDTree`` (chord
distance ranks neighbours exactly as great-circle distance does). Every builder returns ``(2, E)`` int64
edges [row 0 = source index, row 1 = destination index], unique and sorted by destination then source
(the layout graph sharding by destination expects).

Coverage. Nothing about k-NN or a cutoff radius guarantees that every node on a given side gets an
edge (a data point far from every mesh node's k nearest, or outside every cutoff ball, would be cut
off from the model). ``cover_sources`` adds, for every source node without an outgoing edge, the edge
to its nearest destination node; ``cover_destinations`` adds, for every destination without an
incoming edge, the edge from its nearest source node. The graph builder applies ``cover_sources`` to
the encoder (every data point reaches the hidden mesh) and ``cover_destinations`` to the decoder
(every data point receives from it).
"""

from __future__ import annotations

import numpy as np

from stormshard.graphs.sphere import arc_to_chord, chord_to_arc

__all__ = [
    "unique_sorted",
    "sort_unique_edges",
    "knn_edges",
    "max_nearest_neighbour_distance",
    "cutoff_edges",
    "cover_sources",
    "cover_destinations",
]


def _kd_tree(points: np.ndarray):  # noqa: ANN202 - scipy's cKDTree
    """``scipy.spatial.cKDTree(points)``; scipy is imported on first use (a training run that loads a
    cached graph never loads it: ~28 MiB of resident memory per rank)."""
    from scipy.spatial import cKDTree

    return cKDTree(points)


def _check_xyz(xyz: np.ndarray, name: str) -> np.ndarray:
    xyz = np.asarray(xyz, dtype=np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or xyz.shape[0] == 0:
        raise ValueError(
            f"{name} must be a non-empty array of unit vectors (nodes, 3), got shape {xyz.shape}"
        )
    return xyz


def unique_sorted(keys: np.ndarray) -> np.ndarray:
    """Sorted unique values of a 1-D integer array (sort + neighbour compare; faster than ``np.unique``)."""
    keys = np.sort(np.asarray(keys).reshape(-1))
    if keys.size == 0:
        return keys
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])]


def sort_unique_edges(edge_index: np.ndarray, num_src: int) -> np.ndarray:
    """Drop duplicate edges and sort ``(2, E)`` by destination then source."""
    n = np.int64(max(num_src, 1))
    key = unique_sorted(np.asarray(edge_index[1], np.int64) * n + np.asarray(edge_index[0], np.int64))
    return np.stack([key % n, key // n])


def knn_edges(src_xyz: np.ndarray, dst_xyz: np.ndarray, k: int, exclude_self: bool = False) -> np.ndarray:
    """Edges from the ``k`` nearest source nodes into every destination node.

    ``exclude_self`` (for a graph within one node set, ``src_xyz is dst_xyz``) leaves out the node itself,
    so every node receives from its k nearest *other* nodes.
    """
    src_xyz, dst_xyz = _check_xyz(src_xyz, "src_xyz"), _check_xyz(dst_xyz, "dst_xyz")
    available = src_xyz.shape[0] - (1 if exclude_self else 0)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= available:
        raise ValueError(
            f"num_neighbours k={k!r} must be an integer in [1, {available}] (the number of source nodes"
            f"{' other than the node itself' if exclude_self else ''})"
        )
    if exclude_self and src_xyz.shape[0] != dst_xyz.shape[0]:
        raise ValueError("exclude_self=True needs the same node set as source and destination")
    tree = _kd_tree(src_xyz)
    if exclude_self:
        _, idx = tree.query(dst_xyz, k=k + 1)
        idx = idx.reshape(dst_xyz.shape[0], k + 1)
        dst = np.arange(dst_xyz.shape[0])
        # drop the node itself; with coincident points the node may not come first, so drop by identity
        # and keep the first k of the rest (rows without the node keep their k nearest).
        not_self = idx != dst[:, None]
        order = np.argsort(~not_self, axis=1, kind="stable")[:, :k]
        idx = np.take_along_axis(idx, order, axis=1)
    else:
        _, idx = tree.query(dst_xyz, k=k)
        idx = idx.reshape(dst_xyz.shape[0], k)
    dst = np.repeat(np.arange(dst_xyz.shape[0], dtype=np.int64), k)
    return sort_unique_edges(np.stack([idx.reshape(-1).astype(np.int64), dst]), src_xyz.shape[0])


def max_nearest_neighbour_distance(xyz: np.ndarray) -> float:
    """The largest great-circle distance (radians) from a node to its nearest other node.

    Coincident points count as the same node (their mutual distance 0 is skipped), so a grid with
    repeated pole points has the same value as without the repeats.
    """
    xyz = _check_xyz(xyz, "xyz")
    if xyz.shape[0] < 2:
        raise ValueError("a nearest-neighbour distance needs at least 2 nodes")
    tree = _kd_tree(xyz)
    k = min(xyz.shape[0], 8)
    dist, _ = tree.query(xyz, k=k)
    dist = np.where(dist > 1e-12, dist, np.inf)[:, 1:]
    nearest = dist.min(axis=1)
    nearest = nearest[np.isfinite(nearest)]
    if nearest.size == 0:
        raise ValueError("all nodes coincide; a nearest-neighbour distance is undefined")
    return float(chord_to_arc(nearest.max()))


def cutoff_edges(src_xyz: np.ndarray, dst_xyz: np.ndarray, factor: float) -> tuple[np.ndarray, float]:
    """Edges from every source node within ``radius`` of a destination node.

    ``radius = factor * max_nearest_neighbour_distance(dst_xyz)`` (great-circle, radians): AIFS uses
    ``factor = 0.6`` with the hidden mesh as destination. Returns the edges and the radius used.
    """
    src_xyz, dst_xyz = _check_xyz(src_xyz, "src_xyz"), _check_xyz(dst_xyz, "dst_xyz")
    if not np.isfinite(factor) or factor <= 0:
        raise ValueError(f"cutoff factor must be a positive number (AIFS uses 0.6), got {factor!r}")
    radius = float(factor) * max_nearest_neighbour_distance(dst_xyz)
    pairs = _kd_tree(dst_xyz).sparse_distance_matrix(
        _kd_tree(src_xyz), float(arc_to_chord(radius)), output_type="ndarray"
    )
    edges = np.stack([pairs["j"].astype(np.int64), pairs["i"].astype(np.int64)])
    return sort_unique_edges(edges, src_xyz.shape[0]), radius


def cover_sources(edge_index: np.ndarray, src_xyz: np.ndarray, dst_xyz: np.ndarray) -> tuple[np.ndarray, int]:
    """Add the edge to the nearest destination for every source node without an outgoing edge.

    Returns the edges (sorted, unique) and the number of edges added.
    """
    src_xyz, dst_xyz = _check_xyz(src_xyz, "src_xyz"), _check_xyz(dst_xyz, "dst_xyz")
    covered = np.zeros(src_xyz.shape[0], dtype=bool)
    covered[edge_index[0]] = True
    missing = np.flatnonzero(~covered)
    if missing.size == 0:
        return edge_index, 0
    _, nearest = _kd_tree(dst_xyz).query(src_xyz[missing], k=1)
    extra = np.stack([missing.astype(np.int64), np.asarray(nearest, np.int64).reshape(-1)])
    return sort_unique_edges(np.concatenate([edge_index, extra], axis=1), src_xyz.shape[0]), int(missing.size)


def cover_destinations(
    edge_index: np.ndarray, src_xyz: np.ndarray, dst_xyz: np.ndarray
) -> tuple[np.ndarray, int]:
    """Add the edge from the nearest source for every destination node without an incoming edge.

    Returns the edges (sorted, unique) and the number of edges added.
    """
    src_xyz, dst_xyz = _check_xyz(src_xyz, "src_xyz"), _check_xyz(dst_xyz, "dst_xyz")
    covered = np.zeros(dst_xyz.shape[0], dtype=bool)
    covered[edge_index[1]] = True
    missing = np.flatnonzero(~covered)
    if missing.size == 0:
        return edge_index, 0
    _, nearest = _kd_tree(src_xyz).query(dst_xyz[missing], k=1)
    extra = np.stack([np.asarray(nearest, np.int64).reshape(-1), missing.astype(np.int64)])
    return sort_unique_edges(np.concatenate([edge_index, extra], axis=1), src_xyz.shape[0]), int(missing.size)
