"""Grids (octahedral/Gaussian, regular, limited area), icosahedral meshes, edge builders, edge
attributes, area weights and the encoder-processor-decoder graph."""

from __future__ import annotations

from stormshard.graphs.attributes import (  # noqa: F401
    area_weights,
    edge_attributes,
    edge_directions,
    edge_lengths,
)
from stormshard.graphs.builder import (  # noqa: F401
    DECODER,
    ENCODER,
    PROCESSOR,
    CutoffEdges,
    GraphConfig,
    KNNEdges,
    MultimeshEdges,
    build_graph,
    graph_hash,
    load_graph,
    load_or_build_graph,
    save_graph,
)
from stormshard.graphs.edges import (  # noqa: F401
    cover_destinations,
    cover_sources,
    cutoff_edges,
    knn_edges,
    max_nearest_neighbour_distance,
    sort_unique_edges,
    unique_sorted,
)
from stormshard.graphs.grids import (  # noqa: F401
    gaussian_latitudes,
    grid_from_name,
    latlon_patch,
    octahedral_grid,
    octahedral_ring_sizes,
    regular_latlon_grid,
)
from stormshard.graphs.icosahedral import (  # noqa: F401
    IcosahedralMesh,
    icosahedral_mesh,
    icosahedral_num_nodes,
    icosahedron,
    multimesh_edges,
    refine_triangles,
    triangle_edges,
)
from stormshard.graphs.sphere import (  # noqa: F401
    arc_to_chord,
    check_latlon_degrees,
    chord_to_arc,
    haversine,
    latlon_to_xyz,
    xyz_to_latlon,
)

__all__ = [
    "gaussian_latitudes",
    "octahedral_ring_sizes",
    "octahedral_grid",
    "regular_latlon_grid",
    "latlon_patch",
    "grid_from_name",
    "latlon_to_xyz",
    "xyz_to_latlon",
    "arc_to_chord",
    "chord_to_arc",
    "haversine",
    "check_latlon_degrees",
    "IcosahedralMesh",
    "icosahedron",
    "refine_triangles",
    "icosahedral_mesh",
    "icosahedral_num_nodes",
    "triangle_edges",
    "multimesh_edges",
    "unique_sorted",
    "sort_unique_edges",
    "knn_edges",
    "max_nearest_neighbour_distance",
    "cutoff_edges",
    "cover_sources",
    "cover_destinations",
    "edge_lengths",
    "edge_directions",
    "edge_attributes",
    "area_weights",
    "KNNEdges",
    "CutoffEdges",
    "MultimeshEdges",
    "GraphConfig",
    "build_graph",
    "graph_hash",
    "save_graph",
    "load_graph",
    "load_or_build_graph",
    "ENCODER",
    "PROCESSOR",
    "DECODER",
]
