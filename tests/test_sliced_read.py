"""``parallel.read_group_size`` for training: r readers per model group read the slices of the
ranks they serve and hand them out; every rank gets exactly what a direct read of its slice gives."""

from __future__ import annotations

import pytest
import torch

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import WindowedSampleDataset
from stormshard.data.sharded_read import ModelSliceReader, SliceReadPlan
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.parallel.shapes import balanced_sizes
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "synthetic.zarr"
    generate_synthetic_dataset(path, grid="o8", steps=16, seed=3, members=2)
    return str(path)


def test_plan_arithmetic():
    plan = SliceReadPlan((3, 3, 2, 2), readers=2, rank=3)
    assert plan.served == 2 and plan.reader == 2 and not plan.is_reader and list(plan.clients) == [2, 3]
    assert plan.cells(3) == slice(8, 10) and plan.read_cells == slice(6, 10)
    one = SliceReadPlan((3, 3, 2, 2), readers=1, rank=0)
    assert one.is_reader and one.read_cells == slice(0, 10) and list(one.clients) == [0, 1, 2, 3]
    assert SliceReadPlan((5,), readers=1, rank=0).read_cells == slice(0, 5)
    with pytest.raises(ValueError, match="read_group_size=3 must be a positive divisor of gpus_per_model=4"):
        SliceReadPlan((1, 1, 1, 1), readers=3, rank=0)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        SliceReadPlan((1, 1, 1, 1), readers=2, rank=4)


def _read_worker(rank, world, path):
    import torch.distributed as dist

    ds = AnemoiDataset.open(path)
    out = {}
    for ensemble in ("each", "all"):
        samples = WindowedSampleDataset(ds, multistep_input=2, rollout=1, ensemble=ensemble)
        sizes = tuple(balanced_sizes(ds.num_cells, world))  # uneven at world 3
        for readers in [r for r in range(1, world + 1) if world % r == 0]:
            reader = ModelSliceReader(SliceReadPlan(sizes, readers, rank), dist.group.WORLD)
            got = reader.read(samples, [1, 4])
            start = sum(sizes[:rank])
            want = torch.stack([samples.read(i, cells=slice(start, start + sizes[rank])) for i in (1, 4)])
            out[(ensemble, readers)] = (torch.equal(got, want), reader.store_reads)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_readers_hand_every_rank_its_slice(synthetic_path, world):
    results = run_distributed(_read_worker, world, synthetic_path)
    for rank, out in enumerate(results):
        for (ensemble, readers), (equal, reads) in out.items():
            assert equal, f"world {world} rank {rank} readers {readers} {ensemble}"
            served = world // readers
            assert reads == (2 if rank % served == 0 else 0), f"world {world} rank {rank} readers {readers}"


def test_reader_checks_its_group():
    with pytest.raises(ValueError, match="build it for this group"):
        ModelSliceReader(SliceReadPlan((2, 2), readers=1, rank=1), None)
