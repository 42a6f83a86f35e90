"""Grids (octahedral/Gaussian, regular, limited area), icosahedral meshes, edge builders, edge
attributes, area weights and the encoder-processor-decoder graph (a :class:`HeteroGraph`)."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module, loaded on first use: importing the package (e.g. the torch-free graph config, read by
# the experiment config) does not load torch
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("area_weights", "edge_attributes", "gaussian_weights"), "attributes"),
    **dict.fromkeys(("DECODER", "ENCODER", "PROCESSOR", "TRUNCATION_DOWN", "TRUNCATION_UP", "CutoffEdges",
                     "GraphConfig", "KNNEdges", "MultimeshEdges", "TruncationGrid", "build_graph",
                     "load_or_build_graph"),
                    "builder"),
    **dict.fromkeys(("cutoff_edges", "knn_edges"), "edges"),
    **dict.fromkeys(("grid_from_name", "octahedral_grid", "regular_latlon_grid"), "grids"),
    "HeteroGraph": "hetero",
    "icosahedral_mesh": "icosahedral",
}
__all__ = [
    "GraphConfig", "KNNEdges", "CutoffEdges", "MultimeshEdges", "build_graph", "load_or_build_graph",
    "ENCODER", "PROCESSOR", "DECODER", "grid_from_name", "octahedral_grid", "regular_latlon_grid",
    "icosahedral_mesh", "knn_edges", "cutoff_edges", "edge_attributes", "area_weights", "HeteroGraph",
    "TruncationGrid", "TRUNCATION_DOWN", "TRUNCATION_UP", "gaussian_weights",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
