"""Forecasts from an exported bundle: the rollout follows the training convention, the output is a
readable anemoi-layout store, RMSE per lead time (model and persistence) is right, maps are PNGs,
and bad requests fail before anything is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stormshard.checkpoint.export import export_bundle, load_model
from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.inference.forecast import run_forecast
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
    cfg["engine"] = "local"
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


def test_forecast_outputs_scores_and_maps(setup, tmp_path):
    bundle = load_model(setup["bundle"])
    ds = AnemoiDataset.open(setup["dataset"])
    date, steps = "2020-01-12T00", 3
    out = tmp_path / "fc"
    result = run_forecast(bundle, setup["dataset"], date, steps, out, plot_variables=["tracer_1", "tracer_product"],
                          plot_steps=[1, 3], verbose=False)
    t0 = ds.date_index(date)
    np.testing.assert_allclose(result.forecast, _reference_rollout(bundle, ds, t0, steps), rtol=1e-6, atol=1e-6)

    store = AnemoiDataset.open(out / "forecast.zarr")
    names = list(bundle.variables.output_names)
    assert store.variables == names and store.num_dates == steps and store.num_cells == ds.num_cells
    assert [str(d) for d in store.dates] == ["2020-01-12T06:00:00", "2020-01-12T12:00:00", "2020-01-12T18:00:00"]
    np.testing.assert_allclose(store.read(slice(None))[:, :, 0], result.forecast.transpose(0, 2, 1), rtol=1e-6)
    np.testing.assert_array_equal(store.latitudes, ds.latitudes)

    report = json.loads((out / "rmse.json").read_text())
    assert report["lead_hours"] == [6.0, 12.0, 18.0] and report["init_date"] == "2020-01-12T00:00:00"
    w = bundle.graph["data"].area_weight.double().numpy()
    w = w / w.sum()
    for j, name in enumerate(names):
        col = ds.variables.index(name)
        init = ds.read([t0])[0, col, 0]
        for k in range(steps):
            truth = ds.read([t0 + k + 1])[0, col, 0]
            model = np.sqrt((w * (result.forecast[k, :, j] - truth) ** 2).sum())
            persistence = np.sqrt((w * (init - truth) ** 2).sum())
            assert report["rmse"][name]["model"][k] == pytest.approx(model, rel=1e-6)
            assert report["rmse"][name]["persistence"][k] == pytest.approx(persistence, rel=1e-6)
        assert report["rmse"][name]["persistence"][0] > 0
    maps = sorted(p.name for p in (out / "maps").iterdir())
    assert maps == ["tracer_1_step001.png", "tracer_1_step003.png", "tracer_product_step001.png",
                    "tracer_product_step003.png"]
    for name in maps:
        data = (out / "maps" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_and_bad_requests(setup, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("forecast_cli", Path(__file__).parent.parent / "launch" / "forecast.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["--bundle", str(setup["bundle"]), "--dataset", setup["dataset"], "--steps", "2"]
    assert cli.main([*args, "--date", "2020-01-05T00", "--out", str(tmp_path / "ok"), "--plot", "tracer_2"]) == 0
    printed = capsys.readouterr().out
    assert "+6h" in printed and "+12h" in printed and "tracer_2" in printed
    assert (tmp_path / "ok" / "maps" / "tracer_2_step002.png").is_file()
    bad = [
        (["--date", "2020-01-16T12"], "choose a date between"),  # no truth after the last steps
        (["--date", "2020-01-01T00"], "choose a date between"),  # no earlier input state
        (["--date", "2020-01-05T03"], "is not in the dataset"),
        (["--date", "2020-01-05T00", "--plot", "insolation"], "not model outputs"),
        (["--date", "2020-01-05T00", "--plot-steps", "3"], "outside 1..2"),
        (["--date", "2020-01-05T00", "--steps", "0"], "positive integer"),
    ]
    for extra, message in bad:
        out = tmp_path / "bad"
        assert cli.main([*args, *extra, "--out", str(out)]) == 2, extra
        assert message in capsys.readouterr().err, extra
        assert not out.exists(), extra
    assert cli.main([*args, "--date", "2020-01-05T00", "--out", str(tmp_path / "ok")]) == 2  # exists already
    assert "exists" in capsys.readouterr().err


def test_ensemble_members(setup, tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["data"]["path"] = setup["dataset"]
    cfg["training"].update(output_dir=str(tmp_path / "ens"), max_steps=2)
    cfg["model"].update(name="ensemble", ensemble={"noise_channels": 2})
    cfg["parallel"]["ensemble_size_per_device"] = 2
    cfg["engine"] = "local"
    run_training(cfg)
    bundle = load_model(export_bundle(tmp_path / "ens" / "checkpoints", tmp_path / "bundle"))
    first = run_forecast(bundle, setup["dataset"], "2020-01-05T00", 2, tmp_path / "a", members=3, seed=5,
                         verbose=False)
    again = run_forecast(bundle, setup["dataset"], "2020-01-05T00", 2, tmp_path / "b", members=3, seed=5,
                         verbose=False)
    assert first.members.shape == (3, 2, 544, 4)
    np.testing.assert_array_equal(first.members, again.members)  # the seed fixes the noise
    assert not np.allclose(first.members[0], first.members[1])  # members differ
    np.testing.assert_allclose(first.forecast, first.members.mean(axis=0))
    store = AnemoiDataset.open(tmp_path / "a" / "forecast.zarr")
    assert store.ensemble_size == 3
    np.testing.assert_allclose(store.read(slice(None))[:, :, 2], first.members[2].transpose(0, 2, 1), rtol=1e-6)
    deterministic = load_model(setup["bundle"])
    with pytest.raises(ValueError, match="members=2 but the model is deterministic"):
        run_forecast(deterministic, setup["dataset"], "2020-01-05T00", 2, tmp_path / "c", members=2)
    assert not (tmp_path / "c").exists()


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
