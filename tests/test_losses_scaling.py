"""Loss scaling as AIFS does it: per-variable and pressure-level weights, area weights, and the
masked (missing-value) loss: hand-computed references and sharded equivalence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stormshard.models.loss_weights import (
    LossScalingSettings,
    PressureLevelScaling,
    combined_weights,
    level_weight,
    split_level,
    variable_loss_weights,
)
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from stormshard.training.config import load_experiment_config
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedMSELoss
from tests.distributed import run_distributed

OUTPUTS = ["q_50", "q_850", "t_500", "t_1000", "2t", "tp"]


def test_level_forms_match_anemoi():
    relu = PressureLevelScaling(type="relu", slope=0.001, y_intercept=0.2)
    assert level_weight(50, relu) == 0.2 and level_weight(850, relu) == pytest.approx(0.85)
    lin = PressureLevelScaling(type="linear", slope=0.001, y_intercept=0.1)
    assert level_weight(500, lin) == pytest.approx(0.6)
    poly = PressureLevelScaling(type="polynomial", slope=0.002, y_intercept=0.5)
    assert level_weight(500, poly) == pytest.approx(1.5)
    assert level_weight(700, PressureLevelScaling(type="constant", y_intercept=0.7)) == 0.7
    assert split_level("t_850") == ("t", 850.0) and split_level("2t") is None and split_level("10u") is None


def test_variable_weights_by_name_parameter_and_level():
    s = LossScalingSettings(variables={"q": 0.6, "t": 6.0, "t_1000": 2.0, "tp": 0.025}, default_weight=1.0,
                            pressure_level=PressureLevelScaling(type="relu", slope=0.001, y_intercept=0.2))
    w = variable_loss_weights(OUTPUTS, s)
    expect = [0.6 * 0.2, 0.6 * 0.85, 6.0 * 0.5, 2.0 * 1.0, 1.0, 0.025]  # full name beats its parameter
    np.testing.assert_allclose(w, expect)
    only_t = LossScalingSettings(pressure_level=PressureLevelScaling(params=["t"]))
    np.testing.assert_allclose(variable_loss_weights(OUTPUTS, only_t), [1, 1, 0.5, 1.0, 1, 1])


@pytest.mark.parametrize("settings, fragment", [
    (LossScalingSettings(variables={"sst": 1.0}), "neither output variables nor parameters"),
    (LossScalingSettings(variables={"q": -1.0}), "negative or non-finite"),
    (LossScalingSettings(pressure_level=PressureLevelScaling(params=["u"])), "pressure_level.params names ['u']"),
    (LossScalingSettings(default_weight=0.0), "every output weight zero"),
    (LossScalingSettings(pressure_level=PressureLevelScaling(type="linear", slope=-1.0, y_intercept=0.0)),
     "negative weights"),
])
def test_bad_weights_name_the_field(settings, fragment):
    with pytest.raises(ValueError, match="training.loss_scaling") as err:
        variable_loss_weights(OUTPUTS, settings)
    assert fragment in str(err.value)


def test_scaled_loss_equals_hand_computation():
    """2 cells, 3 variables, batch 1: the number written out by hand."""
    pred = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]]], dtype=torch.float64)
    target = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    area = torch.tensor([1.0, 3.0], dtype=torch.float64)
    weights = torch.tensor(variable_loss_weights(["q_500", "t_850", "2t"], LossScalingSettings(
        variables={"q": 2.0}, pressure_level=PressureLevelScaling(slope=0.001, y_intercept=0.2))))
    assert weights.tolist() == pytest.approx([1.0, 0.85, 1.0])
    # squared errors: cell 0: 1, 4, 0; cell 1: 0, 1, 4
    numerator = 1 * (1 * 1.0 + 4 * 0.85 + 0) + 3 * (0 + 1 * 0.85 + 4 * 1.0)
    denominator = (1 + 3) * (1.0 + 0.85 + 1.0)
    loss = WeightedMSELoss(weights)(pred, target, area)
    assert float(loss) == pytest.approx(numerator / denominator, rel=1e-14)
    # the combined per-variable, per-cell weight W = area x variable weight
    W = combined_weights(area, weights)
    assert float(((pred - target) ** 2 * W).sum() / W.sum()) == pytest.approx(numerator / denominator, rel=1e-14)
    # with cell 1 of variable 2t missing: it leaves the sum and the normaliser
    target_nan = target.clone()
    target_nan[0, 1, 2] = float("nan")
    masked = WeightedMSELoss(weights)(pred, target_nan, area, mask=~torch.isnan(target_nan))
    assert float(masked) == pytest.approx((numerator - 3 * 4 * 1.0) / (denominator - 3 * 1.0), rel=1e-14)


def test_masked_loss_has_finite_gradients_and_ignores_nan_targets():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 10, 3, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 10, 3, generator=g, dtype=torch.float64)
    target[:, :4, 1] = float("nan")
    area, vw = torch.rand(10, generator=g, dtype=torch.float64) + 0.1, torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    loss = WeightedMSELoss(vw)(pred, target, area, mask=~torch.isnan(target))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pred.grad).all()
    assert (pred.grad[:, :4, 1] == 0).all()
    # any finite value at the masked points gives the same loss
    filled = torch.nan_to_num(target, nan=123.0)
    again = WeightedMSELoss(vw)(pred.detach(), filled, area, mask=~torch.isnan(target))
    assert float(again) == float(loss.detach())
    with pytest.raises(ValueError, match="bool"):
        WeightedMSELoss(vw)(pred, target, area, mask=torch.ones_like(target))


def _masked_sharded(rank, world):
    g = torch.Generator().manual_seed(3)
    grid = 1001
    pred = torch.randn(2, grid, 4, generator=g, dtype=torch.float64)
    ens = torch.randn(2, 3, grid, 4, generator=g, dtype=torch.float64)
    target = torch.randn(2, grid, 4, generator=g, dtype=torch.float64)
    target[:, 100:700, 2] = float("nan")  # a "land" block crossing the shard boundaries
    mask = ~torch.isnan(target)
    area = torch.rand(grid, generator=g, dtype=torch.float64) + 0.1
    vw = torch.tensor(variable_loss_weights(["q_50", "q_850", "sst", "2t"], LossScalingSettings(
        variables={"2t": 3.0}, pressure_level=PressureLevelScaling())), dtype=torch.float64)
    sizes = balanced_sizes(grid, world)
    lo, n = balanced_offsets(sizes)[rank], sizes[rank]
    out = []
    for full_in, loss_fn in ((pred, WeightedMSELoss(vw)), (ens, AlmostFairCRPSLoss(vw, alpha=0.95))):
        full = full_in.clone().requires_grad_()
        ref = loss_fn(full, target, area, mask=mask)
        ref.backward()
        local = full_in.narrow(-2, lo, n).clone().requires_grad_()
        loss = loss_fn(local, target.narrow(-2, lo, n), area.narrow(0, lo, n), dist.group.WORLD,
                       mask=mask.narrow(-2, lo, n))
        loss.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(local.grad, full.grad.narrow(-2, lo, n), rtol=1e-12, atol=1e-14)
        out.append(float(loss))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_masked_scaled_losses_are_the_same_at_every_layout(world):
    out = run_distributed(_masked_sharded, world)
    assert all(o == out[0] for o in out)


def test_config_reads_loss_scaling():
    cfg = load_experiment_config({"training": {"max_steps": 1, "warmup_steps": 0, "loss_scaling": {
        "variables": {"q": 0.6}, "pressure_level": {"type": "relu", "slope": 0.001, "y_intercept": 0.2}}}})
    assert cfg.training.loss_scaling.variables == {"q": 0.6}
    assert cfg.training.loss_scaling.pressure_level.type == "relu"
