"""Forecasts from an exported bundle: the rollout follows the training convention, the output is a
readable anemoi-layout store (and CF netCDF with the netcdf extra), the scores per lead time
(model, persistence, climatology) are right, maps and score plots are PNGs, and bad requests
(dates, missing dates, coordinates, formats) fail before anything is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stormshard.checkpoint.export import export_bundle, load_model
from stormshard.data.anemoi_layout import AnemoiDataset, write_anemoi_dataset
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.inference.forecast import run_forecast
from stormshard.inference.outputs import netcdf_engine
from stormshard.inference.request import forecast_outputs
from stormshard.training.launch import run_training
from tests.tiny_run import BASE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast")
    dataset = root / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    cfg = copy.deepcopy(BASE)
    cfg["data"]["path"] = str(dataset)
    cfg["training"].update(output_dir=str(root / "run"), max_steps=20, lr=3e-3)
    cfg["engine"], cfg["deepspeed"] = "local", {}  # the deepspeed section is read by engine deepspeed only
    run_training(cfg)
    bundle = export_bundle(root / "run" / "checkpoints", root / "bundle")
    return {"root": root, "dataset": str(dataset), "bundle": bundle}


def _reference_rollout(bundle, ds: AnemoiDataset, t0: int, steps: int) -> np.ndarray:
    """Step by step, by variable name: prognostic variables from the previous prediction,
    forcings from the dataset at the predicted time."""
    v, m = bundle.variables, bundle.multistep_input
    names = list(ds.variables)
    field = lambda t, name: torch.from_numpy(ds.read([t])[0, names.index(name), 0].astype(np.float64))  # noqa: E731
    states = [{n: field(t, n) for n in v.input_names} for t in range(t0 - m + 1, t0 + 1)]
    out = []
    for k in range(1, steps + 1):
        x = torch.stack([torch.stack([s[n] for n in v.input_names], dim=-1) for s in states])[None]
        pred = bundle.predict(x)[0]
        out.append(pred.numpy())
        nxt = {n: field(t0 + k, n) for n in v.forcing}
        nxt.update({n: pred[:, v.output_names.index(n)] for n in v.prognostic})
        states = states[1:] + [nxt]
    return np.stack(out)


def _png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_forecast_outputs_scores_and_maps(setup, tmp_path):
    bundle = load_model(setup["bundle"])
    ds = AnemoiDataset.open(setup["dataset"])
    date, steps = "2020-01-12T00", 3
    out = tmp_path / "fc"
    result = run_forecast(bundle, setup["dataset"], date, steps, out, plot_variables=["tracer_1", "tracer_product"],
                          plot_steps=[1, 3], verbose=False)
    t0 = ds.date_index(date)
    forecast = result.read(0)[0]
    np.testing.assert_allclose(forecast, _reference_rollout(bundle, ds, t0, steps), rtol=1e-5, atol=1e-5)

    store = AnemoiDataset.open(out / "forecast.zarr")
    names = list(bundle.variables.output_names)
    assert store.variables == names and store.num_dates == steps and store.num_cells == ds.num_cells
    assert [str(d) for d in store.dates] == ["2020-01-12T06:00:00", "2020-01-12T12:00:00", "2020-01-12T18:00:00"]
    np.testing.assert_array_equal(store.latitudes, ds.latitudes)
    np.testing.assert_allclose(store.statistics.mean, forecast.mean(axis=(0, 1)), rtol=1e-5)

    report = json.loads((out / "scores.json").read_text())
    assert report["lead_hours"] == [6.0, 12.0, 18.0] and report["init_dates"] == ["2020-01-12T00:00:00"]
    w = bundle.graph["data"].area_weight.double().numpy()
    w = w / w.sum()
    train = [i for i, d in enumerate(ds.dates) if d <= np.datetime64("2020-01-10T18")]
    for j, name in enumerate(names):
        col = ds.variables.index(name)
        init = ds.read([t0])[0, col, 0]
        for k in range(steps):
            truth = ds.read([t0 + k + 1])[0, col, 0]
            hour = (k + 1) * 6 % 24
            clim = np.mean([ds.read([i])[0, col, 0] for i in train if ds.dates[i].astype(object).hour == hour], axis=0)
            s = report["scores"][name]
            assert s["rmse"][k] == pytest.approx(np.sqrt((w * (forecast[k, :, j] - truth) ** 2).sum()), rel=1e-5)
            assert s["rmse_persistence"][k] == pytest.approx(np.sqrt((w * (init - truth) ** 2).sum()), rel=1e-6)
            assert s["rmse_climatology"][k] == pytest.approx(np.sqrt((w * (clim - truth) ** 2).sum()), rel=1e-6)
            a, o = init - clim, truth - clim
            a, o = a - (w * a).sum(), o - (w * o).sum()
            assert s["acc_persistence"][k] == pytest.approx((w * a * o).sum() / np.sqrt((w * a * a).sum() * (w * o * o).sum()), abs=1e-6)
    maps = sorted(p.name for p in (out / "maps").iterdir())
    assert maps == ["tracer_1_step001.png", "tracer_1_step003.png", "tracer_product_step001.png",
                    "tracer_product_step003.png"]
    assert all(_png(out / "maps" / name) for name in maps)
    assert sorted(p.name for p in (out / "plots").iterdir()) == [f"scores_{n}.png" for n in sorted(names)]
    assert all(_png(p) for p in (out / "plots").iterdir())
    # what the request check refuses to replace is exactly what the forecast wrote
    listed = forecast_outputs(out, [out], ["zarr"], True, ["tracer_1", "tracer_product"], [1, 3], names)
    written = {p for p in out.rglob("*") if p.is_file() and "forecast.zarr" not in p.parts} | {out / "forecast.zarr"}
    assert set(listed) == written


def test_several_dates_and_netcdf(setup, tmp_path):
    pytest.importorskip("xarray")
    if netcdf_engine() is None:
        pytest.skip("no netCDF backend (install the netcdf extra)")
    import xarray as xr

    out = tmp_path / "fc"
    result = run_forecast(setup["bundle"], setup["dataset"], ["2020-01-12T00", "2020-01-13T06"], 2, out,
                          formats=["netcdf"], verbose=False)
    assert [p.parent.name for p in result.stores] == ["20200112T0000", "20200113T0600"]
    summary = json.loads((out / "scores.json").read_text())
    assert summary["init_dates"] == ["2020-01-12T00:00:00", "2020-01-13T06:00:00"]
    per_date = [json.loads((p.parent / "scores.json").read_text())["scores"] for p in result.stores]
    for name, s in summary["scores"].items():
        both = np.array([d[name]["rmse"] for d in per_date])
        np.testing.assert_allclose(s["rmse"], np.sqrt((both**2).mean(axis=0)))
        np.testing.assert_allclose(s["acc"], np.mean([d[name]["acc"] for d in per_date], axis=0))
    nc = xr.open_dataset(result.stores[1].parent / "forecast.nc")
    assert nc.attrs["Conventions"] == "CF-1.8"
    assert nc["latitude"].attrs["units"] == "degrees_north" and nc["longitude"].attrs["units"] == "degrees_east"
    assert [float(h) for h in nc["lead_time"].values / np.timedelta64(1, "h")] == [6.0, 12.0]
    assert [str(t)[:19] for t in nc["valid_time"].values] == ["2020-01-13T12:00:00", "2020-01-13T18:00:00"]
    assert str(nc["forecast_reference_time"].values)[:19] == "2020-01-13T06:00:00"
    members = result.read(1)  # (members, steps, grid, variables)
    for j, name in enumerate(AnemoiDataset.open(result.stores[1]).variables):
        assert nc[name].dims == ("lead_time", "member", "cell")
        np.testing.assert_array_equal(nc[name].values, members[..., j].transpose(1, 0, 2))
    nc.close()


def test_cli_and_bad_requests(setup, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("forecast_cli", Path(__file__).parent.parent / "launch" / "forecast.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["--bundle", str(setup["bundle"]), "--dataset", setup["dataset"], "--steps", "2"]
    assert cli.main([*args, "--date", "2020-01-05T00", "--out", str(tmp_path / "ok"), "--plot", "tracer_2"]) == 0
    printed = capsys.readouterr().out
    assert "+6h" in printed and "+12h" in printed and "tracer_2" in printed and "rmse_climatology" in printed
    assert (tmp_path / "ok" / "maps" / "tracer_2_step002.png").is_file()
    bad = [
        (["--date", "2020-01-16T12"], "choose a date between"),  # no truth after the last steps
        (["--date", "2020-01-01T00"], "choose a date between"),  # no earlier input state
        (["--date", "2020-01-05T03"], "is not in the dataset"),
        (["--date", "2020-01-05T00", "--plot", "insolation"], "not model outputs"),
        (["--date", "2020-01-05T00", "--plot-steps", "3"], "outside 1..2"),
        (["--date", "2020-01-05T00", "--steps", "0"], "positive integer"),
        (["--date", "2020-01-05T00", "--formats", "grib"], "unknown: use ['zarr', 'netcdf']"),
        (["--date", "2020-01-05T00", "--members", "2"], "the model is deterministic"),
        (["--date", "2020-01-05T00", "2020-01-05T00"], "more than once"),
        (["--date", "2020-01-05T00", "--precision", "fp64", "--gpus-per-model", "3"], "does not divide"),
    ]
    for extra, message in bad:
        out = tmp_path / "bad"
        assert cli.main([*args, *extra, "--out", str(out)]) == 2, extra
        assert message in capsys.readouterr().err, extra
        assert not out.exists(), extra
    assert cli.main([*args, "--date", "2020-01-05T00", "--out", str(tmp_path / "ok")]) == 2  # exists already
    assert "exists" in capsys.readouterr().err


def _copy_dataset(src: str, path: Path, **change) -> str:
    ds = AnemoiDataset.open(src)
    kw = {"latitudes": ds.latitudes, "longitudes": ds.longitudes, "missing_dates": ()}
    kw.update(change)
    write_anemoi_dataset(path, ds.read(slice(None)), ds.dates, kw["latitudes"], kw["longitudes"], ds.variables,
                         frequency="6h", missing_dates=kw["missing_dates"])
    return str(path)


def test_dataset_coordinates_and_missing_dates_are_checked(setup, tmp_path):
    ds = AnemoiDataset.open(setup["dataset"])
    lon = ds.longitudes.copy()
    lon[[10, 20]] += 1.0
    moved = _copy_dataset(setup["dataset"], tmp_path / "moved.zarr", longitudes=lon)
    with pytest.raises(ValueError, match="other coordinates than the model's grid at 2 of 544 cells .first: cell 10"):
        run_forecast(setup["bundle"], moved, "2020-01-05T00", 2, tmp_path / "a")
    gappy = _copy_dataset(setup["dataset"], tmp_path / "gap.zarr", missing_dates=["2020-01-05T12"])
    with pytest.raises(ValueError, match=r"needs the dataset dates \['2020-01-05T12:00:00'\], which the dataset marks"):
        run_forecast(setup["bundle"], gappy, "2020-01-05T00", 2, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_ensemble_members(setup, tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["data"]["path"] = setup["dataset"]
    cfg["training"].update(output_dir=str(tmp_path / "ens"), max_steps=2)
    cfg["model"].update(name="ensemble", ensemble={"noise_channels": 2})
    cfg["parallel"]["ensemble_size_per_device"] = 2
    cfg["engine"] = "local"
    cfg.pop("deepspeed", None)
    run_training(cfg)
    bundle = export_bundle(tmp_path / "ens" / "checkpoints", tmp_path / "bundle")
    first = run_forecast(bundle, setup["dataset"], "2020-01-05T00", 2, tmp_path / "a", members=3, seed=5,
                         verbose=False)
    again = run_forecast(bundle, setup["dataset"], "2020-01-05T00", 2, tmp_path / "b", members=3, seed=5,
                         verify=False, verbose=False)
    members = first.read(0)
    assert members.shape == (3, 2, 544, 4)
    np.testing.assert_array_equal(members, again.read(0))  # the seed fixes the noise
    assert not np.allclose(members[0], members[1])  # members differ
    assert AnemoiDataset.open(tmp_path / "a" / "forecast.zarr").ensemble_size == 3
    default = run_forecast(bundle, setup["dataset"], "2020-01-05T00", 1, tmp_path / "c", verify=False, verbose=False)
    assert default.request.members == 2  # the ensemble size the model trained with
    scores = json.loads((tmp_path / "a" / "scores.json").read_text())["scores"]["tracer_1"]
    assert len(scores["crps"]) == 2 and all(x > 0 for x in scores["spread_skill"])
    deterministic = load_model(setup["bundle"])
    with pytest.raises(ValueError, match="members=2 but the model is deterministic"):
        run_forecast(deterministic, setup["dataset"], "2020-01-05T00", 2, tmp_path / "d", members=2)
    assert not (tmp_path / "d").exists()


def test_advance_window_moves_the_window_and_feeds_back_prognostics():
    from stormshard.models.rollout import advance_window

    window = torch.arange(2 * 3 * 5 * 4, dtype=torch.float64).reshape(2, 3, 5, 4)  # (batch, time, grid, inputs)
    forcing = -torch.ones(2, 5, 4, dtype=torch.float64)
    pred = torch.rand(2, 5, 3, dtype=torch.float64, requires_grad=True)  # (batch, grid, outputs)
    out = advance_window(window, forcing, pred, [0, 2], [1, 0])
    assert out.shape == window.shape
    assert torch.equal(out[:, :2], window[:, 1:])
    assert torch.equal(out[:, 2, :, 0], pred[..., 1].detach()) and torch.equal(out[:, 2, :, 2], pred[..., 0].detach())
    assert torch.equal(out[:, 2, :, 1], forcing[..., 1]) and torch.equal(out[:, 2, :, 3], forcing[..., 3])
    out[:, 2, :, 0].sum().backward()  # differentiable through the rollout
    assert torch.equal(pred.grad[..., 1], torch.ones(2, 5)) and pred.grad[..., [0, 2]].abs().sum() == 0
    with pytest.raises(ValueError, match="disagree on batch, grid or input variables"):
        advance_window(window, forcing[:, :4], pred, [0, 2], [1, 0])
    with pytest.raises(ValueError, match="2 prognostic input positions but 1 output"):
        advance_window(window, forcing, pred, [0, 2], [1])


def test_netcdf_without_the_extra_is_a_clear_error(setup, tmp_path, monkeypatch):
    import stormshard.inference.request as request

    monkeypatch.setattr(request, "netcdf_engine", lambda: None)
    with pytest.raises(ValueError, match=r"pip install 'stormshard\[netcdf\]'"):
        run_forecast(setup["bundle"], setup["dataset"], "2020-01-05T00", 2, tmp_path / "a", formats=["netcdf"])
    assert not (tmp_path / "a").exists()
