"""Forecast outputs: an anemoi-layout zarr store written in regions by every rank, and netCDF.

**Zarr, no gather.** ``data`` ``(lead times, variables, members, cells)`` is chunked
``(1, variables, 1, chunk)`` along the cells. Each rank holds its grid slice (the model's
balanced ``data_sizes``), which need not align with chunk boundaries, so a
:class:`ChunkExchange` moves only the cells of the chunks a rank does not own (a chunk belongs to
the rank that holds its first cell) to their owners, in one ``all_to_all_single`` over the model
group (at most one chunk's worth of cells per rank), and every rank then writes whole chunks.
No two ranks write one chunk, so the writes need no lock; data-parallel replicas write other
(lead time, member) chunks. Statistics (mean, stdev, minimum, maximum over the forecast) are
accumulated per rank over the cells it writes and all-reduced once at the end.

**netCDF** (the ``netcdf`` extra: xarray + netCDF4 or h5netcdf) is written per initial date from the
finished zarr store, one variable at a time, with CF attributes: ``latitude`` / ``longitude``
auxiliary coordinates on the ``cell`` dimension, ``lead_time`` with ``valid_time`` beside it,
``forecast_reference_time``, and units where the dataset's ``variables_metadata`` has them.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zarr
from torch import Tensor

from stormshard.data.anemoi_layout import LAYOUT_VERSION, AnemoiDataset, frequency_to_string
from stormshard.parallel.shapes import group_rank, group_size
from stormshard.parallel.topology import collective_device

__all__ = ["ChunkExchange", "ForecastStore", "StoreStatistics", "netcdf_engine", "write_netcdf", "variable_units"]


@dataclass(frozen=True, eq=False)
class ChunkExchange:
    """Cells between the model's grid slices and whole store chunks (computed once per layout).

    ``sizes``: every rank's number of grid cells in rank order; ``chunk``: cells per store chunk;
    ``group``: the model group (None: one rank). ``counts[src][dst]``: cells ``src`` sends ``dst``.
    """

    sizes: tuple[int, ...]
    chunk: int
    group: Any = None
    counts: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"cells_per_chunk must be at least 1, got {self.chunk}")
        k, starts = len(self.sizes), np.concatenate([[0], np.cumsum(self.sizes)])
        counts = np.zeros((k, k), dtype=np.int64)
        n = int(starts[-1])
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            owner = int(np.searchsorted(starts, lo, side="right")) - 1
            for src in range(k):
                counts[src, owner] += max(0, min(hi, starts[src + 1]) - max(lo, starts[src]))
        object.__setattr__(self, "counts", tuple(tuple(int(c) for c in row) for row in counts))

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def owned(self) -> slice:
        """The cells this rank writes after :meth:`exchange` (whole chunks; possibly empty)."""
        before = sum(sum(row[d] for row in self.counts) for d in range(self.rank))
        mine = sum(row[self.rank] for row in self.counts)
        return slice(before, before + mine)

    def exchange(self, x: Tensor) -> Tensor:
        """``x`` ``(cells_local, ...)`` this rank's slice -> ``(owned cells, ...)``. Sends each
        cell of a chunk another rank owns to that rank (one ``all_to_all_single``)."""
        if group_size(self.group) == 1:
            return x
        send = list(self.counts[self.rank])
        recv = [row[self.rank] for row in self.counts]
        flat = x.reshape(x.shape[0], -1).contiguous()
        out = flat.new_empty((sum(recv), flat.shape[1]))
        dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out.reshape(sum(recv), *x.shape[1:])


@dataclass
class StoreStatistics:
    """Running per-variable sums over the cells one rank wrote: reduced over ranks at the end."""

    num_variables: int
    sums: np.ndarray = field(init=False)
    squares: np.ndarray = field(init=False)
    count: np.ndarray = field(init=False)
    minimum: np.ndarray = field(init=False)
    maximum: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        v = self.num_variables
        self.sums, self.squares, self.count = np.zeros(v), np.zeros(v), np.zeros(v)
        self.minimum, self.maximum = np.full(v, np.inf), np.full(v, -np.inf)

    def add(self, values: np.ndarray) -> None:
        """``values`` ``(variables, cells)``."""
        if values.shape[1] == 0:
            return
        v = values.astype(np.float64)
        self.sums += v.sum(axis=1)
        self.squares += (v * v).sum(axis=1)
        self.count += v.shape[1]
        self.minimum = np.minimum(self.minimum, v.min(axis=1))
        self.maximum = np.maximum(self.maximum, v.max(axis=1))


def reduce_statistics(stats: list[StoreStatistics], group: Any = None) -> list[StoreStatistics]:
    """Sum / min / max every store's statistics over ``group`` (all ranks: 3 all-reduces in total)."""
    if not stats or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return stats
    device = collective_device(group)  # NCCL takes tensors on this rank's GPU only, gloo CPU ones
    summed = torch.from_numpy(np.stack([np.stack([s.sums, s.squares, s.count]) for s in stats])).to(device)
    low = torch.from_numpy(np.stack([s.minimum for s in stats])).to(device)
    high = torch.from_numpy(np.stack([s.maximum for s in stats])).to(device)
    dist.all_reduce(summed, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    summed, low, high = summed.cpu(), low.cpu(), high.cpu()
    for i, s in enumerate(stats):
        s.sums, s.squares, s.count = (summed[i, j].numpy() for j in range(3))
        s.minimum, s.maximum = low[i].numpy(), high[i].numpy()
    return stats


class ForecastStore:
    """One initial date's forecast in the anemoi layout: ``data`` ``(lead times, variables,
    members, cells)``, valid ``dates``, ``latitudes``/``longitudes`` and statistics."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._data: zarr.Array | None = None

    @classmethod
    def create(cls, path: str | os.PathLike, *, valid_dates: np.ndarray, latitudes: np.ndarray,
               longitudes: np.ndarray, variables: list[str], members: int, frequency: datetime.timedelta,
               cells_per_chunk: int, attributes: dict[str, Any]) -> ForecastStore:
        """Create the store's metadata and an empty (NaN) ``data`` array. One rank calls this."""
        steps, n_vars, n_cells = len(valid_dates), len(variables), len(latitudes)
        root = zarr.open_group(os.fspath(path), mode="w", zarr_format=2)
        dates = np.asarray(valid_dates, dtype="datetime64[s]")
        iso = [str(d) for d in dates]
        root.attrs.update({**attributes, "variables": list(variables), "frequency": frequency_to_string(frequency),
                           "start_date": iso[0], "end_date": iso[-1], "ensemble_dimension": members,
                           "flatten_grid": True, "field_shape": [n_cells],
                           "order_by": ["valid_datetime", "param_level", "number"], "missing_dates": [],
                           "statistics_start_date": iso[0], "statistics_end_date": iso[-1],
                           "version": LAYOUT_VERSION})
        data = root.create_array("data", shape=(steps, n_vars, members, n_cells), dtype=np.float32,
                                 chunks=(1, n_vars, 1, min(cells_per_chunk, n_cells)), fill_value=np.nan)
        data.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "ensemble", "cell"]
        for name, values, dims in (("dates", dates, ["time"]), ("latitudes", np.asarray(latitudes, np.float64), ["cell"]),
                                   ("longitudes", np.asarray(longitudes, np.float64), ["cell"])):
            arr = root.create_array(name, shape=values.shape, dtype=values.dtype, chunks=values.shape)
            arr[...] = values
            arr.attrs["_ARRAY_DIMENSIONS"] = dims
        return cls(path)

    @property
    def data(self) -> zarr.Array:
        if self._data is None:
            self._data = zarr.open_group(os.fspath(self.path), mode="r+")["data"]
        return self._data

    def write(self, step: int, member: int, cells: slice, values: np.ndarray) -> None:
        """``values`` ``(variables, cells)`` into lead index ``step``, ``member``, whole chunks ``cells``."""
        if cells.stop > cells.start:
            self.data[step, :, member, cells] = values.astype(np.float32, copy=False)

    def finalise(self, stats: StoreStatistics) -> None:
        """Write the reduced statistics and consolidate the metadata. One rank calls this."""
        root = zarr.open_group(os.fspath(self.path), mode="r+")
        n = np.maximum(stats.count, 1)
        mean = stats.sums / n
        values = {"mean": mean, "stdev": np.sqrt(np.maximum(stats.squares / n - mean**2, 0.0)),
                  "minimum": stats.minimum, "maximum": stats.maximum, "sums": stats.sums,
                  "squares": stats.squares, "count": stats.count}
        for name, v in values.items():
            arr = root.create_array(name, shape=v.shape, dtype=np.float64, chunks=v.shape)
            arr[...] = v
            arr.attrs["_ARRAY_DIMENSIONS"] = ["variable"]
        zarr.consolidate_metadata(os.fspath(self.path), zarr_format=2)


def netcdf_engine() -> str | None:
    """``"netcdf4"`` or ``"h5netcdf"`` when xarray and that backend are importable, else None."""
    if importlib.util.find_spec("xarray") is None:
        return None
    for module, engine in (("netCDF4", "netcdf4"), ("h5netcdf", "h5netcdf")):
        if importlib.util.find_spec(module) is not None:
            return engine
    return None


def variable_units(dataset: AnemoiDataset) -> dict[str, str]:
    """Units per variable from the dataset's ``variables_metadata`` attribute, where it has them."""
    meta = dataset.attributes.get("variables_metadata") or {}
    return {name: str(m["units"]) for name, m in meta.items() if isinstance(m, dict) and m.get("units")}


def write_netcdf(store: str | os.PathLike, path: str | os.PathLike, *, init_date: np.datetime64,
                 units: dict[str, str], attributes: dict[str, Any] | None = None) -> Path:
    """The zarr forecast ``store`` as CF netCDF at ``path``: variables ``(lead_time, member, cell)``
    in float32, written one variable at a time (memory: one variable of the forecast)."""
    import xarray as xr

    engine = netcdf_engine()
    if engine is None:
        raise ImportError("netCDF output needs the netcdf extra: pip install 'stormshard[netcdf]'")
    fc = AnemoiDataset.open(store)
    init = np.datetime64(init_date, "s")
    lead = (fc.dates - init).astype("timedelta64[s]")
    coords = {
        "lead_time": ("lead_time", lead, {"long_name": "forecast lead time", "standard_name": "forecast_period"}),
        "valid_time": ("lead_time", fc.dates.astype("datetime64[ns]"), {"long_name": "valid time",
                                                                         "standard_name": "time"}),
        "forecast_reference_time": ((), np.datetime64(init, "ns"), {"standard_name": "forecast_reference_time"}),
        "member": ("member", np.arange(fc.ensemble_size, dtype=np.int32), {"long_name": "ensemble member"}),
        "latitude": ("cell", fc.latitudes, {"units": "degrees_north", "standard_name": "latitude"}),
        "longitude": ("cell", fc.longitudes, {"units": "degrees_east", "standard_name": "longitude"}),
    }
    head = xr.Dataset(coords=coords, attrs={"Conventions": "CF-1.8", "title": "stormshard forecast",
                                            "source": "stormshard", "initial_date": str(init),
                                            **{k: str(v) for k, v in (attributes or {}).items()}})
    out = Path(path)
    encoding = {"lead_time": {"units": "hours", "dtype": "float64"},
                "valid_time": {"units": f"hours since {init}", "dtype": "float64"},
                "forecast_reference_time": {"units": f"hours since {init}", "dtype": "float64"}}
    head.to_netcdf(out, mode="w", engine=engine, encoding=encoding)
    for j, name in enumerate(fc.variables):
        values = np.asarray(fc.data[:, j], dtype=np.float32)  # (lead_time, member, cell)
        attrs = {"long_name": name, **({"units": units[name]} if name in units else {}),
                 "coordinates": "valid_time forecast_reference_time latitude longitude"}
        var = xr.DataArray(values, dims=("lead_time", "member", "cell"), attrs=attrs)
        xr.Dataset({name: var}).to_netcdf(out, mode="a", engine=engine, encoding={name: {"dtype": "float32"}})
    return out
