"""A forecast request, checked in full before any process group, model or file exists.

:func:`check_request` validates the initial dates, lead steps, members, model-group size,
precision, output formats and paths against the model (its grid, variables, timestep) and the
dataset (its coordinates, dates, missing dates), and that ``out`` can be written, and returns a
frozen :class:`ForecastRequest`. Every error names the argument, the value and the fix. A request
that is legitimate but worth a word gets a line in ``ForecastRequest.warnings``: scores of initial
dates whose lead times fall inside the model's training range are in-sample.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stormshard.data.anemoi_layout import AnemoiDataset, as_datetime64, frequency_to_string, parse_frequency
from stormshard.data.dataset import date_range_bounds
from stormshard.errors import check_writable_directory
from stormshard.graphs.hetero import HeteroGraph
from stormshard.inference.loader import PRECISIONS
from stormshard.inference.output_paths import DateOutputs, RunOutputs
from stormshard.inference.outputs import netcdf_engine
from stormshard.models.config import ModelConfig
from stormshard.models.variables import VariableIndex

__all__ = ["FORMATS", "ForecastRequest", "check_request", "date_directory", "default_members", "forecast_outputs",
           "in_sample_warning"]

FORMATS = ("zarr", "netcdf")
COORDINATE_TOLERANCE_DEG = 1e-4


@dataclass(frozen=True)
class ForecastRequest:
    """What to forecast: dataset indices of the initial dates (the last input state of each), the
    dataset index stride of one model step, lead ``steps``, ``members`` per date, the model group
    size, the precision, output formats and directories (one per initial date)."""

    dataset: str
    init_indices: tuple[int, ...]
    init_dates: tuple[np.datetime64, ...]
    stride: int
    step_text: str
    multistep: int
    steps: int
    members: int
    gpus_per_model: int
    precision: str
    formats: tuple[str, ...]
    out: Path
    date_dirs: tuple[Path, ...]
    plot_variables: tuple[str, ...]
    plot_steps: tuple[int, ...]
    cells_per_chunk: int | None
    verify: bool
    seed: int
    warnings: tuple[str, ...] = ()  # lines rank 0 prints before the forecast (e.g. in-sample scores)

    def indices(self, i: int) -> np.ndarray:
        """Dataset indices of initial date ``i``: its ``multistep`` inputs, then the ``steps`` lead times."""
        t0 = self.init_indices[i]
        return np.arange(t0 - (self.multistep - 1) * self.stride, t0 + self.steps * self.stride + 1, self.stride)


def date_directory(out: Path, date: np.datetime64, several: bool) -> Path:
    """``out`` itself for one initial date, ``out/<YYYYmmddTHHMM>`` for each of several."""
    if not several:
        return out
    return out / str(np.datetime64(date, "m")).replace("-", "").replace(":", "")


def default_members(metadata: dict[str, Any], ensemble: bool) -> int:
    """Members per initial state the model trained with (the ensemble size of its config); 1 when
    deterministic."""
    if not ensemble:
        return 1
    par = (metadata.get("experiment") or {}).get("parallel") or {}
    k = par.get("gpus_per_model") or par.get("tensor_model_parallel_size") or 1
    return int(par.get("ensemble_size_per_device", 1)) * int(par.get("gpus_per_ensemble") or k) // int(k)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_grid(ds: AnemoiDataset, graph: HeteroGraph, dataset: Any) -> None:
    n_model = graph["data"].num_nodes
    if ds.num_cells != n_model:
        raise ValueError(f"the dataset {dataset} has {ds.num_cells} grid cells, the model's graph {n_model}: "
                         "forecast on the grid the model was trained on")
    latlon = np.rad2deg(graph["data"].x.double().numpy())
    dlat = np.abs(latlon[:, 0] - ds.latitudes)
    dlon = np.abs((latlon[:, 1] - ds.longitudes + 180.0) % 360.0 - 180.0)
    dlon[np.abs(ds.latitudes) > 90.0 - COORDINATE_TOLERANCE_DEG] = 0.0  # any longitude is the pole
    bad = np.flatnonzero((dlat > COORDINATE_TOLERANCE_DEG) | (dlon > COORDINATE_TOLERANCE_DEG))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"the dataset {dataset} has other coordinates than the model's grid at {bad.size} of {ds.num_cells} "
            f"cells (first: cell {i} is at lat {ds.latitudes[i]:.6g}, lon {ds.longitudes[i]:.6g} in the dataset, "
            f"lat {latlon[i, 0]:.6g}, lon {latlon[i, 1]:.6g} in the model): forecast from a dataset on the model's "
            "grid, in the same cell order")


def in_sample_warning(ds: AnemoiDataset, init_indices: Sequence[int], indices: Sequence[np.ndarray],
                      train_range: tuple[Any, Any] | None) -> str | None:
    """A warning when a forecast's lead times fall inside the model's training range (``data.train``
    of its config; an open end is this dataset's first or last date): its scores are in-sample."""
    if train_range is None:
        return None
    try:
        lo, hi = date_range_bounds(ds, *train_range)
    except ValueError:
        return None
    inside = [str(ds.dates[t0]) for t0, idx in zip(init_indices, indices, strict=True)
              if any(lo <= ds.dates[i] <= hi for i in idx)]
    if not inside:
        return None
    shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
    return (f"warning: the forecast from {shown} uses dates inside the model's training range (data.train: "
            f"{lo} to {hi}): the model trained on them, so its scores are "
            "in-sample (better than on unseen dates); forecast from dates after the training range for honest scores")


def _stride(timestep: str | None, ds: AnemoiDataset) -> tuple[int, str]:
    step = parse_frequency(timestep) if timestep else ds.frequency
    ratio = step / ds.frequency
    if ratio != int(ratio) or ratio < 1:
        raise ValueError(f"the model's timestep {timestep} is not a multiple of the dataset's frequency "
                         f"{frequency_to_string(ds.frequency)}: forecast from a dataset whose frequency divides it")
    return int(ratio), f"{step.total_seconds() / 3600:g}h"


def check_forecast_attention_kernel(kernel: str, device_type: str, precision: str | None = None,
                                    head_dim: int | None = None, model: ModelConfig | None = None) -> None:
    """ValueError unless ``--attention-kernel`` ``kernel`` can run a forecast (forward only) on ``device_type``
    at ``precision`` with heads of ``head_dim`` (None: not known yet); the rule is
    :func:`~stormshard.kernels.dispatch.attention_kernel_problem`. With the ``model``'s config, a kernel
    other than ``auto`` for a model without sliding-window attention (a GNN or graph-transformer
    processor) is refused, as training refuses ``model.processor.attention_kernel`` there, not ignored."""
    from stormshard.kernels.dispatch import attention_kernel_problem

    if model is not None and kernel != "auto" and model.is_builtin and model.uses_graph_processor:
        raise ValueError(f"--attention-kernel {kernel!r} picks the sliding-window attention kernel, but the model "
                         f"(model.name={model.name!r}) has a graph processor and no sliding-window attention: leave "
                         "--attention-kernel out (or 'auto')")

    problem = attention_kernel_problem(kernel, device_type, precision=precision, head_dim=head_dim, backward=False)
    if problem is not None:
        raise ValueError(f"attention_kernel {kernel!r} cannot run this forecast ({device_type}"
                         f"{'' if precision is None else ', ' + precision}): {problem}; or use 'auto' / 'banded'")


def _check_not_into_dataset(dataset: str | os.PathLike, out: Path, date_dirs: Sequence[Path]) -> None:
    """A forecast never writes into its dataset: ``--out`` equal to or inside the dataset, or a
    ``forecast.zarr`` it writes (re-created, even with ``--overwrite``) that is or holds the dataset, is an
    error naming both (the dataset would be lost while the forecast reads it)."""
    source = Path(dataset).resolve()
    target = out.resolve()
    if target == source or source in target.parents:
        raise ValueError(f"--out {out} is {'the' if target == source else 'inside the'} dataset {dataset}: a forecast "
                         "never writes into its dataset; choose an --out outside it")
    for store in (DateOutputs(d).store for d in date_dirs):
        if store.resolve() == source or store.resolve() in source.parents:
            raise ValueError(f"--out {out} would re-create {store}, which is (or holds) the dataset {dataset} the "
                             "forecast reads: choose another --out (or copy the dataset elsewhere first)")


def _check_not_into_model(model: str | os.PathLike | None, out: Path) -> None:
    """A forecast never writes into the bundle or checkpoint it reads (``model``): an ``--out`` equal to or inside
    it is an error naming both (its outputs would land among the model's files)."""
    if model is None:
        return
    source, target = Path(model).resolve(), out.resolve()
    if target == source or source in target.parents:
        raise ValueError(f"--out {out} is {'the' if target == source else 'inside the'} model {model}: a forecast "
                         "never writes into the bundle or checkpoint it reads; choose an --out outside it")


def forecast_outputs(out: Path, date_dirs: Sequence[Path], formats: Sequence[str], verify: bool,
                     plot_variables: Sequence[str], plot_steps: Sequence[int], output_names: Sequence[str]) -> list[Path]:
    """Every path a forecast writes (:mod:`stormshard.inference.output_paths`): per date directory ``forecast.zarr``,
    ``forecast.nc`` (netcdf), ``scores.json`` (verify) and ``maps/<variable>_step<k>.png``; in ``out`` the
    combined ``scores.json``, ``climatology.npz`` and ``plots/scores_<variable>.png`` (verify)."""
    paths = []
    for date in map(DateOutputs, date_dirs):
        paths.append(date.store)
        paths += [date.netcdf] if "netcdf" in formats else []
        paths += [date.scores] if verify else []
        paths += [date.map(name, k) for name in plot_variables for k in plot_steps]
    run = RunOutputs(out)
    paths.append(run.summary)  # refused even with --no-scores (an earlier forecast's summary)
    if verify:
        paths += [run.climatology, *(run.score_plot(name) for name in output_names)]
    return list(dict.fromkeys(paths))


def check_request(*, dataset: str | os.PathLike, ds: AnemoiDataset, graph: HeteroGraph, variables: VariableIndex,
                  timestep: str | None, multistep: int, ensemble: bool, default_member_count: int,
                  dates: Sequence[Any], steps: int, out: str | os.PathLike, members: int | None, world_size: int,
                  gpus_per_model: int, precision: str, formats: Sequence[str], plot_variables: Sequence[str],
                  plot_steps: Sequence[int] | None, cells_per_chunk: int | None, verify: bool, seed: int,
                  overwrite: bool, model_name: str, train_range: tuple[Any, Any] | None = None,
                  model: str | os.PathLike | None = None) -> ForecastRequest:
    """Validate a request (see the module docstring); nothing is created. ``train_range``: the model's
    ``data.train`` ``(start, end)``, for the in-sample warning; ``model``: the bundle or checkpoint path read
    (None: a loaded model), which ``out`` must not be or lie in."""
    steps = _positive_int("steps", steps)
    k = _positive_int("gpus_per_model", gpus_per_model)
    n_data, n_hidden = graph["data"].num_nodes, graph["hidden"].num_nodes
    if k > min(n_data, n_hidden):
        raise ValueError(f"gpus_per_model={k} is more than the model's {n_data} grid / {n_hidden} hidden nodes: "
                         f"use at most {min(n_data, n_hidden)}")
    if world_size % k:
        raise ValueError(f"gpus_per_model={k} does not divide the {world_size} launched processes: launch a multiple "
                         f"of {k} processes (each group of {k} holds one model) or change --gpus-per-model")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown: use one of {sorted(PRECISIONS)}")
    fmts = tuple(dict.fromkeys(["zarr", *formats]))
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        raise ValueError(f"output formats {unknown} are unknown: use {list(FORMATS)}")
    if "netcdf" in fmts and netcdf_engine() is None:
        raise ValueError("output format 'netcdf' needs xarray and netCDF4 (or h5netcdf): "
                         "pip install 'stormshard[netcdf]', or leave netcdf out of --formats")
    if members is None:
        members = default_member_count
    members = _positive_int("members", members)
    if members > 1 and not ensemble:
        raise ValueError(f"members={members} but the model is deterministic ({model_name}): use members=1")
    if cells_per_chunk is not None:
        _positive_int("cells_per_chunk", cells_per_chunk)
    missing = [n for n in variables.variables if n not in ds.variables]
    if missing:
        raise ValueError(f"the dataset {dataset} lacks the model's variables {missing}: use the dataset the model was "
                         "trained on (or one with the same variables)")
    ds.check_coordinates()  # a store whose coordinates were never written: name it, not a grid mismatch
    _check_grid(ds, graph, dataset)
    stride, step_text = _stride(timestep, ds)
    if not dates:
        raise ValueError("no initial date given: pass at least one --date")
    init_idx, init_dates = [], []
    for date in dates:
        t0 = ds.date_index(date)  # raises "is not in the dataset"
        first, last = t0 - (multistep - 1) * stride, t0 + steps * stride
        if first < 0 or last >= ds.num_dates:
            lo = ds.dates[min((multistep - 1) * stride, ds.num_dates - 1)]
            hi = ds.dates[max(ds.num_dates - 1 - steps * stride, 0)]
            raise ValueError(f"date {as_datetime64(date)} with {multistep} input states and {steps} steps of "
                             f"{step_text} needs dataset dates from index {first} to {last}; choose a date between "
                             f"{lo} and {hi}")
        gaps = [str(ds.dates[i]) for i in range(first, last + 1, stride) if i in ds.missing_dates]
        if gaps:
            raise ValueError(f"date {ds.dates[t0]} needs the dataset dates {gaps}, which the dataset marks as missing "
                             "(their fields are NaN): choose an initial date whose inputs, forcings and truth exist")
        init_idx.append(t0)
        init_dates.append(ds.dates[t0])
    dup = sorted({str(d) for d in init_dates if init_dates.count(d) > 1})
    if dup:
        raise ValueError(f"initial dates {dup} are given more than once: give each once")
    plot_variables = list(plot_variables or [])
    unknown = [n for n in plot_variables if n not in variables.output_names]
    if unknown:
        raise ValueError(f"plot variables {unknown} are not model outputs {list(variables.output_names)}")
    plot_steps = list(plot_steps or [steps])
    bad = [s for s in plot_steps if not 1 <= s <= steps]
    if bad:
        raise ValueError(f"plot steps {bad} are outside 1..{steps}")
    out = Path(out)
    check_writable_directory(out, "--out")
    several = len(init_dates) > 1
    date_dirs = tuple(date_directory(out, d, several) for d in init_dates)
    _check_not_into_dataset(dataset, out, date_dirs)
    _check_not_into_model(model, out)
    if not overwrite:  # every file the forecast writes, not only its stores: none is replaced unasked
        written = forecast_outputs(out, date_dirs, fmts, verify, plot_variables, plot_steps, variables.output_names)
        taken = [p for p in written if p.exists() or p.is_symlink()]
        if taken:
            more = f" (and {len(taken) - 1} more of its outputs)" if len(taken) > 1 else ""
            raise FileExistsError(f"{taken[0]} exists{more}: the forecast would replace it; choose another --out or "
                                  "pass --overwrite")
    req = ForecastRequest(str(dataset), tuple(init_idx), tuple(init_dates), stride, step_text, multistep, steps,
                          members, k, precision, fmts, out, date_dirs, tuple(plot_variables), tuple(plot_steps),
                          cells_per_chunk, verify, seed)
    warning = in_sample_warning(ds, req.init_indices, [req.indices(i) for i in range(len(init_idx))], train_range) \
        if verify else None
    return req if warning is None else dataclasses.replace(req, warnings=(warning,))
