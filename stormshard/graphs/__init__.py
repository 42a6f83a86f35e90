"""Grids (octahedral/Gaussian, regular, limited area), icosahedral meshes, edge builders, edge
attributes, area weights and the encoder-processor-decoder graph."""

from __future__ import annotations

from stormshard.graphs.attributes import area_weights, edge_attributes
from stormshard.graphs.builder import (
    DECODER,
    ENCODER,
    PROCESSOR,
    CutoffEdges,
    GraphConfig,
    KNNEdges,
    MultimeshEdges,
    build_graph,
    load_or_build_graph,
)
from stormshard.graphs.edges import cutoff_edges, knn_edges
from stormshard.graphs.grids import grid_from_name, octahedral_grid, regular_latlon_grid
from stormshard.graphs.icosahedral import icosahedral_mesh

__all__ = [
    "GraphConfig", "KNNEdges", "CutoffEdges", "MultimeshEdges", "build_graph", "load_or_build_graph",
    "ENCODER", "PROCESSOR", "DECODER", "grid_from_name", "octahedral_grid", "regular_latlon_grid",
    "icosahedral_mesh", "knn_edges", "cutoff_edges", "edge_attributes", "area_weights",
]
