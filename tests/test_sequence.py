"""Sequence primitives: head/sequence all-to-all and halo exchange equal slicing the full tensor.

Every distributed case checks the forward against the single-process slice and the gradient
against the analytic one (each rank's loss weights summed over the ranks), in float64, with
uneven shards, on 2, 3 and 4 ranks and on subgroups without global rank 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel.counter import CommCounter
from stormshard.parallel.sequence import (
    HaloPlan,
    add_halos,
    halo_exchange,
    remove_halos,
    shard_heads,
    shard_sequence,
)
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from tests.distributed import run_distributed

F64 = torch.float64


def _group(world: int, kind: str):
    """(group, members) for this rank; group None when this rank is not a member.

    kinds: "world"; "halves" (two groups, one without rank 0); "tail" (ranks 1.., without rank 0).
    """
    rank = dist.get_rank()
    if kind == "world":
        return dist.group.WORLD, list(range(world))
    if kind == "halves":
        half = world // 2
        a, b = list(range(half)), list(range(half, world))
        ga, gb = dist.new_group(a), dist.new_group(b)
        return (ga, a) if rank < half else (gb, b)
    if kind == "tail":
        members = list(range(1, world))
        group = dist.new_group(members)
        return (group if rank in members else None), members
    raise ValueError(kind)


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ------------------------------------------------------------------------------------------
# halo plan (no communication)
# ------------------------------------------------------------------------------------------


def test_halo_plan_counts():
    sizes = balanced_sizes(1001, 3)  # 334, 334, 333
    plan = HaloPlan.build(sizes, 1, 10)
    assert (plan.left, plan.right, plan.offset) == (10, 10, 334)
    assert plan.recv_counts == (10, 0, 10) and plan.send_counts == (10, 0, 10)
    assert plan.send_starts == (0, 0, 324) and plan.hops == 1
    # a halo longer than a neighbour's shard is filled from two ranks away
    plan = HaloPlan.build(sizes, 0, 400)
    assert (plan.left, plan.right) == (0, 400) and plan.recv_counts == (0, 334, 66) and plan.hops == 2
    plan = HaloPlan.build(sizes, 2, 400)
    assert (plan.left, plan.right) == (400, 0) and plan.recv_counts == (66, 334, 0)
    assert plan.send_counts == (66, 333, 0) and plan.send_starts == (0, 0, 0)
    # halo 0 and empty shards
    assert HaloPlan.build(sizes, 1, 0).recv_counts == (0, 0, 0)
    plan = HaloPlan.build([3, 0, 2], 1, 5)
    assert (plan.left, plan.right, plan.send_counts) == (3, 2, (0, 0, 0))
    # every row a rank receives is sent by its owner
    for halo in (0, 1, 5, 333, 334, 700, 2000):
        plans = [HaloPlan.build(sizes, r, halo) for r in range(3)]
        for a in range(3):
            for b in range(3):
                assert plans[a].send_counts[b] == plans[b].recv_counts[a]


def test_halo_plan_errors():
    with pytest.raises(ValueError, match="halo_size must be a non-negative int, got -1"):
        HaloPlan.build([3, 3], 0, -1)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        HaloPlan.build([3, 3], 2, 1)


def test_single_process_is_identity():
    x = torch.randn(2, 5, 3)
    y, plan = add_halos(x, 3, None)
    assert y is x and (plan.left, plan.right) == (0, 0)
    assert remove_halos(y, plan) is not None and torch.equal(remove_halos(y, plan), x)
    q = torch.randn(2, 4, 5, 3)
    assert shard_heads(q, [5], None) is q and shard_sequence(q, [5], None) is q


# ------------------------------------------------------------------------------------------
# halo exchange on ranks
# ------------------------------------------------------------------------------------------


def _check_halo(group, members, length, halo, layout, method, seed):
    me = members.index(dist.get_rank())
    n = len(members)
    sizes = balanced_sizes(length, n)
    offsets = balanced_offsets(sizes)
    if layout == "bsc":
        full, dim = _rand((2, length, 3), seed), 1
    elif layout == "bhsd":
        full, dim = _rand((2, 3, length, 2), seed), 2
    else:
        full, dim = _rand((length, 4), seed), 0
    local = full.narrow(dim, offsets[me], sizes[me]).clone().requires_grad_()
    ext, plan = add_halos(local, halo, group, sizes if seed % 2 == 0 else None, dim=dim, method=method)
    lo, hi = max(0, offsets[me] - halo), min(length, offsets[me] + sizes[me] + halo)
    torch.testing.assert_close(ext, full.narrow(dim, lo, hi - lo), rtol=0, atol=0)
    assert (plan.left, plan.right) == (offsets[me] - lo, hi - offsets[me] - sizes[me])
    torch.testing.assert_close(remove_halos(ext, plan, dim=dim), local, rtol=0, atol=0)
    # loss_r = sum(ext_r * weight_r[lo_r:hi_r]); gradient of the full input = sum of the windows
    expect = torch.zeros_like(full)
    for r in range(n):
        r_lo, r_hi = max(0, offsets[r] - halo), min(length, offsets[r] + sizes[r] + halo)
        weight = _rand(full.shape, seed + 100 + r)
        expect.narrow(dim, r_lo, r_hi - r_lo).add_(weight.narrow(dim, r_lo, r_hi - r_lo))
        if r == me:
            mine = weight.narrow(dim, lo, hi - lo)
    (ext * mine).sum().backward()
    torch.testing.assert_close(local.grad, expect.narrow(dim, offsets[me], sizes[me]), rtol=1e-14, atol=1e-14)


def _halo_cases(rank, world, kind):
    group, members = _group(world, kind)
    if group is None:
        return True
    n = len(members)
    seed = 0
    for method in ("all_to_all", "p2p"):
        for length in (1001, 4 * n + 1):
            sizes = balanced_sizes(length, n)
            halos = {0, 1, 2, min(sizes) - 1, min(sizes), max(sizes), max(sizes) + 1, 2 * max(sizes) + 3, length}
            for halo in sorted(h for h in halos if h >= 0):
                layout = ("bsc", "bhsd", "sc")[seed % 3]
                _check_halo(group, members, length, halo, layout, method, seed)
                seed += 1
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_exchange(world):
    run_distributed(_halo_cases, world, "world")


def _halo_subgroups(rank, world):
    _halo_cases(rank, world, "halves")
    _halo_cases(rank, world, "tail")
    return True


def test_halo_exchange_subgroups_without_rank0():
    run_distributed(_halo_subgroups, 4)


def _halo_bytes(rank, world):
    group = dist.group.WORLD
    sizes = balanced_sizes(1001, world)  # 334, 334, 333
    x = torch.zeros(2, sizes[rank], 5, dtype=torch.float32)
    for method, kind in (("all_to_all", "all_to_all"), ("p2p", "send")):
        with CommCounter() as counter:
            y = halo_exchange(x.requires_grad_(), 400, group, sizes, method=method)
            y.sum().backward()
        plan = HaloPlan.build(sizes, rank, 400)
        row = 2 * 5 * 4
        assert counter.calls(kind) == 2
        assert counter.bytes(kind) == row * (sum(plan.send_counts) + sum(plan.recv_counts))
    return True


def test_halo_bytes_counted():
    run_distributed(_halo_bytes, 3)


def _halo_errors(rank, world):
    group = dist.group.WORLD
    x = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="sizes lists 3 shards"):
        halo_exchange(x, 1, group, [4, 4, 4])
    with pytest.raises(ValueError, match=r"holds 4 rows along dim 1 but sizes \[5, 5\]"):
        halo_exchange(x, 1, group, [5, 5])
    with pytest.raises(ValueError, match="halo_size must be a non-negative int"):
        halo_exchange(x, -2, group, [4, 4])
    with pytest.raises(ValueError, match="method must be"):
        halo_exchange(x, 1, group, [4, 4], method="ring")
    _, plan = add_halos(x, 1, group, [4, 4])
    with pytest.raises(ValueError, match="remove_halos: dim -2 has 4 rows but the plan expects 5"):
        remove_halos(x, plan)
    return True


def test_halo_errors():
    run_distributed(_halo_errors, 2)


# ------------------------------------------------------------------------------------------
# shard_heads / shard_sequence
# ------------------------------------------------------------------------------------------


def _check_all_to_all(group, members, length, heads, seed):
    me, n = members.index(dist.get_rank()), len(members)
    sizes = balanced_sizes(length, n)
    offsets = balanced_offsets(sizes)
    hl = heads // n
    shapes = [[2, heads, s, 3] for s in sizes]
    full = _rand((2, heads, length, 3), seed)
    # shard_heads: loss_r = sum(y_r * w_r); the full gradient is the w_r stacked along heads
    local = full[:, :, offsets[me] : offsets[me] + sizes[me]].clone().requires_grad_()
    y = shard_heads(local, shapes, group)
    torch.testing.assert_close(y, full[:, me * hl : (me + 1) * hl], rtol=0, atol=0)
    weights = torch.cat([_rand((2, hl, length, 3), seed + 1 + r) for r in range(n)], dim=1)
    (y * weights[:, me * hl : (me + 1) * hl]).sum().backward()
    torch.testing.assert_close(local.grad, weights[:, :, offsets[me] : offsets[me] + sizes[me]], rtol=0, atol=0)
    # shard_sequence: the inverse, with sizes given as plain lengths
    heads_part = full[:, me * hl : (me + 1) * hl].clone().requires_grad_()
    z = shard_sequence(heads_part, sizes, group)
    torch.testing.assert_close(z, full[:, :, offsets[me] : offsets[me] + sizes[me]], rtol=0, atol=0)
    weights = torch.cat([_rand((2, heads, s, 3), seed + 50 + r) for r, s in enumerate(sizes)], dim=2)
    (z * weights[:, :, offsets[me] : offsets[me] + sizes[me]]).sum().backward()
    torch.testing.assert_close(heads_part.grad, weights[:, me * hl : (me + 1) * hl], rtol=0, atol=0)
    # round trip
    torch.testing.assert_close(shard_sequence(shard_heads(local.detach(), sizes, group), sizes, group),
                               local.detach(), rtol=0, atol=0)


def _all_to_all_cases(rank, world, kind):
    group, members = _group(world, kind)
    if group is None:
        return True
    n = len(members)
    for seed, (length, heads) in enumerate([(1001, n), (7 * n + n - 1, 2 * n), (n, 3 * n)]):
        _check_all_to_all(group, members, length, heads, seed)
    sizes = balanced_sizes(10, n)
    me = members.index(dist.get_rank())
    with CommCounter() as counter:
        shard_heads(torch.zeros(1, n, sizes[me], 2), sizes, group)
    assert counter.bytes("all_to_all") == sizes[me] * 2 * 4 * (n - 1)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_heads_and_sequence(world):
    run_distributed(_all_to_all_cases, world, "world")


def _all_to_all_subgroups(rank, world):
    _all_to_all_cases(rank, world, "halves")
    _all_to_all_cases(rank, world, "tail")
    return True


def test_shard_heads_subgroups_without_rank0():
    run_distributed(_all_to_all_subgroups, 4)


def _all_to_all_errors(rank, world):
    group = dist.group.WORLD
    sizes = balanced_sizes(10, world)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by the group size 3"):
        shard_heads(torch.zeros(1, 4, sizes[rank], 2), sizes, group)
    with pytest.raises(ValueError, match="shapes lists 2 shards but the process group has 3 ranks"):
        shard_heads(torch.zeros(1, 3, sizes[rank], 2), [5, 5], group)
    with pytest.raises(ValueError, match=r"holds 9 tokens but shapes say"):
        shard_heads(torch.zeros(1, 3, 9, 2), sizes, group)
    with pytest.raises(ValueError, match=r"input holds 9 tokens but the shard sizes \[4, 3, 3\] sum to 10"):
        shard_sequence(torch.zeros(1, 1, 9, 2), sizes, group)
    return True


def test_all_to_all_errors():
    run_distributed(_all_to_all_errors, 3)
