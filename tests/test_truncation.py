"""The truncated residual (anemoi's TruncatedConnection): the graph's truncation grid and projections, the
sharded layer against one process (outputs and input gradients, float64, 2-4 ranks, uneven rows), the model's
residual against the dense matrices, and the errors before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stormshard.graphs.builder import (
    TRUNCATION_DOWN,
    TRUNCATION_UP,
    GraphConfig,
    KNNEdges,
    TruncationGrid,
    build_graph,
    graph_hash,
    load_graph,
    save_graph,
)
from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.sphere import latlon_to_xyz
from stormshard.kernels.sparse_projection import csr_pair, sparse_project
from stormshard.layers.truncation import TruncatedResidual
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex
from stormshard.parallel.shard import SequenceShard
from stormshard.training.config import ExperimentConfig
from tests.distributed import run_distributed

VARIABLES = VariableIndex.build(["u", "v", "t", "insolation", "precip"], forcing=["insolation"], diagnostic=["precip"])
TRUNCATION = TruncationGrid(grid="o2", num_neighbours=3, sigma=0.3)


def _graph(data_latlon: tuple | None = None) -> object:
    config = GraphConfig(data_grid=None if data_latlon is not None else "o4", hidden="o2",
                         processor=KNNEdges(num_neighbours=4), truncation=TRUNCATION)
    return build_graph(config, data_latlon)


def _uneven_latlon(n: int = 1001) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return np.degrees(np.arcsin(rng.uniform(-1, 1, n))), rng.uniform(0, 360, n)


def _dense(graph, edge_type, shape) -> torch.Tensor:  # noqa: ANN001
    """The projection as a dense float64 ``(destinations, sources)`` matrix."""
    store = graph[edge_type]
    matrix = torch.zeros(shape, dtype=torch.float64)
    matrix.index_put_((store.edge_index[1], store.edge_index[0]), store.edge_weight.double(), accumulate=True)
    return matrix


def test_truncation_grid_and_weights():
    graph = _graph()
    n_data, n_trunc = graph["data"].num_nodes, graph["truncation"].num_nodes
    lat, lon = grid_from_name("o2")
    assert n_trunc == lat.size
    torch.testing.assert_close(graph["truncation"].x.double(),
                               torch.from_numpy(np.radians(np.stack([lat, lon], 1))), atol=1e-6, rtol=0)
    k = TRUNCATION.num_neighbours
    for edge_type, n_src, n_dst in ((TRUNCATION_DOWN, n_data, n_trunc), (TRUNCATION_UP, n_trunc, n_data)):
        store = graph[edge_type]
        src, dst = store.edge_index.numpy()
        assert np.array_equal(np.bincount(dst, minlength=n_dst), np.full(n_dst, k)), edge_type
        # every destination receives from its k nearest sources, weighted exp(-d^2 / 2 sigma^2), l1-normalised
        nodes = {"data": graph["data"].x.double().numpy(), "truncation": graph["truncation"].x.double().numpy()}
        s_xyz = latlon_to_xyz(*nodes[edge_type[0]].T)
        d_xyz = latlon_to_xyz(*nodes[edge_type[2]].T)
        dist_all = np.arccos(np.clip(d_xyz @ s_xyz.T, -1, 1))  # (n_dst, n_src) great-circle distances
        chosen = np.sort(dist_all[dst, src].reshape(n_dst, k), axis=1)  # edges sorted by destination
        np.testing.assert_allclose(chosen, np.sort(dist_all, axis=1)[:, :k], rtol=0, atol=1e-6)  # ties either way
        raw = np.exp(-dist_all[dst, src] ** 2 / (2 * TRUNCATION.sigma**2))
        expected = raw / np.bincount(dst, weights=raw, minlength=n_dst)[dst]
        np.testing.assert_allclose(store.edge_weight.numpy(), expected, rtol=1e-5, atol=1e-7)
        dense = _dense(graph, edge_type, (n_dst, n_src))
        torch.testing.assert_close(dense.sum(1), torch.ones(n_dst, dtype=torch.float64), atol=1e-6, rtol=0)


def test_graph_without_truncation_hashes_as_before_and_with_it_differs():
    # hashes of these configs before the truncation option existed: cached graphs and checkpoints stay valid
    assert graph_hash(GraphConfig(data_grid="o2", hidden="ico0")) == \
        "951afc0671e7d0b2898e6c67f61d69b19677778867706c59034462ddac7dbb9a"
    plain = GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4))
    assert graph_hash(plain) == "f54dd3778d2b34594c0c2b9b3e59b66d98898e530829d7f782024cf65750b46b"
    assert graph_hash(plain.model_copy(update={"truncation": TRUNCATION})) != graph_hash(plain)


def test_truncation_survives_save_and_load(tmp_path):
    graph = _graph()
    save_graph(graph, tmp_path / "graph.pt")
    loaded = load_graph(tmp_path / "graph.pt")
    for edge_type in (TRUNCATION_DOWN, TRUNCATION_UP):
        assert torch.equal(loaded[edge_type].edge_index, graph[edge_type].edge_index)
        assert torch.equal(loaded[edge_type].edge_weight, graph[edge_type].edge_weight)
    assert torch.equal(loaded["truncation"].x, graph["truncation"].x)


def _layer(graph, group) -> TruncatedResidual:  # noqa: ANN001
    down, up = graph[TRUNCATION_DOWN], graph[TRUNCATION_UP]
    shard = SequenceShard.balanced(graph["data"].num_nodes, group)
    return TruncatedResidual(down.edge_index, down.edge_weight, up.edge_index, up.edge_weight,
                             graph["truncation"].num_nodes, shard)


def _inputs(n_data: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return (torch.randn(2, n_data, 4, generator=g, dtype=torch.float64),
            torch.randn(2, n_data, 4, generator=g, dtype=torch.float64))


def test_layer_equals_the_dense_projections():
    graph = _graph()
    n_data, n_trunc = graph["data"].num_nodes, graph["truncation"].num_nodes
    x, grad = _inputs(n_data)
    x.requires_grad_(True)
    out = _layer(graph, None)(x)
    out.backward(grad)
    a_down = _dense(graph, TRUNCATION_DOWN, (n_trunc, n_data))
    a_up = _dense(graph, TRUNCATION_UP, (n_data, n_trunc))
    full = a_up @ a_down
    torch.testing.assert_close(out, torch.einsum("ij,bjv->biv", full, x.detach()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, torch.einsum("ji,bjv->biv", full, grad), rtol=1e-12, atol=1e-12)
    # fp32 in, fp32 out, autocast (bf16) leaves it alone: the carried state is never rounded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out32 = _layer(graph, None)(x.detach().float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out.detach(), rtol=1e-5, atol=1e-5)


def test_a_projection_without_entries_gives_zeros():
    # a rank whose data rows feed no truncation node multiplies an empty matrix: zeros, and zero gradients
    pair = csr_pair(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0), (5, 3))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = sparse_project(x, pair, (5, 3))
    out.sum().backward()
    assert torch.equal(out, torch.zeros(5, 4, dtype=torch.float64)) and torch.equal(x.grad, torch.zeros_like(x))


def _check_sharded_layer(rank: int, world: int, uneven: bool) -> bool:
    graph = _graph(_uneven_latlon() if uneven else None)
    layer = _layer(graph, dist.group.WORLD)
    rows = layer.shard.local_slice
    x, grad = _inputs(graph["data"].num_nodes)
    ref_x = x.clone().requires_grad_(True)
    ref = _layer(graph, None)(ref_x)
    ref.backward(grad)
    local = x[:, rows].clone().requires_grad_(True)
    out = layer(local)
    out.backward(grad[:, rows])
    torch.testing.assert_close(out, ref[:, rows].detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, ref_x.grad[:, rows], rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("world, uneven", [(2, True), (3, True), (4, False)])
def test_sharded_layer_equals_single_process(world, uneven):
    # uneven: 1,001 scattered data points (501 + 500 rows at 2 ranks, 334 + 334 + 333 at 3): every rank's rows feed
    # truncation nodes that other ranks read
    assert all(run_distributed(_check_sharded_layer, world, uneven))


def _model_config(residual: str) -> ModelConfig:
    return ModelConfig(name="transformer", num_channels=24, multistep_input=2, trainable_size=3, residual=residual,
                       processor=dict(num_layers=1, num_heads=4, window_size=5, mlp_ratio=2),
                       encoder=dict(num_heads=2), decoder=dict(num_heads=2))


def test_model_residual_is_the_truncated_last_step():
    graph = _graph()
    n_data, n_trunc = graph["data"].num_nodes, graph["truncation"].num_nodes
    torch.manual_seed(3)
    plain = build_model(_model_config("last_step"), graph, VARIABLES, None).double()
    torch.manual_seed(3)
    truncated = build_model(_model_config("truncated"), graph, VARIABLES, None).double()
    x = torch.randn(2, 2, n_data, len(VARIABLES.input_names), dtype=torch.float64)
    difference = truncated(x) - plain(x)
    full = _dense(graph, TRUNCATION_UP, (n_data, n_trunc)) @ _dense(graph, TRUNCATION_DOWN, (n_trunc, n_data))
    last = x[:, -1][..., list(VARIABLES.prognostic_in_input)]
    expected = torch.zeros_like(difference)
    expected[..., list(VARIABLES.prognostic_in_output)] = torch.einsum("ij,bjv->biv", full, last) - last
    torch.testing.assert_close(difference, expected, rtol=1e-10, atol=1e-10)
    assert expected.abs().max() > 0.1  # the truncation changes the residual: the test can fail


def test_errors_before_any_work():
    with pytest.raises(ValueError, match=r"model.residual='truncated' needs a truncation grid.*graph.truncation"):
        ExperimentConfig(model=_model_config("truncated").model_dump())
    ExperimentConfig(model=_model_config("truncated").model_dump(), graph=dict(hidden="ico2", truncation={"grid": "o4"}))
    with pytest.raises(ValueError, match=r"truncation.grid='x12' is not a grid name"):
        TruncationGrid(grid="x12")
    with pytest.raises(ValueError, match=r"num_neighbours"):
        TruncationGrid(grid="o2", num_neighbours=0)
    plain_graph = build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4)))
    with pytest.raises(ValueError, match=r"model.residual='truncated' but the graph has no truncation grid"):
        build_model(_model_config("truncated"), plain_graph, VARIABLES, None)
    with pytest.raises(ValueError, match=r"graph.truncation.num_neighbours=100 exceeds the 88 truncation nodes"):
        build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4),
                                truncation=TruncationGrid(grid="o2", num_neighbours=100)))
