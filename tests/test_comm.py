"""The anemoi-compatible collectives: forward and gradients equal the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel import comm
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.shapes import balanced_sizes, get_shape_shards
from tests.distributed import run_distributed


def _groups(world: int, split: bool):
    """The group under test: the world, or (split) two halves, so one group lacks global rank 0."""
    if not split:
        return dist.group.WORLD, list(range(world))
    half = world // 2
    ranks_a, ranks_b = list(range(half)), list(range(half, world))
    group_a, group_b = dist.new_group(ranks_a), dist.new_group(ranks_b)
    mine = ranks_a if dist.get_rank() < half else ranks_b
    return (group_a if dist.get_rank() < half else group_b), mine


def _reference(shape, dim, seed, nranks):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.randn(shape, generator=g, dtype=torch.float64)
    per_rank = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(nranks)]
    return full, weight, per_rank


def _check_primitive(rank, world, kind, shape, dim, split):
    group, members = _groups(world, split)
    n = len(members)
    me = members.index(rank)
    seed = 1234
    full, weight, per_rank = _reference(shape, dim, seed, n)
    sizes = balanced_sizes(shape[dim], n)
    shapes = get_shape_shards(full, dim, group)
    assert [s[dim] for s in shapes] == sizes
    local_full = full.narrow(dim, sum(sizes[:me]), sizes[me])

    if kind == "shard":
        x = full.clone().requires_grad_()
        y = comm.shard_tensor(x, dim, shapes, group)
        ref_y = local_full
        # loss on each rank's slice; total loss = sum over ranks -> gradient of full = weight
        (y * weight.narrow(dim, sum(sizes[:me]), sizes[me])).sum().backward()
        torch.testing.assert_close(y, ref_y, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, weight)
    elif kind == "shard_no_gather":
        x = full.clone().requires_grad_()
        y = comm.shard_tensor(x, dim, shapes, group, gather_in_backward=False)
        w_local = weight.narrow(dim, sum(sizes[:me]), sizes[me])
        (y * w_local).sum().backward()
        expect = torch.zeros_like(full)
        expect.narrow(dim, sum(sizes[:me]), sizes[me]).copy_(w_local)
        torch.testing.assert_close(x.grad, expect)
    elif kind == "gather":
        x = local_full.clone().requires_grad_()
        y = comm.gather_tensor(x, dim, shapes, group)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        (y * weight).sum().backward()  # same loss on every rank
        torch.testing.assert_close(x.grad, weight.narrow(dim, sum(sizes[:me]), sizes[me]))
    elif kind == "sync":
        x = local_full.clone().requires_grad_()
        y = comm.sync_tensor(x, dim, shapes, group)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        (y * per_rank[me]).sum().backward()  # a different loss on every rank; total = sum
        total = sum(per_rank)
        torch.testing.assert_close(x.grad, total.narrow(dim, sum(sizes[:me]), sizes[me]))
    elif kind == "reduce":
        x = per_rank[me].clone().requires_grad_()
        y = comm.reduce_tensor(x, group)
        torch.testing.assert_close(y, sum(per_rank))
        (y * weight).sum().backward()
        torch.testing.assert_close(x.grad, weight)
    elif kind == "copy":
        x = full.clone().requires_grad_()
        y = comm.copy_tensor(x, group)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        (y * per_rank[me]).sum().backward()
        torch.testing.assert_close(x.grad, sum(per_rank))
    elif kind == "reduce_shard":
        x = per_rank[me].clone().requires_grad_()
        y = comm.reduce_shard_tensor(x, dim, shapes, group)
        total = sum(per_rank)
        torch.testing.assert_close(y, total.narrow(dim, sum(sizes[:me]), sizes[me]))
        w_local = weight.narrow(dim, sum(sizes[:me]), sizes[me])
        (y * w_local).sum().backward()
        torch.testing.assert_close(x.grad, weight)
    else:
        raise ValueError(kind)
    return True


KINDS = ["shard", "shard_no_gather", "gather", "sync", "reduce", "copy", "reduce_shard"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_primitives_world_group(world):
    def cases():
        for kind in KINDS:
            for shape, dim in [((1001, 3), 0), ((2, 7, 5), 1), ((3, 4, 10), -1)]:
                yield kind, shape, dim
    for kind, shape, dim in cases():
        run_distributed(_check_primitive, world, kind, shape, dim, False)


def _check_all_kinds_subgroups(rank, world):
    for kind in KINDS:
        for shape, dim in [((1001, 3), 0), ((2, 5, 3), 1)]:
            _check_primitive(rank, world, kind, shape, dim, True)
    return True


def test_primitives_subgroups_without_rank0():
    run_distributed(_check_all_kinds_subgroups, 4)


def _check_noop_and_counter(rank, world):
    x = torch.randn(5, 3, dtype=torch.float64)
    for fn in (comm.reduce_tensor, comm.copy_tensor):
        assert fn(x, None) is x
    assert comm.gather_tensor(x, 0, [[5, 3]], None) is x
    group = dist.group.WORLD
    shapes = [[s, 3] for s in balanced_sizes(7, world)]
    local = torch.ones(shapes[rank], dtype=torch.float32)
    with CommCounter() as outer:
        with CommCounter() as inner:
            comm.gather_tensor(local, 0, shapes, group)
        comm.reduce_tensor(torch.ones(4, 3), group)
    padded = max(s[0] for s in shapes) * 3 * 4
    assert inner.calls("all_gather") == 1 and inner.bytes("all_gather") == padded * (world - 1)
    assert inner.calls("all_reduce") == 0
    assert outer.calls() == 2 and outer.bytes("all_reduce") == 12 * 4 * 2 * (world - 1) // world
    return True


def test_noop_and_counter():
    run_distributed(_check_noop_and_counter, 2)


def _check_dtypes(rank, world):
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        shapes = [[s, 2] for s in balanced_sizes(5, world)]
        full = torch.arange(10).reshape(5, 2).to(dtype)
        local = full.narrow(0, sum(s[0] for s in shapes[:rank]), shapes[rank][0])
        out = comm.gather_tensor(local, 0, shapes, group)
        assert out.dtype == dtype and torch.equal(out, full)
    return True


def test_dtypes():
    run_distributed(_check_dtypes, 3)


def _check_shape_errors(rank, world):
    with pytest.raises(ValueError, match="process group has"):
        comm.gather_tensor(torch.zeros(2, 2), 0, [[2, 2]] * (world + 1), dist.group.WORLD)
    return True


def test_shape_errors():
    run_distributed(_check_shape_errors, 2)


def test_shape_helpers_and_memory_format():
    x = torch.zeros(1001, 3)
    assert get_shape_shards(x, 0, None) == []  # anemoi's convention: no group, nothing to shard
    from stormshard.parallel.anemoi_compat import get_memory_format
    from stormshard.parallel.shapes import change_channels_in_shape

    assert change_channels_in_shape([[2, 5, 7], [2, 4, 7]], 3) == [[2, 5, 3], [2, 4, 3]]
    # (1, 1, n, d) is both contiguous and channels-last: anemoi calls it channels_last, which
    # then allocates non-contiguous receive buffers; it must be contiguous_format
    for shape in [(1, 1, 7, 5), (2, 3, 1, 1), (1, 4, 1, 6), (3, 5)]:
        assert get_memory_format(torch.zeros(shape)) == torch.contiguous_format
    cl = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert get_memory_format(cl) == torch.channels_last
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        get_shape_shards(x, 2, None)
