"""Data: the anemoi layout (write, read, validate), the synthetic dataset's dynamics, windows,
normalisation, the resumable sampler and sharded reading over reader groups of 2, 3 and 4 ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr

from stormshard.data.anemoi_layout import (
    AnemoiDataset,
    AnemoiLayoutError,
    Statistics,
    compute_statistics,
    frequency_to_string,
    parse_frequency,
    write_anemoi_dataset,
)
from stormshard.data.dataset import (
    ResumableSampler,
    WindowedSampleDataset,
    split_by_dates,
    split_sample,
)
from stormshard.data.normalisation import Normaliser
from stormshard.data.sharded_read import CellShardDataset, cell_shard, gather_cells, read_sample_sharded
from stormshard.data.synthetic import (
    DIAGNOSTIC,
    FORCING,
    PROGNOSTIC,
    VARIABLES,
    SyntheticDynamics,
    generate_synthetic_dataset,
    insolation,
    main,
    unit_vectors,
)
from stormshard.graphs.grids import grid_from_name
from stormshard.models.variables import VariableIndex
from stormshard.parallel.counter import CommCounter
from tests.distributed import run_distributed

GRID, STEPS, MEMBERS = "o8", 48, 2


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("data") / "synthetic.zarr")
    generate_synthetic_dataset(path, grid=GRID, steps=STEPS, frequency="6h", seed=3, members=MEMBERS)
    return path


def _random_store(path, zarr_format=2, n_dates=7, n_vars=3, n_ens=2, n_cells=50, attributes=None, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.normal(size=(n_dates, n_vars, n_ens, n_cells)).astype(np.float32) * 5 + 10
    dates = np.datetime64("2021-03-01T00", "s") + np.timedelta64(3, "h") * np.arange(n_dates)
    lat, lon = rng.uniform(-90, 90, n_cells), rng.uniform(0, 360, n_cells)
    variables = [f"v{i}" for i in range(n_vars)]
    write_anemoi_dataset(path, data, dates, lat, lon, variables, attributes=attributes, resolution="n/a",
                         zarr_format=zarr_format)
    return data, dates, lat, lon, variables


# ------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_written_store_reads_back_exactly(tmp_path, zarr_format):
    path = str(tmp_path / "ds.zarr")
    extra = {"description": "test", "licence": "CC0", "nested": {"a": [1, 2]}}
    data, dates, lat, lon, variables = _random_store(path, zarr_format, attributes=extra)
    ds = AnemoiDataset.open(path)
    assert ds.zarr_format == zarr_format
    assert ds.shape == data.shape and ds.ensemble_size == 2 and ds.num_cells == 50
    np.testing.assert_array_equal(ds.read(slice(None)), data)
    np.testing.assert_array_equal(ds.read([0, 2, 5], cells=slice(10, 20)), data[[0, 2, 5]][..., 10:20])
    np.testing.assert_array_equal(ds.dates, dates)
    np.testing.assert_array_equal(ds.latitudes, lat)
    np.testing.assert_array_equal(ds.longitudes, lon)
    assert ds.variables == variables and ds.name_to_index == {"v0": 0, "v1": 1, "v2": 2}
    assert ds.frequency == parse_frequency("3h") and ds.resolution == "n/a"
    expected = compute_statistics(data)
    for name, value in expected.as_dict().items():
        np.testing.assert_array_equal(getattr(ds.statistics, name), value)
    flat = data.transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(ds.statistics.mean, flat.mean(1), rtol=1e-12)
    np.testing.assert_allclose(ds.statistics.stdev, flat.std(1), rtol=1e-9)
    np.testing.assert_array_equal(ds.statistics.minimum, flat.min(1))
    a = ds.attributes
    assert a["description"] == "test" and a["nested"] == {"a": [1, 2]} and a["licence"] == "CC0"
    assert a["variables"] == variables and a["frequency"] == "3h" and a["ensemble_dimension"] == 2
    assert a["start_date"] == "2021-03-01T00:00:00" and a["end_date"] == "2021-03-01T18:00:00"
    assert a["flatten_grid"] is True and a["missing_dates"] == []


def test_written_layout_is_anemois_on_disk(tmp_path):
    """Format 2, datetime64[s] dates, per-date chunks, _ARRAY_DIMENSIONS as anemoi-datasets writes them."""
    path = str(tmp_path / "ds.zarr")
    _random_store(path)
    with open(os.path.join(path, "data", ".zarray")) as f:
        meta = json.load(f)
    assert meta["zarr_format"] == 2 and meta["dtype"] == "<f4" and meta["chunks"] == [1, 3, 1, 50]
    with open(os.path.join(path, "dates", ".zarray")) as f:
        assert json.load(f)["dtype"] == "<M8[s]"
    dims = {"data": ["time", "variable", "ensemble", "cell"], "dates": ["time"], "latitudes": ["cell"],
            "longitudes": ["cell"], "mean": ["variable"], "has_nans": ["variable"]}
    for name, expected in dims.items():
        with open(os.path.join(path, name, ".zattrs")) as f:
            assert json.load(f)["_ARRAY_DIMENSIONS"] == expected
    assert os.path.exists(os.path.join(path, ".zmetadata"))


def test_statistics_period_and_cell_chunks(tmp_path):
    path = str(tmp_path / "c.zarr")
    rng = np.random.default_rng(2)
    data = rng.normal(size=(8, 2, 1, 40)).astype(np.float32)
    dates = np.datetime64("2020-01-01", "s") + np.timedelta64(6, "h") * np.arange(8)
    write_anemoi_dataset(path, data, dates, np.zeros(40), np.zeros(40), ["a", "b"], statistics_end="2020-01-02T00",
                         cells_per_chunk=16)
    ds = AnemoiDataset.open(path)
    assert ds.data.chunks == (1, 2, 1, 16)
    assert ds.attributes["statistics_end_date"] == "2020-01-02T00:00:00"
    np.testing.assert_array_equal(ds.statistics.mean, compute_statistics(data[:5]).mean)
    np.testing.assert_array_equal(ds.read([2, 7], cells=slice(10, 35)), data[[2, 7]][..., 10:35])
    with pytest.raises(ValueError, match="cells_per_chunk"):
        write_anemoi_dataset(str(tmp_path / "d.zarr"), data, dates, np.zeros(40), np.zeros(40), ["a", "b"],
                             cells_per_chunk=0)


def _hand_made_store(path, *, zarr_format=2, drop=(), attrs=None, data_shape=(6, 2, 1, 30), dates=None,
                     stats_len=None, coord_names=("latitudes", "longitudes")):
    """A store written directly with zarr, the way other tools might (not through our writer)."""
    root = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    rng = np.random.default_rng(1)
    n_dates, n_vars, _, n_cells = data_shape[0], data_shape[1], None, data_shape[-1]
    arrays = {
        "data": rng.normal(size=data_shape).astype(np.float32),
        "dates": dates if dates is not None else (
            np.datetime64("2020-01-01T00", "s") + np.timedelta64(6, "h") * np.arange(n_dates)),
        coord_names[0]: rng.uniform(-90, 90, n_cells),
        coord_names[1]: rng.uniform(0, 360, n_cells),
    }
    for name in ("mean", "stdev", "minimum", "maximum"):
        arrays[name] = np.ones(stats_len or n_vars)
    for name, value in arrays.items():
        if name not in drop:
            root.create_array(name, shape=value.shape, dtype=value.dtype)[...] = value
    base = {"variables": [f"x{i}" for i in range(n_vars)], "frequency": "6h"}
    base.update(attrs or {})
    root.attrs.update({k: v for k, v in base.items() if k not in drop})
    return arrays


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_foreign_store_with_extra_and_missing_attributes_opens(tmp_path, zarr_format):
    path = str(tmp_path / f"foreign{zarr_format}.zarr")
    extra = {"_create_yaml_config": {"input": {"mars": {}}}, "history": [{"action": "init"}],
             "data_request": {"grid": "O96"}, "uuid": "1234", "licence": "CC-BY-4.0", "variables_metadata": {}}
    arrays = _hand_made_store(path, zarr_format=zarr_format, attrs=extra, drop=("frequency",),
                              coord_names=("latitude", "longitude"))
    ds = AnemoiDataset.open(path)  # no frequency, ensemble_dimension, flatten_grid, resolution, sums, ...
    assert ds.frequency == parse_frequency("6h") and ds.ensemble_size == 1 and ds.resolution is None
    assert ds.statistics.sums is None and ds.statistics.has_nans is None
    assert ds.attributes["uuid"] == "1234"
    np.testing.assert_array_equal(ds.latitudes, arrays["latitude"])
    np.testing.assert_array_equal(ds.read([1, 3]), arrays["data"][[1, 3]])
    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=1)
    assert samples[0].shape == (3, 1, 30, 2)
    # older stores name the variables with name_to_index
    path2 = str(tmp_path / "n2i.zarr")
    _hand_made_store(path2, zarr_format=zarr_format, drop=("variables",), attrs={"name_to_index": {"b": 1, "a": 0}})
    assert AnemoiDataset.open(path2).variables == ["a", "b"]


@pytest.mark.parametrize(
    "case, kwargs, words",
    [
        ("no data", {"drop": ("data",)}, ["'data'", "missing"]),
        ("3-d data", {"data_shape": (6, 2, 30)}, ["'data'", "3 dims"]),
        ("variables mismatch", {"attrs": {"variables": ["a", "b", "c"]}}, ["'variables'", "3 names", "2 variables"]),
        ("no variables", {"drop": ("variables",)}, ["'variables'"]),
        ("statistics mismatch", {"stats_len": 3}, ["statistics", "'mean'", "2 variables"]),
        ("no stdev", {"drop": ("stdev",)}, ["'stdev'"]),
        ("dates off frequency", {"attrs": {"frequency": "3h"}}, ["dates", "3h", "frequency"]),
        ("uneven dates", {"dates": np.array(["2020-01-01T00", "2020-01-01T06", "2020-01-01T18", "2020-01-02T00",
                                             "2020-01-02T06", "2020-01-02T12"], dtype="datetime64[s]")},
         ["entry 2", "2020-01-01T18"]),
        ("dates length", {"dates": np.datetime64("2020-01-01", "s") + np.timedelta64(6, "h") * np.arange(5)},
         ["'dates'", "6 dates"]),
        ("no latitudes", {"drop": ("latitudes",)}, ["'latitudes'"]),
        ("bad frequency", {"attrs": {"frequency": "six hours"}}, ["'frequency'", "six hours"]),
        ("ensemble attr", {"attrs": {"ensemble_dimension": 3}}, ["'ensemble_dimension'", "3", "1 members"]),
        ("start_date attr", {"attrs": {"start_date": "2019-01-01T00:00:00"}}, ["'start_date'", "2019"]),
        ("missing date", {"attrs": {"missing_dates": ["2030-01-01T00:00:00"]}}, ["'missing_dates'", "2030"]),
    ],
)
def test_malformed_store_gets_a_clear_error(tmp_path, case, kwargs, words):
    path = str(tmp_path / "bad.zarr")
    _hand_made_store(path, **kwargs)
    with pytest.raises(AnemoiLayoutError) as info:
        AnemoiDataset.open(path)
    message = str(info.value)
    assert path in message
    for word in words:
        assert word in message, (case, message)


def test_open_and_write_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        AnemoiDataset.open(tmp_path / "nothing.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(AnemoiLayoutError, match="not a zarr group"):
        AnemoiDataset.open(tmp_path / "plain")
    path = str(tmp_path / "w.zarr")
    data = np.zeros((3, 2, 1, 4), np.float32)
    dates = np.datetime64("2020-01-01", "s") + np.timedelta64(1, "h") * np.arange(3)
    with pytest.raises(ValueError, match="variables lists 3 names"):
        write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b", "c"])
    with pytest.raises(ValueError, match="latitudes has shape"):
        write_anemoi_dataset(path, data, dates, np.zeros(5), np.zeros(4), ["a", "b"])
    with pytest.raises(AnemoiLayoutError, match="equally spaced"):
        write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b"], frequency="2h")
    with pytest.raises(ValueError, match="missing_dates"):
        write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b"], missing_dates=["2021-01-01"])
    with pytest.raises(ValueError, match="set by the layout"):
        write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b"], attributes={"variables": 1})
    write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b"])
    with pytest.raises(FileExistsError):
        write_anemoi_dataset(path, data, dates, np.zeros(4), np.zeros(4), ["a", "b"])
    assert [frequency_to_string(parse_frequency(f)) for f in ("6h", 6, "30m", "1d", "90s", "06:00:00", "24h")] == [
        "6h", "6h", "30m", "1d", "90s", "6h", "1d"]
    with pytest.raises(ValueError, match="not understood"):
        parse_frequency("weekly")


# ------------------------------------------------------------------------------------ synthetic


def test_synthetic_store_matches_its_dynamics(synthetic_path):
    ds = AnemoiDataset.open(synthetic_path)
    lat, lon = grid_from_name(GRID)
    assert ds.variables == list(VARIABLES) and ds.ensemble_size == MEMBERS and ds.resolution == GRID
    assert ds.shape == (STEPS, len(VARIABLES), MEMBERS, len(lat))
    np.testing.assert_array_equal(ds.latitudes, lat)
    np.testing.assert_array_equal(ds.longitudes, lon)
    dyn = SyntheticDynamics.from_attributes(ds.attributes["synthetic"])
    data = ds.read(slice(None))
    for i in (0, 17, STEPS - 1):
        expected = np.moveaxis(dyn.state(ds.dates[i], lat, lon), 0, 1)
        np.testing.assert_allclose(data[i], expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(ds.statistics.mean, compute_statistics(data).mean)
    assert not np.array_equal(data[:, :, 0], data[:, :, 1])  # members differ


def test_synthetic_dynamics_exact_step_and_persistence(synthetic_path):
    """Next stored state = current analytic state at the departure points; persistence is far worse."""
    ds = AnemoiDataset.open(synthetic_path)
    dyn = SyntheticDynamics.from_attributes(ds.attributes["synthetic"])
    xyz = unit_vectors(ds.latitudes, ds.longitudes)
    dt = ds.frequency.total_seconds() / 3600
    departure = dyn.departure_points(xyz, dt)
    assert np.allclose(np.linalg.norm(departure, axis=-1), 1.0)
    data = ds.read(slice(None)).astype(np.float64)  # (dates, variables, members, cells)
    p = [VARIABLES.index(v) for v in PROGNOSTIC]
    exact_err, persist_err = [], []
    for i in range(0, STEPS - 1, 5):
        hours = dyn.hours_since_start(ds.dates[i])
        advanced = np.moveaxis(dyn.prognostic(hours, departure), 0, 1)  # advance state i by one step
        exact_err.append(np.sqrt(((advanced - data[i + 1, p]) ** 2).mean(axis=(1, 2))))
        persist_err.append(np.sqrt(((data[i, p] - data[i + 1, p]) ** 2).mean(axis=(1, 2))))
    exact_err, persist_err = np.mean(exact_err, 0), np.mean(persist_err, 0)
    stdev = ds.statistics.stdev[p]
    assert np.all(exact_err / stdev < 1e-5), exact_err / stdev  # float32 storage only
    assert np.all(persist_err / stdev > 0.25), persist_err / stdev  # persistence is a poor forecast
    # forcing and diagnostic are the documented functions
    i = 11
    np.testing.assert_allclose(data[i, VARIABLES.index(FORCING[0]), 0],
                               insolation(ds.dates[i], ds.latitudes, ds.longitudes), atol=1e-6)
    norm = (data[i, p[:2]] - dyn.offsets[:2, None, None]) / dyn.scales[:2, None, None]
    np.testing.assert_allclose(data[i, VARIABLES.index(DIAGNOSTIC[0])], norm[0] * norm[1], atol=2e-5)


def test_synthetic_cli_and_if_missing(tmp_path, capsys):
    out = str(tmp_path / "cli" / "s.zarr")
    assert main(["--grid", "o4", "--steps", "10", "--out", out, "--frequency", "3h", "--seed", "1"]) == 0
    ds = AnemoiDataset.open(out)
    assert ds.num_dates == 10 and ds.frequency == parse_frequency("3h") and ds.ensemble_size == 1
    stamp = os.path.getmtime(os.path.join(out, "data", "0.0.0.0"))
    assert main(["--grid", "o4", "--steps", "10", "--out", out, "--if-missing"]) == 0
    assert "kept" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(out, "data", "0.0.0.0")) == stamp
    broken = str(tmp_path / "broken.zarr")
    _hand_made_store(broken, drop=("data",))
    assert main(["--grid", "o4", "--steps", "10", "--out", broken, "--if-missing"]) == 2
    assert "not a valid dataset" in capsys.readouterr().err
    assert main(["--grid", "o4", "--steps", "10", "--out", broken]) == 2  # never deletes a foreign store
    assert os.path.isdir(broken)



def test_synthetic_cli_never_loses_the_dataset_it_replaces(tmp_path, capsys, monkeypatch):
    """Regenerating over an existing synthetic store: a bad option is one ``error:`` (status 2) before the
    store is touched (it used to be deleted first, then the option failed with a traceback), and a failure
    while writing (a full disk) leaves the old store as it was and nothing partial beside it."""
    import errno

    import stormshard.data.synthetic as synthetic

    out = tmp_path / "s.zarr"
    assert main(["--grid", "o4", "--steps", "6", "--out", str(out)]) == 0
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    for option, value, fragment in (("--grid", "q7", "--grid 'q7': unknown grid"), ("--steps", "1", "--steps 1"),
                                    ("--frequency", "6x", "--frequency '6x'"),
                                    ("--start-date", "soon", "--start-date 'soon'"), ("--members", "0", "--members 0")):
        assert main(["--grid", "o4", "--steps", "6", "--out", str(out), option, value]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("error: ") == 1 and "Traceback" not in err, err
        assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files

    def disk_full(path: str, **_kwargs: object) -> None:
        os.makedirs(os.path.join(path, "data"))  # some of the new store is written, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synthetic, "generate_synthetic_dataset", disk_full)
    assert main(["--grid", "o4", "--steps", "8", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"error: the disk is full (No space left on device) writing {out}" in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


# ------------------------------------------------------------------------------------ samples


def test_windows_split_by_date_and_timestep(synthetic_path):
    ds = AnemoiDataset.open(synthetic_path)  # 48 dates every 6h from 2020-01-01
    full = ds.read(slice(None))
    train = WindowedSampleDataset(ds, multistep_input=2, rollout=3, timestep="12h", end="2020-01-08T18:00")
    valid = WindowedSampleDataset(ds, multistep_input=2, rollout=3, timestep="12h", start="2020-01-09")
    assert train.stride == 2 and len(train.offsets) == 5
    assert len(train) == 31 - 8 + 1 - 1 + 1 and len(valid) == 48 - 32 - 8
    for end in ("2020-01-08", "2020-01-08T23", "2020-01-08T18:00:00"):
        same = WindowedSampleDataset(ds, multistep_input=2, rollout=3, timestep="12h", end=end)
        assert list(same.window_starts) == list(train.window_starts), end
    assert len(WindowedSampleDataset(ds, end="2020-01")) == STEPS - 1
    train_dates = {d for i in range(len(train)) for d in train.dates(i)}
    valid_dates = {d for i in range(len(valid)) for d in valid.dates(i)}
    assert max(train_dates) <= np.datetime64("2020-01-08T18:00") < min(valid_dates)
    assert not train_dates & valid_dates
    x = train[4]
    assert x.shape == (5, MEMBERS, ds.num_cells, len(VARIABLES)) and x.dtype == torch.float32
    idx = train.date_indices(4)
    np.testing.assert_array_equal(idx, 4 + 2 * np.arange(5))
    np.testing.assert_array_equal(x.numpy(), full[idx].transpose(0, 2, 3, 1))
    each = WindowedSampleDataset(ds, multistep_input=1, rollout=1, ensemble="each", end=2020)
    assert len(each) == (STEPS - 1) * MEMBERS
    np.testing.assert_array_equal(each[2 * 5 + 1].numpy(), full[[5, 6], :, 1].transpose(0, 2, 1))
    splits = split_by_dates(ds, {"train": (None, "2020-01-08T18:00"), "validation": ("2020-01-09", None)},
                            multistep_input=2, rollout=3, timestep="12h")
    assert list(splits["train"].window_starts) == list(train.window_starts)
    assert list(splits["validation"].window_starts) == list(valid.window_starts)
    with pytest.raises(ValueError, match="'train' and 'test' overlap"):
        split_by_dates(ds, {"train": (None, 2020), "test": ("2020-01-05", None)})
    with pytest.raises(ValueError, match="not a multiple"):
        WindowedSampleDataset(ds, timestep="9h")
    with pytest.raises(ValueError, match="no window"):
        WindowedSampleDataset(ds, rollout=10, start="2020-01-12")
    with pytest.raises(ValueError, match="multistep_input"):
        WindowedSampleDataset(ds, multistep_input=0)


def test_windows_skip_missing_dates(tmp_path):
    path = str(tmp_path / "m.zarr")
    data = np.arange(10 * 1 * 1 * 3, dtype=np.float32).reshape(10, 1, 1, 3)
    dates = np.datetime64("2020-01-01", "s") + np.timedelta64(6, "h") * np.arange(10)
    write_anemoi_dataset(path, data, dates, np.zeros(3), np.zeros(3), ["a"], missing_dates=[dates[4]])
    ds = AnemoiDataset.open(path)
    assert ds.missing_dates == {4}
    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=1)
    assert list(samples.window_starts) == [0, 1, 5, 6, 7]


def test_variable_roles_and_split():
    roles = VariableIndex.build(VARIABLES, forcing=FORCING, diagnostic=DIAGNOSTIC)
    assert roles.prognostic == PROGNOSTIC
    assert roles.input_names == PROGNOSTIC + FORCING and roles.output_names == PROGNOSTIC + DIAGNOSTIC
    assert roles.input_idx == [0, 1, 2, 3] and roles.output_idx == [0, 1, 2, 4]
    assert roles.prognostic_in_input == [0, 1, 2] and roles.prognostic_in_output == [0, 1, 2]
    sample = torch.arange(4 * 2 * 3 * 5.0).reshape(4, 2, 3, 5)
    inputs, targets = split_sample(sample, 2, roles.input_idx, roles.output_idx)
    assert torch.equal(inputs, sample[:2][..., [0, 1, 2, 3]]) and torch.equal(targets, sample[2:][..., [0, 1, 2, 4]])
    batch = sample[None].expand(3, -1, -1, -1, -1)
    inputs, targets = split_sample(batch, 3, roles.input_idx, roles.output_idx, time_dim=1)
    assert inputs.shape == (3, 3, 2, 3, 4) and targets.shape == (3, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="needs more than multistep_input=4"):
        split_sample(sample, 4, roles.input_idx, roles.output_idx)
    with pytest.raises(ValueError, match="outside the sample's 5 variables"):
        split_sample(sample, 2, [0, 5], roles.output_idx)
    with pytest.raises(ValueError, match="not in the dataset"):
        VariableIndex.build(VARIABLES, forcing=("sst",))
    with pytest.raises(ValueError, match="both forcing and diagnostic"):
        VariableIndex.build(VARIABLES, forcing=FORCING, diagnostic=FORCING)


# ------------------------------------------------------------------------------------ normalisation


def test_normalisation_round_trip_and_methods(synthetic_path):
    ds = AnemoiDataset.open(synthetic_path)
    methods = {"insolation": "min-max", "tracer_product": "none"}
    norm = Normaliser.from_statistics(ds.statistics, ds.variables, methods=methods)
    x = torch.from_numpy(ds.read(slice(None))).permute(0, 2, 3, 1).double()  # (dates, ens, cells, variables)
    y = norm.normalise(x)
    torch.testing.assert_close(norm.denormalise(y), x, rtol=1e-12, atol=1e-9)
    flat = y.reshape(-1, len(VARIABLES))
    torch.testing.assert_close(flat[:, :3].mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(flat[:, :3].std(0, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-6,
                               rtol=0)
    assert flat[:, 3].min() == 0 and abs(flat[:, 3].max().item() - 1) < 1e-12
    torch.testing.assert_close(flat[:, 4], x.reshape(-1, 5)[:, 4])
    assert set(dict(norm.named_buffers())) == {"offset", "scale"}
    # a subset (the model's inputs) in its own order, and float32
    sub = Normaliser.from_statistics(ds.statistics, ds.variables, ["tracer_3", "tracer_1"])
    z = x[..., [2, 0]].float()
    torch.testing.assert_close(sub(z), ((x[..., [2, 0]] - torch.tensor(ds.statistics.mean[[2, 0]]))
                                        / torch.tensor(ds.statistics.stdev[[2, 0]])).float())
    other = Normaliser.from_statistics(ds.statistics, ds.variables, ["tracer_1", "insolation"],
                                       methods={"tracer_1": "std", "insolation": "max"})
    torch.testing.assert_close(other.scale, torch.tensor([ds.statistics.stdev[0], ds.statistics.maximum[3]]))
    torch.testing.assert_close(other.offset, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="'sst' is not in the dataset"):
        Normaliser.from_statistics(ds.statistics, ds.variables, ["sst"])
    with pytest.raises(ValueError, match="'zscore' for tracer_1 is unknown"):
        Normaliser.from_statistics(ds.statistics, ds.variables, methods={"tracer_1": "zscore"})
    constant = Statistics(mean=np.ones(2), stdev=np.array([1.0, 0.0]), minimum=np.zeros(2), maximum=np.ones(2))
    with pytest.raises(ValueError, match=r"\['b'\] have a zero"):
        Normaliser.from_statistics(constant, ["a", "b"])
    Normaliser.from_statistics(constant, ["a", "b"], methods={"b": "none"})
    with pytest.raises(ValueError, match="last dim of x has 3"):
        sub.normalise(torch.zeros(2, 3))


# ------------------------------------------------------------------------------------ sampler


def test_sampler_is_deterministic_sharded_and_resumable():
    n, world = 23, 3
    samplers = [ResumableSampler(n, seed=5, rank=r, world_size=world) for r in range(world)]
    shards = [list(s) for s in samplers]
    assert all(len(s) == n // world for s in shards)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat) == (n // world) * world  # disjoint, tail dropped
    assert shards[0] == list(ResumableSampler(n, seed=5, rank=0, world_size=world))  # deterministic
    assert shards[0] != list(ResumableSampler(n, seed=6, rank=0, world_size=world))
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != shards[0]
    padded = [list(ResumableSampler(n, seed=5, rank=r, world_size=world, drop_last=False)) for r in range(world)]
    assert all(len(s) == 8 for s in padded) and set(i for s in padded for i in s) == set(range(n))

    # resume mid-epoch: consume 3 samples, save, restore in a fresh sampler, get exactly the rest
    s = ResumableSampler(n, seed=5, rank=1, world_size=world)
    s.set_epoch(2)
    full = list(s.indices())
    it = iter(s)
    head = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["position"] == 3 and s.position == 3
    fresh = ResumableSampler(n, seed=5, rank=1, world_size=world)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert head + rest == full and fresh.position == len(full)
    assert list(fresh) == full  # the resume position applies once
    # a prefetching loader: the training loop states how many it consumed
    assert ResumableSampler(n).state_dict(consumed=4)["position"] == 4
    with pytest.raises(ValueError, match="world_size=3 but this sampler has 2"):
        ResumableSampler(n, seed=5, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 3"):
        ResumableSampler(n, rank=3, world_size=3)


def test_sampler_with_dataloader(synthetic_path):
    ds = AnemoiDataset.open(synthetic_path)
    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=1)
    sampler = ResumableSampler(len(samples), seed=0)
    loader = torch.utils.data.DataLoader(samples, batch_size=4, sampler=sampler, num_workers=2, timeout=120)
    batch = next(iter(loader))  # workers (fork on Linux) read the store themselves
    first = sampler.indices()[:4]
    assert batch.shape == (4, 3, MEMBERS, ds.num_cells, len(VARIABLES))
    assert torch.equal(batch, torch.stack([samples[i] for i in first]))


# ------------------------------------------------------------------------------------ sharded read


def _sharded_read_worker(rank, world, path):
    ds = AnemoiDataset.open(path)
    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=2, timestep="12h")
    each = WindowedSampleDataset(ds, multistep_input=1, rollout=1, ensemble="each")
    # groups: the whole world, and (for 4 ranks) two reader groups of 2 (one lacks global rank 0)
    cases = [(dist.group.WORLD, list(range(world)))]
    if world == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cases.append((halves[rank // 2], [0, 1] if rank < 2 else [2, 3]))
    checked = 0
    for group, members in cases:
        r = len(members)
        shard = cell_shard(ds.num_cells, members.index(rank), r)
        assert shard.sizes == tuple(np.array_split(np.arange(ds.num_cells), r)[i].size for i in range(r))
        for index in (0, 7, len(samples) - 1):
            with CommCounter() as counter:
                got = read_sample_sharded(samples, index, group)
            assert torch.equal(got, samples.read(index)), (rank, index)
            sent = samples.read(index, cells=slice(0, max(shard.sizes))).numel() * 4 * (r - 1)
            assert counter.bytes("all_gather") == sent
            checked += 1
        # the DataLoader path: shards in workers, one all-gather per batch in the main process
        shard_ds = CellShardDataset.for_group(each, group)
        loader = torch.utils.data.DataLoader(shard_ds, batch_size=3, shuffle=False)
        batch = next(iter(loader))
        assert batch.shape[-2] == shard.sizes[shard.rank]
        full = gather_cells(batch, shard_ds.shard, group, dim=-2)
        assert torch.equal(full, torch.stack([each[i] for i in range(3)]))
        checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_read_equals_whole_read(synthetic_path, world):
    # o8 has 544 cells: 272/272 over 2, 182/181/181 over 3, 136 x 4 over 4
    results = run_distributed(_sharded_read_worker, world, synthetic_path)
    assert results == [4 + (4 if world == 4 else 0)] * world


def test_shard_errors():
    with pytest.raises(ValueError, match="at most 3"):
        cell_shard(3, 0, 4)
    shard = cell_shard(10, 1, 3)
    assert (shard.start, shard.stop, shard.sizes) == (4, 7, (4, 3, 3))
    with pytest.raises(ValueError, match="reader 1 of 3"):
        gather_cells(torch.zeros(3, 2), shard, None)


# ------------------------------------------------------------------------------------ input pipeline


def _keys(sampler, micro, n, accumulation=1, start_step=0):
    from stormshard.data.loader import micro_batch_keys

    stream = micro_batch_keys(sampler, micro, accumulation, start_step, lambda step: 2 + step % 2)
    return [next(stream) for _ in range(n)]


def test_micro_batch_keys_follow_the_sampler_across_epochs_and_resume():
    sampler = ResumableSampler(7, seed=4, rank=1, world_size=2)  # 3 samples per epoch on this rank
    keys = _keys(sampler, micro=2, n=5, accumulation=2)
    flat = [i for k in keys for i in k.indices]
    assert flat == (sampler.indices(0) + sampler.indices(1) + sampler.indices(2) + sampler.indices(3))[:10]
    assert [(k.step, k.micro, k.times) for k in keys] == [(0, 0, 2), (0, 1, 2), (1, 0, 3), (1, 1, 3), (2, 0, 2)]
    assert [(k.epoch, k.position) for k in keys] == [(0, 2), (1, 1), (1, 3), (2, 2), (3, 1)]
    # the state after step 0 (key 1) restores the stream from key 2 on, however far a loader had read ahead
    resumed = ResumableSampler(7, seed=4, rank=1, world_size=2)
    resumed.load_state_dict({**sampler.state_dict(), "epoch": keys[1].epoch, "position": keys[1].position})
    again = _keys(resumed, micro=2, n=3, accumulation=2, start_step=1)
    assert again == keys[2:]


@pytest.mark.parametrize("kind, workers", [("inline", 0), ("threads", 2), ("processes", 2)])
def test_prefetch_loader_hands_out_the_inline_read(synthetic_path, kind, workers):
    from stormshard.data.loader import PrefetchLoader, SliceBatchReader

    ds = AnemoiDataset.open(synthetic_path)
    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=2, ensemble="each")
    norm = Normaliser.from_statistics(ds.statistics, ds.variables)
    read = SliceBatchReader(samples, slice(100, 300), norm.offset, norm.scale)
    keys = _keys(ResumableSampler(len(samples), seed=1), micro=2, n=6)
    with PrefetchLoader(iter(keys), read, num_workers=workers, prefetch=2,
                        worker_type="auto" if kind == "inline" else kind) as loader:
        assert loader.kind == kind
        got = [next(loader) for _ in range(6)]
    for key, (got_key, block) in zip(keys, got, strict=True):
        assert got_key == key
        direct = torch.stack([samples.read(i, cells=slice(100, 300), times=key.times) for i in key.indices])
        assert block.shape == (2, key.times, 200, ds.num_variables) and block.dtype == torch.float32
        assert torch.equal(block, norm.normalise(direct.double()).float())
    with pytest.raises(ValueError, match="data.num_workers=-1"):
        PrefetchLoader(iter(keys), read, num_workers=-1)
    with pytest.raises(ValueError, match="data.prefetch=0"):
        PrefetchLoader(iter(keys), read, prefetch=0)


def test_prefetch_overlaps_reads_with_compute(synthetic_path):
    """Reads that take as long as the 'step' leave almost no wait with 2 workers, all of it inline."""
    import time as _time

    from stormshard.data.loader import PrefetchLoader

    def slow_read(key):
        _time.sleep(0.03)
        return torch.zeros(1)

    keys = _keys(ResumableSampler(40, seed=0), micro=1, n=12)
    waits = {}
    for workers in (0, 2):
        with PrefetchLoader(iter(keys), slow_read, num_workers=workers, prefetch=2, worker_type="threads") as loader:
            next(loader)  # the first read always waits
            start = loader.wait_time
            for _ in range(10):
                _time.sleep(0.03)  # compute
                next(loader)
            waits[workers] = loader.wait_time - start
    assert waits[0] > 0.25 and waits[2] < 0.5 * waits[0], waits
