"""anemoi's truncated residual in an anemoi checkpoint, as stormshard's truncation graph (``model.residual:
"truncated"``: :data:`~stormshard.graphs.builder.TRUNCATION_DOWN` / ``TRUNCATION_UP`` edges with ``edge_weight``
and the ``truncation`` node store), and back (the residual section of anemoi's config for ``export-anemoi``).

anemoi carries the last input state through two fixed sparse matrices, ``A_down`` ``(truncation, data)`` and
``A_up`` ``(data, truncation)``: ``A_up @ (A_down @ x)``, in fp32, per variable (it projects every input
variable and adds the prognostic ones; a column-wise linear map, so projecting only the prognostic ones, as
stormshard does, is the same). :func:`read_truncation` finds them where the checkpoint holds them:

- an anemoi-models 0.19 inference checkpoint (``TruncatedConnection``, any of its three forms): the pickled
  ``residual.<dataset>.provider_down`` / ``provider_up`` ``.projection_matrix`` (sparse CSR, read as inert
  records by :mod:`~stormshard.checkpoint.anemoi_pickle`), exactly as anemoi multiplies them;
- an older pickled model (AIFS 1.x, ``hardware.files.truncation`` / ``truncation_inv``): its ``A_down`` /
  ``A_up`` attributes (sparse COO, built from those files when the model was trained);
- a Lightning ``last.ckpt`` of a ``TruncatedConnection`` on edges of the model's graph
  (``truncation_down_edges_name`` / ``truncation_up_edges_name``): those edges and their
  ``edge_weight_attribute`` in the graph the file holds (``hyper_parameters["graph_data"]``), with anemoi's
  ``ProjectionGraphProvider`` arithmetic (source-node weights, row normalisation, fp32, duplicates summed).

A Lightning file holds no matrices otherwise (they are attributes, not in its state dict) and is refused
naming the fix (import the inference checkpoint written with it): the on-the-fly form (``truncation_config``
``grid`` / ``num_nearest_neighbours`` / ``sigma``) is not rebuilt, because its k nearest neighbours are not
unique on the symmetric octahedral grids (a truncation node with two data nodes at equal distance for its
k-th place: anemoi's scikit-learn search picks one, any other search may pick the other; for the fixture's
O16 -> O4, k = 3, stormshard's own search differs from anemoi's in 2 of 208 rows of ``A_down`` and 62 of 1,600 of
``A_up``), and the file form names ``.npz`` files on the training machine, which may have changed since.

The truncation nodes' coordinates (``graph["truncation"].x``, radians; the model does not use them) come from
the graph anemoi built them in where the checkpoint keeps it (the edge form), else from the grid named in
``truncation_config`` (``grid: o<N>``: stormshard's octahedral grid, kept only if every stored edge is among its
destination's k nearest sources, ties allowed, with the Gaussian weight of its length); otherwise anemoi kept
none (AIFS 1.x files, ``node_builder`` grids, ``.npz`` matrices) and the store holds ``num_nodes`` only, which is
all the model needs; the bundle's metadata says which (``anemoi.truncation``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_layouts import (
    AnemoiArchitecture,
    dataset_and_hidden_names,
    model_config_json,
    stored_graph,
)
from stormshard.checkpoint.anemoi_pickle import AnemoiCheckpoint, SparseTensor, stub_class_name
from stormshard.checkpoint.errors import ConversionError
from stormshard.graphs.builder import TRUNCATION_DOWN, TRUNCATION_UP
from stormshard.graphs.hetero import HeteroGraph

__all__ = ["Projection", "AnemoiTruncation", "TRUNCATED_RESIDUALS", "sparse_entries", "read_truncation",
           "add_truncation_graph", "truncation_residual_config", "EDGE_WEIGHT_ATTRIBUTE", "check_same_residual"]

#: the residuals (``AnemoiArchitecture.residual``) whose matrices :func:`read_truncation` reads
TRUNCATED_RESIDUALS = ("TruncatedConnection", "truncation matrices (A_down / A_up)",
                       "truncation matrices (hardware.files.truncation)", "truncation matrices (system.input.truncation)",
                       "truncation matrices (model.truncation_data)")
#: the edge attribute an exported graph keeps the projection weights in (anemoi-graphs' default name)
EDGE_WEIGHT_ATTRIBUTE = "gauss_weight"
_FIX = ("import the inference-*.ckpt anemoi-training wrote with this file (its pickled model holds the two "
        "truncation matrices)")


@dataclass(frozen=True)
class Projection:
    """A sparse matrix ``(rows, cols)`` as its entries: ``A[rows[i], cols[i]] = values[i]`` (int64, fp32)."""

    rows: Tensor
    cols: Tensor
    values: Tensor
    shape: tuple[int, int]


@dataclass(frozen=True)
class AnemoiTruncation:
    """anemoi's two truncation matrices (``down`` ``(truncation, data)``, ``up`` ``(data, truncation)``), the
    truncation nodes' coordinates ``(truncation, 2)`` radians (None: anemoi kept none), and where each came from."""

    down: Projection
    up: Projection
    coordinates: Tensor | None
    source: str
    coordinates_source: str

    @property
    def num_nodes(self) -> int:
        return int(self.down.shape[0])


def sparse_entries(obj: Any, name: str) -> Projection:
    """The entries of a 2-D sparse COO or CSR matrix pickled in a checkpoint (a
    :class:`~stormshard.checkpoint.anemoi_pickle.SparseTensor`), checked: index dtypes and ranges, lengths,
    monotone row pointers, finite values; a :class:`ConversionError` naming ``name`` otherwise."""
    if not isinstance(obj, SparseTensor):
        raise ConversionError(f"{name} is a {stub_class_name(obj) or type(obj).__name__}, not a sparse tensor",
                              fix="report this: the anemoi model keeps its truncation matrices as sparse tensors")
    problems = []
    size = obj.size
    if len(size) != 2 or min(size) < 1:
        raise ConversionError(f"{name}: a sparse tensor of size {list(size)}, not a matrix", fix=_FIX)
    if any(p.is_floating_point() or p.is_complex() for p in obj.parts[:-1]) or not obj.parts[-1].is_floating_point():
        raise ConversionError(f"{name}: sparse parts of dtypes {[str(p.dtype) for p in obj.parts]} (integer indices "
                              "and floating values expected)", fix=_FIX)
    values = obj.parts[-1].reshape(-1)
    if obj.layout == torch.sparse_coo:
        indices = obj.parts[0]
        if indices.dim() != 2 or indices.shape[0] != 2 or indices.shape[1] != values.numel():
            raise ConversionError(f"{name}: COO indices of shape {list(indices.shape)} for {values.numel()} values",
                                  fix=_FIX)
        rows, cols = indices[0].long(), indices[1].long()
    elif obj.layout == torch.sparse_csr:
        crow, col = obj.parts[0].long().reshape(-1), obj.parts[1].long().reshape(-1)
        if crow.numel() != size[0] + 1 or col.numel() != values.numel():
            raise ConversionError(f"{name}: CSR row pointers of length {crow.numel()} for {size[0]} rows, "
                                  f"{col.numel()} columns for {values.numel()} values", fix=_FIX)
        counts = crow[1:] - crow[:-1]
        if int(crow[0]) != 0 or int(crow[-1]) != col.numel() or bool((counts < 0).any()):
            raise ConversionError(f"{name}: CSR row pointers not from 0 to {col.numel()} in order", fix=_FIX)
        rows, cols = torch.repeat_interleave(torch.arange(size[0]), counts), col
    else:
        raise ConversionError(f"{name}: a sparse tensor of layout {obj.layout} (COO or CSR expected)", fix=_FIX)
    for what, index, bound in (("row", rows, size[0]), ("column", cols, size[1])):
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= bound):
            problems.append(f"{what} indices in [{int(index.min())}, {int(index.max())}], outside [0, {bound})")
    if not bool(torch.isfinite(values).all()):
        problems.append("non-finite values")
    if problems:
        raise ConversionError(f"{name}: malformed sparse matrix of size {list(size)}:", problems, fix=_FIX)
    return Projection(rows.contiguous(), cols.contiguous(), values.float().contiguous(), (int(size[0]), int(size[1])))


def _module(obj: Any, *names: str) -> Any:
    for name in names:
        modules = (getattr(obj, "__dict__", {}).get("_modules") or {})
        if name not in modules:
            return None
        obj = modules[name]
    return obj


def _inner_model(ckpt: AnemoiCheckpoint) -> Any:
    return _module(ckpt.root, "model") if ckpt.kind == "inference" else None


def _residual_config(ckpt: AnemoiCheckpoint) -> dict[str, Any]:
    """The dataset's ``model.residual`` section of the training config (``{}`` when absent)."""
    dataset, _ = dataset_and_hidden_names(ckpt.metadata)
    residual = model_config_json(ckpt.metadata).get("residual")
    if isinstance(residual, dict) and isinstance(residual.get("datasets"), dict):
        residual = residual["datasets"].get(dataset) or (next(iter(residual["datasets"].values()), None)
                                                         if len(residual["datasets"]) == 1 else None)
    return residual if isinstance(residual, dict) else {}


def _store(graph: Any, key: Any) -> dict[str, Any] | None:
    """A node (str key) or edge (tuple key) store's mapping of a stubbed torch-geometric HeteroData."""
    state = getattr(graph, "__dict__", {})
    stores = state.get("_edge_store_dict" if isinstance(key, tuple) else "_node_store_dict")
    store = stores.get(key) if isinstance(stores, dict) else None
    mapping = getattr(store, "__dict__", {}).get("_mapping") if store is not None else None
    return mapping if isinstance(mapping, dict) else None


def _num_nodes(store: dict[str, Any] | None) -> int | None:
    if store is None:
        return None
    if isinstance(store.get("num_nodes"), int):
        return int(store["num_nodes"])
    x = store.get("x")
    return int(x.shape[0]) if isinstance(x, Tensor) else None


def _edges_name(value: Any) -> tuple[str, str, str] | None:
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) and len(value) == 3 else None


def _graph_projection(ckpt: AnemoiCheckpoint, graph: Any, edges: tuple[str, str, str], config: dict[str, Any],
                      ) -> Projection:
    """anemoi's ``ProjectionGraphProvider._build_from_graph`` of a stored graph's edge set, without anemoi."""
    store = _store(graph, edges)
    where = f"{ckpt.path}: the graph's {edges[0]} -> {edges[2]} truncation edges"
    if store is None or not isinstance(store.get("edge_index"), Tensor):
        raise ConversionError(f"{where} are missing (the residual config names them)", fix=_FIX)
    edge_index = store["edge_index"].long()
    attribute = config.get("edge_weight_attribute") or EDGE_WEIGHT_ATTRIBUTE
    weights = store.get(attribute)
    if not isinstance(weights, Tensor) or weights.numel() != edge_index.shape[1]:
        raise ConversionError(f"{where} have no {attribute!r} weights of one value per edge", fix=_FIX)
    weights = weights.reshape(-1).float()
    node_attribute = config.get("src_node_weight_attribute")
    if node_attribute:
        node_weights = (_store(graph, edges[0]) or {}).get(node_attribute)
        if not isinstance(node_weights, Tensor):
            raise ConversionError(f"{where}: the source nodes have no {node_attribute!r} (src_node_weight_attribute)",
                                  fix=_FIX)
        weights = weights * node_weights.reshape(-1).float()[edge_index[0]]
    shape = (_num_nodes(_store(graph, edges[2])), _num_nodes(_store(graph, edges[0])))
    if None in shape:
        raise ConversionError(f"{where}: the node sets {edges[2]!r} / {edges[0]!r} have no node count", fix=_FIX)
    rows, cols = edge_index[1], edge_index[0]
    if bool(config.get("row_normalize")):  # anemoi: divide each row by its sum (fp32); zero rows stay
        sums = torch.zeros(shape[0], dtype=torch.float32).index_add_(0, rows, weights)
        inverse = torch.where(sums != 0, 1.0 / torch.where(sums != 0, sums, 1.0), torch.zeros_like(sums))
        weights = weights * inverse[rows]
    return Projection(rows.contiguous(), cols.contiguous(), weights.contiguous(), (int(shape[0]), int(shape[1])))


def _pickled_truncation(ckpt: AnemoiCheckpoint) -> tuple[Projection, Projection, str] | None:
    """The matrices a pickled model holds (0.19 residual providers, or an older model's A_down / A_up)."""
    model = _inner_model(ckpt)
    if model is None:
        return None
    residuals = _module(model, "residual")
    modules = getattr(residuals, "__dict__", {}).get("_modules") or {}
    for key, residual in modules.items():
        if (stub_class_name(residual) or "").rsplit(".", 1)[-1] != "TruncatedConnection":
            continue
        found = []
        for provider in ("provider_down", "provider_up"):
            matrix = getattr(_module(residual, provider), "__dict__", {}).get("projection_matrix")
            if matrix is None:
                raise ConversionError(f"{ckpt.path}: the pickled TruncatedConnection has no {provider}.projection_matrix",
                                      fix="report this: anemoi-models 0.19 keeps the truncation matrices there")
            found.append(sparse_entries(matrix, f"{ckpt.path}: model.residual.{key}.{provider}.projection_matrix"))
        return found[0], found[1], f"the pickled model's residual.{key}.provider_down / provider_up"
    state = model.__dict__
    down, up = state.get("A_down"), state.get("A_up")
    if down is None and up is None:
        return None
    if down is None or up is None:
        raise ConversionError(f"{ckpt.path}: the pickled model has A_{'down' if up is None else 'up'} but no "
                              f"A_{'up' if up is None else 'down'}: a one-way truncation (a residual of another "
                              "shape than the data grid's) has no stormshard equivalent",
                              fix="only models that truncate to a coarser grid and back import")
    return (sparse_entries(down, f"{ckpt.path}: model.A_down"), sparse_entries(up, f"{ckpt.path}: model.A_up"),
            "the pickled model's A_down / A_up")


def _graph_truncation(ckpt: AnemoiCheckpoint, config: dict[str, Any]) -> tuple[Projection, Projection, str] | None:
    """The matrices from the edge sets of the stored graph a ``TruncatedConnection`` config names."""
    down_name = _edges_name(config.get("truncation_down_edges_name"))
    up_name = _edges_name(config.get("truncation_up_edges_name"))
    if down_name is None or up_name is None:
        return None
    graph = stored_graph(ckpt)
    if graph is None:
        raise ConversionError(f"{ckpt.path}: the residual names the truncation edges {down_name} / {up_name} of the "
                              "graph, and the file holds no graph", fix=_FIX)
    return (_graph_projection(ckpt, graph, down_name, config), _graph_projection(ckpt, graph, up_name, config),
            f"the stored graph's {down_name} / {up_name} edges ({config.get('edge_weight_attribute') or EDGE_WEIGHT_ATTRIBUTE})")


def _lightning_refusal(ckpt: AnemoiCheckpoint, arch: AnemoiArchitecture, config: dict[str, Any]) -> ConversionError:
    trunc = config.get("truncation_config") if isinstance(config.get("truncation_config"), dict) else {}
    files = [trunc.get(k) or config.get(k) for k in ("truncation_down_file_path", "truncation_up_file_path")]
    if any(files):
        why = (f"its truncation matrices are the files {files[0]!r} / {files[1]!r} of the training machine "
               "(truncation_config), which may have changed since")
    elif trunc:
        given = {k: v for k, v in trunc.items() if v is not None}
        why = (f"anemoi built its truncation matrices when the model was made (truncation_config {given}), and "
               "their nearest neighbours are not unique on octahedral grids (equidistant nodes: anemoi's search "
               "picks one, any other may pick the other), so they are not rebuilt")
    else:
        why = f"its residual ({arch.residual}) keeps its truncation matrices outside the state dict"
    return ConversionError(f"{ckpt.path}: a Lightning checkpoint of a model with a truncated residual holds no "
                           f"truncation matrices (they are not in its state dict): {why}", fix=_FIX)


def _grid_coordinates(ckpt: AnemoiCheckpoint, config: dict[str, Any], down: Projection, up: Projection,
                      data_latlon: Tensor) -> tuple[Tensor | None, str]:
    """The truncation nodes' coordinates from ``truncation_config``'s grid name, checked against the matrices."""
    from stormshard.graphs.attributes import gaussian_weights
    from stormshard.graphs.grids import grid_from_name
    from stormshard.graphs.sphere import latlon_to_xyz

    trunc = config.get("truncation_config") if isinstance(config.get("truncation_config"), dict) else {}
    builder = trunc.get("node_builder") if isinstance(trunc.get("node_builder"), dict) else {}
    grid = trunc.get("grid") or (builder.get("grid") if str(builder.get("_target_", "")).endswith(
        "ReducedGaussianGridNodes") else None)
    if not trunc or any(trunc.get(k) for k in ("truncation_down_file_path", "truncation_up_file_path")):
        return None, "none: anemoi keeps no coordinates of the truncation nodes of this form (matrices only)"
    if not isinstance(grid, str) or not grid.strip().lower().startswith("o"):
        return None, (f"none: the truncation grid ({grid or builder.get('_target_')}) is not an octahedral grid "
                      "stormshard computes, and anemoi keeps no coordinates of it")
    try:
        lat_deg, lon_deg = grid_from_name(grid)
    except ValueError:
        return None, f"none: stormshard does not compute the grid {grid!r}, and anemoi keeps no coordinates of it"
    lat, lon = np.radians(lat_deg), np.radians(lon_deg)
    if lat.size != down.shape[0]:
        return None, f"none: grid {grid!r} has {lat.size} nodes, the matrices {down.shape[0]}"
    k, sigma = int(trunc.get("num_nearest_neighbours") or 3), float(trunc.get("sigma") or 1.0)
    data_xyz = latlon_to_xyz(data_latlon[:, 0].double().numpy(), data_latlon[:, 1].double().numpy())
    trunc_xyz = latlon_to_xyz(lat, lon)
    for proj, src, dst in ((down, data_xyz, trunc_xyz), (up, trunc_xyz, data_xyz)):
        if not _consistent(proj, src, dst, k, sigma, gaussian_weights):
            return None, (f"none: the matrices are not the {k}-nearest-neighbour Gaussian weights (sigma {sigma}) of "
                          f"stormshard's grid {grid!r}, so its coordinates are not the ones anemoi used")
    return (torch.from_numpy(np.stack([lat, lon], axis=1)).float(),
            f"grid {grid!r} (stormshard.graphs.grids), checked: every matrix entry joins one of the {k} nearest "
            f"nodes (ties allowed) with the Gaussian weight (sigma {sigma}) of its length")


def _consistent(proj: Projection, src_xyz: np.ndarray, dst_xyz: np.ndarray, k: int, sigma: float,
                gaussian_weights: Any) -> bool:
    """Whether every destination row has ``k`` entries whose sources are among its ``k`` nearest (ties allowed)
    and whose values are the l1-normalised Gaussian weights of their lengths (1e-5)."""
    from scipy.spatial import cKDTree

    rows, cols = proj.rows.numpy(), proj.cols.numpy()
    if not np.array_equal(np.bincount(rows, minlength=dst_xyz.shape[0]), np.full(dst_xyz.shape[0], k)):
        return False
    kth = cKDTree(src_xyz).query(dst_xyz, k=k)[0].reshape(dst_xyz.shape[0], k)[:, -1]
    chord = np.linalg.norm(src_xyz[cols] - dst_xyz[rows], axis=1)
    if bool((chord > kth[rows] * (1 + 1e-5) + 1e-9).any()):
        return False
    weights = gaussian_weights(np.stack([cols, rows]), src_xyz, dst_xyz, sigma, dst_xyz.shape[0])
    return bool(np.abs(weights - proj.values.double().numpy()).max() <= 1e-5)


def read_truncation(ckpt: AnemoiCheckpoint, arch: AnemoiArchitecture, data_latlon: Tensor) -> AnemoiTruncation | None:
    """anemoi's truncation matrices (and the truncation nodes' coordinates) of ``ckpt``, None for a model
    without a truncated residual; a :class:`ConversionError` naming the file and the fix where the checkpoint
    does not hold them (module docstring). ``data_latlon``: the data nodes ``(nodes, 2)`` radians."""
    found = _pickled_truncation(ckpt)  # the pickled model's own matrices, whatever its config says
    if found is None and arch.residual not in TRUNCATED_RESIDUALS:
        return None
    config = _residual_config(ckpt)
    found = found or _graph_truncation(ckpt, config)
    if found is None:
        if ckpt.kind == "lightning":
            raise _lightning_refusal(ckpt, arch, config)
        raise ConversionError(f"{ckpt.path}: the model's residual is {arch.residual}, and its pickled model holds no "
                              "truncation matrices (no TruncatedConnection providers, no A_down / A_up)",
                              fix="import a checkpoint whose model holds its truncation matrices")
    down, up, source = found
    data = int(data_latlon.shape[0])
    if down.shape[1] != data or up.shape[0] != data or down.shape[0] != up.shape[1]:
        raise ConversionError(f"{ckpt.path}: truncation matrices of shapes {list(down.shape)} (down) and "
                              f"{list(up.shape)} (up) for {data} data nodes: expected (T, {data}) and ({data}, T)",
                              fix=_FIX)
    coordinates, coordinates_source = None, ""
    down_name = _edges_name(config.get("truncation_down_edges_name"))
    graph = stored_graph(ckpt)
    if down_name is not None and graph is not None:
        x = (_store(graph, down_name[2]) or {}).get("x")
        if isinstance(x, Tensor) and x.dim() == 2 and x.shape == (down.shape[0], 2):
            coordinates, coordinates_source = x.float().clone(), f"the stored graph's {down_name[2]!r} nodes"
    if coordinates is None and "A_down" not in source:
        data_x = (_store(graph, dataset_and_hidden_names(ckpt.metadata)[0]) or {}).get("x") if graph is not None \
            else None
        exact = data_x if isinstance(data_x, Tensor) and tuple(data_x.shape) == (data, 2) else data_latlon
        coordinates, coordinates_source = _grid_coordinates(ckpt, config, down, up, exact)
    if coordinates is None and not coordinates_source:
        coordinates_source = "none: an AIFS 1.x model keeps its truncation matrices only (no coordinates)"
    return AnemoiTruncation(down, up, coordinates, source, coordinates_source)


def add_truncation_graph(graph: HeteroGraph, truncation: AnemoiTruncation) -> None:
    """The truncation node store (``x`` where known, else ``num_nodes``) and the ``TRUNCATION_DOWN`` /
    ``TRUNCATION_UP`` edges (``edge_index`` row 0 the source, ``edge_weight`` fp32) of ``truncation``."""
    if truncation.coordinates is not None:
        graph["truncation"].x = truncation.coordinates
    else:
        graph["truncation"].num_nodes = truncation.num_nodes
    down, up = truncation.down, truncation.up
    graph[TRUNCATION_DOWN].edge_index = torch.stack([down.cols, down.rows]).long().contiguous()
    graph[TRUNCATION_DOWN].edge_weight = down.values.float().contiguous()
    graph[TRUNCATION_UP].edge_index = torch.stack([up.cols, up.rows]).long().contiguous()
    graph[TRUNCATION_UP].edge_weight = up.values.float().contiguous()


def truncation_residual_config() -> dict[str, Any]:
    """anemoi's residual config for stormshard's truncated residual: a ``TruncatedConnection`` on the exported
    graph's ``truncation`` edges (their weights under :data:`EDGE_WEIGHT_ATTRIBUTE`), nothing renormalised."""
    return {"_target_": "anemoi.models.layers.residual.TruncatedConnection",
            "truncation_down_edges_name": list(TRUNCATION_DOWN), "truncation_up_edges_name": list(TRUNCATION_UP),
            "edge_weight_attribute": EDGE_WEIGHT_ATTRIBUTE, "src_node_weight_attribute": None,
            "row_normalize": False, "autocast": False}


def _entries(rows: Tensor, cols: Tensor, values: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """A matrix's entries in one canonical order (duplicates summed): flat indices and values."""
    flat = rows.long() * shape[1] + cols.long()
    keys, inverse = torch.unique(flat, return_inverse=True)
    return keys, torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, inverse, values.double())


def check_same_residual(truncation: AnemoiTruncation | None, residual: str, graph: HeteroGraph, where: str) -> None:
    """A :class:`ConversionError` unless a bundle of ``residual`` with ``graph`` computes the residual of the anemoi
    model whose truncation is ``truncation`` (None: a SkipConnection): ``export-anemoi`` writes a bundle's weights
    into the anemoi checkpoint it descends from, whose pickled residual stays as it is."""
    fix = ("export by building anemoi's model instead: copy the bundle without its anemoi_source.ckpt and metadata "
           "anemoi.template, or import and fine-tune the anemoi checkpoint with its own residual")
    if (truncation is not None) != (residual == "truncated"):
        theirs = "a truncated residual (TruncatedConnection)" if truncation is not None else "the last input step"
        raise ConversionError(f"{where}: model.residual={residual!r}, and the anemoi checkpoint it descends from "
                              f"adds {theirs}: writing the weights into it would change the forecast", fix=fix)
    if truncation is None:
        return
    for proj, edge_type in ((truncation.down, TRUNCATION_DOWN), (truncation.up, TRUNCATION_UP)):
        store = graph[edge_type] if edge_type in graph else None
        ok = store is not None and "edge_weight" in store
        if ok:
            ei = store.edge_index
            ours = _entries(ei[1], ei[0], store.edge_weight, proj.shape)
            theirs = _entries(proj.rows, proj.cols, proj.values, proj.shape)
            ok = torch.equal(ours[0], theirs[0]) and bool((ours[1] - theirs[1]).abs().max() <= 1e-6) \
                if ours[0].numel() else not theirs[0].numel()
        if not ok:
            raise ConversionError(f"{where}: the graph's {edge_type[0]} -> {edge_type[2]} truncation edges are not the "
                                  "matrix of the anemoi checkpoint it descends from: writing the weights into it "
                                  "would change the forecast", fix=fix)
