"""Tensor-parallel linears, partitions, RNG tracker and TE fallback: parallel runs equal the dense reference."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stormshard.parallel import te_backend
from stormshard.parallel.comm import all_gather_along
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.grads import reduce_model_parallel_gradients
from stormshard.parallel.partition import Partition, get_partition
from stormshard.parallel.random import (
    REPLICATED_REGION,
    TENSOR_PARALLEL_REGION,
    RNGStatesTracker,
    TrackedDropout,
    tensor_parallel_rng_tracker,
)
from stormshard.parallel.shapes import balanced_sizes
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_state_dict,
    gather_partition,
    load_full_state_dict,
)
from tests.distributed import run_distributed

F64 = torch.float64
EXACT = {"rtol": 0.0, "atol": 0.0}
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def _narrow(t, dim, sizes, index):
    return t.narrow(dim, sum(sizes[:index]), sizes[index])


def _check_grads(layer, reference, group, sequence_parallel):
    """Gathered parameter gradients of ``layer`` equal ``reference``'s, on every rank.

    Sliced gradients are all-gathered; with sequence parallelism the replicated ones are summed
    over the group first, by the project's model-group gradient reduction.
    """
    if sequence_parallel:
        reduce_model_parallel_gradients(layer.parameters(), group)
    ref = dict(reference.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad
        part = get_partition(p)
        if part is not None:
            grad = all_gather_along(grad.contiguous(), part.dim, part.sizes, group)
        torch.testing.assert_close(grad, ref[name].grad, **TIGHT, msg=lambda m, n=name: f"grad of {n}: {m}")


def _linear_cases(rank, world, seq, batch=2, c_in=4, c_out=8):
    group = dist.group.WORLD
    seq_sizes = balanced_sizes(seq, world)
    shard = SequenceShard(seq_sizes, group)
    checked = 0
    for kind, bias, flag, sp in itertools.product(("column", "row"), (True, False), (True, False), (False, True)):
        torch.manual_seed(11)
        full = nn.Linear(c_in, c_out, bias=bias, dtype=F64)
        g = torch.Generator().manual_seed(5)
        x_full = torch.randn(batch, seq, c_in, generator=g, dtype=F64)
        w_out = torch.randn(batch, seq, c_out, generator=g, dtype=F64)
        x_ref = x_full.clone().requires_grad_()
        y_ref = full(x_ref)
        (y_ref * w_out).sum().backward()

        if kind == "column":
            layer = ColumnParallelLinear.from_linear(full, group, gather_output=flag,
                                                     sequence_shard=shard if sp else None)
            x = (_narrow(x_full, 1, seq_sizes, rank) if sp else x_full).clone().requires_grad_()
            y = layer(x)
            expect = y_ref if flag else _narrow(y_ref, 2, balanced_sizes(c_out, world), rank)
            torch.testing.assert_close(y, expect, **TIGHT)
            # gathered output: every rank computes the same loss; sliced: the loss is the sum over ranks
            weight = w_out if flag else _narrow(w_out, 2, balanced_sizes(c_out, world), rank)
            (y * weight).sum().backward()
            expect_grad = _narrow(x_ref.grad, 1, seq_sizes, rank) if sp else x_ref.grad
        else:
            layer = RowParallelLinear.from_linear(full, group, input_is_parallel=flag,
                                                  sequence_shard=shard if sp else None)
            x_in = _narrow(x_full, 2, balanced_sizes(c_in, world), rank) if flag else x_full
            x = x_in.clone().requires_grad_()
            y = layer(x)
            expect = _narrow(y_ref, 1, seq_sizes, rank) if sp else y_ref
            torch.testing.assert_close(y, expect, **TIGHT)
            weight = _narrow(w_out, 1, seq_sizes, rank) if sp else w_out
            (y * weight).sum().backward()
            expect_grad = _narrow(x_ref.grad, 2, balanced_sizes(c_in, world), rank) if flag else x_ref.grad
        torch.testing.assert_close(x.grad, expect_grad, **TIGHT)
        _check_grads(layer, full, group, sp)

        # partition metadata and the round trip to a full nn.Linear
        part = get_partition(layer.weight)
        split = 0 if kind == "column" else 1
        assert part == Partition(split, world, rank, full.weight.shape[split])
        if bias:
            assert (get_partition(layer.bias) is None) == (kind == "row")
        back = layer.to_linear()
        torch.testing.assert_close(back.weight, full.weight, **EXACT)
        if bias:
            torch.testing.assert_close(back.bias, full.bias, **EXACT)
        checked += 1
    return checked


def _init_cases(rank, world):
    """Fresh layers hold, gathered, exactly the nn.Linear built from the same seed."""
    group = dist.group.WORLD
    for cls, kwargs in ((ColumnParallelLinear, {}), (RowParallelLinear, {"input_is_parallel": True})):
        for bias in (True, False):
            torch.manual_seed(2024)
            layer = cls(12, 8, bias=bias, group=group, dtype=F64, **kwargs)
            after_layer = torch.rand(1)
            torch.manual_seed(2024)
            reference = nn.Linear(12, 8, bias=bias, dtype=F64)
            after_reference = torch.rand(1)
            back = layer.to_linear()
            torch.testing.assert_close(back.weight, reference.weight, **EXACT)
            if bias:
                torch.testing.assert_close(back.bias, reference.bias, **EXACT)
            # same generator consumption: what follows the construction is seeded the same way too
            torch.testing.assert_close(after_layer, after_reference, **EXACT)
    # full_state_dict / load_full_state_dict round trip
    torch.manual_seed(3)
    model = nn.Sequential(ColumnParallelLinear(4, 8, group=group, dtype=F64),
                          RowParallelLinear(8, 4, group=group, dtype=F64))
    full = full_state_dict(model, group)
    assert {k: tuple(v.shape) for k, v in full.items()} == {
        "0.weight": (8, 4), "0.bias": (8,), "1.weight": (4, 8), "1.bias": (4,)}
    torch.manual_seed(4)
    other = nn.Sequential(ColumnParallelLinear(4, 8, group=group, dtype=F64),
                          RowParallelLinear(8, 4, group=group, dtype=F64))
    load_full_state_dict(other, full)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    return True


def _error_cases(rank, world):
    group = dist.group.WORLD
    with pytest.raises(ValueError, match=rf"out_features=7 is not divisible by the tensor-parallel group size {world}"):
        ColumnParallelLinear(4, 7, group=group)
    with pytest.raises(ValueError, match=rf"in_features=5 is not divisible by the tensor-parallel group size {world}"):
        RowParallelLinear(5, 4, group=group)
    with pytest.raises(ValueError, match=r"out_features=11 is not divisible"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 11), group)
    with pytest.raises(ValueError, match=r"in_features=11 is not divisible"):
        RowParallelLinear.from_linear(nn.Linear(11, 4), group)
    with pytest.raises(TypeError, match="sequence_shard must be a SequenceShard or None"):
        ColumnParallelLinear(4, 12, group=group, sequence_shard=[3] * world)
    with pytest.raises(ValueError, match=rf"sequence_shard is split over a different process group \(1 ranks\) than "
                                          rf"the tensor-parallel group \({world} ranks\)"):
        RowParallelLinear(12, 4, group=group, sequence_shard=SequenceShard.unsharded(3))
    col = ColumnParallelLinear(4, 12, group=group, sequence_shard=SequenceShard([5] * world, group))
    with pytest.raises(ValueError, match=rf"has 3 rows along dim -2 .* gives this rank \(rank {rank} of {world}\) 5"):
        col(torch.randn(1, 3, 4))
    col = ColumnParallelLinear(4, 12, sequence_shard=SequenceShard([3] * world, group))  # the shard's group
    assert col.group is group and col.parts == world
    with pytest.raises(ValueError, match="input has 3 channels but in_features=4"):
        col(torch.randn(1, 3, 3))
    row = RowParallelLinear(12, 4, group=group)
    with pytest.raises(ValueError, match=rf"input has 12 channels but this rank expects {12 // world}"):
        row(torch.randn(1, 3, 12))
    return True


def _rng_cases(rank, world):
    group = dist.group.WORLD
    tracker = tensor_parallel_rng_tracker(seed=99, group=group)
    before = torch.get_rng_state()
    masks = {}
    for region in (TENSOR_PARALLEL_REGION, REPLICATED_REGION):
        with tracker.fork(region):
            masks[region] = torch.rand(64) < 0.5
    torch.testing.assert_close(torch.get_rng_state(), before, **EXACT)  # default stream untouched
    gathered = {region: all_gather_along(m.to(torch.uint8).unsqueeze(0), 0, [1] * world, group)
                for region, m in masks.items()}
    for r in range(1, world):
        assert torch.equal(gathered[REPLICATED_REGION][0], gathered[REPLICATED_REGION][r])
        assert not torch.equal(gathered[TENSOR_PARALLEL_REGION][0], gathered[TENSOR_PARALLEL_REGION][r])
    # a dropout on a column-parallel hidden layer: masks differ between ranks, and the layer stays
    # exactly reproducible from the seed
    drop = TrackedDropout(0.5, tensor_parallel_rng_tracker(seed=7, group=group))
    ones = torch.ones(2, 32, dtype=F64)
    first = drop(ones)
    again = TrackedDropout(0.5, tensor_parallel_rng_tracker(seed=7, group=group))(ones)
    torch.testing.assert_close(first, again, **EXACT)
    masks = all_gather_along((first != 0).to(torch.uint8), 0, [2] * world, group)
    for r in range(1, world):
        assert not torch.equal(masks[:2], masks[2 * r: 2 * r + 2])
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_linears_match_dense(world):
    """Column / row, bias or not, gather_output / input_is_parallel, with and without sequence
    parallelism (7 tokens: uneven shards on 2 and 4 ranks); then initialisation and errors."""
    assert run_distributed(_linear_cases, world, 7) == [16] * world
    assert all(run_distributed(_init_cases, world))
    if world > 1:
        assert all(run_distributed(_error_cases, world))
        assert all(run_distributed(_rng_cases, world))


def _uneven_sequence(rank, world):
    """Sequence-parallel column -> row on 3 ranks with 10 tokens (4/3/3), channels divisible by 3."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(5, 12, dtype=F64), nn.Linear(12, 5, dtype=F64)
    x_full = torch.randn(2, 10, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    x_ref = x_full.clone().requires_grad_()
    y_ref = fc2(F.gelu(fc1(x_ref)))
    y_ref.square().sum().backward()
    sizes = balanced_sizes(10, world)
    shard = SequenceShard(sizes, group)
    col = ColumnParallelLinear.from_linear(fc1, group, sequence_shard=shard)
    row = RowParallelLinear.from_linear(fc2, group, sequence_shard=shard)
    x = _narrow(x_full, 1, sizes, rank).clone().requires_grad_()
    with CommCounter() as counter:
        y = row(F.gelu(col(x)))
        y.square().sum().backward()
    torch.testing.assert_close(y, _narrow(y_ref, 1, sizes, rank), **TIGHT)
    torch.testing.assert_close(x.grad, _narrow(x_ref.grad, 1, sizes, rank), **TIGHT)
    # forward: 1 all-gather + 1 reduce-scatter; backward: 1 reduce-scatter + 1 all-gather
    counts = counter.as_dict()
    _check_grads(col, fc1, group, True)
    _check_grads(row, fc2, group, True)
    return counts


def test_three_ranks_uneven_shards_errors_and_rng():
    assert all(run_distributed(_error_cases, 3))
    assert all(run_distributed(_rng_cases, 3))
    out = run_distributed(_uneven_sequence, 3)
    for counts in out:
        assert counts["all_gather"]["calls"] == 2
        assert counts["reduce_scatter"]["calls"] == 2
        assert set(counts) == {"all_gather", "reduce_scatter"}


def test_single_process_is_plain_linear():
    torch.manual_seed(0)
    full = nn.Linear(3, 4, dtype=F64)
    x = torch.randn(2, 5, 3, dtype=F64)
    for layer in (ColumnParallelLinear.from_linear(full), RowParallelLinear.from_linear(full)):
        torch.testing.assert_close(layer(x), full(x), **EXACT)
        assert get_partition(layer.weight) == Partition(layer.split_dim, 1, 0, full.weight.shape[layer.split_dim])
        torch.testing.assert_close(gather_partition(layer.weight, None), full.weight, **EXACT)


def test_bad_arguments_raise_before_work():
    with pytest.raises(TypeError, match="in_features must be an int"):
        ColumnParallelLinear(4.0, 8)
    with pytest.raises(ValueError, match="out_features must be positive"):
        RowParallelLinear(4, 0)
    with pytest.raises(TypeError, match="sequence_shard must be a SequenceShard or None"):
        ColumnParallelLinear(4, 8, sequence_shard="yes")
    with pytest.raises(TypeError, match="gather_output must be True or False"):
        ColumnParallelLinear(4, 8, gather_output="yes")
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear"):
        ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="missing keys"):
        load_full_state_dict(nn.Linear(2, 2), {})


def test_rng_tracker_single_process():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    tracker.add("b", 2)
    with pytest.raises(ValueError, match="region 'a' already exists"):
        tracker.add("a", 3)
    with pytest.raises(ValueError, match="no region named 'c'"):
        with tracker.fork("c"):
            pass
    before = torch.get_rng_state()
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(8)
        with pytest.raises(RuntimeError, match="already forked"):
            with tracker.fork("a"):
                pass
    with tracker.fork("a"):
        second = torch.rand(8)
    assert not torch.equal(first, second)  # the region's stream advances
    assert torch.equal(first, torch.rand(8, generator=torch.Generator().manual_seed(1)))
    with tracker.fork("b"):
        other = torch.rand(8)
    assert not torch.equal(first, other)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(8), first)  # checkpointed states replay
    assert torch.equal(torch.get_rng_state(), before)
    drop = TrackedDropout(0.3, tracker, "b").eval()
    x = torch.ones(4)
    assert drop(x) is x


def test_transformer_engine_fallback():
    """Without TE (or on CPU) the layers run plain torch; use_te=True without TE fails clearly.

    The TE path itself needs Transformer Engine and a CUDA device: it is not tested here.
    """
    torch.manual_seed(0)
    full = nn.Linear(3, 4, dtype=F64)
    x = torch.randn(5, 3, dtype=F64)
    layer = ColumnParallelLinear.from_linear(full, use_te=None)
    torch.testing.assert_close(layer(x), full(x), **EXACT)
    if te_backend.transformer_engine_available():
        pytest.skip("Transformer Engine is installed: the missing-TE error cannot be checked")
    assert te_backend.resolve_use_te(None) is False
    with pytest.raises(ImportError, match="use_te=True but transformer_engine.pytorch cannot be imported"):
        ColumnParallelLinear(3, 4, use_te=True)
    with pytest.raises(TypeError, match="use_te must be None, True or False"):
        RowParallelLinear(3, 4, use_te="auto")
