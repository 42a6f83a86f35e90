"""Read and write datasets in the anemoi-datasets zarr layout.

The layout (as written by ``anemoi-datasets create``), one zarr group:

==============================  ======================================  =========================
array                           shape, dtype                            ``_ARRAY_DIMENSIONS``
==============================  ======================================  =========================
``data``                        ``(dates, variables, ensemble, cells)``  time, variable, ensemble,
                                float32, chunks ``(1, V, 1, cells)``     cell
``dates``                       ``(dates,)`` datetime64[s]               time
``latitudes``, ``longitudes``   ``(cells,)`` float64, degrees            cell
``mean``, ``stdev``,            ``(variables,)`` float64                 variable
``minimum``, ``maximum``
``sums``, ``squares``           ``(variables,)`` float64 (optional)      variable
``count``, ``has_nans``         ``(variables,)`` int64 / bool (optional) variable
==============================  ======================================  =========================

Group attributes: ``variables`` (list of names; older stores have ``name_to_index`` instead),
``frequency`` (e.g. ``"6h"``), ``start_date``, ``end_date`` (ISO), ``resolution``,
``ensemble_dimension``, ``flatten_grid``, ``missing_dates``, ``statistics_start_date``,
``statistics_end_date``, ``version``, ... Anything but ``data``, ``dates``, the coordinates, the
four statistics and ``variables`` may be absent (current anemoi-datasets releases omit some), and
extra attributes are kept and ignored.

We write zarr format 2, as anemoi-datasets does, and read formats 2 and 3. A malformed store
raises :class:`AnemoiLayoutError` (a ValueError) naming the array or attribute that is wrong.
Dates and frequencies (:mod:`stormshard.data.dates`) and the statistics
(:mod:`stormshard.data.statistics`) have modules of their own; their public names are importable
from here too.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from stormshard.data.dates import as_datetime64, frequency_to_string, parse_frequency
from stormshard.data.statistics import (
    STATISTICS_OPTIONAL,
    STATISTICS_REQUIRED,
    Statistics,
    compute_statistics,
)

__all__ = [
    "AnemoiLayoutError",
    "DamagedStoreError",
    "Statistics",
    "AnemoiDataset",
    "compute_statistics",
    "write_anemoi_dataset",
    "settle_zarr_tasks",
    "parse_frequency",
    "frequency_to_string",
    "as_datetime64",
    "LAYOUT_VERSION",
]

LAYOUT_VERSION = "0.30"
"""The ``version`` attribute we write (anemoi-datasets' own layout version at the time of writing)."""


class AnemoiLayoutError(ValueError):
    """A store does not follow the anemoi-datasets layout; the message names what is wrong."""


class DamagedStoreError(RuntimeError):
    """A chunk of the ``data`` array that zarr cannot decode, met while reading (a rank's slice, mid-run): not
    a ``ValueError``, so every rank that meets it reports it (bad input is printed by rank 0 alone)."""


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _create(group: zarr.Group, name: str, array: np.ndarray, dims: tuple[str, ...], zarr_format: int,
            chunks: tuple[int, ...] | None = None) -> zarr.Array:
    kwargs: dict[str, Any] = {"shape": array.shape, "dtype": array.dtype, "chunks": chunks or array.shape}
    if zarr_format == 3:
        kwargs["dimension_names"] = dims
    out = group.create_array(name, **kwargs)
    out[...] = array
    out.attrs["_ARRAY_DIMENSIONS"] = list(dims)
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o)))


def write_anemoi_dataset(
    path: str | os.PathLike,
    data: np.ndarray,
    dates: Sequence | np.ndarray,
    latitudes: np.ndarray,
    longitudes: np.ndarray,
    variables: Sequence[str],
    *,
    frequency: str | int | datetime.timedelta | None = None,
    statistics: Statistics | None = None,
    attributes: Mapping[str, Any] | None = None,
    resolution: str | None = None,
    missing_dates: Sequence = (),
    statistics_end: Any = None,
    cells_per_chunk: int | None = None,
    dtype: str | np.dtype = np.float32,
    zarr_format: int = 2,
    overwrite: bool = False,
    compressor: str | None = None,
) -> None:
    """Write ``data`` ``(dates, variables, ensemble, cells)`` and its metadata in the anemoi layout.

    ``compressor`` of the ``data`` chunks: None for zarr's default (Blosc lz4 with byte shuffle,
    what anemoi-datasets stores get), ``"blosc-zstd"`` (smaller, slower to decode) or ``"none"``.

    ``statistics`` default to :func:`compute_statistics` over the dates up to ``statistics_end``
    (inclusive; default all), recorded in ``statistics_start_date`` / ``statistics_end_date``.
    ``frequency`` defaults to the spacing of ``dates``. ``attributes`` are added to the group
    (they may not override the layout's own). ``data`` is chunked ``(1, variables, 1, cells)``
    as anemoi-datasets does; ``cells_per_chunk`` also splits the grid into chunks, so that a
    reader of a slice of the cells decompresses only the chunks it needs. Format 2 is what
    anemoi-datasets writes; 3 is for tests of the reader.
    """
    data = np.asarray(data)
    if data.ndim != 4:
        raise ValueError(f"data must have 4 dims (dates, variables, ensemble, cells), got shape {data.shape}")
    n_dates, n_vars, n_ens, n_cells = data.shape
    dates = np.array([as_datetime64(d, "dates entry") for d in dates], dtype="datetime64[s]")
    lat, lon = np.asarray(latitudes, dtype=np.float64), np.asarray(longitudes, dtype=np.float64)
    variables = [str(v) for v in variables]
    checks = [
        (len(dates) == n_dates, f"dates has {len(dates)} entries but data has {n_dates} dates"),
        (lat.shape == (n_cells,), f"latitudes has shape {lat.shape} but data has {n_cells} cells"),
        (lon.shape == (n_cells,), f"longitudes has shape {lon.shape} but data has {n_cells} cells"),
        (len(variables) == n_vars, f"variables lists {len(variables)} names but data has {n_vars} variables"),
        (len(set(variables)) == n_vars, f"variables {variables} has duplicate names"),
        (zarr_format in (2, 3), f"zarr_format must be 2 or 3, got {zarr_format}"),
        (n_dates >= 1, "data has no dates"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if frequency is None:
        if n_dates < 2:
            raise ValueError("frequency is required when there is a single date")
        frequency = datetime.timedelta(seconds=int((dates[1] - dates[0]) / np.timedelta64(1, "s")))
    freq = parse_frequency(frequency)
    _check_dates(dates, freq, where="dates")
    stats_last = len(dates) - 1
    if statistics_end is not None:
        stats_last = int(np.searchsorted(dates, as_datetime64(statistics_end, "statistics_end"), side="right")) - 1
        if stats_last < 0:
            raise ValueError(f"statistics_end {statistics_end} is before the first date {dates[0]}")
    if cells_per_chunk is not None and (isinstance(cells_per_chunk, bool) or not isinstance(cells_per_chunk, int)
                                        or cells_per_chunk < 1):
        raise ValueError(f"cells_per_chunk must be a positive integer or None, got {cells_per_chunk!r}")
    if statistics is not None and len(statistics) != n_vars:
        raise ValueError(f"statistics have {len(statistics)} values per array but data has {n_vars} variables")
    reserved = {"variables", "frequency", "start_date", "end_date", "ensemble_dimension", "flatten_grid"}
    clash = reserved & set(attributes or {})
    if clash:
        raise ValueError(f"attributes {sorted(clash)} are set by the layout itself; remove them from attributes")
    missing = [as_datetime64(d, "missing date") for d in missing_dates]
    outside = [str(d) for d in missing if d not in dates]
    if outside:
        raise ValueError(f"missing_dates {outside} are not among the dates")
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists: pass overwrite=True or remove it")
    if statistics is None:
        statistics = compute_statistics(data[: stats_last + 1])
    root = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    to_iso = lambda d: str(np.datetime64(d, "s"))  # noqa: E731
    attrs: dict[str, Any] = dict(_jsonable(dict(attributes or {})))
    attrs.update(
        variables=variables,
        frequency=frequency_to_string(freq),
        start_date=to_iso(dates[0]),
        end_date=to_iso(dates[-1]),
        ensemble_dimension=n_ens,
        flatten_grid=True,
        field_shape=[n_cells],
        order_by=["valid_datetime", "param_level", "number"],
        missing_dates=[to_iso(d) for d in missing],
        statistics_start_date=to_iso(dates[0]),
        statistics_end_date=to_iso(dates[stats_last]),
        version=LAYOUT_VERSION,
    )
    if resolution is not None:
        attrs["resolution"] = str(resolution)
    root.attrs.update(attrs)
    codec: dict[str, Any] = {}
    if compressor == "none":
        codec = {"compressors": None}
    elif compressor == "blosc-zstd":
        from zarr.codecs import BloscCodec

        codec = {"compressors": BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")} if zarr_format == 3 else \
            {"compressors": __import__("numcodecs").Blosc(cname="zstd", clevel=3, shuffle=1)}
    elif compressor is not None:
        raise ValueError(f"compressor={compressor!r} must be None (zarr's default), 'blosc-zstd' or 'none'")
    data_array = root.create_array(
        "data", shape=data.shape, dtype=np.dtype(dtype), chunks=(1, n_vars, 1, min(cells_per_chunk or n_cells, n_cells)),
        fill_value=np.nan, **codec,
        **({"dimension_names": ("time", "variable", "ensemble", "cell")} if zarr_format == 3 else {}),
    )
    data_array[...] = data.astype(dtype, copy=False)
    data_array.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "ensemble", "cell"]
    _create(root, "dates", dates, ("time",), zarr_format)
    _create(root, "latitudes", lat, ("cell",), zarr_format)
    _create(root, "longitudes", lon, ("cell",), zarr_format)
    for name, value in statistics.as_dict().items():
        _create(root, name, np.asarray(value), ("variable",), zarr_format)
    if zarr_format == 2:
        zarr.consolidate_metadata(path, zarr_format=2)


def _damaged(path: str, what: str, exc: BaseException, error: type[Exception] = AnemoiLayoutError) -> Exception:
    """The ``error`` for ``what`` of the store ``path`` that zarr cannot decode (``exc``)."""
    settle_zarr_tasks()
    detail = (str(exc).strip().splitlines() or [""])[0][:160]
    return error(f"{path}: {what} cannot be read ({type(exc).__name__}: {detail}): the store is damaged (a truncated "
                 "or overwritten chunk); copy or write it again")


def _read_whole(array: zarr.Array, path: str, what: str) -> np.ndarray:
    """``array[:]``; a chunk zarr cannot decode is :func:`_damaged`."""
    try:
        return array[:]
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the codec raises
        raise _damaged(path, what, exc) from exc


def settle_zarr_tasks(timeout: float = 60.0) -> None:
    """After a zarr read or write that failed (a damaged chunk, a full disk), wait for the other chunks of that call
    that zarr's event loop still decodes or writes: left pending (or failed, unretrieved), the interpreter's exit
    reports each with a traceback after the error message."""
    from zarr.core import sync as zarr_sync

    loop = (getattr(zarr_sync, "loop", None) or [None])[0]
    if loop is None or loop.is_closed() or not loop.is_running():
        return

    async def rest() -> None:
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()),
                             return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(rest(), loop).result(timeout)
    except Exception:  # noqa: BLE001, S110 - a best effort after the error that is being reported
        pass


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def _check_dates(dates: np.ndarray, freq: datetime.timedelta, where: str) -> None:
    if len(dates) < 2:
        return
    step = np.timedelta64(int(freq.total_seconds()), "s")
    expected = dates[0] + step * np.arange(len(dates))
    wrong = np.flatnonzero(dates != expected)
    if wrong.size:
        i = int(wrong[0])
        raise AnemoiLayoutError(
            f"{where}: entry {i} is {dates[i]} but a frequency of {frequency_to_string(freq)} from "
            f"{dates[0]} puts it at {expected[i]}; the dates must be equally spaced at the 'frequency' attribute"
        )


@dataclass(eq=False)
class AnemoiDataset:
    """A dataset in the anemoi layout, opened read-only and validated (use :meth:`open`).

    Coordinates and statistics are loaded at open; ``data`` is read on demand with :meth:`read`.
    Pickles by path (safe to hand to DataLoader workers).
    """

    path: str
    zarr_format: int
    attributes: dict[str, Any]
    variables: list[str]
    dates: np.ndarray
    frequency: datetime.timedelta
    latitudes: np.ndarray
    longitudes: np.ndarray
    statistics: Statistics
    shape: tuple[int, int, int, int]
    dtype: np.dtype
    missing_dates: frozenset[int] = frozenset()
    _data: Any = field(default=None, repr=False, compare=False)
    #: coordinate arrays listed in the store but without one stored chunk (an interrupted copy; or every
    #: value equal to the fill value): their values are the fill value. See :meth:`check_coordinates`.
    unwritten_coordinates: tuple[str, ...] = ()

    # ---------------------------------------------------------------- open / validate
    @classmethod
    def open(cls, path: str | os.PathLike) -> AnemoiDataset:
        """Open and validate the store at ``path`` (zarr format 2 or 3)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no dataset at {path}")
        try:
            root = zarr.open_group(path, mode="r")
        except Exception as exc:  # noqa: BLE001
            raise AnemoiLayoutError(f"{path} is not a zarr group: {exc}") from None
        return cls._from_group(path, root)

    @classmethod
    def _from_group(cls, path: str, root: zarr.Group) -> AnemoiDataset:
        def err(message: str) -> AnemoiLayoutError:
            return AnemoiLayoutError(f"{path}: {message}")

        arrays = set(root.array_keys())
        if "data" not in arrays:
            raise err(f"missing the array 'data' (dates, variables, ensemble, cells); it has {sorted(arrays)}")
        data = root["data"]
        if data.ndim != 4:
            raise err(
                f"array 'data' has {data.ndim} dims (shape {data.shape}) but the anemoi layout has 4: "
                "(dates, variables, ensemble, cells)"
            )
        n_dates, n_vars, n_ens, n_cells = (int(s) for s in data.shape)
        attrs = dict(root.attrs)

        if "variables" in attrs:
            variables = [str(v) for v in attrs["variables"]]
        elif "name_to_index" in attrs:
            variables = [k for k, _ in sorted(attrs["name_to_index"].items(), key=lambda kv: kv[1])]
        else:
            raise err("missing the attribute 'variables' (and 'name_to_index'): the variable names are unknown")
        if len(variables) != n_vars:
            raise err(f"attribute 'variables' lists {len(variables)} names but 'data' has {n_vars} variables")
        if len(set(variables)) != len(variables):
            raise err(f"attribute 'variables' has duplicate names: {variables}")

        if "dates" not in arrays:
            raise err("missing the array 'dates'")
        raw_dates = _read_whole(root["dates"], path, "the array 'dates'")
        try:
            dates = raw_dates.astype("datetime64[s]")
        except (TypeError, ValueError):
            raise err(f"array 'dates' has dtype {raw_dates.dtype}, not datetime64") from None
        if dates.shape != (n_dates,):
            raise err(f"array 'dates' has shape {dates.shape} but 'data' has {n_dates} dates")

        if "frequency" in attrs:
            try:
                frequency = parse_frequency(attrs["frequency"])
            except (TypeError, ValueError) as exc:
                raise err(f"attribute 'frequency': {exc}") from None
        elif n_dates >= 2:
            frequency = datetime.timedelta(seconds=int((dates[1] - dates[0]) / np.timedelta64(1, "s")))
        else:
            raise err("a single date and no attribute 'frequency': the frequency is unknown")
        _check_dates(dates, frequency, where=f"{path}: array 'dates'")
        for key, value in (("start_date", dates[0]), ("end_date", dates[-1])):
            if key in attrs and as_datetime64(attrs[key], f"attribute '{key}'") != value:
                raise err(f"attribute '{key}' is {attrs[key]} but the array 'dates' has {value}")

        coords, unwritten = [], []
        for names in (("latitudes", "latitude"), ("longitudes", "longitude")):
            name = next((n for n in names if n in arrays), None)
            if name is None:
                raise err(f"missing the array '{names[0]}'")
            array = root[name]
            if array.size and array.nchunks_initialized == 0:  # listed, but no value was ever written
                unwritten.append(f"{name} (fill value {array.fill_value})")
            values = np.asarray(_read_whole(array, path, f"the array '{name}'"), dtype=np.float64)
            if values.shape != (n_cells,):
                raise err(f"array '{name}' has shape {values.shape} but 'data' has {n_cells} cells")
            bad = np.flatnonzero(~np.isfinite(values) | (np.abs(values) > (90.0 if name.startswith("lat") else 360.0)))
            if bad.size:
                raise err(f"array '{name}' has {bad.size} of {n_cells} values that are not "
                          f"{'latitudes in [-90, 90]' if name.startswith('lat') else 'longitudes in [-360, 360]'} "
                          f"degrees (first: cell {bad[0]} = {values[bad[0]]}): fix the dataset's coordinates")
            coords.append(values)

        stats: dict[str, np.ndarray] = {}
        for name in STATISTICS_REQUIRED + STATISTICS_OPTIONAL:
            if name not in arrays:
                if name in STATISTICS_REQUIRED:
                    raise err(f"missing the statistics array '{name}'")
                continue
            values = np.asarray(_read_whole(root[name], path, f"the statistics array '{name}'"))
            if values.shape != (n_vars,):
                raise err(f"statistics array '{name}' has shape {values.shape} but there are {n_vars} variables")
            stats[name] = values

        if "ensemble_dimension" in attrs and int(attrs["ensemble_dimension"]) != n_ens:
            raise err(f"attribute 'ensemble_dimension' is {attrs['ensemble_dimension']} but 'data' has {n_ens} members")

        missing = set()
        index = {d: i for i, d in enumerate(dates)}
        for d in attrs.get("missing_dates", []) or []:
            i = index.get(as_datetime64(d, "attribute 'missing_dates' entry"))
            if i is None:
                raise err(f"attribute 'missing_dates' has {d}, which is not one of the dates")
            missing.add(i)

        return cls(
            path=path,
            zarr_format=int(root.metadata.zarr_format),
            attributes=attrs,
            variables=variables,
            dates=dates,
            frequency=frequency,
            latitudes=coords[0],
            longitudes=coords[1],
            statistics=Statistics(**stats),
            shape=(n_dates, n_vars, n_ens, n_cells),
            dtype=np.dtype(data.dtype),
            missing_dates=frozenset(missing),
            _data=data,
            unwritten_coordinates=tuple(unwritten),
        )

    def check_coordinates(self) -> None:
        """Raise :class:`AnemoiLayoutError` naming the store when a coordinate array holds no stored
        value (:attr:`unwritten_coordinates`): a graph built on it would put every cell at one point.
        Called before the coordinates are used (the graph build, a forecast's grid check)."""
        if self.unwritten_coordinates:
            raise AnemoiLayoutError(
                f"{self.path}: the array(s) {', '.join(self.unwritten_coordinates)} hold no stored values (their "
                "chunks are missing, so every cell would sit at the same point): the store is incomplete; copy it "
                "again or rewrite its latitudes and longitudes"
            )

    # ---------------------------------------------------------------- properties
    @property
    def num_dates(self) -> int:
        return self.shape[0]

    @property
    def num_variables(self) -> int:
        return self.shape[1]

    @property
    def ensemble_size(self) -> int:
        """Members per date (the ``ensemble`` dim of ``data``; 1 for deterministic datasets)."""
        return self.shape[2]

    @property
    def num_cells(self) -> int:
        return self.shape[3]

    @property
    def name_to_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.variables)}

    @property
    def resolution(self) -> str | None:
        value = self.attributes.get("resolution")
        return None if value is None else str(value)

    @property
    def start_date(self) -> np.datetime64:
        return self.dates[0]

    @property
    def variables_with_nans(self) -> list[str]:
        """Variables whose stored data holds NaNs (e.g. sea-surface fields over land), in dataset order.

        From the ``has_nans`` statistics array when the store has it, else anemoi-datasets'
        ``variables_with_nans`` attribute; a store with neither reports none here (training masks
        NaN targets and imputes NaN inputs of every variable regardless).
        """
        if self.statistics.has_nans is not None:
            flags = np.asarray(self.statistics.has_nans, dtype=bool)
            return [v for v, f in zip(self.variables, flags, strict=True) if f]
        listed = set(self.attributes.get("variables_with_nans") or [])
        return [v for v in self.variables if v in listed]

    @property
    def end_date(self) -> np.datetime64:
        return self.dates[-1]

    def __len__(self) -> int:
        return self.num_dates

    def __repr__(self) -> str:
        return (f"AnemoiDataset({self.path!r}, dates={self.num_dates} from {self.start_date} every "
                f"{frequency_to_string(self.frequency)}, variables={self.variables}, "
                f"ensemble={self.ensemble_size}, cells={self.num_cells})")

    # ---------------------------------------------------------------- data access
    @property
    def data(self) -> zarr.Array:
        """The zarr array ``data`` (opened lazily in each process)."""
        if self._data is None:
            self._data = zarr.open_group(self.path, mode="r")["data"]
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_data"] = None
        return state

    def date_index(self, date: Any) -> int:
        """Index of ``date`` in :attr:`dates`; ValueError when it is not one of them."""
        d = as_datetime64(date)
        i = int(np.searchsorted(self.dates, d))
        if i >= self.num_dates or self.dates[i] != d:
            raise ValueError(f"date {d} is not in the dataset ({self.start_date} to {self.end_date} every "
                             f"{frequency_to_string(self.frequency)})")
        return i

    def _read_chunks(self, dates: np.ndarray | slice, lo: int, hi: int) -> np.ndarray:
        """``data[dates, :, :, lo:hi]``: a run of consecutive dates as one slice (zarr's fast path)."""
        if isinstance(dates, slice):
            return np.asarray(self.data[dates, :, :, lo:hi])
        if dates.size and np.all(np.diff(dates) == 1):
            return np.asarray(self.data[int(dates[0]) : int(dates[-1]) + 1, :, :, lo:hi])
        return np.asarray(self.data.get_orthogonal_selection((dates, slice(None), slice(None), slice(lo, hi))))

    def read(self, date_indices: Sequence[int] | np.ndarray | slice, cells: slice | None = None) -> np.ndarray:
        """``data[date_indices, :, :, cells]`` as a numpy array ``(dates, variables, ensemble, cells)``.

        ``cells`` is a contiguous slice of the grid (a reader's share). The read is widened to
        whole chunks along the cells (zarr decodes whole chunks anyway, and aligned reads skip a
        slow partial-chunk path), then cut to ``cells``; only the chunks that hold them are read.
        """
        start, stop, step = (cells or slice(None)).indices(self.num_cells)
        if step != 1:
            raise ValueError(f"cells must be a contiguous slice, got step {step}")
        per_chunk = int(self.data.chunks[3])
        lo, hi = (start // per_chunk) * per_chunk, min(-(-stop // per_chunk) * per_chunk, self.num_cells)
        dates = date_indices
        if not isinstance(date_indices, slice):
            dates = np.asarray(date_indices, dtype=np.int64)
            if dates.ndim != 1 or (dates.size and (dates.min() < 0 or dates.max() >= self.num_dates)):
                raise IndexError(f"date indices {dates.tolist()} out of range for {self.num_dates} dates")
        try:  # a damaged chunk (truncated, overwritten) is the store's fault: name it, not the codec's error
            out = self._read_chunks(dates, lo, hi)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the codec raises (blosc, zlib, a wrong size)
            chosen = self.dates[dates]
            where = f" at dates {chosen.min()} to {chosen.max()}" if chosen.size else ""
            raise _damaged(self.path, f"the array 'data'{where}", exc, DamagedStoreError) from exc
        if (lo, hi) == (start, stop):
            return out
        return np.ascontiguousarray(out[..., start - lo : stop - lo])
