"""Verification scores against direct formulas: RMSE, anomaly correlation, ensemble CRPS (against
the integral of the squared CDF difference), spread/skill (1 for a reliable ensemble), the
hour-of-day climatology of the training period, combining dates, and the score plots."""

from __future__ import annotations

import numpy as np
import pytest

from stormshard.data.anemoi_layout import AnemoiDataset, write_anemoi_dataset
from stormshard.inference.plots import plot_scores
from stormshard.inference.verification import (
    acc,
    combine_scores,
    compute_climatology,
    crps,
    rmse,
    score_forecast,
    spread,
)


def test_rmse_and_acc_match_the_formulas():
    rng = np.random.default_rng(0)
    pred, truth, clim = rng.normal(size=(3, 2, 50, 4))
    w = rng.uniform(0.5, 2.0, 50)
    wn = w / w.sum()
    want = np.sqrt((wn[:, None] * (pred - truth) ** 2).sum(axis=1))
    np.testing.assert_allclose(rmse(pred, truth, w), want)
    got = acc(pred, truth, clim, w)
    for s in range(2):
        for v in range(4):
            a, o = pred[s, :, v] - clim[s, :, v], truth[s, :, v] - clim[s, :, v]
            a, o = a - (wn * a).sum(), o - (wn * o).sum()
            assert got[s, v] == pytest.approx((wn * a * o).sum() / np.sqrt((wn * a * a).sum() * (wn * o * o).sum()))
    np.testing.assert_allclose(acc(truth, truth, clim, w), 1.0)


def test_crps_equals_the_integral_of_the_squared_cdf_difference():
    rng = np.random.default_rng(1)
    members = rng.normal(size=(5, 1, 3, 1))
    truth = rng.normal(size=(1, 3, 1))
    w = np.ones(3)
    x = np.linspace(-8, 8, 160001)
    want = []
    for g in range(3):
        cdf = (members[:, 0, g, 0][:, None] <= x[None]).mean(axis=0)
        step = (x >= truth[0, g, 0]).astype(float)
        want.append(np.trapezoid((cdf - step) ** 2, x))
    assert crps(members, truth, w)[0, 0] == pytest.approx(np.mean(want), rel=1e-3)
    np.testing.assert_allclose(crps(members[:1], truth, w), np.abs(members[0] - truth).mean(axis=1))  # one member: MAE


def test_spread_skill_is_one_for_a_reliable_ensemble():
    rng = np.random.default_rng(2)
    m, g = 4, 200_000
    centre = rng.normal(size=(1, g, 1))
    members = centre[None] + rng.normal(size=(m, 1, g, 1))
    truth = centre + rng.normal(size=(1, g, 1))  # truth drawn like a member
    scores = score_forecast(members, truth, truth[0], np.zeros_like(truth), np.ones(g), ["x"])["x"]
    assert scores["spread_skill"][0] == pytest.approx(1.0, abs=0.01)
    assert scores["spread"][0] == pytest.approx(np.sqrt((members.var(axis=0, ddof=1)).mean()))
    np.testing.assert_allclose(spread(members, np.ones(g)), [[scores["spread"][0]]])


def test_climatology_per_hour_of_the_training_period(tmp_path):
    dates = np.arange(np.datetime64("2020-01-01T00"), np.datetime64("2020-01-05T00"), np.timedelta64(6, "h"))
    data = np.zeros((len(dates), 2, 1, 3), dtype=np.float32)
    for i, d in enumerate(dates):
        data[i, 0, 0] = d.astype(object).hour + 100 * (d.astype(object).day - 1)
        data[i, 1, 0] = i
    path = tmp_path / "c.zarr"
    write_anemoi_dataset(path, data, dates, np.zeros(3), np.arange(3.0), ["a", "b"], frequency="6h",
                         missing_dates=["2020-01-02T06"])
    ds = AnemoiDataset.open(path)
    clim = compute_climatology(ds, ["a"], None, "2020-01-03T18")
    assert clim.hours == [0, 6, 12, 18] and clim.period == ("2020-01-01T00:00:00", "2020-01-03T18:00:00")
    assert clim.mean[0, 0, 0] == pytest.approx(100.0)  # days 1-3 at 00 UTC
    assert clim.mean[1, 0, 0] == pytest.approx(6 + (0 + 200) / 2)  # 2020-01-02T06 is missing
    valid = np.array(["2020-01-04T12", "2020-01-04T00"], dtype="datetime64[s]")
    np.testing.assert_allclose(clim.at(valid)[:, 0, 0], [112.0, 100.0])
    with pytest.raises(ValueError, match=r"not \[3\]"):
        clim.at(np.array(["2020-01-04T03"], dtype="datetime64[s]"))
    with pytest.raises(ValueError, match="no dates in the training period"):
        compute_climatology(ds, ["a"], "2021-01-01", None)
    clim.save(tmp_path / "clim.npz")
    again = type(clim).load(tmp_path / "clim.npz")
    np.testing.assert_array_equal(again.mean, clim.mean)
    assert again.hours == clim.hours and again.names == ["a"] and again.samples == clim.samples


def test_combine_scores_and_plots(tmp_path):
    a = {"x": {"rmse": [1.0, 2.0], "acc": [0.9, 0.5], "crps": [0.2, 0.4], "spread": [1.0, 1.0],
               "spread_skill": [1.0, 0.5]}}
    b = {"x": {"rmse": [3.0, 2.0], "acc": [0.7, 0.3], "crps": [0.4, 0.2], "spread": [3.0, 1.0],
               "spread_skill": [1.0, 0.5]}}
    out = combine_scores([a, b], members=3)["x"]
    np.testing.assert_allclose(out["rmse"], [np.sqrt(5.0), 2.0])
    np.testing.assert_allclose(out["acc"], [0.8, 0.4])
    np.testing.assert_allclose(out["crps"], [0.3, 0.3])
    np.testing.assert_allclose(out["spread_skill"], np.sqrt(4 / 3) * np.array([1.0, 0.5]))
    paths = plot_scores({"x": out}, [6.0, 12.0], tmp_path / "plots", "test")
    assert [p.name for p in paths] == ["scores_x.png"]
    assert paths[0].read_bytes()[:4] == b"\x89PNG"
