"""Parallel layout, process groups, DeepSpeed mpu interface and batch arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel.topology import (
    LayoutError,
    ParallelLayout,
    batch_arithmetic,
    build_process_groups,
)
from tests.distributed import run_distributed


def _valid_layouts(world):
    for gpm in range(1, world + 1):
        if world % gpm:
            continue
        for rgs in [r for r in range(1, gpm + 1) if gpm % r == 0]:
            for ens in [e for e in range(gpm, world + 1) if e % gpm == 0 and world % e == 0]:
                yield ParallelLayout(world, gpm, rgs, ens)


def _is_partition(groups, world):
    flat = sorted(itertools.chain.from_iterable(groups))
    return flat == list(range(world))


@pytest.mark.parametrize("world", range(1, 9))
def test_layout_groups_partition_world(world):
    count = 0
    for layout in _valid_layouts(world):
        count += 1
        k = layout.gpus_per_model
        assert layout.data_parallel_size == world // k
        for family in (layout.model_groups(), layout.data_parallel_groups(), layout.reader_groups(),
                       layout.ensemble_groups(), layout.ensemble_data_parallel_groups(),
                       layout.ensemble_member_groups()):
            assert _is_partition(family, world)
        for rank in range(world):
            mg = layout.model_group_ranks(rank)
            assert rank in mg and mg == list(range(mg[0], mg[0] + k)) and mg[0] % k == 0
            dp = layout.data_parallel_group_ranks(rank)
            assert len(dp) == world // k and {r % k for r in dp} == {rank % k}
            rg = layout.reader_group_ranks(rank)
            assert set(rg) <= set(mg) and len(rg) == layout.read_group_size
            eg = layout.ensemble_group_ranks(rank)
            assert set(mg) <= set(eg) and len(eg) == layout.ensemble_size
            members = layout.ensemble_member_group_ranks(rank)
            assert set(members) <= set(eg) and {r % k for r in members} == {rank % k}
            assert len(members) == layout.ensemble_size // k
    assert count >= 1


def test_seed_worked_example():
    plan = batch_arithmetic(micro_batch=4, world_size=8, accumulation=1, gpus_per_model=2)
    assert (plan.model_parallel_size, plan.data_parallel_size, plan.effective_batch) == (2, 4, 16)
    layout = ParallelLayout(world_size=8, gpus_per_model=2)
    assert layout.data_parallel_size == 4
    assert layout.model_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # BioNeMo's formula with tensor x pipeline sizes and accumulation
    plan = batch_arithmetic(micro_batch=2, world_size=16, accumulation=3, tensor_model_parallel_size=4)
    assert plan.effective_batch == 2 * 16 * 3 // 4 and plan.data_parallel_size == 4


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=6, gpus_per_model=4), "world_size=6 is not a multiple of gpus_per_model=4"),
        (dict(world_size=4, gpus_per_model=4, read_group_size=3), "read_group_size=3 does not divide"),
        (dict(world_size=8, gpus_per_model=2, gpus_per_ensemble=3), "gpus_per_ensemble=3 is not a multiple"),
        (dict(world_size=6, gpus_per_model=2, gpus_per_ensemble=4), "gpus_per_ensemble=4 does not divide"),
        (dict(world_size=0), "world_size must be a positive integer, got 0"),
        (dict(world_size=4, gpus_per_model=-2), "gpus_per_model must be a positive integer, got -2"),
        (dict(world_size=4, read_group_size=0), "read_group_size must be a positive integer"),
        (dict(world_size=4, gpus_per_model=2, pipeline_model_parallel_size=2), "pipeline_model_parallel_size=2"),
        (dict(world_size=4, gpus_per_model=2, tensor_model_parallel_size=4), "must equal gpus_per_model=2"),
    ],
)
def test_bad_layouts(kwargs, fragment):
    with pytest.raises(LayoutError, match=fragment.replace("(", r"\(")):
        ParallelLayout(**kwargs)


def test_bad_batch_arithmetic():
    with pytest.raises(LayoutError, match="micro_batch must be a positive integer"):
        batch_arithmetic(micro_batch=0, world_size=2)
    with pytest.raises(LayoutError, match="world_size=6 is not a multiple of gpus_per_model=4"):  # ParallelLayout's rule
        batch_arithmetic(micro_batch=1, world_size=6, gpus_per_model=4)


def test_single_process_groups_without_distributed():
    groups = build_process_groups(ParallelLayout(1))
    assert groups.model_group is None and groups.get_data_parallel_world_size() == 1
    with pytest.raises(LayoutError, match="not initialised"):
        build_process_groups(ParallelLayout(2))


def _check_groups(rank, world, gpm, rgs, ens):
    layout = ParallelLayout(world, gpm, rgs, ens)
    groups = build_process_groups(layout)
    # every group really contains the ranks the layout says: sum the global ranks over it
    for group, ranks in [
        (groups.model_group, groups.model_group_ranks),
        (groups.data_parallel_group, groups.data_parallel_group_ranks),
        (groups.reader_group, groups.reader_group_ranks),
        (groups.ensemble_group, groups.ensemble_group_ranks),
        (groups.ensemble_member_group, groups.ensemble_member_group_ranks),
    ]:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), (t.item(), ranks)
        assert dist.get_world_size(group) == len(ranks)
    # DeepSpeed's mpu interface
    assert groups.get_model_parallel_world_size() == gpm
    assert groups.get_data_parallel_world_size() == world // gpm
    assert groups.get_model_parallel_rank() == dist.get_rank(groups.get_model_parallel_group())
    assert groups.get_data_parallel_rank() == dist.get_rank(groups.get_data_parallel_group())
    assert groups.get_tensor_model_parallel_world_size() == gpm
    assert groups.get_pipeline_model_parallel_world_size() == 1
    with pytest.raises(LayoutError, match="launch"):
        build_process_groups(ParallelLayout(world * 2, gpm))
    return True


@pytest.mark.parametrize("world, gpm, rgs, ens", [(2, 1, 1, 1), (2, 2, 2, 2), (4, 2, 1, 4), (4, 2, 2, 2), (4, 4, 2, 4)])
def test_process_groups(world, gpm, rgs, ens):
    run_distributed(_check_groups, world, gpm, rgs, ens)
