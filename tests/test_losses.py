"""Losses: sharded weighted MSE and almost-fair CRPS equal their single-process values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedMSELoss, almost_fair_crps
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
    for kind in ("mse", "crps"):
        full_in = (pred if kind == "mse" else ens).clone().requires_grad_()
        loss_fn = WeightedMSELoss(vw) if kind == "mse" else AlmostFairCRPSLoss(vw, alpha=0.9)
        ref = loss_fn(full_in, target, area)
        ref.backward()
        local_in = full_in.detach().narrow(-2, lo, n).clone().requires_grad_()
        loss = loss_fn(local_in, target.narrow(-2, lo, n), area.narrow(0, lo, n), group)
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
