"""PowerSGD compression: exact paths equal the group mean, full rank is exact, error feedback is
lossless over time, 3 all-reduce calls per step with the expected bytes, resume, DDP hook."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stormshard.parallel.compression import (
    PowerSGDCompressor,
    PowerSGDConfig,
    exact_allreduce_gradients,
    make_plan,
    register_powersgd_hook,
)
from stormshard.parallel.counter import CommCounter
from tests.distributed import run_distributed

SHAPES = [(6, 5), (7,), (3, 8), (4, 3, 2), (2, 9), (5,), (6, 5)]


def _params(shapes, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _per_rank_grads(shapes, world, step, dtype=torch.float64, salt=0):
    """Every rank's gradients for ``step`` (all ranks can compute all of them)."""
    g = torch.Generator().manual_seed(1000 + step + 7919 * salt)
    return [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(world)]


def _set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _mean(per_rank):
    return [torch.stack(gs).mean(0) for gs in zip(*per_rank, strict=True)]


FULL = dict(start_iter=0, min_compression_rate=0.0, min_numel=0)


# --------------------------------------------------------------------------------------------
# exact paths and full rank
# --------------------------------------------------------------------------------------------


def _data_parallel_groups(world):
    """The whole world, and for 4 ranks also the data-parallel subgroups {0, 2} and {1, 3} of a
    layout with 2 GPUs per model (made on every rank, in the same order)."""
    out = [(dist.group.WORLD, list(range(world)))]
    if world == 4:
        subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        members = [0, 2] if dist.get_rank() % 2 == 0 else [1, 3]
        out.append((subgroups[dist.get_rank() % 2], members))
    return out


def _check_exact_and_full_rank(rank, world):
    for group, members in _data_parallel_groups(world):
        _check_group(members.index(rank), len(members), group, salt=1 + members[0])
    return True


def _check_group(rank, world, group, salt):
    """``rank``/``world``: this rank's position in ``group`` and its size; ``salt``: differs per group."""
    params = _params(SHAPES)
    for step in range(2):
        per_rank = _per_rank_grads(SHAPES, world, step, salt=salt)
        mean = _mean(per_rank)
        # baseline: one flat all-reduce
        _set_grads(params, per_rank[rank])
        with CommCounter() as c:
            exact_allreduce_gradients(params, group)
        assert c.calls("all_reduce") == 1
        for p, m in zip(params, mean, strict=True):
            torch.testing.assert_close(p.grad, m, rtol=1e-14, atol=1e-14)
        # compressor before start_iter: the same single exact call
        comp = PowerSGDCompressor(params, group, PowerSGDConfig(start_iter=5))
        _set_grads(params, per_rank[rank])
        with CommCounter() as c:
            comp.reduce_gradients()
        assert c.calls("all_reduce") == 1
        for p, m in zip(params, mean, strict=True):
            torch.testing.assert_close(p.grad, m, rtol=1e-14, atol=1e-14)
    # full rank: r >= min(rows, cols) compresses every >= 2-D tensor and reproduces the mean
    for warm in (True, False):
        for feedback in (True, False):
            cfg = PowerSGDConfig(rank=9, warm_start=warm, use_error_feedback=feedback, **FULL)
            comp = PowerSGDCompressor(params, group, cfg)
            assert len(comp.plan.compressed) == 5
            for step in range(3):
                per_rank = _per_rank_grads(SHAPES, world, step, salt=salt)
                _set_grads(params, per_rank[rank])
                with CommCounter() as c:
                    comp.reduce_gradients()
                assert c.calls("all_reduce") == 3
                for p, m in zip(params, _mean(per_rank), strict=True):
                    torch.testing.assert_close(p.grad, m, rtol=1e-10, atol=1e-10)
                # each rank keeps M_i - mean(M): their mean vanishes
                for e in comp.error_buffers().values():
                    total = e.clone()
                    dist.all_reduce(total, group=group)
                    torch.testing.assert_close(total, torch.zeros_like(e), rtol=0, atol=1e-10)


@pytest.mark.parametrize("world", [2, 4])
def test_exact_and_full_rank_equal_mean(world):
    assert all(run_distributed(_check_exact_and_full_rank, world))


# --------------------------------------------------------------------------------------------
# error feedback
# --------------------------------------------------------------------------------------------


def _check_error_feedback(rank, world):
    """sum_t approx_t + mean_i E_i,T == sum_t mean_i G_i,t exactly (E starts at zero)."""
    group = dist.group.WORLD
    shapes = [(12, 10), (9, 16), (10,)]
    params = _params(shapes)
    comp = PowerSGDCompressor(params, group, PowerSGDConfig(rank=1, **FULL))
    assert len(comp.plan.compressed) == 2
    steps = 6
    sum_approx = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sum_mean = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    worst = 0.0
    for step in range(steps):
        per_rank = _per_rank_grads(shapes, world, step)
        _set_grads(params, per_rank[rank])
        comp.reduce_gradients()
        for a, m, p, g in zip(sum_approx, sum_mean, params, _mean(per_rank), strict=True):
            a += p.grad
            m += g
            worst = max(worst, (p.grad - g).abs().max().item())
    assert worst > 1e-2, "rank 1 must be a real approximation of these gradients"
    errors = comp.error_buffers()
    for i, e in enumerate(comp.plan.entries):
        if not e.compressed:
            torch.testing.assert_close(sum_approx[i], sum_mean[i], rtol=1e-12, atol=1e-12)
            continue
        mean_error = errors[e.name].clone()
        dist.all_reduce(mean_error, group=group)
        mean_error /= world
        torch.testing.assert_close(sum_approx[i] + mean_error.view(e.shape), sum_mean[i], rtol=1e-10, atol=1e-10)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_tracks_sum_of_mean_gradients(world):
    assert all(run_distributed(_check_error_feedback, world))


# --------------------------------------------------------------------------------------------
# calls and bytes
# --------------------------------------------------------------------------------------------


def _mlp_shapes(layers, width=64):
    shapes = []
    for _ in range(layers):
        shapes += [(width, width), (width,)]
    return shapes


def _check_calls_and_bytes(rank, world):
    group = dist.group.WORLD
    r = 2
    for layers in (2, 12):
        for with_bias in (True, False):
            shapes = _mlp_shapes(layers) if with_bias else [s for s in _mlp_shapes(layers) if len(s) == 2]
            params = _params(shapes, torch.float32)
            comp = PowerSGDCompressor(params, group, PowerSGDConfig(rank=r, start_iter=1, min_numel=0))
            for step in range(3):
                _set_grads(params, _per_rank_grads(shapes, world, step, torch.float32)[rank])
                with CommCounter() as c:
                    comp.reduce_gradients()
                expected_calls = 1 if step == 0 else (3 if with_bias else 2)
                assert c.calls("all_reduce") == expected_calls, (layers, with_bias, step, c)
                if step == 0:
                    continue
                est = comp.bytes_per_step()
                assert c.bytes("all_reduce") == est.compressed
                ring = 2 * (world - 1) / world
                # per matrix (n + m) r elements instead of n m; biases stay exact
                n_bias = layers * 64 if with_bias else 0
                expect_c = (layers * (64 + 64) * r + n_bias) * 4 * ring
                expect_e = (layers * 64 * 64 + n_bias) * 4 * ring
                assert abs(c.bytes("all_reduce") - expect_c) <= 3
                assert abs(est.exact - expect_e) <= 1
            with CommCounter() as c:
                exact_allreduce_gradients(params, group)
            assert c.calls("all_reduce") == 1 and c.bytes("all_reduce") == est.exact
            assert est.ratio == pytest.approx(expect_e / expect_c, rel=1e-6)
    # overlap (async uncompressed bucket) changes the schedule, not the numbers
    shapes = _mlp_shapes(3)
    results = []
    for overlap in (True, False):
        params = _params(shapes, torch.float32)
        comp = PowerSGDCompressor(params, group, PowerSGDConfig(rank=r, start_iter=0, min_numel=0, overlap=overlap))
        for step in range(3):
            _set_grads(params, _per_rank_grads(shapes, world, step, torch.float32)[rank])
            comp.reduce_gradients()
        results.append([p.grad.clone() for p in params])
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_three_calls_per_step_and_bytes_fall(world):
    assert all(run_distributed(_check_calls_and_bytes, world))


# --------------------------------------------------------------------------------------------
# training: PowerSGD stays close to exact all-reduce; state_dict resumes identically
# --------------------------------------------------------------------------------------------

LOSS_MARGIN = 0.25  # PowerSGD final loss <= (1 + margin) * exact final loss


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).double()


def _batch(rank, step):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(32, 16, generator=g, dtype=torch.float64)
    w = torch.linspace(-0.5, 0.5, 64, dtype=torch.float64).view(16, 4)
    return x, x @ w + 0.5 * torch.tanh(x @ w.flip(0) * 2)


def _train(rank, world, steps, compress, cfg=None, comp_state=None, model_state=None, start=0):
    model = _mlp(0)
    if model_state is not None:
        model.load_state_dict(model_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comp = PowerSGDCompressor(model.named_parameters(), dist.group.WORLD, cfg) if compress else None
    if comp_state is not None:
        comp.load_state_dict(comp_state)
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        comp.reduce_gradients() if compress else exact_allreduce_gradients(model.parameters(), dist.group.WORLD)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
    return model, comp, losses


def _check_training(rank, world):
    cfg = PowerSGDConfig(rank=2, start_iter=5, min_numel=256)
    steps = 80
    _, _, exact = _train(rank, world, steps, compress=False)
    _, comp, power = _train(rank, world, steps, compress=True, cfg=cfg)
    assert len(comp.plan.compressed) == 2
    return exact, power


def test_powersgd_training_stays_close_to_exact():
    exact, power = run_distributed(_check_training, 2)[0]
    assert exact[-1] < 0.3 * exact[0], "the exact run must learn"
    tail_exact, tail_power = sum(exact[-10:]) / 10, sum(power[-10:]) / 10
    assert tail_power <= (1 + LOSS_MARGIN) * tail_exact, (tail_exact, tail_power)
    assert power[:5] == exact[:5] and power[10:] != exact[10:], "exact before start_iter, compressed after"


def _check_resume(rank, world):
    cfg = PowerSGDConfig(rank=2, start_iter=2, min_numel=256)
    model, comp, _ = _train(rank, world, 6, compress=True, cfg=cfg)
    comp_state = comp.state_dict()
    # continue on fixed gradients: the original compressor vs a fresh one loaded from the state
    shapes = [tuple(p.shape) for p in model.parameters()]

    def continue_run(compressor):
        out = []
        params = list(model.parameters())
        for step in range(3):
            _set_grads(params, _per_rank_grads(shapes, world, 50 + step)[rank])
            compressor.reduce_gradients()
            out.append([p.grad.clone() for p in params])
        return out

    reference = continue_run(comp)
    fresh = PowerSGDCompressor(model.named_parameters(), dist.group.WORLD, cfg)
    fresh.load_state_dict(comp_state)
    resumed = continue_run(fresh)
    for a, b in zip(reference, resumed, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    # a mismatched config is refused
    with pytest.raises(ValueError, match="rank"):
        PowerSGDCompressor(model.parameters(), dist.group.WORLD, PowerSGDConfig(rank=3)).load_state_dict(comp_state)
    return True


def test_state_dict_round_trip_resumes_identically():
    assert all(run_distributed(_check_resume, 2))


# --------------------------------------------------------------------------------------------
# DDP hook
# --------------------------------------------------------------------------------------------


def _check_ddp(rank, world):
    group = dist.group.WORLD
    cfg = PowerSGDConfig(rank=2, start_iter=2, min_numel=256)
    for as_view in (False, True):
        torch.manual_seed(3)
        base = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 48), nn.Linear(48, 4))
        base = base.double()
        plain = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(base, bucket_cap_mb=0.03, gradient_as_bucket_view=as_view)
        state = register_powersgd_hook(ddp, cfg)
        comp = PowerSGDCompressor(plain.parameters(), group, cfg)
        calls, buckets = [], []
        for step in range(5):
            x, _ = _batch(rank, step)
            with CommCounter() as c:
                ddp(x).pow(2).sum().backward()
            calls.append(c.calls("all_reduce"))
            buckets.append(state.buckets_last_step)
            plain(x).pow(2).sum().backward()
            if step < 2:  # before start_iter: the exact mean of the per-rank gradients
                everyone = []
                for p in plain.parameters():
                    gathered = [torch.zeros_like(p.grad) for _ in range(world)]
                    dist.all_gather(gathered, p.grad, group=group)
                    everyone.append(torch.stack(gathered).mean(0))
            comp.reduce_gradients()
            if step < 2:
                for p, m in zip(plain.parameters(), everyone, strict=True):
                    torch.testing.assert_close(p.grad, m, rtol=1e-13, atol=1e-13)
            for p, q in zip(ddp.module.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
                if as_view:
                    p.grad.zero_()
                else:
                    p.grad = None
                q.grad = None
        assert calls[:2] == [1, 1] and calls[2:] == [3, 3, 3], calls
        assert max(buckets[1:]) > 1, f"DDP should use several buckets here, got {buckets}"
        assert state.compressor.step == 5
    return True


def test_ddp_hook_matches_compressor_on_two_ranks():
    assert all(run_distributed(_check_ddp, 2))


# --------------------------------------------------------------------------------------------
# single process, plan and bad input
# --------------------------------------------------------------------------------------------


def test_single_process_needs_no_group():
    params = _params(SHAPES)
    comp = PowerSGDCompressor(params, None, PowerSGDConfig(rank=9, **FULL))
    grads = _per_rank_grads(SHAPES, 1, 0)[0]
    _set_grads(params, grads)
    with CommCounter() as c:
        comp.reduce_gradients()
    assert c.calls() == 0
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)
    assert comp.bytes_per_step().compressed == 0


def test_zero_gradient_does_not_stall_warm_start():
    """A zero gradient makes Q vanish; its columns are redrawn, so later steps are still exact at full rank."""
    params = _params([(6, 5), (4, 7)])
    comp = PowerSGDCompressor(params, None, PowerSGDConfig(rank=7, **FULL))
    _set_grads(params, [torch.zeros(6, 5, dtype=torch.float64), torch.zeros(4, 7, dtype=torch.float64)])
    comp.reduce_gradients()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    for step in range(2):
        grads = _per_rank_grads([(6, 5), (4, 7)], 1, step)[0]
        _set_grads(params, grads)
        comp.reduce_gradients()
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def test_non_contiguous_gradients():
    params = _params([(6, 5), (5,)])
    comp = PowerSGDCompressor(params, None, PowerSGDConfig(rank=5, **FULL))
    grads = [torch.randn(5, 6, dtype=torch.float64).t(), torch.randn(10, dtype=torch.float64)[::2]]
    expect = [g.clone() for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    assert not params[0].grad.is_contiguous()
    comp.reduce_gradients()
    for p, g in zip(params, expect, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def test_bfloat16_gradients():
    params = _params([(64, 32), (32,)], torch.bfloat16)
    comp = PowerSGDCompressor(params, None, PowerSGDConfig(rank=32, **FULL))
    grads = _per_rank_grads([(64, 32), (32,)], 1, 0, torch.bfloat16)[0]
    _set_grads(params, grads)
    comp.reduce_gradients()
    assert params[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(params[0].grad.float(), grads[0].float(), rtol=0.05, atol=0.05)
    assert torch.equal(params[1].grad, grads[1])


def test_plan_rules():
    cfg = PowerSGDConfig(rank=4, min_compression_rate=2.0, min_numel=100)
    plan = make_plan(["a", "b", "c", "d", "e"], [(64, 64), (64,), (8, 8), (12, 12), (1024, 3)], cfg)
    by_name = {e.name: e for e in plan.entries}
    assert by_name["a"].compressed  # 4096 >= 2 * 128 * 4
    assert not by_name["b"].compressed  # 1-D
    assert not by_name["c"].compressed  # 64 elements < min_numel
    assert by_name["d"].compressed is False  # 144 < 2 * 24 * 4: no saving
    assert by_name["e"].compressed is False and by_name["e"].rank == 3  # rank capped at cols; 3072 < 2*1027*3
    assert plan.p_numel == 64 * 4 and plan.q_numel == 64 * 4 and plan.exact_numel == 64 + 64 + 144 + 3072


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rank=0), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(rank=True), "rank"),
        (dict(start_iter=-1), "start_iter"),
        (dict(min_compression_rate=-1.0), "min_compression_rate"),
        (dict(min_compression_rate=math.inf), "min_compression_rate"),
        (dict(min_numel=-5), "min_numel"),
        (dict(orthogonalisation_eps=0.0), "orthogonalisation_eps"),
        (dict(orthogonalisation_eps=math.nan), "orthogonalisation_eps"),
        (dict(warm_start="yes"), "warm_start"),
        (dict(use_error_feedback=1), "use_error_feedback"),
        (dict(seed=-1), "seed"),
        (dict(overlap=None), "overlap"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"PowerSGDConfig.{field}"):
        PowerSGDConfig(**kwargs)


def test_bad_parameters_raise_before_work():
    a = nn.Parameter(torch.zeros(4, 4))
    b = nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one compressor handles one dtype"):
        PowerSGDCompressor([a, b], None)
    with pytest.raises(ValueError, match="no trainable parameter"):
        PowerSGDCompressor([nn.Parameter(torch.zeros(3), requires_grad=False)], None)
    with pytest.raises(TypeError, match="params\\[0\\]"):
        PowerSGDCompressor([3], None)
    with pytest.raises(TypeError, match="PowerSGDConfig"):
        PowerSGDCompressor([a], None, {"rank": 2})
    comp = PowerSGDCompressor([("w", a)], None)
    with pytest.raises(ValueError, match="'w' has no gradient"):
        comp.reduce_gradients()
    assert comp.step == 0
    comp = PowerSGDCompressor([("w", a)], None, allow_missing_grads=True)
    comp.reduce_gradients()
    assert torch.equal(a.grad, torch.zeros(4, 4))
