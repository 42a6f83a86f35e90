"""Edge and node attributes of a graph on the sphere.

Edge attributes ``(E, 3)``: ``[length / max length, east, north]``, where length is the great-circle
distance between source and destination (radians) divided by the largest length in the edge set, and
(east, north) is the direction from the destination towards the source in the destination's local
tangent frame, normalised to unit length ((0, 0) for an edge of zero length).

Node area weights: the area of each node's spherical Voronoi cell (``scipy.spatial.SphericalVoronoi``),
normalised to mean 1 (they sum to the number of nodes), for area-weighted losses.
"""

from __future__ import annotations

import numpy as np

from stormshard.graphs.sphere import latlon_to_xyz

__all__ = ["edge_lengths", "edge_directions", "edge_attributes", "gaussian_weights", "area_weights"]

_DUPLICATE_CHORD = 1e-9


def edge_lengths(edge_index: np.ndarray, src_xyz: np.ndarray, dst_xyz: np.ndarray) -> np.ndarray:
    """Great-circle length (radians) of every edge ``(E,)``."""
    s, d = src_xyz[edge_index[0]], dst_xyz[edge_index[1]]
    # atan2(|s x d|, s . d) is accurate for short and long arcs alike
    return np.arctan2(np.linalg.norm(np.cross(s, d), axis=1), np.einsum("ij,ij->i", s, d))


def edge_directions(
    edge_index: np.ndarray, src_xyz: np.ndarray, dst_lat: np.ndarray, dst_lon: np.ndarray
) -> np.ndarray:
    """Unit direction ``(E, 2)`` (east, north) of the source seen from the destination, in radians input.

    The destination's frame: east = (-sin lon, cos lon, 0), north = (-sin lat cos lon, -sin lat sin lon,
    cos lat); a source at the same point gets (0, 0).
    """
    s = src_xyz[edge_index[0]]
    lat, lon = dst_lat[edge_index[1]], dst_lon[edge_index[1]]
    sin_lat, cos_lat, sin_lon, cos_lon = np.sin(lat), np.cos(lat), np.sin(lon), np.cos(lon)
    east = -sin_lon * s[:, 0] + cos_lon * s[:, 1]
    north = -sin_lat * cos_lon * s[:, 0] - sin_lat * sin_lon * s[:, 1] + cos_lat * s[:, 2]
    direction = np.stack([east, north], axis=1)
    norm = np.linalg.norm(direction, axis=1, keepdims=True)
    return np.divide(direction, norm, out=np.zeros_like(direction), where=norm > 1e-15)


def edge_attributes(
    edge_index: np.ndarray,
    src_latlon: tuple[np.ndarray, np.ndarray],
    dst_latlon: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """``(E, 3)`` float64 ``[length / max length, east, north]``; lat/lon in radians."""
    src_xyz = latlon_to_xyz(*src_latlon)
    dst_xyz = latlon_to_xyz(*dst_latlon)
    length = edge_lengths(edge_index, src_xyz, dst_xyz)
    scale = length.max() if length.size and length.max() > 0 else 1.0
    direction = edge_directions(edge_index, src_xyz, *dst_latlon)
    return np.concatenate([(length / scale)[:, None], direction], axis=1)


def gaussian_weights(edge_index: np.ndarray, src_xyz: np.ndarray, dst_xyz: np.ndarray, sigma: float,
                     num_dst: int) -> np.ndarray:
    """``(E,)`` float64 ``exp(-d^2 / (2 sigma^2))`` of every edge's great-circle length ``d`` (radians), divided
    by their sum over the edges into the same destination (each destination's weights sum to 1; a destination
    whose weights all underflow to 0 keeps 0s), as anemoi-graphs' ``GaussianDistanceWeights(norm="l1")``."""
    weights = np.exp(-edge_lengths(edge_index, src_xyz, dst_xyz) ** 2 / (2.0 * sigma**2))
    totals = np.bincount(edge_index[1], weights=weights, minlength=num_dst)
    scale = totals[edge_index[1]]
    return np.divide(weights, scale, out=np.zeros_like(weights), where=scale > 0)


def area_weights(lat: np.ndarray, lon: np.ndarray, clip_factor: float | None = 4.0) -> np.ndarray:
    """Spherical Voronoi cell areas ``(nodes,)`` normalised to mean 1; lat/lon in radians.

    Coincident points (e.g. the repeated pole points of a regular lat-lon grid) share one cell equally.
    ``clip_factor`` caps every area at that multiple of the median area before normalising: on a
    limited-area grid the Voronoi cells of the boundary points cover the rest of the globe, and the cap
    gives them a weight comparable to their neighbours' (global O-N and icosahedral grids never reach it).
    ``None`` keeps the raw areas.
    """
    if clip_factor is not None and not clip_factor > 1.0:
        raise ValueError(f"area clip_factor must be greater than 1 or None, got {clip_factor!r}")
    # scipy on first use: a training run that loads a cached graph never imports it
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import SphericalVoronoi, cKDTree

    xyz = latlon_to_xyz(lat, lon)
    n = xyz.shape[0]
    if n < 4:
        raise ValueError(f"spherical Voronoi area weights need at least 4 distinct nodes, got {n} nodes")
    pairs = cKDTree(xyz).query_pairs(_DUPLICATE_CHORD, output_type="ndarray")
    if pairs.size:
        graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
        _, label = connected_components(graph, directed=False)
    else:
        label = np.arange(n)
    first = np.unique(label, return_index=True)[1]  # one representative per group of coincident points
    if first.size < 4:
        raise ValueError(f"spherical Voronoi area weights need at least 4 distinct nodes, got {first.size}")
    voronoi = SphericalVoronoi(xyz[first], radius=1.0, threshold=1e-10)
    cell = voronoi.calculate_areas()
    count = np.bincount(label)[label[first]]
    # label values may not be 0..groups-1 in the order of `first`; map through a lookup
    per_group = np.empty(label.max() + 1)
    per_group[label[first]] = cell / count
    area = per_group[label]
    if clip_factor is not None:
        area = np.minimum(area, clip_factor * np.median(area))
    return area * (n / area.sum())
