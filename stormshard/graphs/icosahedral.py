"""Refined icosahedral meshes and their multi-level (multimesh) edges.

Level 0 is the icosahedron (12 nodes, 20 faces). Each refinement splits every triangle into four
through its edge midpoints, projected back onto the unit sphere, so level r has 10 * 4**r + 2 nodes
and 20 * 4**r faces. New nodes are appended after the old ones: the nodes of level r are the first
10 * 4**r + 2 nodes of every finer level, which is what lets the multimesh use coarse-level edges on
the finest node set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stormshard.graphs.edges import unique_sorted
from stormshard.graphs.sphere import xyz_to_latlon

__all__ = [
    "IcosahedralMesh",
    "icosahedron",
    "refine_triangles",
    "icosahedral_mesh",
    "icosahedral_num_nodes",
    "triangle_edges",
    "multimesh_edges",
]

_MAX_LEVEL = 10


@dataclass(frozen=True)
class IcosahedralMesh:
    """A refined icosahedral mesh.

    ``vertices``: unit vectors ``(nodes, 3)`` of the finest level; ``faces[r]``: triangles
    ``(20 * 4**r, 3)`` of level r (node indices into ``vertices``), counter-clockwise seen from outside.
    """

    vertices: np.ndarray
    faces: tuple[np.ndarray, ...]

    @property
    def level(self) -> int:
        return len(self.faces) - 1

    @property
    def num_nodes(self) -> int:
        return int(self.vertices.shape[0])

    def latlon(self) -> tuple[np.ndarray, np.ndarray]:
        """Latitudes and longitudes of the nodes in radians."""
        return xyz_to_latlon(self.vertices)


def icosahedral_num_nodes(level: int) -> int:
    """Number of nodes of the icosahedral mesh at ``level``: 10 * 4**level + 2."""
    return 10 * 4**level + 2


def icosahedron() -> tuple[np.ndarray, np.ndarray]:
    """Vertices ``(12, 3)`` (unit vectors) and faces ``(20, 3)`` (counter-clockwise) of the icosahedron."""
    phi = (1.0 + np.sqrt(5.0)) / 2.0
    v = np.array(
        [
            [-1, phi, 0], [1, phi, 0], [-1, -phi, 0], [1, -phi, 0],
            [0, -1, phi], [0, 1, phi], [0, -1, -phi], [0, 1, -phi],
            [phi, 0, -1], [phi, 0, 1], [-phi, 0, -1], [-phi, 0, 1],
        ],
        dtype=np.float64,
    )  # fmt: skip
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    f = np.array(
        [
            [0, 11, 5], [0, 5, 1], [0, 1, 7], [0, 7, 10], [0, 10, 11],
            [1, 5, 9], [5, 11, 4], [11, 10, 2], [10, 7, 6], [7, 1, 8],
            [3, 9, 4], [3, 4, 2], [3, 2, 6], [3, 6, 8], [3, 8, 9],
            [4, 9, 5], [2, 4, 11], [6, 2, 10], [8, 6, 7], [9, 8, 1],
        ],
        dtype=np.int64,
    )  # fmt: skip
    return v, f


def refine_triangles(vertices: np.ndarray, faces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split every triangle into four through its edge midpoints (projected onto the unit sphere).

    Returns the old vertices followed by one new vertex per unique edge, and faces ``(4 * F, 3)``.
    """
    a, b, c = faces[:, 0], faces[:, 1], faces[:, 2]
    pairs = np.concatenate([np.stack([a, b], 1), np.stack([b, c], 1), np.stack([c, a], 1)])
    unique, inverse = np.unique(np.sort(pairs, axis=1), axis=0, return_inverse=True)
    mid = vertices[unique[:, 0]] + vertices[unique[:, 1]]
    mid /= np.linalg.norm(mid, axis=1, keepdims=True)
    new_id = vertices.shape[0] + inverse.reshape(3, -1)  # (3, F): midpoints of ab, bc, ca
    ab, bc, ca = new_id[0], new_id[1], new_id[2]
    new_faces = np.concatenate(
        [np.stack(t, 1) for t in ((a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca))]
    )
    return np.concatenate([vertices, mid]), new_faces


def icosahedral_mesh(level: int) -> IcosahedralMesh:
    """The icosahedron refined ``level`` times (10 * 4**level + 2 nodes), with the faces of every level."""
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not 0 <= level <= _MAX_LEVEL:
        raise ValueError(
            f"icosahedral level must be an integer in [0, {_MAX_LEVEL}], got {level!r} "
            "(level 5 has 10,242 nodes, level 6 has 40,962)"
        )
    vertices, faces = icosahedron()
    all_faces = [faces]
    for _ in range(int(level)):
        vertices, faces = refine_triangles(vertices, faces)
        all_faces.append(faces)
    return IcosahedralMesh(vertices=vertices, faces=tuple(all_faces))


def triangle_edges(faces: np.ndarray) -> np.ndarray:
    """Directed edges ``(2, E)`` int64 in both directions along the sides of the triangles ``(F, 3)``.

    Unique, sorted by destination then source.
    """
    a, b, c = faces[:, 0], faces[:, 1], faces[:, 2]
    src = np.concatenate([a, b, c, b, c, a]).astype(np.int64)
    dst = np.concatenate([b, c, a, a, b, c]).astype(np.int64)
    n = np.int64(faces.max()) + 1
    key = unique_sorted(dst * n + src)
    return np.stack([key % n, key // n])


def multimesh_edges(mesh: IcosahedralMesh, levels: range | None = None) -> np.ndarray:
    """The multimesh: the union of the triangle edges of ``levels`` (default all levels of ``mesh``).

    Returns ``(2, E)`` int64 edges on the finest nodes [row 0 = source, row 1 = destination], symmetric,
    without self loops or duplicates, sorted by destination then source.
    """
    levels = range(mesh.level + 1) if levels is None else levels
    if len(levels) == 0 or min(levels) < 0 or max(levels) > mesh.level:
        raise ValueError(f"levels {levels} must be a non-empty range within [0, {mesh.level}]")
    n = np.int64(mesh.num_nodes)
    keys = [triangle_edges(mesh.faces[r]) for r in levels]
    key = unique_sorted(np.concatenate([e[1] * n + e[0] for e in keys]))
    return np.stack([key % n, key // n]).astype(np.int64)
