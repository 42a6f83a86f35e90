"""Grids, icosahedral meshes, edge builders, attributes and the cached HeteroData graph."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch
from scipy.spatial import cKDTree

from stormshard.graphs import builder as builder_module
from stormshard.graphs.attributes import area_weights, edge_attributes
from stormshard.graphs.builder import (
    DECODER,
    ENCODER,
    PROCESSOR,
    GraphConfig,
    build_graph,
    graph_hash,
    load_graph,
    load_or_build_graph,
    save_graph,
)
from stormshard.graphs.edges import (
    cover_destinations,
    cover_sources,
    cutoff_edges,
    knn_edges,
    max_nearest_neighbour_distance,
)
from stormshard.graphs.grids import (
    gaussian_latitudes,
    grid_from_name,
    latlon_patch,
    octahedral_grid,
    octahedral_ring_sizes,
    regular_latlon_grid,
)
from stormshard.graphs.icosahedral import icosahedral_mesh, multimesh_edges, triangle_edges
from stormshard.graphs.sphere import haversine, latlon_to_xyz, xyz_to_latlon


def _random_sphere(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _brute_arc(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(dst, src) great-circle distances."""
    return np.arccos(np.clip(dst @ src.T, -1.0, 1.0))


def _edge_set(edge_index) -> set[tuple[int, int]]:
    e = np.asarray(edge_index)
    return set(zip(e[0].tolist(), e[1].tolist(), strict=True))


# ----------------------------------------------------------------------------------------- grids


def test_octahedral_grid_counts_and_rings():
    assert octahedral_grid(48)[0].size == 10_944
    assert octahedral_grid(96)[0].size == 40_320
    for n in (1, 5, 32, 96):
        sizes = octahedral_ring_sizes(n)
        assert sizes.size == 2 * n
        np.testing.assert_array_equal(sizes[:n], 4 * np.arange(1, n + 1) + 16)
        np.testing.assert_array_equal(sizes, sizes[::-1])
        lat, lon = octahedral_grid(n)
        assert lat.size == sizes.sum() == 4 * n * (n + 9)  # sum of 2 * (4i + 16)
        # ring sizes read back from the coordinates, north to south
        _, counts = np.unique(-lat, return_counts=True)
        np.testing.assert_array_equal(counts, sizes)
        assert lon.min() == 0.0 and lon.max() < 360.0
    lats = gaussian_latitudes(48)
    np.testing.assert_allclose(lats, -lats[::-1], atol=1e-12)
    assert np.all(np.diff(lats) < 0)
    # Gauss-Legendre: the Gaussian weights are the cell areas; their sines are the Legendre roots
    roots = np.polynomial.legendre.leggauss(96)[0]
    np.testing.assert_allclose(np.sort(np.sin(np.radians(lats))), np.sort(roots), atol=1e-12)
    assert grid_from_name("O48")[0].size == 10_944
    with pytest.raises(ValueError, match="at least 1"):
        octahedral_grid(0)


def test_regular_and_patch_grids():
    lat, lon = regular_latlon_grid(1.0)
    assert lat.size == 181 * 360
    lat, lon = regular_latlon_grid(2.5, include_poles=False)
    assert lat.size == 72 * 144 and np.abs(lat).max() == 88.75
    lat, lon = latlon_patch((30.0, 60.0), (350.0, 20.0), 0.5)  # wraps across Greenwich
    assert lat.size == 61 * 61
    assert lat.max() == 60.0 and lat.min() == 30.0
    assert set(np.unique(lon)) == set(np.mod(350.0 + 0.5 * np.arange(61), 360.0))
    with pytest.raises(ValueError, match="lat_range"):
        latlon_patch((60.0, 30.0), (0.0, 10.0), 1.0)
    with pytest.raises(ValueError, match="unknown grid"):
        grid_from_name("n320")


# ----------------------------------------------------------------------------------- icosahedral


def test_icosahedral_mesh_levels():
    mesh = icosahedral_mesh(5)
    assert mesh.level == 5
    np.testing.assert_allclose(np.linalg.norm(mesh.vertices, axis=1), 1.0, atol=1e-14)
    for r in range(6):
        n_r = 10 * 4**r + 2
        faces = mesh.faces[r]
        assert faces.shape == (20 * 4**r, 3) and faces.max() == n_r - 1  # uses exactly the first n_r nodes
        assert icosahedral_mesh(r).num_nodes == n_r
        np.testing.assert_array_equal(icosahedral_mesh(r).vertices, mesh.vertices[:n_r])
        edges = triangle_edges(faces)
        assert edges.shape[1] == 2 * 30 * 4**r  # Euler: V - E + F = 2 with E = 30 * 4**r undirected
        assert n_r - edges.shape[1] // 2 + faces.shape[0] == 2
        # every node of the level has degree 5 (the 12 icosahedron vertices) or 6
        degree = np.bincount(edges[1], minlength=n_r)
        assert (degree == 5).sum() == 12 and (degree == 6).sum() == n_r - 12
        # faces are counter-clockwise seen from outside
        v = mesh.vertices
        normal = np.cross(v[faces[:, 1]] - v[faces[:, 0]], v[faces[:, 2]] - v[faces[:, 0]])
        assert (np.einsum("ij,ij->i", normal, v[faces[:, 0]]) > 0).all()
    # nearest-neighbour spacing halves per level (at most about 2.4 degrees at level 5)
    spacing = [max_nearest_neighbour_distance(mesh.vertices[: 10 * 4**r + 2]) for r in (3, 4, 5)]
    assert spacing[2] < np.radians(2.4)
    np.testing.assert_allclose(np.array(spacing[1:]) / spacing[:2], 0.5, rtol=0.05)
    d = np.sort(_brute_arc(mesh.vertices[:642], mesh.vertices[:642]), axis=1)[:, 1]
    assert d.min() > 0.05
    with pytest.raises(ValueError, match="icosahedral level"):
        icosahedral_mesh(-1)


def test_multimesh_edges():
    mesh = icosahedral_mesh(4)
    e = multimesh_edges(mesh)
    n = mesh.num_nodes
    assert e.dtype == np.int64 and e.shape[0] == 2
    assert (e[0] != e[1]).all(), "self loops"
    pairs = _edge_set(e)
    assert len(pairs) == e.shape[1], "duplicate edges"
    assert {(d, s) for s, d in pairs} == pairs, "not symmetric"
    assert e.min() == 0 and e.max() == n - 1
    key = e[1] * n + e[0]
    assert (np.diff(key) > 0).all(), "not sorted by destination then source"
    for r in range(5):
        assert _edge_set(triangle_edges(mesh.faces[r])) <= pairs, f"level {r} missing"
    # the levels' edges are disjoint (different lengths), so the union has every level's count
    assert e.shape[1] == sum(60 * 4**r for r in range(5))
    only_top = multimesh_edges(mesh, range(4, 5))
    assert _edge_set(only_top) == _edge_set(triangle_edges(mesh.faces[4]))
    with pytest.raises(ValueError, match="levels"):
        multimesh_edges(mesh, range(3, 7))


# ---------------------------------------------------------------------------------- edge builders


def test_knn_edges_match_brute_force():
    src, dst = _random_sphere(300, 0), _random_sphere(120, 1)
    for k in (1, 4):
        e = knn_edges(src, dst, k)
        assert e.shape == (2, 120 * k)
        np.testing.assert_array_equal(np.bincount(e[1], minlength=120), k)
        nearest = np.argsort(_brute_arc(src, dst), axis=1)[:, :k]
        expected = {(int(s), d) for d in range(120) for s in nearest[d]}
        assert _edge_set(e) == expected
    e = knn_edges(src, src, 6, exclude_self=True)
    assert (e[0] != e[1]).all()
    nearest = np.argsort(_brute_arc(src, src), axis=1)[:, 1:7]
    assert _edge_set(e) == {(int(s), d) for d in range(300) for s in nearest[d]}
    with pytest.raises(ValueError, match="num_neighbours"):
        knn_edges(src, dst, 0)
    with pytest.raises(ValueError, match="num_neighbours"):
        knn_edges(src[:3], dst, 4)
    with pytest.raises(ValueError, match=r"\(nodes, 3\)"):
        knn_edges(src[:, :2], dst, 1)


def test_cutoff_edges_match_brute_force():
    src, dst = _random_sphere(400, 2), _random_sphere(150, 3)
    dist_dst = _brute_arc(dst, dst)
    np.fill_diagonal(dist_dst, np.inf)
    expected_radius = 0.6 * dist_dst.min(axis=1).max()
    assert max_nearest_neighbour_distance(dst) == pytest.approx(expected_radius / 0.6, rel=1e-9)
    e, radius = cutoff_edges(src, dst, 0.6)
    assert radius == pytest.approx(expected_radius, rel=1e-9)
    within = np.argwhere(_brute_arc(src, dst) <= radius)  # (dst, src)
    assert _edge_set(e) == {(int(s), int(d)) for d, s in within}
    assert (np.diff(e[1] * 400 + e[0]) > 0).all()
    with pytest.raises(ValueError, match="cutoff factor"):
        cutoff_edges(src, dst, 0.0)


def test_cover_adds_nearest_edges():
    src, dst = _random_sphere(200, 4), _random_sphere(50, 5)
    empty = np.zeros((2, 0), dtype=np.int64)
    e, added = cover_sources(empty, src, dst)
    assert added == 200
    np.testing.assert_array_equal(e[1], np.sort(e[1]))
    nearest_dst = np.argmin(_brute_arc(dst, src), axis=1)  # per source
    assert _edge_set(e) == {(s, int(nearest_dst[s])) for s in range(200)}
    e, added = cover_destinations(empty, src, dst)
    assert added == 50
    nearest_src = np.argmin(_brute_arc(src, dst), axis=1)
    assert _edge_set(e) == {(int(nearest_src[d]), d) for d in range(50)}
    # already covered: unchanged
    full = knn_edges(src, dst, 5)
    e, added = cover_destinations(full, src, dst)
    assert added == 0 and e is full


# ------------------------------------------------------------------------------------- attributes


def test_edge_attributes():
    src_lat, src_lon = xyz_to_latlon(_random_sphere(200, 6))
    dst_lat, dst_lon = xyz_to_latlon(_random_sphere(80, 7))
    e = knn_edges(latlon_to_xyz(src_lat, src_lon), latlon_to_xyz(dst_lat, dst_lon), 5)
    attr = edge_attributes(e, (src_lat, src_lon), (dst_lat, dst_lon))
    assert attr.shape == (e.shape[1], 3)
    length = haversine(src_lat[e[0]], src_lon[e[0]], dst_lat[e[1]], dst_lon[e[1]])
    np.testing.assert_allclose(attr[:, 0] * length.max(), length, rtol=1e-9, atol=1e-12)
    assert attr[:, 0].max() == pytest.approx(1.0)
    np.testing.assert_allclose(np.linalg.norm(attr[:, 1:], axis=1), 1.0, rtol=1e-12)
    # directions: a source due north / east / south-west of the destination
    d_lat, d_lon = np.array([0.3]), np.array([1.0])
    s_lat = np.array([0.31, 0.3, 0.29])
    s_lon = np.array([1.0, 1.01, 0.99])
    e = np.array([[0, 1, 2], [0, 0, 0]])
    attr = edge_attributes(e, (s_lat, s_lon), (d_lat, d_lon))
    np.testing.assert_allclose(attr[0, 1:], [0.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(attr[1, 1:], [1.0, 0.0], atol=2e-3)  # great circle bends slightly poleward
    assert attr[2, 1] < 0 and attr[2, 2] < 0
    # a zero-length edge has length 0 and direction (0, 0)
    attr = edge_attributes(
        np.array([[0, 1], [0, 0]]), (np.array([0.3, 0.4]), np.array([1.0, 1.0])), (d_lat, d_lon)
    )
    np.testing.assert_allclose(attr[0], [0.0, 0.0, 0.0], atol=1e-12)


def test_area_weights():
    # regular grid without poles: Voronoi cells are close to the lat-lon boxes (their sides between rows
    # are great-circle arcs, not parallels, hence the tolerance)
    for res, rtol in ((10.0, 5e-3), (2.0, 2e-4)):
        lat, lon = regular_latlon_grid(res, include_poles=False)
        w = area_weights(np.radians(lat), np.radians(lon), clip_factor=None)
        box = np.sin(np.radians(lat + res / 2)) - np.sin(np.radians(lat - res / 2))
        np.testing.assert_allclose(w, box * lat.size / box.sum(), rtol=rtol)
    for lat, lon in (octahedral_grid(24), icosahedral_mesh(3).latlon()):
        if lat.max() > np.pi:  # grids are in degrees, the mesh in radians
            lat, lon = np.radians(lat), np.radians(lon)
        w = area_weights(lat, lon)
        assert (w > 0).all() and w.sum() == pytest.approx(lat.size)
    # repeated pole points share one cell: the 36 pole points of a 10-degree grid split the pole's cell
    lat, lon = regular_latlon_grid(10.0)
    w = area_weights(np.radians(lat), np.radians(lon), clip_factor=None) * 4 * np.pi / lat.size
    keep = (np.abs(lat) < 90.0) | (lon == 0.0)  # one point per pole
    single = (
        area_weights(np.radians(lat[keep]), np.radians(lon[keep]), clip_factor=None) * 4 * np.pi / keep.sum()
    )
    north = lat == 90.0
    np.testing.assert_allclose(w[north], np.full(36, single[lat[keep] == 90.0][0] / 36), rtol=1e-9)
    np.testing.assert_allclose(w[~north & (lat > -90)], single[np.abs(lat[keep]) < 90], rtol=1e-9)
    cap = 2 * np.pi * (1 - np.sin(np.radians(85.0)))  # the pole's cell is a 36-gon inside lat 85
    assert 0.99 * cap < w[north].sum() < 1.01 * cap
    # limited area: boundary cells are capped at clip_factor * median
    lat, lon = latlon_patch((40.0, 50.0), (0.0, 10.0), 1.0)
    raw = area_weights(np.radians(lat), np.radians(lon), clip_factor=None)
    clipped = area_weights(np.radians(lat), np.radians(lon), clip_factor=2.0)
    assert raw.max() / np.median(raw) > 50
    assert clipped.max() / np.median(clipped) == pytest.approx(2.0)
    assert (clipped > 0).all() and clipped.sum() == pytest.approx(lat.size)
    with pytest.raises(ValueError, match="clip_factor"):
        area_weights(np.radians(lat), np.radians(lon), clip_factor=0.5)


# ------------------------------------------------------------------------------------ graph builder


def _check_graph(graph, num_data: int) -> None:
    graph.validate(raise_on_error=True)
    assert graph["data"].x.shape == (num_data, 2) and graph["data"].x.dtype == torch.float32
    for edge_type in (ENCODER, PROCESSOR, DECODER):
        src, _, dst = edge_type
        ei = graph[edge_type].edge_index
        assert ei.dtype == torch.int64 and ei.shape[0] == 2
        assert graph[edge_type].edge_attr.shape == (ei.shape[1], 3)
        assert ei[0].max() < graph[src].num_nodes and ei[1].max() < graph[dst].num_nodes
        key = ei[1] * graph[src].num_nodes + ei[0]
        assert (key.diff() > 0).all(), f"{edge_type} not sorted by destination, or duplicates"
        # edge_attr[:, 0] is length / max length, checked against haversine on the stored coordinates
        s, d = graph[src].x.double()[ei[0]].numpy(), graph[dst].x.double()[ei[1]].numpy()
        length = haversine(s[:, 0], s[:, 1], d[:, 0], d[:, 1])
        np.testing.assert_allclose(
            graph[edge_type].edge_attr[:, 0].double().numpy() * length.max(), length, atol=1e-5
        )
    # coverage: every data point sends to the hidden mesh and receives from it
    assert torch.bincount(graph[ENCODER].edge_index[0], minlength=num_data).min() > 0
    assert torch.bincount(graph[DECODER].edge_index[1], minlength=num_data).min() > 0
    for node_type in ("data", "hidden"):
        w = graph[node_type].area_weight
        assert (w > 0).all() and float(w.double().sum()) == pytest.approx(
            graph[node_type].num_nodes, rel=1e-5
        )


def test_build_graph_global_and_coverage():
    cfg = GraphConfig(data_grid="o32", hidden="ico3")
    g = build_graph(cfg)
    _check_graph(g, 5_248)
    assert g["hidden"].num_nodes == 642
    mesh = icosahedral_mesh(3)
    # hidden nodes are the mesh's nodes sorted north to south (then by longitude), and the
    # processor edges are the multimesh edges renumbered accordingly
    hid = g["hidden"].x.double().numpy()
    assert np.all(np.diff(hid[:, 0]) <= 1e-6)
    mesh_ll = np.stack(mesh.latlon(), 1)
    dist, mesh_id = cKDTree(latlon_to_xyz(mesh_ll[:, 0], mesh_ll[:, 1])).query(latlon_to_xyz(hid[:, 0], hid[:, 1]))
    assert dist.max() < 1e-6 and np.unique(mesh_id).size == mesh_id.size
    renumbered = mesh_id[g[PROCESSOR].edge_index.numpy()]
    key = lambda e: np.sort(e[0] * 10_000 + e[1])  # noqa: E731
    np.testing.assert_array_equal(key(renumbered), key(multimesh_edges(mesh)))
    lat, lon = octahedral_grid(32)
    np.testing.assert_allclose(g["data"].x.double().numpy(), np.radians(np.stack([lat, lon], 1)), atol=1e-6)
    assert torch.bincount(g[DECODER].edge_index[1]).eq(3).all()

    # settings under which k-NN / cutoff alone leave data points out: the builder adds them
    cases = [
        GraphConfig(data_grid="o32", hidden="ico2", encoder={"kind": "knn", "num_neighbours": 1}),
        GraphConfig(data_grid="o32", hidden="ico3", encoder={"kind": "cutoff", "factor": 0.2}),
        GraphConfig(
            data_grid="2.0",
            hidden="o8",
            processor={"kind": "knn", "num_neighbours": 6},
            decoder={"kind": "cutoff", "factor": 0.3},
        ),
    ]
    for cfg in cases:
        g = build_graph(cfg)
        _check_graph(g, grid_from_name(cfg.data_grid)[0].size)
        assert g.coverage_edges["encoder"] + g.coverage_edges["decoder"] > 0, cfg
    g = build_graph(cases[2])
    ei = g[PROCESSOR].edge_index
    assert (ei[0] != ei[1]).all() and torch.bincount(ei[1]).eq(6).all()


def test_build_graph_limited_area():
    lat, lon = latlon_patch((35.0, 70.0), (340.0, 30.0), 0.5)  # Europe, across Greenwich
    perm = np.random.default_rng(0).permutation(lat.size)  # a dataset's own order is kept
    lat, lon = lat[perm], lon[perm]
    for cfg in (
        GraphConfig(hidden="ico4"),
        GraphConfig(hidden="ico5", encoder={"kind": "knn", "num_neighbours": 2}),
        GraphConfig(hidden="o16", processor={"kind": "knn", "num_neighbours": 8}, decoder={"kind": "cutoff"}),
    ):
        g = build_graph(cfg, data_latlon=(lat, lon))
        _check_graph(g, lat.size)
        np.testing.assert_allclose(g["data"].x[:, 0].double().numpy(), np.radians(lat), atol=1e-6)
        np.testing.assert_allclose(g["data"].x[:, 1].double().numpy(), np.radians(lon), atol=1e-6)


def test_save_load_and_rebuild_on_change(tmp_path, monkeypatch):
    cfg = GraphConfig(data_grid="o16", hidden="ico2")
    path = tmp_path / "graphs" / "g.pt"
    built = []
    real_build = builder_module.build_graph

    def counting_build(config, data_latlon=None):
        built.append(config)
        return real_build(config, data_latlon)

    monkeypatch.setattr(builder_module, "build_graph", counting_build)
    g1 = load_or_build_graph(cfg, path)
    assert path.exists() and len(built) == 1
    g2 = load_or_build_graph(GraphConfig(data_grid="o16", hidden="ico2"), path)  # equal config: loaded
    assert len(built) == 1
    assert g2.config_hash == g1.config_hash == graph_hash(cfg)
    assert g2.coverage_edges == g1.coverage_edges
    assert set(g2.node_types) == {"data", "hidden"} and set(g2.edge_types) == {ENCODER, PROCESSOR, DECODER}
    for store in ("data", "hidden", ENCODER, PROCESSOR, DECODER):
        assert set(g1[store].keys()) == set(g2[store].keys())
        for key in g1[store].keys():
            torch.testing.assert_close(g1[store][key], g2[store][key], rtol=0, atol=0)

    changed = GraphConfig(data_grid="o16", hidden="ico2", decoder={"kind": "knn", "num_neighbours": 4})
    g3 = load_or_build_graph(changed, path)
    assert len(built) == 2 and g3.config_hash != g1.config_hash
    assert g3[DECODER].edge_index.shape[1] == 4 * g3["data"].num_nodes
    assert load_graph(path).config_hash == g3.config_hash  # the file now holds the new graph
    load_or_build_graph(changed, path)
    assert len(built) == 2

    # given coordinates: a moved point changes the hash and rebuilds
    lat, lon = latlon_patch((0.0, 10.0), (0.0, 10.0), 1.0)
    area = GraphConfig(hidden="ico2", processor={"kind": "knn", "num_neighbours": 4})
    load_or_build_graph(area, path, (lat, lon))
    load_or_build_graph(area, path, (lat.copy(), lon.copy()))
    assert len(built) == 3
    lat2 = lat.copy()
    lat2[5] += 0.01
    g4 = load_or_build_graph(area, path, (lat2, lon))
    assert len(built) == 4 and float(g4["data"].x[5, 0]) == pytest.approx(np.radians(lat2[5]))

    # an unreadable file is rebuilt and overwritten
    path.write_bytes(b"not a graph")
    load_or_build_graph(cfg, path)
    assert len(built) == 5 and load_graph(path).config_hash == graph_hash(cfg)
    save_graph(g1, tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt", weights_only=True)["config_hash"] == g1.config_hash


def test_bad_configs_raise_clear_errors():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        GraphConfig(data_grid="o16", hiden="ico2")
    with pytest.raises(ValueError, match="multimesh edges need an icosahedral"):
        GraphConfig(data_grid="o16", hidden="o8")
    with pytest.raises(ValueError, match="hidden='hex3'"):
        GraphConfig(data_grid="o16", hidden="hex3")
    with pytest.raises(ValueError, match="unknown grid"):
        GraphConfig(data_grid="q16")
    with pytest.raises(ValueError, match="num_neighbours"):
        GraphConfig(data_grid="o16", decoder={"kind": "knn", "num_neighbours": 0})
    with pytest.raises(ValueError, match="factor"):
        GraphConfig(data_grid="o16", encoder={"kind": "cutoff", "factor": -1})
    with pytest.raises(ValueError, match="kind"):
        GraphConfig(data_grid="o16", encoder={"kind": "radius"})
    with pytest.raises(ValueError, match="area_clip_factor"):
        GraphConfig(data_grid="o16", area_clip_factor=0.5)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        GraphConfig(data_grid="o16").hidden = "ico3"
    cfg = GraphConfig(hidden="ico1")
    with pytest.raises(ValueError, match="no data coordinates"):
        build_graph(cfg)
    with pytest.raises(ValueError, match="both GraphConfig.data_grid"):
        build_graph(GraphConfig(data_grid="o16", hidden="ico1"), data_latlon=([0.0], [0.0]))
    with pytest.raises(ValueError, match=r"latitudes must lie in \[-90, 90\]"):
        build_graph(cfg, data_latlon=(np.array([0.0, 95.0, 1.0, 2.0]), np.zeros(4)))
    with pytest.raises(ValueError, match="same length"):
        build_graph(cfg, data_latlon=(np.zeros(5), np.zeros(4)))
    with pytest.raises(ValueError, match="finite"):
        build_graph(cfg, data_latlon=(np.array([0.0, np.nan, 1.0, 2.0]), np.zeros(4)))
    with pytest.raises(TypeError, match="pair"):
        build_graph(cfg, data_latlon=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="exceeds"):
        build_graph(
            GraphConfig(data_grid="o16", hidden="ico0", decoder={"kind": "knn", "num_neighbours": 13})
        )


def test_hetero_graph_container():
    """The graph container: stores by node / edge type, attribute and item access, counts, validation;
    and building a graph never imports torch-geometric (~130 MiB per process)."""
    import subprocess
    import sys

    from stormshard.graphs.hetero import HeteroGraph

    g = HeteroGraph()
    g["data"].x = torch.zeros(5, 2)
    g["hidden"]["x"] = torch.zeros(3, 2)
    g[ENCODER].edge_index = torch.tensor([[0, 4, 2], [0, 1, 2]])
    g[ENCODER].edge_attr = torch.zeros(3, 3)
    g.config_hash = "abc"
    assert g.node_types == ["data", "hidden"] and g.edge_types == [ENCODER]
    assert g["data"].num_nodes == 5 and g[ENCODER].num_edges == 3 and g["hidden"].x is g["hidden"]["x"]
    assert g[ENCODER].keys() == ["edge_index", "edge_attr"] and g.config_hash == "abc"
    assert g.validate()
    g[ENCODER].edge_index = torch.tensor([[0, 5], [0, 3]])  # source 5 of 5 data nodes, destination 3 of 3
    with pytest.raises(ValueError, match=r"row 0 leaves \[0, 5\) of 'data'.*row 1 leaves \[0, 3\) of 'hidden'"):
        g.validate()
    assert not g.validate(raise_on_error=False)
    with pytest.raises(AttributeError, match="has no 'area_weight'"):
        _ = g["data"].area_weight
    with pytest.raises(KeyError, match="node type"):
        _ = g[("data", "to")]
    code = ("import sys; from stormshard.graphs.builder import GraphConfig, build_graph; "
            "import stormshard.models.registry, stormshard.training.loop; "
            "build_graph(GraphConfig(data_grid='o8', hidden='ico1')); "
            "print([m for m in ('torch_geometric', 'pandas') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_isolated_build_equals_in_process_and_keeps_scipy_out(tmp_path):
    """load_or_build_graph(isolate=True) builds a large graph in a child process: the same graph (every
    tensor equal), and the parent never imports scipy. The caller is a script without a main guard (the
    child must not run it again) and a failing build's exception is raised in the caller."""
    import subprocess
    import sys

    from stormshard.graphs.builder import KNNEdges

    script = tmp_path / "unguarded.py"
    script.write_text(f"""
import sys
from stormshard.graphs.builder import CHILD_BUILD_MIN_NODES, GraphConfig, KNNEdges, load_or_build_graph
print("script body runs")
open(r"{tmp_path}/file", "w").close()
try:  # a path under a file cannot be saved: the child's OSError comes back here
    load_or_build_graph(GraphConfig(data_grid="o32", hidden="o8", processor=KNNEdges(num_neighbours=4)),
                        r"{tmp_path}/file/g.pt", isolate=True)
except OSError as exc:
    print("child error:", type(exc).__name__)
cfg = GraphConfig(data_grid="o32", hidden="o8", processor=KNNEdges(num_neighbours=4))
graph = load_or_build_graph(cfg, r"{tmp_path}/g.pt", isolate=True)
assert graph["data"].num_nodes >= CHILD_BUILD_MIN_NODES, graph["data"].num_nodes
print("scipy" in sys.modules)
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines.count("script body runs") == 1, run.stdout  # not again in the child
    assert any(line.startswith("child error:") for line in lines) and lines[-1] == "False", run.stdout
    isolated = load_graph(tmp_path / "g.pt")
    built = build_graph(GraphConfig(data_grid="o32", hidden="o8", processor=KNNEdges(num_neighbours=4)))
    stores = dict(isolated.stores())
    for key, store in built.stores():
        for name, value in store.items():
            other = stores[key][name]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), (key, name)
