"""Graph sharding: anemoi's edge-sorting API and the destination-node halo plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel import comm
from stormshard.parallel.anemoi_compat import (
    get_k_hop_edges,
    sort_edges_1hop_chunks,
    sort_edges_1hop_sharding,
)
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.halo_projection import halo_linear
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from tests.distributed import run_distributed


def random_graph(num_src: int, num_dst: int, num_edges: int, seed: int, dst_limit: int | None = None) -> torch.Tensor:
    """A random directed edge index ``(2, E)``; destinations drawn from ``[0, dst_limit)`` only, so
    the last destinations (and, sharded, possibly whole ranks) have no incoming edges."""
    g = torch.Generator().manual_seed(seed)
    limit = num_dst if dst_limit is None else dst_limit
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, limit, (num_edges,), generator=g)
    return torch.stack([src, dst])


# (num_src, num_dst, num_edges, dst_limit): bipartite, uneven, empty destinations, ranks without edges
GRAPHS = [
    (61, 45, 300, None),
    (45, 61, 200, 40),  # at 3 and 4 ranks the last rank owns no edges
    (50, 50, 250, None),  # one node set (processor)
    (3, 7, 12, None),  # fewer source nodes than ranks at 4: a rank owns no source rows
]


# --------------------------------------------------------------------------------------------
# anemoi's API
# --------------------------------------------------------------------------------------------


def test_get_k_hop_edges():
    edge_index = torch.tensor([[0, 1, 2, 4, 3], [1, 2, 3, 3, 0]])
    attr = torch.arange(5.0).unsqueeze(-1)
    idx, a = get_k_hop_edges(torch.tensor([3]), attr, edge_index)
    assert idx.tolist() == [[2, 4], [3, 3]] and a.flatten().tolist() == [2.0, 3.0]
    idx, a = get_k_hop_edges(torch.tensor([3]), attr, edge_index, num_hops=2)
    assert idx.tolist() == [[1, 2, 4], [2, 3, 3]] and a.flatten().tolist() == [1.0, 2.0, 3.0]
    idx, a = get_k_hop_edges(torch.tensor([], dtype=torch.long), attr, edge_index)
    assert idx.shape == (2, 0) and a.shape == (0, 1)
    with pytest.raises(ValueError, match="num_hops"):
        get_k_hop_edges(torch.tensor([3]), attr, edge_index, num_hops=0)
    with pytest.raises(ValueError, match="edge_attr has 4 rows"):
        get_k_hop_edges(torch.tensor([3]), attr[:4], edge_index)


@pytest.mark.parametrize("num_nodes_kind", ["int", "tuple"])
def test_sort_edges_1hop_chunks(num_nodes_kind):
    num_src, num_dst = (50, 50) if num_nodes_kind == "int" else (61, 45)
    edge_index = random_graph(num_src, num_dst, 300, seed=3, dst_limit=num_dst - 5)
    attr = torch.randn(300, 3)
    num_nodes = num_dst if num_nodes_kind == "int" else (num_src, num_dst)
    for chunks in (1, 2, 3, 7):
        attrs, indices = sort_edges_1hop_chunks(num_nodes, attr, edge_index, chunks)
        assert len(attrs) == len(indices) == chunks
        starts = balanced_offsets(balanced_sizes(num_dst, chunks)) + [num_dst]
        seen = []
        for c in range(chunks):
            inside = (edge_index[1] >= starts[c]) & (edge_index[1] < starts[c + 1])
            # exactly the edges into the chunk's destination range, in edge_index order
            assert torch.equal(indices[c], edge_index[:, inside])
            assert torch.equal(attrs[c], attr[inside])
            seen.append(indices[c])
        assert torch.cat(seen, dim=1).shape == edge_index.shape
    with pytest.raises(ValueError, match="num_chunks"):
        sort_edges_1hop_chunks(num_nodes, attr, edge_index, 0)
    with pytest.raises(ValueError, match="destinations"):
        sort_edges_1hop_chunks((num_src, 3), attr, edge_index, 2)
    with pytest.raises(TypeError, match="num_nodes"):
        sort_edges_1hop_chunks("45", attr, edge_index, 2)
    with pytest.raises(ValueError, match=r"shape \(2, num_edges\)"):
        sort_edges_1hop_chunks(num_nodes, attr, edge_index.T, 2)


def test_sort_edges_1hop_sharding_without_group():
    edge_index = random_graph(10, 8, 30, seed=1)
    attr = torch.randn(30, 2)
    out = sort_edges_1hop_sharding((10, 8), attr, edge_index, None)
    assert out[0] is edge_index and out[1] is attr and out[2] == [] and out[3] == []


# --------------------------------------------------------------------------------------------
# the plan, without communication: every rank's halo rows reproduce the full graph
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_reproduces_graph(world):
    for num_src, num_dst, num_edges, limit in GRAPHS:
        edge_index = random_graph(num_src, num_dst, num_edges, seed=7, dst_limit=limit)
        num_nodes = num_src if num_src == num_dst else (num_src, num_dst)
        x = torch.randn(num_src, 2, dtype=torch.float64)
        plans = [GraphShardPlan.for_rank(edge_index, num_nodes, world, r) for r in range(world)]
        assert sorted(torch.cat([p.edge_ids for p in plans]).tolist()) == list(range(num_edges))
        for r, p in enumerate(plans):
            ext = torch.cat([p.shard_src(x), x[p.halo_ids]])
            assert torch.equal(ext[p.edge_index[0]], x[edge_index[0, p.edge_ids]])
            assert torch.equal(p.edge_index[1] + p.dst_offset, edge_index[1, p.edge_ids])
            assert bool((p.edge_index[1][1:] >= p.edge_index[1][:-1]).all())  # destination-sorted
            # exactly the remote sources this rank's edges read: no more, no less
            srcs = edge_index[0, p.edge_ids].unique()
            remote = srcs[(srcs < p.src_offset) | (srcs >= p.src_offset + p.num_src_local)]
            assert torch.equal(p.halo_ids, remote)
            for q, other in enumerate(plans):  # q sends r exactly what r expects from q, in order
                lo = sum(other.send_counts[:r])
                sent = other.send_index[lo : lo + other.send_counts[r]] + other.src_offset
                lo = sum(p.recv_counts[:q])
                assert torch.equal(sent, p.halo_ids[lo : lo + p.recv_counts[q]])
        if world == 1:
            assert plans[0].num_halo == 0 and torch.equal(plans[0].edge_index, edge_index[:, plans[0].edge_ids])


def test_plan_errors():
    edge_index = random_graph(10, 8, 30, seed=1)
    with pytest.raises(ValueError, match="row 0"):
        GraphShardPlan.for_rank(edge_index, (5, 8), 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        GraphShardPlan.for_rank(edge_index, (10, 8), 2, 2)
    with pytest.raises(TypeError, match="int64"):
        GraphShardPlan.for_rank(edge_index.float(), (10, 8), 2, 0)
    plan = GraphShardPlan.for_rank(edge_index, (10, 8), 2, 0)
    assert plan.group is None  # for_rank: a plan to inspect a layout, without a process group
    with pytest.raises(ValueError, match="x_src has 4 rows"):
        plan.exchange_halo(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="rank 0 of 2"):
        plan.exchange_halo(torch.zeros(5, 3))
    with pytest.raises(ValueError, match="edge attributes have 29 rows"):
        plan.shard_edges(torch.zeros(29, 3))
    with pytest.raises(AttributeError):
        plan.rank = 1  # frozen


# --------------------------------------------------------------------------------------------
# the halo exchange on 1-4 ranks: values, gradients, bytes
# --------------------------------------------------------------------------------------------


def _check_halo_exchange(rank, world):
    group = dist.group.WORLD
    for case, (num_src, num_dst, num_edges, limit) in enumerate(GRAPHS):
        edge_index = random_graph(num_src, num_dst, num_edges, seed=11 + case, dst_limit=limit)
        num_nodes = num_src if num_src == num_dst else (num_src, num_dst)
        plan = GraphShardPlan.build(edge_index, num_nodes, group)
        assert plan.group is group and (plan.world, plan.rank) == (world, rank)
        g = torch.Generator().manual_seed(case)
        x_full = torch.randn(num_src, 3, 2, generator=g, dtype=torch.float64)  # trailing dims kept
        w_edges = torch.randn(num_edges, 3, 2, generator=g, dtype=torch.float64)

        # reference: every edge reads its source row; loss = sum_e w_e . x_src(e)
        ref = x_full.clone().requires_grad_()
        (ref[edge_index[0]] * w_edges).sum().backward()

        x = plan.shard_src(x_full).clone().requires_grad_()
        with CommCounter() as counter:
            ext = plan.exchange_halo(x)
            assert ext.shape[0] == plan.num_src_local + plan.num_halo
            torch.testing.assert_close(ext[plan.edge_index[0]], x_full[edge_index[0, plan.edge_ids]], rtol=0, atol=0)
            (ext[plan.edge_index[0]] * plan.shard_edges(w_edges)).sum().backward()
        # backward returned the halo gradients to their owners and added them
        torch.testing.assert_close(x.grad, plan.shard_src(ref.grad))

        row = 3 * 2 * 8
        if sum(plan.halo_per_rank) == 0:
            assert counter.calls() == 0
        else:
            assert counter.calls("all_to_all") == 2
            assert counter.bytes("all_to_all") == plan.halo_bytes(row) + plan.num_halo * row
        assert counter.bytes("all_gather") == 0

        # anemoi's sorted edges split by shard_tensor along the edge dimension give each rank the
        # edges into its destination slice
        attr = torch.arange(num_edges, dtype=torch.float64).unsqueeze(-1)
        index_s, attr_s, index_shapes, attr_shapes = sort_edges_1hop_sharding(num_nodes, attr, edge_index, group)
        assert len(index_shapes) == len(attr_shapes) == world
        mine_index = comm.shard_tensor(index_s, 1, index_shapes, group)
        mine_attr = comm.shard_tensor(attr_s, 0, attr_shapes, group)
        assert torch.equal(mine_attr.flatten().long(), plan.edge_ids.sort().values)
        assert torch.equal(mine_index, edge_index[:, plan.edge_ids.sort().values])

    # a plan of another layout is refused: without a group it cannot exchange, and it cannot hold
    # a group whose size differs from its layout
    plan = GraphShardPlan.for_rank(random_graph(10, 8, 30, seed=1), (10, 8), world + 1, 0)
    with pytest.raises(ValueError, match=f"of {world + 1}"):
        plan.exchange_halo(torch.zeros(plan.num_src_local, 1))
    with pytest.raises(ValueError, match=f"describes rank 0 of {world + 1}"):
        replace(plan, group=group)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_halo_exchange(world):
    run_distributed(_check_halo_exchange, world)


def _compare_halo_linear(plan: GraphShardPlan, num_src: int, num_edges: int, seed: int, batch: tuple) -> None:
    """halo_linear against exchange_halo + F.linear on ``plan``: outputs, gradients, bytes."""
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(num_src, *batch, 6, generator=g, dtype=torch.float64)
    weights = [torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)]
    biases = [torch.randn(5, generator=g, dtype=torch.float64), None]
    w_out = [torch.randn(num_edges, *batch, 5, generator=g, dtype=torch.float64),
             torch.randn(num_edges, *batch, 3, generator=g, dtype=torch.float64)]
    mine = [plan.shard_edges(w) for w in w_out]

    def run(fn):  # noqa: ANN001, ANN202
        x = plan.shard_src(x_full).clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        bs = [None if b is None else b.clone().requires_grad_() for b in biases]
        with CommCounter() as counter:
            outs = fn(x, ws, bs)
            loss = sum((o[plan.edge_index[0]] * w).sum() for o, w in zip(outs, mine, strict=True))
            loss.backward()
        return outs, [x.grad, *[w.grad for w in ws], bs[0].grad], counter.bytes("all_to_all")

    def reference(x, ws, bs):  # noqa: ANN001, ANN202
        ext = plan.exchange_halo(x)  # one exchange, then the products
        return [torch.nn.functional.linear(ext, w, b) for w, b in zip(ws, bs, strict=True)]

    ref_outs, ref_grads, ref_bytes = run(reference)
    outs, grads, nbytes = run(lambda x, ws, bs: halo_linear(plan, x, ws, bs))
    for a, b in zip(outs, ref_outs, strict=True):
        assert a.shape == (plan.num_src_local + plan.num_halo, *batch, b.shape[-1])
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads, strict=True):
        # replicated parameters: each rank holds the gradient of its own edges
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert nbytes == ref_bytes, (nbytes, ref_bytes)


def _check_halo_linear(rank, world):
    """halo_linear (exchange overlapped with the projections) equals exchange_halo + F.linear:
    outputs and gradients of rows, weights and biases, float64; the same bytes."""
    group = dist.group.WORLD
    for case, (num_src, num_dst, num_edges, limit) in enumerate(GRAPHS):
        edge_index = random_graph(num_src, num_dst, num_edges, seed=11 + case, dst_limit=limit)
        num_nodes = num_src if num_src == num_dst else (num_src, num_dst)
        plan = GraphShardPlan.build(edge_index, num_nodes, group)
        _compare_halo_linear(plan, num_src, num_edges, 100 + case, (2,) if case % 2 else ())

    # bf16 autocast: the products run in bf16, like F.linear under autocast
    edge_index = random_graph(50, 50, 250, seed=3)
    plan = GraphShardPlan.build(edge_index, 50, group)
    x = plan.shard_src(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)))
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = halo_linear(plan, x, [w], [None])
        ref = torch.nn.functional.linear(plan.exchange_halo(x), w)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)

    with pytest.raises(ValueError, match="one bias"):
        halo_linear(plan, x, [w], [])
    with pytest.raises(ValueError, match="weights must be"):
        halo_linear(plan, x, [torch.zeros(4, 7)], [None])
    with pytest.raises(ValueError, match="rows but rank"):
        halo_linear(plan, torch.zeros(plan.num_src_local + 1, 8), [w], [None])
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_halo_linear(world):
    run_distributed(_check_halo_linear, world)


def test_halo_smaller_than_all_gather_on_a_local_graph():
    """A graph whose edges are mostly local (a ring with short links) needs a small halo."""
    n = 1000
    src = torch.arange(n).repeat_interleave(4)
    dst = (src + torch.tensor([-2, -1, 1, 2]).repeat(n)) % n
    for world in (2, 3, 4):
        for r in range(world):
            plan = GraphShardPlan.for_rank(torch.stack([src, dst]), n, world, r)
            assert plan.num_halo == 4  # two rows from each neighbour
            assert plan.halo_bytes(8) * 50 < plan.all_gather_bytes(8)
