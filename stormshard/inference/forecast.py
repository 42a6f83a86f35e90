"""Forecasts from an inference bundle: rollout, anemoi-layout output, maps, RMSE against persistence.

``run_forecast(bundle, dataset, date, steps, out)``:

1. reads the ``multistep_input`` states ending at ``date`` (spaced by the model's timestep) from an
   anemoi-layout dataset, on the whole grid;
2. rolls the model out ``steps`` times, as in training
   (:func:`~stormshard.models.rollout.advance_window`): each prediction replaces the prognostic
   variables of the next input, forcings come from the dataset at the predicted time;
3. writes the forecast (output variables, dates ``date + k * timestep``, k = 1..steps) as an
   anemoi-layout zarr store ``out/forecast.zarr``;
4. computes the area-weighted RMSE per lead time and variable of the forecast and of persistence
   (the state at ``date``) against the dataset, prints a table and writes ``out/rmse.json``;
5. draws PNG maps (forecast, truth, error; scatter on lat/lon) of the chosen variables at the
   chosen lead times into ``out/maps/``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange
from torch import Tensor

from stormshard.checkpoint.export import InferenceModel, load_model
from stormshard.data.anemoi_layout import AnemoiDataset, as_datetime64, parse_frequency, write_anemoi_dataset
from stormshard.models.rollout import advance_window

__all__ = ["ForecastResult", "rollout", "rmse_per_lead", "plot_maps", "run_forecast"]


@dataclass
class ForecastResult:
    """Physical fields ``(steps, grid, output_variables)`` and scores per lead time."""

    init_date: np.datetime64
    dates: np.ndarray  # (steps,) valid dates
    forecast: np.ndarray  # (steps, grid, output_variables); the ensemble mean for ensemble models
    truth: np.ndarray
    persistence: np.ndarray  # (grid, output_variables): the state at init_date
    members: np.ndarray | None = None  # (members, steps, grid, output_variables) for ensemble models
    rmse: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # {var: {"model": [...], "persistence": [...]}}
    files: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def rollout(bundle: InferenceModel, states: Tensor, forcings: Tensor, generator: torch.Generator | None = None
            ) -> Tensor:
    """Autoregressive forecast in physical units.

    ``states``: ``(batch, multistep_input, grid, input_variables)``; ``forcings``: ``(batch, steps - 1,
    grid, input_variables)`` (only the forcing columns are read: the inputs at the predicted times).
    Ensemble models draw fresh noise per batch entry and step from ``generator``. Returns ``(batch, steps, grid, output_variables)``.
    """
    v = bundle.variables
    dtype = next(bundle.model.parameters()).dtype
    x = bundle.normaliser.normalise(states.double()).to(dtype)
    f = bundle.normaliser.normalise(forcings.double()).to(dtype)
    prog_in = torch.tensor(v.prognostic_in_input, device=x.device)
    prog_out = torch.tensor(v.prognostic_in_output, device=x.device)
    out = []
    for k in range(f.shape[1] + 1):
        if hasattr(bundle.model, "sample_noise"):
            pred = bundle.model(x, bundle.model.sample_noise(x.shape[0], generator=generator, dtype=x.dtype))
        else:
            pred = bundle.model(x)
        out.append(bundle.output_normaliser.denormalise(pred.double()))
        if k < f.shape[1]:
            x = advance_window(x, f[:, k], pred, prog_in, prog_out)
    return torch.stack(out, dim=1)


def rmse_per_lead(pred: np.ndarray, truth: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Area-weighted RMSE ``(steps, variables)`` of ``pred`` vs ``truth`` ``(steps, grid, variables)``."""
    w = (weights / weights.sum())[None, :, None]
    return np.sqrt(((pred - truth) ** 2 * w).sum(axis=1))


def plot_maps(result: ForecastResult, variables: list[str], names: list[str], steps: list[int], lat: np.ndarray,
              lon: np.ndarray, out: Path) -> list[Path]:
    """One PNG per variable and lead step: forecast, truth and error side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    lon = ((lon + 180.0) % 360.0) - 180.0
    size = float(np.clip(40000.0 / max(lat.size, 1), 1.0, 40.0))  # dots that tile the globe
    for name in variables:
        j = names.index(name)
        for k in steps:
            fc, tr = result.forecast[k - 1, :, j], result.truth[k - 1, :, j]
            fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
            lo, hi = float(min(fc.min(), tr.min())), float(max(fc.max(), tr.max()))
            err = fc - tr
            e = float(np.abs(err).max()) or 1.0
            panels = ((fc, "forecast", "viridis", lo, hi), (tr, "truth", "viridis", lo, hi),
                      (err, "error (forecast - truth)", "RdBu_r", -e, e))
            for ax, (field_, title, cmap, vmin, vmax) in zip(axes, panels, strict=True):
                sc = ax.scatter(lon, lat, c=field_, s=size, cmap=cmap, vmin=vmin, vmax=vmax, linewidths=0)
                ax.set_title(f"{name} {title}")
                ax.set_xlim(-180, 180)
                ax.set_ylim(-90, 90)
                ax.set_xlabel("longitude")
                ax.set_ylabel("latitude")
                fig.colorbar(sc, ax=ax, shrink=0.8)
            fig.suptitle(f"init {result.init_date}, lead step {k} (valid {result.dates[k - 1]})")
            path = out / f"{name}_step{k:03d}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            paths.append(path)
    return paths


def _stride(bundle: InferenceModel, dataset: AnemoiDataset) -> tuple[int, str]:
    step = parse_frequency(bundle.timestep) if bundle.timestep else dataset.frequency
    ratio = step / dataset.frequency
    if ratio != int(ratio) or ratio < 1:
        raise ValueError(f"the model's timestep {bundle.timestep} is not a multiple of the dataset's frequency "
                         f"{dataset.frequency}: forecast from a dataset whose frequency divides it")
    hours = step.total_seconds() / 3600
    return int(ratio), f"{hours:g}h"


def run_forecast(bundle: str | os.PathLike | InferenceModel, dataset: str | os.PathLike, date: Any, steps: int,
                 out: str | os.PathLike, *, plot_variables: list[str] | None = None,
                 plot_steps: list[int] | None = None, members: int = 1, seed: int = 0, overwrite: bool = False,
                 verbose: bool = True) -> ForecastResult:
    """Forecast ``steps`` lead times from ``date`` (the last input state) and write the outputs
    under ``out`` (see the module docstring). All inputs are checked before anything is written.

    Ensemble models (``model.name == "ensemble"``) run ``members`` members (noise drawn from
    ``seed``); the store gets an ensemble dimension of that size, scores and maps use the mean.
    """
    model = bundle if isinstance(bundle, InferenceModel) else load_model(bundle)
    ds = AnemoiDataset.open(dataset)
    v = model.variables
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    missing = [n for n in v.variables if n not in ds.variables]
    if missing:
        raise ValueError(f"the dataset {dataset} lacks the model's variables {missing}: use the dataset the model was "
                         "trained on (or one with the same variables)")
    if ds.num_cells != model.graph["data"].num_nodes:
        raise ValueError(f"the dataset has {ds.num_cells} grid cells, the model's graph {model.graph['data'].num_nodes}: "
                         "forecast on the training grid")
    stride, step_text = _stride(model, ds)
    m = model.multistep_input
    t0 = ds.date_index(date)
    first, last = t0 - (m - 1) * stride, t0 + steps * stride
    if first < 0 or last >= ds.num_dates:
        lo = ds.dates[min((m - 1) * stride, ds.num_dates - 1)]
        hi = ds.dates[max(ds.num_dates - 1 - steps * stride, 0)]
        raise ValueError(f"date {as_datetime64(date)} with {m} input states and {steps} steps of {step_text} needs "
                         f"dataset dates from index {first} to {last}; choose a date between {lo} and {hi}")
    ensemble = model.config.name == "ensemble"
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"members must be a positive integer, got {members!r}")
    if members > 1 and not ensemble:
        raise ValueError(f"members={members} but the model is deterministic ({model.config.name}): use members=1")
    plot_variables = list(plot_variables or [])
    unknown = [n for n in plot_variables if n not in v.output_names]
    if unknown:
        raise ValueError(f"plot variables {unknown} are not model outputs {list(v.output_names)}")
    plot_steps = list(plot_steps or [steps])
    bad = [k for k in plot_steps if not 1 <= k <= steps]
    if bad:
        raise ValueError(f"plot steps {bad} are outside 1..{steps}")
    out = Path(out)
    store = out / "forecast.zarr"
    if store.exists() and not overwrite:
        raise FileExistsError(f"{store} exists: choose another --out or pass --overwrite")

    idx = np.arange(first, last + 1, stride)  # inputs, then the predicted times
    raw = torch.from_numpy(rearrange(ds.read(idx)[:, :, 0], "t v c -> t c v").astype(np.float64))
    ds_index = [ds.variables.index(n) for n in v.variables]
    data = raw[..., ds_index]  # (time, grid, model's dataset variables)
    states = data[:m][..., v.input_idx].unsqueeze(0).expand(members, -1, -1, -1)
    forcings = data[m:m + steps - 1][..., v.input_idx].unsqueeze(0).expand(members, -1, -1, -1)
    ens = rollout(model, states, forcings, torch.Generator().manual_seed(seed)).numpy()  # (members, steps, grid, variables)
    pred = ens.mean(axis=0)
    truth = data[m:][..., v.output_idx].numpy()
    persistence = data[m - 1][..., v.output_idx].numpy()
    weights = model.graph["data"].area_weight.double().numpy()
    model_rmse = rmse_per_lead(pred, truth, weights)
    pers_rmse = rmse_per_lead(np.broadcast_to(persistence, truth.shape), truth, weights)
    dates = ds.dates[idx[m:]]
    result = ForecastResult(ds.dates[t0], dates, pred, truth, persistence, ens if ensemble else None)
    names = list(v.output_names)
    result.rmse = {n: {"model": model_rmse[:, j].tolist(), "persistence": pers_rmse[:, j].tolist()}
                   for j, n in enumerate(names)}

    out.mkdir(parents=True, exist_ok=True)
    write_anemoi_dataset(store, rearrange(ens, "e t c v -> t v e c"), dates, ds.latitudes, ds.longitudes, names,
                         frequency=step_text, overwrite=overwrite,
                         attributes={"initial_date": str(ds.dates[t0]), "source": "stormshard forecast",
                                     "ensemble_members": members,
                                     "model_step": model.metadata.get("step")})
    lead_hours = [float((d - ds.dates[t0]) / np.timedelta64(1, "h")) for d in dates]
    report = {"init_date": str(ds.dates[t0]), "members": members, "lead_hours": lead_hours,
              "valid_dates": [str(d) for d in dates],
              "rmse": result.rmse}
    (out / "rmse.json").write_text(json.dumps(report, indent=1))
    maps = plot_maps(result, plot_variables, names, plot_steps, ds.latitudes, ds.longitudes, out / "maps")
    result.files = {"forecast": store, "rmse": out / "rmse.json", "maps": maps}
    if verbose:
        print(format_rmse(report))
    return result


def format_rmse(report: dict[str, Any]) -> str:
    """Table of RMSE per variable and lead time, model / persistence."""
    leads = report["lead_hours"]
    lines = [f"RMSE against the dataset, init {report['init_date']} (model / persistence)"]
    head = f"{'variable':<16}" + "".join(f"{f'+{h:g}h':>22}" for h in leads)
    lines += [head, "-" * len(head)]
    for name, r in report["rmse"].items():
        cells = "".join(f"{f'{a:.4g} / {b:.4g}':>22}" for a, b in zip(r["model"], r["persistence"], strict=True))
        lines.append(f"{name:<16}{cells}")
    return "\n".join(lines)
