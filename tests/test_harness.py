"""The spawn helper itself: results come back, and failures fail fast with the rank's traceback."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import DistributedTestError, run_distributed


def _sum_ranks(rank, world):
    t = torch.tensor([rank], dtype=torch.float64)
    dist.all_reduce(t)
    return rank, world, t.item(), os.environ["OMP_NUM_THREADS"], dist.get_backend()


def _raise_on_rank_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank one")
    return rank


def _die_on_rank_zero(rank, world):
    if rank == 0:
        os._exit(3)
    time.sleep(30)


def _hang(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def test_results_come_back_in_rank_order():
    out = run_distributed(_sum_ranks, 3)
    assert out == [(r, 3, 3.0, "1", "gloo") for r in range(3)]


def test_exception_carries_rank_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)rank\(s\) \[1\] raised.*boom on rank one"):
        run_distributed(_raise_on_rank_one, 2)
    assert run_distributed(_sum_ranks, 2)[0][2] == 1.0  # the pool is rebuilt afterwards


def test_dead_rank_fails_fast():
    run_distributed(_sum_ranks, 2)  # the pool started first: its start-up (seconds on a loaded host) is not timed
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank\(s\) 0 \(exit code 3\) died"):
        run_distributed(_die_on_rank_zero, 2, timeout=60)
    assert time.monotonic() - start < 15


def test_hanging_rank_fails_after_timeout():
    run_distributed(_sum_ranks, 2)  # the pool started first: its start-up is not timed
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"did not finish within 3 s"):
        run_distributed(_hang, 2, timeout=3)
    assert time.monotonic() - start < 15
