"""The fused graph kernels (stormshard.kernels.graph_csr) against the straightforward math, in float64.

Reference: ``graph_attention`` (per-edge gathers, torch-geometric softmax and scatter) with the
edge embedding ``Linear(edge_attr)`` formed per edge, i.e. the graph blocks' previous
implementation. Forward and every gradient (queries, keys, values, edge attributes, edge weight
and bias); destinations without edges, duplicate and unsorted edges, batch dimensions, a graph
without edges (a rank with no edges), and the blocks with 1 and several chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.utils import scatter

import stormshard.kernels.dispatch as dispatch
from stormshard.kernels.graph_csr import csr_structure, fused_graph_attention, segment_sum
from stormshard.kernels.reference import graph_attention
from stormshard.layers.gnn import GNNMapperBlock, GNNProcessorBlock
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock, GraphTransformerProcessorBlock
from stormshard.parallel.graph import GraphShardPlan

F64 = torch.float64


def reference_attention(q, k, v, attr, weight, bias, edge_index, num_dst):  # noqa: ANN001
    """The previous implementation's math: edge embedding per edge, added to keys and values."""
    heads, d = q.shape[-2], q.shape[-1]
    emb = F.linear(attr, weight, bias)
    emb = emb.reshape(*emb.shape[:-1], heads, d)
    emb = emb.reshape(emb.shape[:1] + (1,) * (k.dim() - emb.dim()) + emb.shape[1:])
    return graph_attention(q, k, v, emb, edge_index, num_dst)


def make_case(num_src, num_dst, num_edges, batch=(), heads=3, d=4, fdim=5, attr_batched=False, seed=0,
              dst_pool=None, bias=True):  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    pool = torch.as_tensor(dst_pool) if dst_pool is not None else torch.arange(num_dst)
    dst = pool[torch.randint(0, len(pool), (num_edges,), generator=g)]
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    edge_index = torch.stack([src, dst])

    def rnd(*shape):  # noqa: ANN002
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)

    tensors = dict(
        q=rnd(num_dst, *batch, heads, d), k=rnd(num_src, *batch, heads, d), v=rnd(num_src, *batch, heads, d),
        attr=rnd(num_edges, *(batch if attr_batched else ()), fdim), weight=rnd(heads * d, fdim),
        bias=rnd(heads * d) if bias else None,
    )
    grad_out = torch.randn(num_dst, *batch, heads, d, generator=g, dtype=F64)
    return tensors, edge_index, grad_out


def both(tensors, edge_index, grad_out, num_dst):  # noqa: ANN001
    names = [n for n, t in tensors.items() if t is not None]
    outs = []
    for fn in (reference_attention, fused_graph_attention):
        args = [tensors[n] for n in ("q", "k", "v", "attr", "weight", "bias")]
        out = fn(*args, edge_index, num_dst)
        grads = torch.autograd.grad((out * grad_out).sum(), [tensors[n] for n in names], allow_unused=True)
        outs.append((out, dict(zip(names, grads, strict=True))))
    return outs


CASES = {
    "bipartite": dict(num_src=13, num_dst=9, num_edges=60),
    "processor-like": dict(num_src=17, num_dst=17, num_edges=80),
    "empty destinations": dict(num_src=11, num_dst=10, num_edges=40, dst_pool=[0, 2, 3, 7]),
    "one edge": dict(num_src=4, num_dst=3, num_edges=1),
    "batch, shared edges": dict(num_src=9, num_dst=7, num_edges=30, batch=(2,)),
    "batch, batched edges": dict(num_src=9, num_dst=7, num_edges=30, batch=(3,), attr_batched=True),
    "two batch dims": dict(num_src=6, num_dst=5, num_edges=20, batch=(2, 2)),
    "no bias": dict(num_src=8, num_dst=6, num_edges=25, bias=False),
    "one head": dict(num_src=8, num_dst=6, num_edges=25, heads=1, d=7),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_attention_matches_reference(name):
    tensors, edge_index, grad_out = make_case(**CASES[name])
    (ref, ref_g), (out, out_g) = both(tensors, edge_index, grad_out, grad_out.shape[0])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for n in ref_g:
        torch.testing.assert_close(out_g[n], ref_g[n], rtol=1e-11, atol=1e-11, msg=lambda m, n=n: f"{n}: {m}")
    if "empty" in name:
        empty = torch.ones(grad_out.shape[0], dtype=torch.bool)
        empty[edge_index[1]] = False
        assert torch.all(out[empty] == 0)


def test_duplicate_and_unsorted_edges():
    tensors, edge_index, grad_out = make_case(num_src=7, num_dst=6, num_edges=30, seed=3)
    edge_index = torch.cat([edge_index, edge_index[:, :7]], dim=1)[:, torch.randperm(37)]  # duplicates
    attr = tensors["attr"].detach()
    tensors["attr"] = torch.cat([attr, attr[:7]])[torch.randperm(37)].requires_grad_(True)
    (ref, ref_g), (out, out_g) = both(tensors, edge_index, grad_out, 6)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for n in ref_g:
        torch.testing.assert_close(out_g[n], ref_g[n], rtol=1e-11, atol=1e-11)


def test_no_edges_gives_zeros_and_zero_grads():
    """A rank whose plan has no edges: zero output, zero (not missing) gradients."""
    tensors, edge_index, grad_out = make_case(num_src=5, num_dst=4, num_edges=0)
    out = fused_graph_attention(*(tensors[n] for n in ("q", "k", "v", "attr", "weight", "bias")), edge_index, 4)
    assert out.shape == grad_out.shape and torch.all(out == 0)
    grads = torch.autograd.grad((out * grad_out).sum(), [tensors[n] for n in ("q", "k", "v", "weight", "bias")])
    assert all(g is not None and torch.all(g == 0) for g in grads)


def test_gradcheck():
    tensors, edge_index, _ = make_case(num_src=5, num_dst=4, num_edges=12, batch=(2,), heads=2, d=3, fdim=2,
                                       dst_pool=[0, 1, 3])
    args = [tensors[n] for n in ("q", "k", "v", "attr", "weight", "bias")]
    assert torch.autograd.gradcheck(lambda *a: fused_graph_attention(*a, edge_index, 4), args)


def test_structure_cache_follows_the_edge_index():
    tensors, edge_index, grad_out = make_case(num_src=9, num_dst=8, num_edges=30, seed=5)
    args = [tensors[n].detach() for n in ("q", "k", "v", "attr", "weight", "bias")]
    first = csr_structure(edge_index, 9, 8, 3)
    assert csr_structure(edge_index, 9, 8, 3) is first  # same tensor: cached
    assert csr_structure(edge_index, 9, 8, 6) is not first  # other head count: other structure
    out1 = fused_graph_attention(*args, edge_index, 8)
    edge_index[0] = (edge_index[0] + 1) % 9  # in place: the version changes, the structure is rebuilt
    assert csr_structure(edge_index, 9, 8, 3) is not first
    torch.testing.assert_close(fused_graph_attention(*args, edge_index, 8), reference_attention(*args, edge_index, 8))
    assert not torch.allclose(out1, fused_graph_attention(*args, edge_index, 8))


def test_bad_shapes_raise():
    tensors, edge_index, _ = make_case(num_src=5, num_dst=4, num_edges=6)
    q, k, v, attr, w, b = (tensors[n] for n in ("q", "k", "v", "attr", "weight", "bias"))
    with pytest.raises(ValueError, match="edge_weight"):
        fused_graph_attention(q, k, v, attr, w[:, :2], b, edge_index, 4)
    with pytest.raises(ValueError, match="edge_attr has"):
        fused_graph_attention(q, k, v, attr[:3], w, b, edge_index, 4)
    with pytest.raises(ValueError, match="num_dst"):
        fused_graph_attention(q, k, v, attr, w, b, edge_index, 5)


def test_segment_sum_matches_scatter():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, 3, generator=g, dtype=F64, requires_grad=True)
    index = torch.randint(0, 9, (40,), generator=g)
    index[index == 4] = 5  # an empty row
    w = torch.randn(11, 2, 3, generator=g, dtype=F64)
    ref = scatter(x, index, dim=0, dim_size=11, reduce="sum")
    out = segment_sum(x, index, 11)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad((out * w).sum(), x)[0], torch.autograd.grad((ref * w).sum(), x)[0])
    assert torch.autograd.gradcheck(lambda t: segment_sum(t, index, 11), (x,))


# ------------------------------------------------------------------------------------------------
# the blocks: new kernel path vs the previous (reference) path, float64, 1 and several chunks
# ------------------------------------------------------------------------------------------------


def _block_case(kind: str, seed: int = 0):  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    ns, nd, e = (23, 23, 90) if kind.endswith("processor") else (29, 17, 100)
    dst = torch.randint(0, nd - 3, (e,), generator=g)  # the last 3 destinations have no edges
    edge_index = torch.stack([torch.randint(0, ns, (e,), generator=g), dst])
    x_src = torch.randn(ns, 2, 8, generator=g, dtype=F64, requires_grad=True)
    x_dst = x_src if kind.endswith("processor") else torch.randn(nd, 2, 8, generator=g, dtype=F64, requires_grad=True)
    attr = torch.randn(e, 5, generator=g, dtype=F64)
    w = torch.randn(nd, 2, 8, generator=g, dtype=F64)
    w_e = torch.randn(e, 2, 5, generator=g, dtype=F64)
    # one-rank plan: node ids unchanged, edges in plan order (sorted by destination)
    plan = GraphShardPlan.build(edge_index, ns if kind.endswith("processor") else (ns, nd))
    return plan, x_src, x_dst, plan.shard_edges(attr), w, plan.shard_edges(w_e)


def _make_block(kind: str, plan: GraphShardPlan, num_chunks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "transformer_processor":
        return GraphTransformerProcessorBlock(8, 5, 4, plan, mlp_ratio=2.0, num_chunks=num_chunks).double()
    if kind == "transformer_mapper":
        return GraphTransformerMapperBlock(8, 8, 5, 4, plan, mlp_ratio=2.0, num_chunks=num_chunks).double()
    if kind == "gnn_processor":
        return GNNProcessorBlock(8, 5, plan, num_chunks=num_chunks).double()
    return GNNMapperBlock(8, 8, 5, plan, num_chunks=num_chunks).double()


def _run(block, kind, plan, x_src, x_dst, attr, w, w_e):  # noqa: ANN001
    out = block(x_dst, attr) if kind.endswith("processor") else block(x_src, x_dst, attr)
    nodes, edges = out if isinstance(out, tuple) else (out, None)
    if kind.startswith("transformer"):  # a transformer processor returns its edges unchanged
        assert edges is None or edges is attr
        edges = None
    loss = (nodes * w).sum() + (0 if edges is None else (edges * w_e).sum())
    inputs = [x_src] if kind.endswith("processor") else [x_src, x_dst]
    grads = torch.autograd.grad(loss, inputs + list(block.parameters()))
    return nodes, edges, grads


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("kind", ["transformer_processor", "transformer_mapper"])
def test_transformer_blocks_match_previous_path(kind, num_chunks, monkeypatch):
    case = _block_case(kind)
    new = _run(_make_block(kind, case[0], num_chunks), kind, *case)
    monkeypatch.setattr(dispatch, "fused_graph_attention", reference_attention)  # the previous math
    ref = _run(_make_block(kind, case[0], 1), kind, *case)
    torch.testing.assert_close(new[0], ref[0], rtol=1e-11, atol=1e-11)
    for a, b in zip(new[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("kind", ["gnn_processor", "gnn_mapper"])
def test_gnn_blocks_match_scatter_path(kind, num_chunks, monkeypatch):
    import stormshard.layers.gnn as gnn

    case = _block_case(kind, seed=1)
    case = (case[0], case[1], case[2], case[3].unsqueeze(1).expand(-1, 2, -1).contiguous(), case[4], case[5])
    new = _run(_make_block(kind, case[0], num_chunks), kind, *case)
    if hasattr(gnn, "segment_sum"):
        monkeypatch.setattr(gnn, "segment_sum", lambda x, index, n: scatter(x, index, dim=0, dim_size=n, reduce="sum"))
    ref = _run(_make_block(kind, case[0], 1), kind, *case)
    for a, b in zip(new[:2], ref[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    for a, b in zip(new[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_structure_cache_drops_dead_edge_indices():
    from stormshard.kernels.graph_csr import cached_structures

    edge_index = torch.stack([torch.arange(6) % 4, torch.arange(6) % 3])
    csr_structure(edge_index, 4, 3, 2)
    key_count = cached_structures()
    del edge_index
    assert cached_structures() == key_count - 1


def _gnn_reference(block, x_src, x_dst, attr, edge_index):  # noqa: ANN001
    """The GNN block's math written out: edge MLP on concatenated [x_j, x_i, e_ji], scatter sum."""
    src, dst = edge_index
    attr_b = attr.unsqueeze(1).expand(-1, x_dst.shape[1], -1)  # (E, F) shared by the batch
    msg = block.edge_mlp(torch.cat([x_src[src], x_dst[dst], attr_b], dim=-1))
    agg = scatter(msg, dst, dim=0, dim_size=x_dst.shape[0], reduce="sum")
    return x_dst + block.node_mlp(torch.cat([x_dst, agg], dim=-1)), attr_b + msg


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("kind", ["gnn_processor", "gnn_mapper"])
def test_gnn_blocks_match_concatenated_edge_mlp(kind, num_chunks):
    plan, x_src, x_dst, attr, w, w_e = _block_case(kind, seed=2)
    block = _make_block(kind, plan, num_chunks)
    processor = kind.endswith("processor")
    new = block(x_dst, attr) if processor else (block(x_src, x_dst, attr),)  # a mapper returns the nodes only
    ref = _gnn_reference(block, x_src, x_dst, attr, plan.edge_index)[: len(new)]
    params = [x_src] + ([] if processor else [x_dst]) + list(block.parameters())
    for a, b in zip(new, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    w_out = (w, w_e)
    g_new = torch.autograd.grad(sum((t * wt).sum() for t, wt in zip(new, w_out, strict=False)), params)
    g_ref = torch.autograd.grad(sum((t * wt).sum() for t, wt in zip(ref, w_out, strict=False)), params)
    for a, b in zip(g_new, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
