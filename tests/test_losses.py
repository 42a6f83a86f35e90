"""Losses: the sharded weighted pointwise losses (MSE, MAE, Huber, log-cosh, RMSE) and almost-fair CRPS equal their
single-process values and gradients; each kind is anemoi-training's formula."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from stormshard.training.loss_kinds import LOSS_KINDS
from stormshard.training.losses import (
    AlmostFairCRPSLoss,
    WeightedMSELoss,
    WeightedPointwiseLoss,
    almost_fair_crps,
)
from tests.distributed import run_distributed


def _data(grid=1001, variables=4, batch=2, members=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(batch, grid, variables, generator=g, dtype=torch.float64)
    ens = torch.randn(batch, members, grid, variables, generator=g, dtype=torch.float64)
    target = torch.randn(batch, grid, variables, generator=g, dtype=torch.float64)
    area = torch.rand(grid, generator=g, dtype=torch.float64) + 0.1
    vw = torch.rand(variables, generator=g, dtype=torch.float64) + 0.5
    return pred, ens, target, area, vw


def test_weighted_mse_matches_definition():
    pred, _, target, area, vw = _data()
    loss = WeightedMSELoss(vw)(pred, target, area)
    expect = ((pred - target) ** 2 * vw * area[:, None]).sum() / (pred.shape[0] * area.sum() * vw.sum())
    torch.testing.assert_close(loss, expect)


def _anemoi_pointwise(diff, kind, delta):
    """anemoi-training 0.17's ``calculate_difference`` of each loss, as it writes them (log-cosh as log(cosh))."""
    if kind in ("mse", "rmse"):
        return torch.square(diff)
    if kind == "mae":
        return torch.abs(diff)
    if kind == "huber":
        a = torch.abs(diff)
        return torch.where(a < delta, 0.5 * torch.square(a), delta * (a - 0.5 * delta))
    return torch.log(torch.cosh(diff))


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_pointwise_losses_match_anemoi_formulas(kind):
    """Each kind's value and gradient against anemoi's formula with the MSE's weighting and reduction (the
    node weights summed over the grid, the variable weights' mean, the batch mean), float64, with and without a
    mask; the Huber threshold 0.7 so that both branches are taken."""
    pred, _, target, area, vw = _data(grid=301)
    pred = pred * 2.0  # errors up to ~8: log-cosh's large-|d| branch, Huber's linear part
    mask = torch.rand(target.shape, generator=torch.Generator().manual_seed(3)) > 0.2
    for m in (None, mask):
        x = pred.clone().requires_grad_()
        loss = WeightedPointwiseLoss(vw, kind, delta=0.7)(x, target, area, mask=m)
        loss.backward()
        y = pred.clone().requires_grad_()
        w = area[:, None] * vw if m is None else area[:, None] * vw * m
        # unmasked: batch * sum area * sum vw; masked: the weights of the valid points
        norm = pred.shape[0] * area.sum() * vw.sum() if m is None else w.sum()
        expect = (_anemoi_pointwise(y - target, kind, 0.7) * w).sum() / norm
        if kind == "rmse":
            expect = expect.sqrt()
        expect.backward()
        torch.testing.assert_close(loss, expect.detach(), rtol=1e-13, atol=0)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-11, atol=1e-16)
    if kind == "logcosh":  # finite where cosh overflows, gradient tanh(d)
        d = torch.tensor([1000.0, -1000.0, 0.0], dtype=torch.float64, requires_grad=True)
        out = WeightedPointwiseLoss(torch.ones(1, dtype=torch.float64), "logcosh")(
            d[None, :, None], torch.zeros(1, 3, 1, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        out.backward()
        torch.testing.assert_close(out, (2000.0 - 2 * torch.log(torch.tensor(2.0, dtype=torch.float64))) / 3)
        torch.testing.assert_close(d.grad, torch.tanh(d.detach()) / 3)


def test_pointwise_loss_bad_arguments():
    vw = torch.ones(2)
    with pytest.raises(ValueError, match="unknown loss kind 'l1': use one of mse, mae, huber, logcosh, rmse"):
        WeightedPointwiseLoss(vw, "l1")
    with pytest.raises(ValueError, match="Huber delta must be a positive number, got 0.0"):
        WeightedPointwiseLoss(vw, "huber", delta=0.0)


def test_crps_definitions():
    _, ens, target, _, _ = _data(grid=7)
    m = ens.shape[1]
    skill = (ens - target[:, None]).abs().mean(1)
    pair = (ens[:, :, None] - ens[:, None, :]).abs().sum((1, 2))
    fair = skill - pair / (2 * m * (m - 1))
    standard = skill - pair / (2 * m * m)
    torch.testing.assert_close(almost_fair_crps(ens, target, alpha=1.0), fair)
    torch.testing.assert_close(almost_fair_crps(ens, target, alpha=0.0), standard)
    torch.testing.assert_close(almost_fair_crps(ens, target, alpha=0.95), 0.95 * fair + 0.05 * standard)
    with pytest.raises(ValueError, match="at least 2 ensemble members"):
        almost_fair_crps(ens[:, :1], target)


def _check_sharded(rank, world):
    pred, ens, target, area, vw = _data()
    sizes = balanced_sizes(pred.shape[1], world)
    lo, n = balanced_offsets(sizes)[rank], sizes[rank]
    group = dist.group.WORLD
    mask = torch.rand(target.shape, generator=torch.Generator().manual_seed(5)) > 0.1
    for kind in (*LOSS_KINDS, "crps"):
        for m in (None, mask):
            full_in = (ens if kind == "crps" else pred).clone().requires_grad_()
            loss_fn = AlmostFairCRPSLoss(vw, alpha=0.9) if kind == "crps" else WeightedPointwiseLoss(vw, kind, 0.6)
            ref = loss_fn(full_in, target, area, mask=m)
            ref.backward()
            local_in = full_in.detach().narrow(-2, lo, n).clone().requires_grad_()
            local_mask = None if m is None else m.narrow(-2, lo, n)
            loss = loss_fn(local_in, target.narrow(-2, lo, n), area.narrow(0, lo, n), group, mask=local_mask)
            loss.backward()
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(local_in.grad, full_in.grad.narrow(-2, lo, n), rtol=1e-12, atol=1e-14)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_losses_equal_single_process(world):
    run_distributed(_check_sharded, world)


def test_bad_shapes():
    pred, _, target, area, vw = _data(grid=10)
    with pytest.raises(ValueError, match="area_weights has shape"):
        WeightedMSELoss(vw)(pred, target, area[:5])
    with pytest.raises(ValueError, match="variable_weights has shape"):
        WeightedMSELoss(vw[:2])(pred, target, area)


def test_mask_must_broadcast_to_the_target():
    pred, _, target, area, vw = _data(grid=10)
    loss = WeightedMSELoss(vw)
    full = loss(pred, target, area, mask=torch.ones(target.shape, dtype=torch.bool))
    torch.testing.assert_close(loss(pred, target, area, mask=torch.ones(1, 10, 1, dtype=torch.bool)), full)
    for shape in ((2, 9, 4), (3, 10, 4), (10, 3)):
        with pytest.raises(ValueError, match=rf"mask of shape \({', '.join(map(str, shape))}\) does not broadcast"):
            loss(pred, target, area, mask=torch.ones(shape, dtype=torch.bool))


def test_an_eager_step_imports_neither_dynamo_nor_sympy():
    """The kernels' eager path and the loss stay clear of torch._dynamo and sympy (~70 MiB per rank)."""
    import subprocess
    import sys

    code = """
import sys, torch
from stormshard.kernels.graph_csr import fused_graph_attention
from stormshard.kernels.dispatch import sliding_window_attention
from stormshard.training.losses import WeightedMSELoss
q, k, v = (torch.randn(6, 2, 4, requires_grad=True) for _ in range(3))
attr, w = torch.randn(9, 3), torch.randn(8, 3, requires_grad=True)
index = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2], [1, 2, 3, 4, 5, 0, 3, 4, 5]])
out = fused_graph_attention(q, k, v, attr, w, None, index).sum()
qw = torch.randn(1, 2, 50, 4, requires_grad=True)
out = out + sliding_window_attention(qw, qw, qw, 5, kernel="banded").sum()
pred = torch.randn(1, 6, 2, requires_grad=True)
out = out + WeightedMSELoss(torch.ones(2))(pred, torch.zeros(1, 6, 2), torch.ones(6), mask=torch.ones(1, 6, 1, dtype=torch.bool))
out.backward()
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
