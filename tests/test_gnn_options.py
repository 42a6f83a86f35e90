"""GNN block options for anemoi-models' GNN architecture, in float64: ``mlp_hidden_layers`` (MLP
depth), ``edge_in_channels`` (an MLP embedding of the raw edge attributes),
``aggregate_updated_edges`` (sum of ``e_ji + m_ji``), ``edge_mlp_ratio`` and the mapper's
``update_sources``; and the fused, edge-blocked edge MLP
(``gnn_kernels.fused_edge_mlp``, CPU float32/64) against the plain autograd path it replaced.

- the defaults build the same modules (names, shapes) as before the options;
- each option combination equals its math written out (edge MLP on concatenated ``[x_j, x_i,
  e_ji]``, scatter sum), with 1 and 3 chunks, batch dims (shared and per-batch edge attributes),
  one or many edge blocks, forward and every gradient;
- the fused path equals the autograd path (``EdgeKernelOptions(fused=False)``), also under no_grad;
- sharded by destination nodes over 2, 3 and 4 ranks equals the single-process block;
- the kernel options are validated; recycled buffers (``EdgeBufferPool``) are never shared, a
  pool shared by many blocks gives the results of separate pools, ``release()`` frees them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch_geometric.utils import scatter

from stormshard.layers.gnn import (
    GNNMLP,
    EdgeBufferPool,
    EdgeKernelOptions,
    GNNMapperBlock,
    GNNProcessorBlock,
    gnn_mlp,
)
from stormshard.parallel.graph import GraphShardPlan
from tests.distributed import run_distributed
from tests.test_graph_sharding import random_graph

F64 = torch.float64
SRC_C, DST_C, EDGE_C, EDGE_IN = 6, 8, 8, 3

# (mlp_hidden_layers, edge_in_channels, aggregate_updated_edges)
OPTIONS = [(2, None, False), (1, EDGE_IN, False), (1, None, True), (3, EDGE_IN, True)]
ANEMOI = (2, EDGE_IN, True)  # anemoi's GNN with mlp_extra_layers=0, first processor layer / mapper
SMALL_BLOCKS = EdgeKernelOptions(block_bytes=1)  # fused blocks of 16 rows
AUTOGRAD = EdgeKernelOptions(fused=False)  # the plain autograd path


def make_block(kind: str, plan: GraphShardPlan, options: tuple, num_chunks: int = 1, seed: int = 0,
               kernel_options: EdgeKernelOptions | None = None, buffer_pool: EdgeBufferPool | None = None):
    hidden_layers, edge_in, aggregate = options
    torch.manual_seed(seed)
    kw = dict(num_chunks=num_chunks, mlp_hidden_layers=hidden_layers, edge_in_channels=edge_in,
              aggregate_updated_edges=aggregate, kernel_options=kernel_options, buffer_pool=buffer_pool)
    if kind == "gnn_processor":
        return GNNProcessorBlock(DST_C, EDGE_C, plan, mlp_ratio=1.5, **kw).double()
    return GNNMapperBlock(SRC_C, DST_C, EDGE_C, plan, mlp_ratio=1.5, **kw).double()


def modules(mlp: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``mlp``'s modules in turn (never the fused path)."""
    return torch.nn.Sequential.forward(mlp, x)


def reference(block, x_src, x_dst, attr, edge_index):  # noqa: ANN001
    """The block's math written out: embedded edges, edge MLP on concatenated [x_j, x_i, e_ji],
    scatter sum of the messages or of the updated edges, node MLP, residuals (the MLPs module by
    module)."""
    src, dst = edge_index
    if block.edge_embedding is not None:
        attr = modules(block.edge_embedding, attr)
    batch = x_dst.shape[1:-1]
    attr_b = attr.reshape(attr.shape[:1] + (1,) * (x_dst.dim() - attr.dim()) + attr.shape[1:])
    attr_b = attr_b.expand(attr.shape[:1] + batch + attr.shape[-1:])
    msg = modules(block.edge_mlp, torch.cat([x_src[src], x_dst[dst], attr_b], dim=-1))
    new_edges = attr_b + msg
    agg = scatter(new_edges if block.aggregate_updated_edges else msg, dst, dim=0, dim_size=x_dst.shape[0],
                  reduce="sum")
    return x_dst + modules(block.node_mlp, torch.cat([x_dst, agg], dim=-1)), new_edges


def test_defaults_build_the_previous_modules():
    edge_index = random_graph(9, 9, 30, seed=0)
    plan = GraphShardPlan.build(edge_index, 9)
    block = GNNProcessorBlock(DST_C, 5, plan)
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters()}
    assert shapes == {
        "edge_mlp.0.weight": (5, 2 * DST_C + 5), "edge_mlp.0.bias": (5,), "edge_mlp.2.weight": (5, 5),
        "edge_mlp.2.bias": (5,), "edge_mlp.3.weight": (5,), "edge_mlp.3.bias": (5,),
        "node_mlp.0.weight": (DST_C, DST_C + 5), "node_mlp.0.bias": (DST_C,), "node_mlp.2.weight": (DST_C, DST_C),
        "node_mlp.2.bias": (DST_C,), "node_mlp.3.weight": (DST_C,), "node_mlp.3.bias": (DST_C,),
    }
    assert block.edge_embedding is None and not block.aggregate_updated_edges


def test_gnn_mlp_depth_and_anemoi_parameter_count():
    mlp = gnn_mlp(10, 7, 4, hidden_layers=3)
    assert [type(m).__name__ for m in mlp] == ["Linear", "GELU"] * 3 + ["Linear", "LayerNorm"]
    # anemoi's GraphConvProcessorBlock (C, mlp_extra_layers=0, edge_dim=4 in the first layer):
    # edge MLP 3C->C->C->C, node MLP 2C->C->C->C, edge embedding 4->C->C->C, each with a LayerNorm
    c = 16
    plan = GraphShardPlan.build(random_graph(9, 9, 30, seed=0), 9)
    block = GNNProcessorBlock(c, c, plan, mlp_hidden_layers=2, edge_in_channels=4, aggregate_updated_edges=True)

    def mlp_params(i: int) -> int:
        return i * c + c + 2 * (c * c + c) + 2 * c

    assert sum(p.numel() for p in block.parameters()) == mlp_params(3 * c) + mlp_params(2 * c) + mlp_params(4)


@pytest.mark.parametrize("shape", [(37, 5), (7, 3, 5), (0, 5)])
@pytest.mark.parametrize("hidden_layers", [1, 3])
def test_gnn_mlp_fused_equals_modules(hidden_layers, shape):
    def build(options: EdgeKernelOptions) -> GNNMLP:
        torch.manual_seed(0)
        return gnn_mlp(5, 9, 4, hidden_layers, kernel_options=options).double()

    mlp, plain = build(SMALL_BLOCKS), build(AUTOGRAD)  # the same parameters
    assert isinstance(mlp, GNNMLP) and isinstance(mlp[1:], torch.nn.Sequential)
    assert mlp[1:].kernel_options is mlp.kernel_options and mlp[1:].buffer_pool is mlp.buffer_pool
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    w = torch.randn(shape[:-1] + (4,), dtype=F64)

    def run(net: GNNMLP):  # noqa: ANN202
        out = net(x)
        return [out, *torch.autograd.grad((out * w).sum(), [x, *net.parameters()], allow_unused=True)]

    new, ref = run(mlp), run(plain)
    for a, b in zip(new, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref[0].detach(), rtol=1e-12, atol=1e-12)


def test_edge_mlp_ratio_and_source_update():
    """``edge_mlp_ratio`` sizes the edge MLP only (anemoi's GraphConv: 1 whatever the node MLP's ratio);
    ``update_sources`` is ``x + node_mlp([x, x])`` (anemoi's update_src_nodes), and needs equal widths."""
    plan = GraphShardPlan.build(random_graph(9, 7, 30, seed=0), (9, 7))
    block = GNNMapperBlock(8, 8, 8, plan, mlp_ratio=2.0, edge_in_channels=3, edge_mlp_ratio=1.0).double()
    assert block.edge_mlp[0].out_features == 8 and block.node_mlp[0].out_features == 16
    assert block.edge_embedding[0].out_features == 16  # the embedding keeps mlp_ratio
    x = torch.randn(9, 2, 8, dtype=F64)
    torch.testing.assert_close(block.update_sources(x), x + modules(block.node_mlp, torch.cat([x, x], dim=-1)))
    with pytest.raises(ValueError, match="update_sources needs src_channels == dst_channels == edge_channels"):
        GNNMapperBlock(8, 8, 3, plan).update_sources(torch.randn(9, 8))
    with pytest.raises(ValueError, match="edge_mlp_ratio must be positive"):
        GNNMapperBlock(8, 8, 3, plan, edge_mlp_ratio=0.0)


def test_bad_options():
    plan = GraphShardPlan.build(random_graph(9, 9, 30, seed=0), 9)
    with pytest.raises(ValueError, match="mlp_hidden_layers"):
        GNNProcessorBlock(8, 4, plan, mlp_hidden_layers=0)
    with pytest.raises(ValueError, match="edge_in_channels"):
        GNNProcessorBlock(8, 4, plan, edge_in_channels=0)
    block = GNNProcessorBlock(8, 4, plan, edge_in_channels=2)
    with pytest.raises(ValueError, match="edge_attr must be"):
        block(torch.randn(9, 8), torch.randn(30, 4))  # the raw attributes have edge_in_channels
    assert block(torch.randn(9, 8), torch.randn(30, 2))[1].shape == (30, 4)  # the edges out have edge_channels


def _case(kind: str, batch: tuple, seed: int):
    g = torch.Generator().manual_seed(seed)
    ns, nd, e = (23, 23, 90) if kind == "gnn_processor" else (31, 17, 110)
    edge_index = random_graph(ns, nd, e, seed=seed, dst_limit=nd - 2)  # two destinations without edges
    x_src = torch.randn(ns, *batch, DST_C if kind == "gnn_processor" else SRC_C, generator=g, dtype=F64)
    x_dst = x_src if kind == "gnn_processor" else torch.randn(nd, *batch, DST_C, generator=g, dtype=F64)
    return edge_index, x_src, x_dst, g


# (batch dims, edge attributes per batch entry): (E, F) shared by the batch or (E, *batch, F)
BATCHES = [((), False), ((2,), False), ((2, 3), True), ((1,), False)]


@pytest.mark.parametrize("block_bytes", [None, 1])  # one edge block / blocks of 16 edges
@pytest.mark.parametrize("batch,attr_batched", BATCHES)
@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("kind", ["gnn_processor", "gnn_mapper"])
def test_options_match_written_out_math(kind, options, num_chunks, batch, attr_batched, block_bytes):
    kernel_options = None if block_bytes is None else EdgeKernelOptions(block_bytes=block_bytes)
    edge_index, x_src, x_dst, g = _case(kind, batch, seed=3)
    processor = kind == "gnn_processor"
    plan = GraphShardPlan.build(edge_index, x_src.shape[0] if processor else (x_src.shape[0], x_dst.shape[0]))
    block = make_block(kind, plan, options, num_chunks, kernel_options=kernel_options)
    edge_in = options[1] or EDGE_C
    attr_shape = (edge_index.shape[1], *(batch if attr_batched else ()), edge_in)
    attr = plan.shard_edges(torch.randn(attr_shape, generator=g, dtype=F64)).requires_grad_()
    x_src = x_src.clone().requires_grad_()
    x_dst = x_src if processor else x_dst.clone().requires_grad_()
    w = torch.randn(x_dst.shape[:-1] + (DST_C,), generator=g, dtype=F64)
    w_e = torch.randn((attr.shape[0],) + batch + (EDGE_C,), generator=g, dtype=F64)
    wrt = [x_src, attr] + ([] if processor else [x_dst]) + list(block.parameters())
    new = block(x_dst, attr) if processor else (block(x_src, x_dst, attr),)
    g_new = torch.autograd.grad(sum((t * wt).sum() for t, wt in zip(new, (w, w_e), strict=False)), wrt)
    ref = reference(block, x_src, x_dst, attr, plan.edge_index)[: len(new)]
    g_ref = torch.autograd.grad(sum((t * wt).sum() for t, wt in zip(ref, (w, w_e), strict=False)), wrt)
    for a, b in zip(new, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    for a, b in zip(g_new, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [(1, None, False), ANEMOI])
@pytest.mark.parametrize("kind", ["gnn_processor", "gnn_mapper"])
def test_fused_path_equals_autograd_path(kind, options):
    edge_index, x_src, x_dst, g = _case(kind, (2,), seed=5)
    processor = kind == "gnn_processor"
    plan = GraphShardPlan.build(edge_index, x_src.shape[0] if processor else (x_src.shape[0], x_dst.shape[0]))
    attr = plan.shard_edges(torch.randn(edge_index.shape[1], options[1] or EDGE_C, generator=g, dtype=F64))
    w = torch.randn(x_dst.shape[:-1] + (DST_C,), generator=g, dtype=F64)

    def run(fused: bool, grad: bool = True):  # noqa: ANN202
        block = make_block(kind, plan, options, kernel_options=SMALL_BLOCKS if fused else AUTOGRAD)
        xs = x_src.clone().requires_grad_(grad)
        xd = xs if processor else x_dst.clone().requires_grad_(grad)
        a = attr.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = block(xd, a) if processor else (block(xs, xd, a),)
        if not grad:
            return out
        wrt = [xs, a] + ([] if processor else [xd]) + list(block.parameters())
        return out, torch.autograd.grad((out[0] * w).sum() + (out[-1] ** 2).sum(), wrt)

    (new, g_new), (old, g_old) = run(True), run(False)
    for a, b in zip(new + g_new, old + g_old, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    for a, b in zip(run(True, grad=False), old, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)


def _run_block(plan, block, processor, x_src, x_dst, attr, w, w_e):  # noqa: ANN001, ANN202
    """This rank's nodes and edges out, input gradients and parameter gradients."""
    xs = plan.shard_src(x_src).clone().requires_grad_()
    xd = xs if processor else plan.shard_dst(x_dst).clone().requires_grad_()
    ea = attr.clone().requires_grad_()
    out = block(xd, plan.shard_edges(ea)) if processor else block(xs, xd, plan.shard_edges(ea))
    nodes, edges = out if processor else (out, None)
    loss = (nodes * plan.shard_dst(w)).sum()
    if edges is not None:
        loss = loss + (edges * plan.shard_edges(w_e)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return nodes.detach(), edges, xs.grad, xd.grad, ea.grad, grads


def _check_sharded(rank, world, num_chunks):  # noqa: ANN001
    _compare_sharded(dist.group.WORLD, num_chunks)
    return True


def _compare_sharded(group, num_chunks):  # noqa: ANN001
    kernel_options = EdgeKernelOptions(block_bytes=1024)  # several edge blocks per rank
    for case, kind in enumerate(["gnn_processor", "gnn_mapper"]):
        for options in (ANEMOI, OPTIONS[0]):
            edge_index, x_src, x_dst, g = _case(kind, (), seed=10 + case)
            processor = kind == "gnn_processor"
            num_nodes = x_src.shape[0] if processor else (x_src.shape[0], x_dst.shape[0])
            attr = torch.randn(edge_index.shape[1], options[1] or EDGE_C, generator=g, dtype=F64)
            w = torch.randn(x_dst.shape[0], DST_C, generator=g, dtype=F64)
            w_e = torch.randn(edge_index.shape[1], EDGE_C, generator=g, dtype=F64)

            tensors = (x_src, x_dst, attr, w, w_e)
            full = GraphShardPlan.build(edge_index, num_nodes)
            ref = _run_block(full, make_block(kind, full, options, kernel_options=kernel_options), processor,
                             *tensors)
            plan = GraphShardPlan.build(edge_index, num_nodes, group)
            got = _run_block(plan, make_block(kind, plan, options, num_chunks, kernel_options=kernel_options),
                             processor, *tensors)
            tol = dict(rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got[0], plan.shard_dst(ref[0]), **tol)
            if processor:  # the one-rank plan's edge order back to edge_index order, then this rank's edges
                ref_edges = ref[1].detach()[torch.argsort(full.edge_ids)]
                torch.testing.assert_close(got[1].detach(), plan.shard_edges(ref_edges), **tol)
            torch.testing.assert_close(got[2], plan.shard_src(ref[2]), **tol)
            if not processor:
                torch.testing.assert_close(got[3], plan.shard_dst(ref[3]), **tol)
            for name, mine, total in [("edge_attr", got[4], ref[4])] + [
                (n, got[5][n], ref[5][n]) for n in ref[5]
            ]:
                summed = mine.clone()
                dist.all_reduce(summed, group=group)
                torch.testing.assert_close(summed, total, **tol, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}")


@pytest.mark.parametrize("world,num_chunks", [(2, 1), (2, 3), (3, 1), (4, 1)])
def test_options_sharded_equal_single_process(world, num_chunks):
    run_distributed(_check_sharded, world, num_chunks)


RECYCLE_ALL = EdgeKernelOptions(block_bytes=1, recycle_min_bytes=0)  # every fused buffer recycled, 16-row blocks
needs_pool = pytest.mark.skipif(not EdgeBufferPool.available,
                                reason="no storage use count in this torch: the pool allocates fresh memory")


def _processor_chain(plan, kernel_options, pools):  # noqa: ANN001, ANN202
    """Three processor blocks (the first embeds the raw edges), block ``i`` seeded ``i``, with pool ``pools[i]``."""
    return [make_block("gnn_processor", plan, ANEMOI if i == 0 else (2, None, True), seed=i,
                       kernel_options=kernel_options, buffer_pool=pools[i]) for i in range(3)]


def _chain_step(blocks, x_src, attr):  # noqa: ANN001, ANN202
    """One training step through the chain: nodes and every edge output, input and parameter gradients."""
    x = x_src.clone().requires_grad_()
    y, e = x, attr
    outs = []
    for block in blocks:
        y, e = block(y, e)
        outs.append(e)
    ((y ** 2).sum() + sum((o ** 2).sum() for o in outs)).backward()
    grads = [p.grad.clone() for b in blocks for p in b.parameters()]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return [y.detach(), *[o.detach() for o in outs], x.grad, *grads]


def _chain_case(seed: int, batch: tuple = ()):  # noqa: ANN202
    edge_index, x_src, _, g = _case("gnn_processor", batch, seed=seed)
    plan = GraphShardPlan.build(edge_index, x_src.shape[0])
    attr = plan.shard_edges(torch.randn(edge_index.shape[1], EDGE_IN, generator=g, dtype=F64))
    return plan, x_src, attr


@needs_pool
def test_recycled_buffers_are_never_shared():
    """With every fused buffer recycled (no size threshold): repeated steps equal fresh
    allocations, outputs and gradients held from one step survive the next, sizes change."""
    plan, x_src, attr = _chain_case(seed=7)
    ref = _chain_step(_processor_chain(plan, dataclasses.replace(RECYCLE_ALL, recycle=False), [None] * 3),
                      x_src, attr)
    pool = EdgeBufferPool()
    blocks = _processor_chain(plan, RECYCLE_ALL, [pool] * 3)
    first = _chain_step(blocks, x_src, attr)
    assert len(pool) > 0
    held = [t.clone() for t in first]
    for _ in range(2):
        again = _chain_step(blocks, x_src, attr)
        for a, b, c, d in zip(first, held, again, ref, strict=True):
            assert torch.equal(a, b)  # what the caller holds is never reused
            torch.testing.assert_close(c, d, rtol=1e-13, atol=1e-13)
    y, e = blocks[0](x_src, attr)  # the outputs are no views: in-place updates work
    e.add_(1.0)
    y.mul_(2.0)
    # another graph size: the pool serves it; once a size is no longer requested, it is dropped
    sizes_first = pool.sizes()
    other = GraphShardPlan.build(random_graph(11, 11, 40, seed=1), 11)
    block = make_block("gnn_processor", other, ANEMOI, kernel_options=RECYCLE_ALL, buffer_pool=pool)
    out, edges = block(torch.randn(11, DST_C, dtype=F64), torch.randn(40, EDGE_IN, dtype=F64))
    out.sum().backward()
    only_other = pool.sizes() - sizes_first
    assert only_other
    del block, out, edges  # the edges out are a pooled buffer: in use while referenced
    # a size never requested before (a miss) with max age 0 drops every free buffer not just requested
    pool.empty((13, 7), x_src, dataclasses.replace(RECYCLE_ALL, recycle_max_age=0))
    assert not only_other & pool.sizes()
    pool.release()
    assert pool.num_free() == 0


@pytest.mark.parametrize("kernel_options", [RECYCLE_ALL, None])
def test_shared_pool_equals_separate_pools(kernel_options):
    """Three blocks sharing one pool (as the models build them) give, step after step, exactly
    the results of three blocks with a pool each, and hold fewer buffers (layers reuse them)."""
    plan, x_src, attr = _chain_case(seed=8, batch=(2,))
    separate, shared = [EdgeBufferPool() for _ in range(3)], EdgeBufferPool()
    ref_blocks = _processor_chain(plan, kernel_options, separate)
    blocks = _processor_chain(plan, kernel_options, [shared] * 3)
    for b in blocks:
        assert b.buffer_pool is shared and b.edge_mlp.buffer_pool is shared and b.node_mlp.buffer_pool is shared
    assert blocks[0].edge_embedding.buffer_pool is shared
    for _ in range(3):  # later steps reuse the buffers of the first
        for a, b in zip(_chain_step(blocks, x_src, attr), _chain_step(ref_blocks, x_src, attr), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    if kernel_options is RECYCLE_ALL and EdgeBufferPool.available:
        assert 0 < len(shared) < sum(len(p) for p in separate)
        assert shared.nbytes < sum(p.nbytes for p in separate)


@needs_pool
def test_pool_release_frees_free_buffers():
    plan, x_src, attr = _chain_case(seed=9)
    pool = EdgeBufferPool()
    block = make_block("gnn_processor", plan, ANEMOI, kernel_options=RECYCLE_ALL, buffer_pool=pool)
    out, edges = block(x_src, attr)  # the graph holds the kept pre-activations
    assert len(pool) > 0 and pool.nbytes > 0 and pool.num_free() > 0 and repr(pool).startswith("EdgeBufferPool(")
    in_use = len(pool) - pool.num_free()
    pool.release()
    assert pool.num_free() == 0 and len(pool) == in_use > 0  # buffers in use stay
    (out.sum() + edges.sum()).backward()
    del out
    pool.release()
    assert len(pool) >= 1 and pool.num_free() == 0  # the edges out are a pooled buffer, still referenced
    del edges
    pool.release()
    assert len(pool) == 0 and pool.nbytes == 0 and pool.sizes() == set()


@pytest.mark.parametrize("field,value,error,message", [
    ("block_bytes", 0, ValueError, "EdgeKernelOptions.block_bytes must be positive (>= 1), got 0"),
    ("block_bytes", 1.5, TypeError, "EdgeKernelOptions.block_bytes must be an int, got 1.5 (float)"),
    ("block_bytes", True, TypeError, "EdgeKernelOptions.block_bytes must be an int, got True (bool)"),
    ("recycle_min_bytes", -1, ValueError, "EdgeKernelOptions.recycle_min_bytes must be non-negative (>= 0), got -1"),
    ("recycle_max_age", -5, ValueError, "EdgeKernelOptions.recycle_max_age must be non-negative (>= 0), got -5"),
    ("fused", 1, TypeError, "EdgeKernelOptions.fused must be True or False, got 1 (int)"),
    ("recycle", "yes", TypeError, "EdgeKernelOptions.recycle must be True or False, got 'yes' (str)"),
])
def test_bad_kernel_options(field, value, error, message):
    with pytest.raises(error) as info:
        EdgeKernelOptions(**{field: value})
    text = str(info.value)
    assert text.startswith(message) and (": pass" in text or "default" in text), text  # names the fix too


def test_kernel_arguments_are_checked_and_bound():
    plan = GraphShardPlan.build(random_graph(9, 9, 30, seed=0), 9)
    with pytest.raises(TypeError, match="kernel_options must be an EdgeKernelOptions .* got dict"):
        GNNProcessorBlock(8, 4, plan, kernel_options={"fused": False})
    with pytest.raises(TypeError, match="buffer_pool must be an EdgeBufferPool .* got object"):
        GNNMapperBlock(8, 8, 4, GraphShardPlan.build(random_graph(9, 7, 30, seed=0), (9, 7)), buffer_pool=object())
    with pytest.raises(TypeError, match="kernel_options"):
        gnn_mlp(4, 4, 4, kernel_options=1 << 20)
    options = EdgeKernelOptions(fused=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.block_bytes = 1  # frozen: settings never change behind a block's back
    block = GNNProcessorBlock(8, 4, plan, kernel_options=options)
    assert block.kernel_options is options and block.node_mlp.kernel_options is options
    assert GNNProcessorBlock(8, 4, plan).kernel_options == EdgeKernelOptions()
    assert GNNProcessorBlock(8, 4, plan).buffer_pool is not block.buffer_pool  # a pool per block by default
    assert set(block.state_dict()) == set(GNNProcessorBlock(8, 4, plan).state_dict())  # not state


def test_copies_get_a_fresh_shared_pool():
    plan = GraphShardPlan.build(random_graph(9, 9, 30, seed=0), 9)
    pool = EdgeBufferPool()
    blocks = torch.nn.ModuleList(GNNProcessorBlock(8, 4, plan, buffer_pool=pool) for _ in range(2))
    pool.empty((1 << 20,), torch.empty(0), EdgeKernelOptions(recycle_min_bytes=0))  # a cached buffer
    copied = copy.deepcopy(blocks)
    new_pool = copied[0].buffer_pool
    assert new_pool is not pool and len(new_pool) == 0
    assert all(m.buffer_pool is new_pool for b in copied for m in (b, b.edge_mlp, b.node_mlp))
