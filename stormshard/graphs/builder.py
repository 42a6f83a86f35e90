"""The graph of an encoder-processor-decoder model, built from a small config, cached in a file.

``build_graph(config, data_latlon)`` returns a :class:`~stormshard.graphs.hetero.HeteroGraph` (the part of
torch-geometric's ``HeteroGraph`` interface stormshard uses, without importing torch-geometric) with

- node types ``"data"`` and ``"hidden"``: ``x`` ``(nodes, 2)`` float32 (lat, lon) in radians and
  ``area_weight`` ``(nodes,)`` float32 (spherical Voronoi areas, mean 1). Data nodes keep the order of
  the given coordinates (the dataset's order); hidden nodes are the mesh/grid nodes in their own order.
- edge types ``("data", "to", "hidden")`` (encoder), ``("hidden", "to", "hidden")`` (processor) and
  ``("hidden", "to", "data")`` (decoder): ``edge_index`` ``(2, E)`` int64 [row 0 = source, row 1 =
  destination], sorted by destination then source, and ``edge_attr`` ``(E, 3)`` float32
  ``[length / max length, east, north]`` (see ``stormshard.graphs.attributes``).
- graph attributes ``config_hash`` (str) and ``coverage_edges`` (dict: edges added so that every data
  point reaches the hidden mesh and receives from it, see ``stormshard.graphs.edges``).

``load_or_build_graph(config, path, data_latlon)`` loads the file when its hash (config + data
coordinates + format version) matches and otherwise builds the graph and saves it (plain tensors and
strings, loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stormshard.errors import disk_full_error, is_disk_full
from stormshard.graphs.attributes import area_weights, edge_attributes, gaussian_weights
from stormshard.graphs.config import (  # the graph's config, torch-free (re-exported here)
    CutoffEdges,
    GraphConfig,
    KNNEdges,
    MultimeshEdges,
    TruncationGrid,
)
from stormshard.graphs.edges import (
    cover_destinations,
    cover_sources,
    cutoff_edges,
    knn_edges,
    sort_unique_edges,
)
from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.hetero import HeteroGraph
from stormshard.graphs.icosahedral import icosahedral_mesh, icosahedral_num_nodes, multimesh_edges
from stormshard.graphs.sphere import check_latlon_degrees, latlon_to_xyz
from stormshard.progress import format_duration, note, phase, reporting

__all__ = [
    "KNNEdges",
    "CutoffEdges",
    "MultimeshEdges",
    "GraphConfig",
    "build_graph",
    "graph_hash",
    "save_graph",
    "load_graph",
    "is_graph_file",
    "load_or_build_graph",
    "graph_node_counts",
    "ENCODER",
    "PROCESSOR",
    "DECODER",
    "TRUNCATION_DOWN",
    "TRUNCATION_UP",
    "TruncationGrid",
]

GRAPH_FORMAT_VERSION = 2
ENCODER = ("data", "to", "hidden")
PROCESSOR = ("hidden", "to", "hidden")
DECODER = ("hidden", "to", "data")
#: a truncated residual's projections (``GraphConfig.truncation``; ``edge_weight`` ``(E,)`` float32)
TRUNCATION_DOWN = ("data", "to", "truncation")
TRUNCATION_UP = ("truncation", "to", "data")


def _data_coordinates(config: GraphConfig, data_latlon: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """Data lat/lon in degrees, from exactly one of ``config.data_grid`` and ``data_latlon``."""
    if data_latlon is None and config.data_grid is None:
        raise ValueError(
            "no data coordinates: set GraphConfig.data_grid (e.g. 'o96') or pass data_latlon=(lat, lon) in degrees"
        )
    if data_latlon is not None and config.data_grid is not None:
        raise ValueError(
            f"both GraphConfig.data_grid={config.data_grid!r} and data_latlon are given; "
            "set data_grid=None to use the dataset's coordinates, or drop data_latlon"
        )
    if data_latlon is not None:
        if not isinstance(data_latlon, (tuple, list)) or len(data_latlon) != 2:
            raise TypeError("data_latlon must be a pair (latitudes, longitudes) of 1-D arrays in degrees")
        lat, lon = check_latlon_degrees(data_latlon[0], data_latlon[1], "data_latlon")
        if lat.size < 4:
            raise ValueError(f"data_latlon has {lat.size} points; a graph needs at least 4 data points")
        return lat, lon
    return grid_from_name(config.data_grid)


def graph_hash(config: GraphConfig, data_latlon: tuple | None = None) -> str:
    """SHA-256 of the graph format version, the config and the data coordinates (float64 degrees)."""
    return _hash_of(config, *_data_coordinates(config, data_latlon))


def _hash_of(config: GraphConfig, lat: np.ndarray, lon: np.ndarray) -> str:
    """:func:`graph_hash` of already resolved data coordinates (degrees)."""
    h = hashlib.sha256()
    h.update(f"stormshard-graph-v{GRAPH_FORMAT_VERSION}".encode())
    # a graph without a truncation grid hashes as before the option existed (cached graphs stay valid)
    h.update(config.model_dump_json(exclude={"truncation"} if config.truncation is None else None).encode())
    h.update(np.ascontiguousarray(lat, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(lon, dtype=np.float64).tobytes())
    return h.hexdigest()


def _mapper_edges(spec: KNNEdges | CutoffEdges, src_xyz: np.ndarray, dst_xyz: np.ndarray) -> np.ndarray:
    if isinstance(spec, KNNEdges):
        if spec.num_neighbours > src_xyz.shape[0]:
            raise ValueError(
                f"knn num_neighbours={spec.num_neighbours} exceeds the {src_xyz.shape[0]} source nodes; lower it"
            )
        return knn_edges(src_xyz, dst_xyz, spec.num_neighbours)
    return cutoff_edges(src_xyz, dst_xyz, spec.factor)[0]


def build_graph(config: GraphConfig, data_latlon: tuple | None = None, progress: bool = False) -> HeteroGraph:
    """Build the data/hidden graph; ``data_latlon`` = (lat, lon) in degrees when ``config.data_grid`` is None.
    ``progress``: a line per phase with its time on standard error (:mod:`stormshard.progress`)."""
    with reporting(progress):
        return _build_graph(config, data_latlon)


def _build_graph(config: GraphConfig, data_latlon: tuple | None) -> HeteroGraph:
    start = time.perf_counter()
    lat_deg, lon_deg = _data_coordinates(config, data_latlon)
    digest = graph_hash(config, data_latlon)
    data_lat, data_lon = np.radians(lat_deg), np.radians(lon_deg)
    data_xyz = latlon_to_xyz(data_lat, data_lon)
    note(f"graph: building ({data_lat.size:,} data cells, hidden {config.hidden})")

    level = config.icosahedral_level
    with phase(f"graph: hidden nodes ({config.hidden})", lambda: f"{hid_lat.size:,}"):
        hid_xyz, hid_lat, hid_lon, mesh, rank_of = _hidden_nodes(config, level)

    with phase("graph: encoder edges", lambda: f"{enc.shape[1]:,}"):
        enc = _mapper_edges(config.encoder, data_xyz, hid_xyz)
        enc, enc_added = cover_sources(enc, data_xyz, hid_xyz)
    with phase("graph: decoder edges", lambda: f"{dec.shape[1]:,}"):
        dec = _mapper_edges(config.decoder, hid_xyz, data_xyz)
        dec, dec_added = cover_destinations(dec, hid_xyz, data_xyz)
    with phase("graph: processor edges", lambda: f"{proc.shape[1]:,}"):
        if isinstance(config.processor, MultimeshEdges):
            proc = sort_unique_edges(rank_of[multimesh_edges(mesh)], hid_xyz.shape[0])
        else:
            proc = knn_edges(hid_xyz, hid_xyz, config.processor.num_neighbours, exclude_self=True)

    graph = HeteroGraph()
    with phase("graph: node areas and edge attributes"):
        for name, lat, lon in (("data", data_lat, data_lon), ("hidden", hid_lat, hid_lon)):
            graph[name].x = torch.from_numpy(np.stack([lat, lon], axis=1)).float()
            graph[name].area_weight = torch.from_numpy(area_weights(lat, lon, config.area_clip_factor)).float()
        latlon = {"data": (data_lat, data_lon), "hidden": (hid_lat, hid_lon)}
        for edge_type, edges in ((ENCODER, enc), (PROCESSOR, proc), (DECODER, dec)):
            src, _, dst = edge_type
            graph[edge_type].edge_index = torch.from_numpy(np.ascontiguousarray(edges, dtype=np.int64))
            graph[edge_type].edge_attr = torch.from_numpy(
                edge_attributes(edges, latlon[src], latlon[dst])
            ).float()
    if config.truncation is not None:
        with phase(f"graph: truncation grid ({config.truncation.grid})", lambda: f"{graph['truncation'].num_nodes:,}"):
            add_truncation(graph, config.truncation, data_xyz)
    graph.config_hash = digest
    graph.coverage_edges = {"encoder": enc_added, "decoder": dec_added}
    note(f"graph: built in {format_duration(time.perf_counter() - start)}")
    return graph


def add_truncation(graph: HeteroGraph, spec: TruncationGrid, data_xyz: np.ndarray) -> None:
    """Add the ``truncation`` nodes of ``spec.grid`` and the two projections ``TRUNCATION_DOWN`` (every truncation
    node from its ``num_neighbours`` nearest data nodes) and ``TRUNCATION_UP`` (every data node from its nearest
    truncation nodes) with Gaussian distance weights summing to 1 per destination (:class:`TruncationGrid`)."""
    lat_deg, lon_deg = grid_from_name(spec.grid)
    lat, lon = np.radians(lat_deg), np.radians(lon_deg)
    trunc_xyz = latlon_to_xyz(lat, lon)
    for name, count in (("data", data_xyz.shape[0]), ("truncation", trunc_xyz.shape[0])):
        if spec.num_neighbours > count:
            raise ValueError(f"graph.truncation.num_neighbours={spec.num_neighbours} exceeds the {count} {name} "
                             f"nodes (truncation grid {spec.grid!r}); lower it")
    graph["truncation"].x = torch.from_numpy(np.stack([lat, lon], axis=1)).float()
    for edge_type, src_xyz, dst_xyz in ((TRUNCATION_DOWN, data_xyz, trunc_xyz), (TRUNCATION_UP, trunc_xyz, data_xyz)):
        edges = knn_edges(src_xyz, dst_xyz, spec.num_neighbours)
        graph[edge_type].edge_index = torch.from_numpy(np.ascontiguousarray(edges, dtype=np.int64))
        graph[edge_type].edge_weight = torch.from_numpy(
            gaussian_weights(edges, src_xyz, dst_xyz, spec.sigma, dst_xyz.shape[0])).float()


def graph_node_counts(config: GraphConfig, data_latlon: tuple | None = None) -> dict[str, int]:
    """``{"data": n, "hidden": m}``: the node counts :func:`build_graph` gives ``config`` (and
    ``data_latlon``), from the grids alone (no edges searched: a fraction of a build's time)."""
    lat, _lon = _data_coordinates(config, data_latlon)
    level = config.icosahedral_level
    hidden = icosahedral_num_nodes(level) if level is not None else grid_from_name(config.hidden)[0].size
    return {"data": int(lat.size), "hidden": int(hidden)}


def _hidden_nodes(config: GraphConfig, level: int | None) -> tuple:
    """``(xyz, lat, lon, mesh, rank_of)`` of the hidden nodes (``mesh``, ``rank_of``: None unless icosahedral)."""
    mesh = rank_of = None
    if level is not None:
        mesh = icosahedral_mesh(level)
        # hidden nodes north to south, then by longitude: contiguous rank slices are then compact
        # latitude bands, so sharded halos stay small (refinement order makes them as large as
        # an all-gather) and a sliding window over the nodes is a neighbourhood
        mesh_lat, mesh_lon = mesh.latlon()
        order = np.lexsort((np.round(mesh_lon, 12), -np.round(mesh_lat, 12)))
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        hid_xyz = mesh.vertices[order]
        hid_lat, hid_lon = mesh_lat[order], mesh_lon[order]
    else:
        hlat, hlon = grid_from_name(config.hidden)
        hid_lat, hid_lon = np.radians(hlat), np.radians(hlon)
        hid_xyz = latlon_to_xyz(hid_lat, hid_lon)
    return hid_xyz, hid_lat, hid_lon, mesh, rank_of


def save_graph(graph: HeteroGraph, path: str | os.PathLike, config: GraphConfig | None = None) -> None:
    """Write ``graph`` as a dict of tensors and strings (atomically: temp file, then rename); a full disk is an
    ``OSError`` naming ``path``."""
    path = Path(path)
    payload = {
        "format": GRAPH_FORMAT_VERSION,
        "config_hash": str(graph.config_hash),
        "config": config.model_dump_json() if config is not None else "",
        "coverage_edges": json.dumps(dict(graph.coverage_edges)),
        "nodes": {t: {k: graph[t][k] for k in graph[t].keys()} for t in graph.node_types},
        "edges": {"__".join(t): {k: graph[t][k] for k in graph[t].keys()} for t in graph.edge_types},
    }
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        if is_disk_full(exc):  # torch.save's RuntimeError names no file: the graph file it was writing
            raise disk_full_error(exc, path) from exc
        raise
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def load_graph(path: str | os.PathLike) -> HeteroGraph:
    """Read a graph written by ``save_graph``; a file that is not one is a ``ValueError`` naming it."""
    try:
        payload = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # not a torch file, truncated, foreign objects
        raise ValueError(f"{path} is not a stormshard graph file (it cannot be read: {str(exc).splitlines()[0][:120]}); "
                         "pass the graph file of the run, or delete it to rebuild") from None
    if not isinstance(payload, dict) or payload.get("format") != GRAPH_FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a stormshard graph file of format {GRAPH_FORMAT_VERSION}; delete it to rebuild"
        )
    graph = HeteroGraph()
    for node_type, store in payload["nodes"].items():
        for key, value in store.items():
            graph[node_type][key] = value
    for name, store in payload["edges"].items():
        for key, value in store.items():
            graph[tuple(name.split("__"))][key] = value
    graph.config_hash = payload["config_hash"]
    graph.coverage_edges = json.loads(payload["coverage_edges"])
    return graph


def is_graph_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file :func:`save_graph` wrote (any format version, any config: a graph cache
    that may be rebuilt over); memory-mapped, so its tensors are not read."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a torch file, truncated, foreign objects: not a graph
        return False
    return isinstance(payload, dict) and "format" in payload and "config_hash" in payload


# a graph over at least this many data nodes is built in a child process by load_or_build_graph(isolate=True)
CHILD_BUILD_MIN_NODES = 4096


def load_or_build_graph(
    config: GraphConfig, path: str | os.PathLike, data_latlon: tuple | None = None, progress: bool = False,
    *, isolate: bool = False,
) -> HeteroGraph:
    """Load the graph at ``path`` if it was built from this config and these coordinates, else build and save.
    ``progress``: say which, and a line per phase of a build, on standard error (:mod:`stormshard.progress`).

    ``isolate``: build a graph of at least :data:`CHILD_BUILD_MIN_NODES` data nodes in a child process
    (a fresh interpreter, not multiprocessing: the caller's script is not imported again) that saves it
    to ``path``, then load it: the builder's libraries (scipy: ~28 MiB) and
    its transient arrays never stay resident in this process (training ranks pass it; the child's
    start, ~2 s, is not worth it for smaller graphs). The child's error is raised here.
    """
    lat, lon = _data_coordinates(config, data_latlon)  # once: a named grid is generated here
    digest = _hash_of(config, lat, lon)
    path = Path(path)
    with reporting(progress):
        if path.exists():
            try:
                graph = load_graph(path)
            except Exception:  # unreadable or foreign file: rebuild below, overwriting it
                graph = None
            if graph is not None and graph.config_hash == digest:
                note(f"graph: loaded {path} (built from this config)")
                return graph
        if isolate and len(lat) >= CHILD_BUILD_MIN_NODES:
            _build_in_child(config, path, data_latlon, progress)
            graph = load_graph(path)
        else:
            graph = build_graph(config, data_latlon)  # its phases print inside this reporting
            save_graph(graph, path, config)
        note(f"graph: saved {path}")
    return graph


def _build_and_save(config: GraphConfig, path: str, data_latlon: tuple | None, progress: bool) -> None:
    """The child's work: build the graph (phases on standard error with ``progress``) and save it."""
    with reporting(progress):
        save_graph(build_graph(config, data_latlon), Path(path), config)


# the child: a fresh interpreter with the parent's sys.path, its job pickled on standard input
_CHILD_CODE = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
               "from stormshard.graphs.builder import _child_main; _child_main()")


def _build_in_child(config: GraphConfig, path: Path, data_latlon: tuple | None, progress: bool) -> None:
    """Run :func:`_build_and_save` in a fresh Python process and raise its exception here.

    Not multiprocessing's ``spawn``: that imports the caller's main script again in the child, which
    runs the whole script there when it has no ``if __name__ == "__main__"`` guard."""
    import json
    import pickle
    import subprocess
    import sys

    job = pickle.dumps((config, str(path), data_latlon, progress))
    run = subprocess.run([sys.executable, "-c", _CHILD_CODE, json.dumps(sys.path)], input=job,
                         stdout=subprocess.PIPE, check=False)
    try:
        error = pickle.loads(run.stdout) if run.stdout else None
    except Exception:  # noqa: BLE001 - anything unreadable: report the exit status below
        error = None
    if isinstance(error, BaseException):
        raise error
    if run.returncode != 0:
        raise RuntimeError(f"building the graph for {path} in a child process failed (exit status "
                           f"{run.returncode}; its messages are above)")


def _child_main() -> None:
    """The child process: read the job from standard input, build and save, and write ``None`` or the
    exception (pickled) to standard output (the build's own output goes to standard error)."""
    import pickle
    import sys

    job = pickle.loads(sys.stdin.buffer.read())
    result_out, sys.stdout = sys.stdout.buffer, sys.stderr
    try:
        _build_and_save(*job)
        result: BaseException | None = None
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        result = exc
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
        data = pickle.dumps(RuntimeError(f"{type(result).__name__}: {result}"))
    result_out.write(data)
    result_out.flush()
    sys.exit(0 if result is None else 1)
