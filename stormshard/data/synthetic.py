"""A synthetic dataset with known dynamics, written in the anemoi layout on an O-grid.

Variables (in this order):

- ``tracer_1``, ``tracer_2``, ``tracer_3`` (prognostic): smooth random patterns on the sphere, each
  a sum of low-order plane waves ``sum_w a_w cos(k_w . x + phi_w)`` of the unit position vector
  ``x`` (``|k_w|`` between 1.5 and 4.5: spherical-harmonic degrees up to ~5), scaled by
  ``scale_f`` and shifted by ``offset_f``. Each is advected by solid-body rotation about one
  tilted axis at its own angular speed ``omega_f`` (degrees per hour; default 3, -2, 4: 18,
  -12 and 24 degrees per 6-hour step), so

      tracer_f(x, t + dt) = tracer_f(R(-omega_f dt) x, t)

  exactly: the next state at ``x`` is the current state at the departure point. Persistence is
  a poor forecast: its RMSE over one 6-hour step is 0.3 to 0.8 of each field's standard deviation.
- ``insolation`` (forcing, input-only): ``max(cos(solar zenith angle), 0)`` from the date, time
  of day and longitude/latitude.
- ``tracer_product`` (diagnostic, output-only): the product of the normalised patterns of
  ``tracer_1`` and ``tracer_2``: ``((tracer_1 - offset_1) / scale_1) * ((tracer_2 - offset_2) / scale_2)``.

With ``sea_field=True`` (``--sea-field``) a sixth variable ``sst`` (prognostic) is written: a
sea-surface field ``290 + 3 * pattern_1`` (it moves with ``tracer_1``) that is NaN over a fixed
"land" (:data:`LAND_BOXES`, two boxes, a fifth of the cells), as sea-surface fields of real
datasets are; its statistics skip the NaNs and ``has_nans`` flags it.

Members (``--members M``) share the dynamics; member ``m > 0`` perturbs the wave phases.
Everything needed to recompute the fields is stored in the group attribute ``synthetic``
(:meth:`SyntheticDynamics.from_attributes`).

CLI::

    python -m stormshard.data.synthetic --grid o16 --steps 400 --out data/synthetic.zarr \\
        [--frequency 6h] [--seed 0] [--members 1] [--start-date 2020-01-01] [--sea-field] [--if-missing]
"""

from __future__ import annotations

import argparse
import datetime
import errno
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stormshard.data.anemoi_layout import (
    AnemoiDataset,
    AnemoiLayoutError,
    as_datetime64,
    frequency_to_string,
    parse_frequency,
    settle_zarr_tasks,
    write_anemoi_dataset,
)
from stormshard.errors import OutputPathError, check_writable_directory, is_disk_full, no_partial_output
from stormshard.graphs.grids import grid_from_name

__all__ = [
    "PROGNOSTIC",
    "FORCING",
    "DIAGNOSTIC",
    "VARIABLES",
    "SyntheticDynamics",
    "unit_vectors",
    "rotation_matrix",
    "insolation",
    "SEA_FIELD",
    "LAND_BOXES",
    "land_mask",
    "generate_synthetic_dataset",
    "main",
]

PROGNOSTIC = ("tracer_1", "tracer_2", "tracer_3")
FORCING = ("insolation",)
DIAGNOSTIC = ("tracer_product",)
VARIABLES = PROGNOSTIC + FORCING + DIAGNOSTIC
SEA_FIELD = "sst"
LAND_BOXES = ((-35.0, 70.0, -20.0, 50.0), (15.0, 70.0, 235.0, 300.0))  # (lat_min, lat_max, lon_min, lon_max), degrees

DEFAULT_OMEGAS = (3.0, -2.0, 4.0)  # degrees per hour, one per prognostic field
DEFAULT_OFFSETS = (280.0, 0.0, 1000.0)
DEFAULT_SCALES = (10.0, 5.0, 20.0)
DEFAULT_AXIS_TILT = 30.0  # degrees from the north pole
DEFAULT_AXIS_LON = 40.0
WAVES = 12
MEMBER_PHASE_SPREAD = 0.3  # radians


def unit_vectors(latitudes: np.ndarray, longitudes: np.ndarray) -> np.ndarray:
    """Positions on the unit sphere ``(cells, 3)`` from latitudes and longitudes in degrees."""
    lat, lon = np.radians(np.asarray(latitudes, float)), np.radians(np.asarray(longitudes, float))
    return np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=-1)


def rotation_matrix(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rotation by ``angle`` radians (right-handed) about the unit vector ``axis`` (Rodrigues), ``(3, 3)``."""
    a = np.asarray(axis, float) / np.linalg.norm(axis)
    k = np.array([[0.0, -a[2], a[1]], [a[2], 0.0, -a[0]], [-a[1], a[0], 0.0]])
    return np.eye(3) + np.sin(angle) * k + (1.0 - np.cos(angle)) * (k @ k)


def insolation(date: Any, latitudes: np.ndarray, longitudes: np.ndarray) -> np.ndarray:
    """Top-of-atmosphere insolation factor ``max(cos(zenith), 0)`` ``(cells,)`` at ``date`` (UTC)."""
    d = as_datetime64(date)
    year_start = d.astype("datetime64[Y]").astype("datetime64[s]")
    days = (d - year_start) / np.timedelta64(1, "D")
    hours = (d - d.astype("datetime64[D]").astype("datetime64[s]")) / np.timedelta64(1, "h")
    declination = np.radians(-23.44) * np.cos(2.0 * np.pi * (days + 10.0) / 365.25)
    hour_angle = 2.0 * np.pi * hours / 24.0 + np.radians(np.asarray(longitudes, float)) - np.pi
    lat = np.radians(np.asarray(latitudes, float))
    cos_zenith = np.sin(lat) * np.sin(declination) + np.cos(lat) * np.cos(declination) * np.cos(hour_angle)
    return np.maximum(cos_zenith, 0.0)


def land_mask(latitudes: np.ndarray, longitudes: np.ndarray) -> np.ndarray:
    """``(cells,)`` bool: the synthetic "land" (:data:`LAND_BOXES`), where ``sst`` is missing."""
    lat = np.asarray(latitudes, float)
    lon = np.mod(np.asarray(longitudes, float), 360.0)
    land = np.zeros(lat.shape, dtype=bool)
    for lat0, lat1, lon0, lon1 in LAND_BOXES:
        in_lon = (lon >= lon0 % 360.0) & (lon <= lon1 % 360.0) if lon0 % 360.0 <= lon1 % 360.0 else \
            (lon >= lon0 % 360.0) | (lon <= lon1 % 360.0)
        land |= (lat >= lat0) & (lat <= lat1) & in_lon
    return land


@dataclass(frozen=True, eq=False)
class SyntheticDynamics:
    """The exact solution: patterns, rotation axis and angular speeds (computed once from a seed).

    Array layouts: ``wave_vectors`` ``(members, fields, waves, 3)``, ``phases``
    ``(members, fields, waves)``, ``amplitudes`` ``(fields, waves)``; ``omegas`` in degrees per
    hour, one per prognostic field; times are hours since ``start_date``.
    """

    axis: np.ndarray
    omegas: np.ndarray
    wave_vectors: np.ndarray
    phases: np.ndarray
    amplitudes: np.ndarray
    offsets: np.ndarray
    scales: np.ndarray
    start_date: np.datetime64

    @classmethod
    def from_seed(cls, seed: int = 0, members: int = 1, start_date: Any = "2020-01-01T00:00:00",
                  omegas: Sequence[float] = DEFAULT_OMEGAS) -> SyntheticDynamics:
        if members < 1:
            raise ValueError(f"members must be at least 1, got {members}")
        if len(omegas) != len(PROGNOSTIC):
            raise ValueError(f"omegas needs one angular speed per prognostic field {PROGNOSTIC}, got {list(omegas)}")
        rng = np.random.default_rng(seed)
        fields = len(PROGNOSTIC)
        directions = rng.normal(size=(fields, WAVES, 3))
        directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
        k = directions * rng.uniform(1.5, 4.5, size=(fields, WAVES, 1))
        phases = rng.uniform(0.0, 2.0 * np.pi, size=(fields, WAVES))
        amplitudes = rng.uniform(0.5, 1.0, size=(fields, WAVES))
        amplitudes *= np.sqrt(2.0 / (amplitudes**2).sum(axis=1, keepdims=True))  # pattern variance ~ 1
        member_phases = np.repeat(phases[None], members, axis=0)
        if members > 1:
            member_phases[1:] += MEMBER_PHASE_SPREAD * rng.normal(size=(members - 1, fields, WAVES))
        tilt, lon = np.radians(DEFAULT_AXIS_TILT), np.radians(DEFAULT_AXIS_LON)
        axis = np.array([np.sin(tilt) * np.cos(lon), np.sin(tilt) * np.sin(lon), np.cos(tilt)])
        return cls(
            axis=axis,
            omegas=np.asarray(omegas, float),
            wave_vectors=np.repeat(k[None], members, axis=0),
            phases=member_phases,
            amplitudes=amplitudes,
            offsets=np.asarray(DEFAULT_OFFSETS, float),
            scales=np.asarray(DEFAULT_SCALES, float),
            start_date=as_datetime64(start_date, "start_date"),
        )

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> SyntheticDynamics:
        """Rebuild from the ``synthetic`` attribute written by :func:`generate_synthetic_dataset`."""
        return cls(
            axis=np.asarray(attrs["axis"], float),
            omegas=np.asarray(attrs["omegas_deg_per_hour"], float),
            wave_vectors=np.asarray(attrs["wave_vectors"], float),
            phases=np.asarray(attrs["phases"], float),
            amplitudes=np.asarray(attrs["amplitudes"], float),
            offsets=np.asarray(attrs["offsets"], float),
            scales=np.asarray(attrs["scales"], float),
            start_date=as_datetime64(attrs["start_date"], "synthetic start_date"),
        )

    def to_attributes(self) -> dict[str, Any]:
        return {
            "description": "solid-body rotation of smooth random patterns; see stormshard.data.synthetic",
            "prognostic": list(PROGNOSTIC),
            "forcing": list(FORCING),
            "diagnostic": list(DIAGNOSTIC),
            "axis": self.axis.tolist(),
            "omegas_deg_per_hour": self.omegas.tolist(),
            "wave_vectors": self.wave_vectors.tolist(),
            "phases": self.phases.tolist(),
            "amplitudes": self.amplitudes.tolist(),
            "offsets": self.offsets.tolist(),
            "scales": self.scales.tolist(),
            "start_date": str(self.start_date),
        }

    @property
    def members(self) -> int:
        return self.wave_vectors.shape[0]

    def hours_since_start(self, date: Any) -> float:
        return float((as_datetime64(date) - self.start_date) / np.timedelta64(1, "h"))

    def departure_points(self, xyz: np.ndarray, dt_hours: float) -> np.ndarray:
        """``(fields, cells, 3)``: where each field's value at ``xyz`` ``(cells, 3)`` was ``dt_hours`` ago."""
        return np.stack([xyz @ rotation_matrix(self.axis, -np.radians(w * dt_hours)).T for w in self.omegas])

    def patterns(self, hours: float, xyz: np.ndarray) -> np.ndarray:
        """Normalised patterns ``(members, fields, cells)`` at time ``hours``.

        ``xyz`` is ``(cells, 3)`` or one set of points per field ``(fields, cells, 3)``.
        Uses ``p(R(-w t) x) = sum_w a cos((R(w t) k) . x + phi)``.
        """
        points = np.broadcast_to(xyz, (len(self.omegas),) + xyz.shape[-2:])
        out = np.empty((self.members, len(self.omegas), points.shape[1]))
        for f, omega in enumerate(self.omegas):
            rot = rotation_matrix(self.axis, np.radians(omega * hours))
            k = self.wave_vectors[:, f] @ rot.T  # (members, waves, 3)
            arg = points[f][None] @ k.transpose(0, 2, 1)  # (members, cells, waves)
            arg += self.phases[:, f, None, :]
            out[:, f] = np.cos(arg, out=arg) @ self.amplitudes[f]
        return out

    def prognostic(self, hours: float, xyz: np.ndarray) -> np.ndarray:
        """Prognostic fields ``(members, fields, cells)`` in physical units."""
        return self.offsets[None, :, None] + self.scales[None, :, None] * self.patterns(hours, xyz)

    def state(self, date: Any, latitudes: np.ndarray, longitudes: np.ndarray) -> np.ndarray:
        """All variables ``(members, variables, cells)`` at ``date``, in :data:`VARIABLES` order."""
        xyz = unit_vectors(latitudes, longitudes)
        hours = self.hours_since_start(date)
        p = self.patterns(hours, xyz)
        prog = self.offsets[None, :, None] + self.scales[None, :, None] * p
        forcing = np.broadcast_to(insolation(date, latitudes, longitudes), (self.members, 1, len(xyz)))
        diagnostic = (p[:, 0] * p[:, 1])[:, None]
        return np.concatenate([prog, forcing, diagnostic], axis=1)


def generate_synthetic_dataset(
    path: str | os.PathLike,
    grid: str = "o16",
    steps: int = 400,
    frequency: str | int | datetime.timedelta = "6h",
    seed: int = 0,
    members: int = 1,
    start_date: Any = "2020-01-01T00:00:00",
    statistics_end: Any = None,
    cells_per_chunk: int | None = None,
    overwrite: bool = False,
    sea_field: bool = False,
    compressor: str | None = None,
) -> SyntheticDynamics:
    """Write ``steps`` dates of the synthetic fields on ``grid`` to ``path``; return the dynamics.

    ``sea_field``: add ``sst``, NaN over :func:`land_mask`. ``statistics_end``, ``cells_per_chunk``
    and ``compressor`` are passed to :func:`write_anemoi_dataset`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer of at least 2 (the number of dates), got {steps!r}")
    freq = parse_frequency(frequency)
    lat, lon = grid_from_name(grid)
    dynamics = SyntheticDynamics.from_seed(seed=seed, members=members, start_date=start_date)
    step = np.timedelta64(int(freq.total_seconds()), "s")
    dates = dynamics.start_date + step * np.arange(steps)
    names = VARIABLES + ((SEA_FIELD,) if sea_field else ())
    data = np.empty((steps, len(names), members, len(lat)), dtype=np.float32)
    land = land_mask(lat, lon)
    for i, date in enumerate(dates):
        state = np.moveaxis(dynamics.state(date, lat, lon), 0, 1)  # (variables, members, cells)
        data[i, :len(VARIABLES)] = state
        if sea_field:
            pattern_1 = (state[0] - dynamics.offsets[0]) / dynamics.scales[0]
            data[i, -1] = np.where(land, np.nan, 290.0 + 3.0 * pattern_1)
    extra = {"compressor": compressor} if compressor is not None else {}
    write_anemoi_dataset(
        path, data, dates, lat, lon, names,
        frequency=freq,
        resolution=grid.lower(),
        attributes={
            "description": f"stormshard synthetic dataset (grid {grid}, seed {seed})",
            "licence": "CC-BY-4.0",
            "attribution": "stormshard",
            "synthetic": dynamics.to_attributes(),
            "variables_metadata": {
                **{v: {"role": "prognostic"} for v in PROGNOSTIC},
                **{v: {"role": "forcing"} for v in FORCING},
                **{v: {"role": "diagnostic"} for v in DIAGNOSTIC},
                **({SEA_FIELD: {"role": "prognostic", "missing": "NaN over land"}} if sea_field else {}),
            },
            **({"variables_with_nans": [SEA_FIELD]} if sea_field else {}),
        },
        statistics_end=statistics_end,
        cells_per_chunk=cells_per_chunk,
        overwrite=overwrite,
        **extra,
    )
    return dynamics


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's ``--grid``, ``--steps``, ``--frequency``, ``--members`` and
    ``--start-date`` (naming the option, the value and the fix), or None."""
    if args.steps < 2:
        return f"--steps {args.steps}: a dataset needs at least 2 dates; give --steps 2 or more"
    if args.members < 1:
        return f"--members {args.members}: give at least 1 member"
    for option, value, check in (("--grid", args.grid, grid_from_name), ("--frequency", args.frequency,
                                                                         parse_frequency),
                                 ("--start-date", args.start_date, as_datetime64)):
        try:
            check(value)
        except (TypeError, ValueError) as exc:
            return f"{option} {value!r}: {exc}"
    return None


def _write_replacing(args: argparse.Namespace) -> None:
    """The store of ``args`` written in a fresh folder beside ``--out``, which replaces ``--out`` only once it is
    complete (and puts the old store back if that rename fails): a failure (a full disk, an interrupt) leaves the
    old dataset as it was and no partial one."""
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(args.out))}.", suffix=".partial", dir=parent)
    try:
        store = os.path.join(work, "new.zarr")
        generate_synthetic_dataset(store, grid=args.grid, steps=args.steps, frequency=args.frequency,
                                   seed=args.seed, members=args.members, start_date=args.start_date,
                                   sea_field=args.sea_field)
        old = os.path.join(work, "old.zarr") if os.path.exists(args.out) else None
        if old is not None:
            os.replace(args.out, old)
        try:
            os.replace(store, args.out)
        except BaseException:
            if old is not None:
                os.replace(old, args.out)
            raise
    except BaseException:
        settle_zarr_tasks()  # no chunk write still running into the folder removed below
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stormshard.data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default="o16", help="grid name: o<N> (octahedral) or a spacing in degrees")
    parser.add_argument("--steps", type=int, default=400, help="number of dates")
    parser.add_argument("--out", required=True, help="output path of the zarr store")
    parser.add_argument("--frequency", default="6h", help="time between dates, e.g. 6h, 1h, 1d")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--members", type=int, default=1, help="ensemble members")
    parser.add_argument("--start-date", default="2020-01-01T00:00:00")
    parser.add_argument("--sea-field", action="store_true",
                        help="add 'sst', a sea-surface field that is NaN over a fixed land region")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when --out already holds a valid anemoi-layout dataset")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:  # before anything is read, replaced or written
        print(f"error: {problem}", file=sys.stderr)
        return 2

    if os.path.exists(args.out):
        try:
            existing = AnemoiDataset.open(args.out)
        except (AnemoiLayoutError, FileNotFoundError) as exc:
            if args.if_missing:
                print(f"error: {args.out} exists but is not a valid dataset ({exc}); remove it", file=sys.stderr)
                return 2
            existing = None
        if args.if_missing and existing is not None:
            print(f"{args.out} exists and is valid ({existing.num_dates} dates, {existing.num_cells} cells): kept")
            return 0
        if existing is None or "synthetic" not in existing.attributes:
            print(f"error: {args.out} exists and was not written by this generator; remove it or choose "
                  "another --out", file=sys.stderr)
            return 2
    try:  # a read-only or unwritable place: before anything is created
        check_writable_directory(os.path.dirname(os.path.abspath(args.out)), "--out", args.out)
    except OutputPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        with no_partial_output(args.out):  # the folders it created go too
            _write_replacing(args)
    except OSError as exc:  # a full disk, an I/O error: the old store as it was, nothing partial beside it
        full = is_disk_full(exc)
        what = (f"the disk is full ({exc.strerror})" if full else
                f"{exc.strerror or type(exc).__name__} ({errno.errorcode.get(exc.errno or 0, 'no errno')})")
        fix = "free space there" if full else "check that file system (its permissions, the device)"
        print(f"error: {what} writing {args.out}: {fix} or write to another file system; "
              f"{'the store there is kept as it was' if os.path.exists(args.out) else 'nothing was written'}",
              file=sys.stderr)
        return 1
    ds = AnemoiDataset.open(args.out)
    print(f"wrote {args.out}: {ds.num_dates} dates every {frequency_to_string(ds.frequency)}, "
          f"{ds.num_variables} variables {ds.variables}, {ds.ensemble_size} member(s), {ds.num_cells} cells "
          f"({args.grid}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
