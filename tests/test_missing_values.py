"""Missing values: a variable that is NaN over a fixed land region trains (imputed inputs, masked
loss and validation) and gives the same losses at 1, 2 and 4 ranks, with AIFS-style loss weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.normalisation import Normaliser, nan_fill_values
from stormshard.data.synthetic import SEA_FIELD, generate_synthetic_dataset, land_mask
from stormshard.training.launch import run_training
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "sst.zarr"
    generate_synthetic_dataset(path, grid="o8", steps=64, seed=1, sea_field=True)
    return str(path)


def test_generator_writes_a_land_masked_variable(dataset):
    ds = AnemoiDataset.open(dataset)
    assert ds.variables[-1] == SEA_FIELD and ds.variables_with_nans == [SEA_FIELD]
    assert ds.attributes["variables_with_nans"] == [SEA_FIELD]
    x = ds.read([0, 5])[:, -1, 0]  # (dates, cells)
    land = land_mask(ds.latitudes, ds.longitudes)
    assert 0 < land.mean() < 0.5
    assert np.isnan(x[:, land]).all() and np.isfinite(x[:, ~land]).all()
    assert np.isfinite(ds.statistics.mean).all() and np.isfinite(ds.statistics.stdev).all()


def test_fill_values_are_normalised_statistics(dataset):
    ds = AnemoiDataset.open(dataset)
    norm = Normaliser.from_statistics(ds.statistics, ds.variables, variables=["tracer_1", SEA_FIELD])
    fill = nan_fill_values(ds.statistics, ds.variables, norm)
    assert fill.tolist() == pytest.approx([0.0, 0.0], abs=1e-12)  # the mean: 0 after mean-std
    i = ds.variables.index(SEA_FIELD)
    fill = nan_fill_values(ds.statistics, ds.variables, norm, {SEA_FIELD: "minimum", "tracer_1": 280.0})
    expect_sst = (ds.statistics.minimum[i] - ds.statistics.mean[i]) / ds.statistics.stdev[i]
    expect_t1 = (280.0 - ds.statistics.mean[0]) / ds.statistics.stdev[0]
    assert fill.tolist() == pytest.approx([expect_t1, expect_sst])
    with pytest.raises(ValueError, match="data.imputation names \\['tracer_product'\\]"):
        nan_fill_values(ds.statistics, ds.variables, norm, {"tracer_product": "mean"})
    with pytest.raises(ValueError, match="'median'"):
        nan_fill_values(ds.statistics, ds.variables, norm, {SEA_FIELD: "median"})


def _train(rank, world, cfg):
    result = run_training(cfg)
    return result.losses, result.validation


LAYOUTS = [  # (world, gpus_per_model, micro batch): the same effective batch of 2
    (1, 1, 2),
    (2, 2, 2),
    (4, 4, 2),
]
SCALING = {"variables": {"tracer_product": 0.5, "sst": 2.0}, "default_weight": 1.0}


def test_nan_variable_trains_identically_at_1_2_and_4_ranks(dataset, tmp_path):
    runs = {}
    for world, gpm, micro in LAYOUTS:
        cfg = tiny_config(dataset, tmp_path / f"w{world}g{gpm}", **{
            "parallel.gpus_per_model": gpm, "training.micro_batch_size": micro, "training.rollout": 2,
            "training.validation_rollout": 2, "training.loss_scaling": SCALING,
            "data.imputation": {"sst": "mean"}})
        out = [_train(0, 1, cfg)] if world == 1 else run_distributed(_train, world, cfg)
        assert all(o[0] == out[0][0] for o in out), "ranks disagree on the logged loss"
        runs[(world, gpm)] = out[0]
    ref_losses, ref_val = runs[(1, 1)]
    assert len(ref_losses) == 3 and all(math.isfinite(x) for x in ref_losses)
    for lead in ("6h", "12h"):
        assert math.isfinite(ref_val["rmse_by_lead"][lead][SEA_FIELD])
        assert math.isfinite(ref_val["persistence_by_lead"][lead][SEA_FIELD])
    for layout, (losses, val) in runs.items():
        assert losses == pytest.approx(ref_losses, rel=2e-5), layout
        for lead, values in val["rmse_by_lead"].items():
            assert values == pytest.approx(ref_val["rmse_by_lead"][lead], rel=1e-4), (layout, lead)


def test_imputation_and_mask_inside_the_task(dataset, tmp_path):
    """The first-step loss of a batch with NaNs equals the loss of the same batch with its NaN
    inputs filled by hand and NaN targets dropped from a hand-written masked MSE."""
    from stormshard.training.config import load_experiment_config
    from stormshard.training.loop import Trainer

    cfg = load_experiment_config(tiny_config(dataset, tmp_path / "task", **{
        "engine": "local", "deepspeed": {}, "training.loss_scaling": SCALING, "data.imputation": {"sst": 0.5 + 290.0}}))
    trainer = Trainer(cfg)
    batch = trainer.read_batch(trainer.train_samples, [0, 3])
    assert torch.isnan(batch).any()
    loss = trainer.task.forecast_loss(trainer.engine, batch)
    assert torch.isfinite(loss)
    v, m = trainer.variables, cfg.model.multistep_input
    x = batch[:, :m][..., v.input_idx]
    fill = trainer.input_fill.float()
    j = v.input_names.index(SEA_FIELD)
    assert float(fill[j]) == pytest.approx((290.5 - trainer.dataset.statistics.mean[-1])
                                           / trainer.dataset.statistics.stdev[-1], rel=1e-6)
    x = torch.where(torch.isnan(x), fill, x)
    with torch.no_grad():
        pred = trainer.engine(x).double()
    target = batch[:, m][..., v.output_idx].double()
    valid = ~torch.isnan(target)
    w = trainer.area.double()[:, None] * torch.tensor(trainer.loss_weights, dtype=torch.float64)[None, :]
    err = torch.where(valid, pred - torch.nan_to_num(target), torch.zeros((), dtype=torch.float64)) ** 2
    expect = (err * w).sum() / (valid * w).sum()
    assert float(loss) == pytest.approx(float(expect), rel=1e-5)
    trainer.close()


def test_a_diverging_model_is_not_blamed_on_data(dataset, tmp_path):
    from stormshard.training.config import load_experiment_config
    from stormshard.training.loop import Trainer

    trainer = Trainer(load_experiment_config(tiny_config(dataset, tmp_path / "msg", engine="local", deepspeed={})))
    message = trainer.non_finite_message(float("nan"), 7)
    assert "missing values in the data cannot cause it" in message and "rollout 1" in message
