"""Graph-transformer and GNN blocks: sharded by destination nodes (1-4 ranks, uneven, directed,
bipartite, ranks without edges) equals the single-process block; chunked equals unchunked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.layers.gnn import GNNMapperBlock, GNNProcessorBlock
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock, GraphTransformerProcessorBlock
from stormshard.layers.row_chunked_mlp import RowChunkedMLP
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.graph import GraphShardPlan
from tests.distributed import run_distributed
from tests.test_graph_sharding import random_graph

SRC_C, DST_C, EDGE_C, HEADS = 6, 8, 5, 4

# (kind, num_src, num_dst, num_edges, dst_limit)
CASES = [
    ("transformer_mapper", 61, 45, 300, None),  # encoder-like, uneven over 2, 3, 4
    ("transformer_mapper", 45, 61, 220, 41),  # decoder-like; at 3 and 4 ranks the last rank has no edges
    ("transformer_processor", 53, 53, 260, 40),
    ("gnn_mapper", 61, 45, 300, None),
    ("gnn_mapper", 45, 61, 220, 41),
    ("gnn_processor", 53, 53, 260, 40),
    ("transformer_mapper", 7, 3, 12, None),  # at 4 ranks one rank owns no destination (and no source) rows
    ("gnn_mapper", 3, 7, 12, None),
    ("transformer_self_mapper", 61, 45, 300, None),  # self_projection=True (anemoi's lin_self)
    ("transformer_self_processor", 53, 53, 260, 40),
]


def make_plan(kind: str, edge_index: torch.Tensor, num_src: int, num_dst: int, group=None) -> GraphShardPlan:
    """The block's plan: one node set for a processor, (sources, destinations) for a mapper."""
    num_nodes = num_src if kind.endswith("processor") else (num_src, num_dst)
    return GraphShardPlan.build(edge_index, num_nodes, group)


def force_lean_paths(module: torch.nn.Module, rows: int = 7) -> int:
    """The memory-lean paths of every graph-transformer block in ``module`` (a block or a model) at any size: norms
    inside their projections (:mod:`stormshard.layers.norm_linear`; by default from 2**26 input entries on, the
    model head's too) and row-chunked MLPs, ``rows`` rows per chunk (:mod:`stormshard.layers.row_chunked_mlp`; by
    default from 2**27 hidden entries on). Returns how many MLPs."""
    for m in module.modules():
        for name in ("norm_linear_min", "head_norm_linear_min"):
            if hasattr(m, name):
                setattr(m, name, 0)
    mlps = [m for m in module.modules() if isinstance(m, RowChunkedMLP)]
    for m in mlps:
        m.min_elements, m.chunk_elements = 0, rows * m[0].out_features
    return len(mlps)


def make_block(kind: str, plan: GraphShardPlan, num_chunks: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    self_projection = "_self_" in kind
    if kind.startswith("transformer") and kind.endswith("mapper"):
        block = GraphTransformerMapperBlock(SRC_C, DST_C, EDGE_C, HEADS, plan, mlp_ratio=2.0, num_chunks=num_chunks,
                                            self_projection=self_projection)
    elif kind.startswith("transformer"):
        block = GraphTransformerProcessorBlock(DST_C, EDGE_C, HEADS, plan, mlp_ratio=2.0, num_chunks=num_chunks,
                                               self_projection=self_projection)
    elif kind == "gnn_mapper":
        block = GNNMapperBlock(SRC_C, DST_C, EDGE_C, plan, num_chunks=num_chunks)
    else:
        block = GNNProcessorBlock(DST_C, EDGE_C, plan, num_chunks=num_chunks)
    return block.double()


def make_inputs(kind: str, num_src: int, num_dst: int, num_edges: int, limit: int | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    edge_index = random_graph(num_src, num_dst, num_edges, seed=seed, dst_limit=limit)
    x_src = torch.randn(num_src, DST_C if kind.endswith("processor") else SRC_C, generator=g, dtype=torch.float64)
    x_dst = x_src if kind.endswith("processor") else torch.randn(num_dst, DST_C, generator=g, dtype=torch.float64)
    edge_attr = torch.randn(num_edges, EDGE_C, generator=g, dtype=torch.float64)
    w_nodes = torch.randn(num_dst, DST_C, generator=g, dtype=torch.float64)
    w_edges = torch.randn(num_edges, EDGE_C, generator=g, dtype=torch.float64)
    return edge_index, x_src, x_dst, edge_attr, w_nodes, w_edges


def run_block(block, kind, x_src, x_dst, edge_attr):
    """Nodes out and edges out (plan order; None where the block does not update edges).

    Mapper blocks return the destinations only; processor blocks return ``(nodes, edges)``, the
    graph transformer its edge attributes unchanged."""
    if not kind.endswith("processor"):
        out = block(x_src, x_dst, edge_attr)
        assert isinstance(out, torch.Tensor)
        return out, None
    nodes, edges = block(x_dst, edge_attr)
    if kind.startswith("transformer"):
        assert edges is edge_attr
        return nodes, None
    return nodes, edges


def reference(kind, num_chunks, inputs):
    """Single-process forward and backward: output, edge output (edge_index order) and every gradient."""
    edge_index, x_src, x_dst, edge_attr, w_nodes, w_edges = inputs
    plan = make_plan(kind, edge_index, x_src.shape[0], x_dst.shape[0])
    block = make_block(kind, plan, num_chunks)
    xs = x_src.clone().requires_grad_()
    xd = xs if kind.endswith("processor") else x_dst.clone().requires_grad_()
    ea = edge_attr.clone().requires_grad_()
    nodes, edges = run_block(block, kind, xs, xd, plan.shard_edges(ea))
    if edges is not None:  # the one-rank plan orders edges by destination: back to edge_index order
        edges = edges[torch.argsort(plan.edge_ids)]
    loss = (nodes * w_nodes).sum() + (0 if edges is None else (edges * w_edges).sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return nodes.detach(), None if edges is None else edges.detach(), xs.grad, xd.grad, ea.grad, grads


def _check_sharded_blocks(rank, world, num_chunks_list):
    group = dist.group.WORLD
    for case, (kind, num_src, num_dst, num_edges, limit) in enumerate(CASES):
        inputs = make_inputs(kind, num_src, num_dst, num_edges, limit, seed=100 + case)
        edge_index, x_src, x_dst, edge_attr, w_nodes, w_edges = inputs
        ref_nodes, ref_edges, ref_gsrc, ref_gdst, ref_gea, ref_grads = reference(kind, 1, inputs)
        processor = kind.endswith("processor")
        plan = make_plan(kind, edge_index, num_src, num_dst, group)
        assert plan.group is group
        if world >= 3 and limit is not None and case in (1, 4):
            assert plan.edges_per_rank[-1] == 0  # the case really has a rank without edges
        for num_chunks in num_chunks_list:
            block = make_block(kind, plan, num_chunks)
            if kind.startswith("transformer") and num_chunks == 1 and world > 1:
                # the lean paths against the plain single-process block: the MLP (its norm inside) in 7-row
                force_lean_paths(block)  # chunks, the destinations' norm inside their projections (norm_linear)
            xs = plan.shard_src(x_src).clone().requires_grad_()
            xd = xs if processor else plan.shard_dst(x_dst).clone().requires_grad_()
            ea_full = edge_attr.clone().requires_grad_()
            with CommCounter() as counter:
                nodes, edges = run_block(block, kind, xs, xd, plan.shard_edges(ea_full))
                loss = (nodes * plan.shard_dst(w_nodes)).sum()
                if edges is not None:
                    loss = loss + (edges * plan.shard_edges(w_edges)).sum()
                loss.backward()
            assert counter.bytes("all_gather") == 0  # only the halo moves
            tol = dict(rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(nodes, plan.shard_dst(ref_nodes), **tol)
            if edges is not None:
                torch.testing.assert_close(edges, plan.shard_edges(ref_edges), **tol)
            torch.testing.assert_close(xs.grad, plan.shard_src(ref_gsrc), **tol)
            if not processor:
                torch.testing.assert_close(xd.grad, plan.shard_dst(ref_gdst), **tol)
            # edge-attribute and parameter gradients: each rank holds its edges' share, the sum is the total
            gea = ea_full.grad.clone()
            dist.all_reduce(gea, group=group)
            torch.testing.assert_close(gea, ref_gea, **tol)
            for name, p in block.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad, group=group)
                torch.testing.assert_close(grad, ref_grads[name], **tol, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_blocks_equal_single_process(world):
    chunks = [1, 3] if world in (1, 3) else [1]
    run_distributed(_check_sharded_blocks, world, chunks)


@pytest.mark.parametrize("kind", ["transformer_mapper", "transformer_processor", "transformer_self_processor",
                                  "gnn_mapper", "gnn_processor"])
def test_chunked_equals_unchunked(kind):
    num_src, num_dst = (53, 53) if kind.endswith("processor") else (61, 45)
    inputs = make_inputs(kind, num_src, num_dst, 300, num_dst - 6, seed=5)
    base = reference(kind, 1, inputs)
    for num_chunks in (2, 4, 45, 64):  # 64 > destinations: empty chunks
        other = reference(kind, num_chunks, inputs)
        for a, b in zip(base[:5], other[:5], strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
        for name in base[5]:
            torch.testing.assert_close(base[5][name], other[5][name], rtol=1e-12, atol=1e-13)
    # inference (no autograd) chunks too, without checkpointing
    with torch.no_grad():
        edge_index, x_src, x_dst, edge_attr, _, _ = inputs
        plan = make_plan(kind, edge_index, num_src, num_dst)
        a = run_block(make_block(kind, plan, 1), kind, x_src, x_dst, plan.shard_edges(edge_attr))[0]
        b = run_block(make_block(kind, plan, 5), kind, x_src, x_dst, plan.shard_edges(edge_attr))[0]
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_destination_without_edges_keeps_residual_path():
    """A destination with no incoming edge gets zero attention: x + MLP(LN(x)) after the projection bias."""
    edge_index = torch.tensor([[0, 1, 3], [0, 0, 1]])
    block = make_block("transformer_mapper", GraphShardPlan.build(edge_index, (4, 3)), 1)
    x_src = torch.randn(4, SRC_C, dtype=torch.float64)
    x_dst = torch.randn(3, DST_C, dtype=torch.float64)
    out = block(x_src, x_dst, torch.randn(3, EDGE_C, dtype=torch.float64))
    x = x_dst[2] + block.proj.bias
    torch.testing.assert_close(out[2], x + block.mlp(block.norm_mlp(x)))


def test_bad_inputs():
    edge_index = torch.tensor([[0, 1], [2, 3]])
    one_set, bipartite = GraphShardPlan.build(edge_index, 5), GraphShardPlan.build(edge_index, (5, 4))
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        GraphTransformerProcessorBlock(10, 4, 3, one_set)
    with pytest.raises(ValueError, match="num_chunks"):
        GNNProcessorBlock(8, 4, one_set, num_chunks=0)
    with pytest.raises(ValueError, match="num_heads"):
        GraphTransformerMapperBlock(4, 8, 2, 0, bipartite)
    with pytest.raises(TypeError, match="plan must be a GraphShardPlan"):
        GNNMapperBlock(4, 8, 2, edge_index)
    block = make_block("transformer_mapper", bipartite, 1)
    x_src, x_dst = torch.randn(5, SRC_C).double(), torch.randn(4, DST_C).double()
    with pytest.raises(ValueError, match="x_src must be"):
        block(x_dst, x_dst, torch.randn(2, EDGE_C).double())
    with pytest.raises(ValueError, match="edge_attr must be"):
        block(x_src, x_dst, torch.randn(3, EDGE_C).double())
    plan = GraphShardPlan.for_rank(edge_index, (5, 4), 2, 0)
    sharded = make_block("transformer_mapper", plan, 1)
    with pytest.raises(ValueError, match="pass this rank's node slices"):
        sharded(x_src, x_dst, torch.randn(0, EDGE_C).double())
    # a for_rank plan of a 2-rank layout has no group: the block cannot exchange its halo
    with pytest.raises(ValueError, match="no process group"):
        sharded(plan.shard_src(x_src), plan.shard_dst(x_dst), torch.randn(0, EDGE_C).double())
    for kind in ("transformer_processor", "gnn_processor"):
        with pytest.raises(ValueError, match="one node set"):
            make_block(kind, plan, 1)


def test_self_projection_is_anemoi_lin_self():
    """``self_projection=True`` adds ``W_s n_dst(x_i)`` to the attention output before the output
    projection (anemoi's ``lin_self``): the block equals the one without it, with the term added by hand."""
    edge_index, x_src, x_dst, edge_attr, _, _ = make_inputs("transformer_mapper", 13, 9, 60, None, seed=5)
    plan = make_plan("transformer_mapper", edge_index, 13, 9)
    with_self = make_block("transformer_self_mapper", plan, 1)
    plain = make_block("transformer_mapper", plan, 1)
    plain.load_state_dict({k: v for k, v in with_self.state_dict().items() if not k.startswith("to_self.")})
    attr = plan.shard_edges(edge_attr)
    captured = {}
    plain.proj.register_forward_pre_hook(lambda _m, args: captured.setdefault("in", args[0]))
    plain(x_src, x_dst, attr)
    extra = with_self.to_self(with_self.norm_dst(x_dst))
    x = x_dst + with_self.proj(captured["in"] + extra)
    expected = x + with_self.mlp(with_self.norm_mlp(x))
    torch.testing.assert_close(with_self(x_src, x_dst, attr), expected, rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in with_self.parameters()) - sum(p.numel() for p in plain.parameters()) == DST_C * DST_C + DST_C


@pytest.mark.parametrize("kind", ["transformer_mapper", "gnn_processor"])
def test_plan_moves_with_the_block(kind):
    """``block.to(device)`` moves the plan's index tensors and the edge chunks (the forward then copies
    nothing per call); a dtype change leaves them where they are."""
    edge_index = random_graph(20, 15, 80, seed=3)
    block = make_block(kind, make_plan(kind, edge_index, 20, 15), num_chunks=2)
    block.float()
    assert block.plan.edge_index.device.type == "cpu"
    block.to("meta")
    plan = block.plan
    assert {t.device.type for t in (plan.edge_index, plan.edge_ids, plan.send_index, plan.halo_ids)} == {"meta"}
    assert {ids.device.type for _, _, ids in block.edge_chunks} == {"meta"}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("kind", ["transformer_mapper", "transformer_processor", "gnn_processor"])
def test_plan_moves_with_a_checkpointed_block(kind, mode):
    """A block wrapped in :class:`ActivationCheckpoint` (``model.activation_checkpointing``, a checkpointed mapper)
    moves its plan, edge chunks and chunk edge indices with ``.to(device)`` as the bare block does: the wrapper
    adopts the block's tree, not its ``_apply``, and left them on the CPU (a checkpointed graph model on CUDA then
    met CPU edge indices)."""
    from stormshard.layers.checkpointing import ActivationCheckpoint

    edge_index = random_graph(20, 15, 80, seed=3)
    wrapped = ActivationCheckpoint(make_block(kind, make_plan(kind, edge_index, 20, 15), num_chunks=2), mode)
    assert wrapped.to("meta") is wrapped
    block, plan = wrapped.block, wrapped.block.plan
    held = [plan.edge_index, plan.edge_ids, plan.send_index, plan.halo_ids, *(ids for _, _, ids in block.edge_chunks),
            *(getattr(block, "chunk_index", None) or {}).values()]
    assert {t.device.type for t in held} == {"meta"}
    assert {t.device.type for t in (*wrapped.parameters(), *wrapped.buffers())} == {"meta"}
    assert wrapped.to(torch.float32).block.plan.edge_index.dtype == torch.int64  # a dtype change leaves indices
