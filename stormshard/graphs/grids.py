"""Data grids computed from their definitions (nothing is downloaded).

- Octahedral reduced Gaussian grid O-N: 2N latitude rings at the Gauss-Legendre roots; ring i
  (1-based, counted from the nearest pole) has 4i + 16 equally spaced points starting at
  longitude 0. O48 has 10,944 points, O96 40,320.
- Regular latitude-longitude grids.

Coordinates are returned in degrees, latitude in [-90, 90] (north first), longitude in [0, 360).
"""

from __future__ import annotations

import re

import numpy as np

__all__ = [
    "gaussian_latitudes",
    "octahedral_ring_sizes",
    "octahedral_grid",
    "regular_latlon_grid",
    "latlon_patch",
    "grid_from_name",
]


def gaussian_latitudes(n: int) -> np.ndarray:
    """The 2n Gaussian latitudes (degrees, north to south) of a grid with n rings per hemisphere."""
    if n < 1:
        raise ValueError(f"the Gaussian grid number must be at least 1, got {n}")
    roots, _ = np.polynomial.legendre.leggauss(2 * n)
    return np.degrees(np.arcsin(np.sort(roots)[::-1]))


def octahedral_ring_sizes(n: int) -> np.ndarray:
    """Points per latitude ring of O-n, north to south: 20, 24, ..., 4n+16, 4n+16, ..., 20."""
    north = 4 * np.arange(1, n + 1) + 16
    return np.concatenate([north, north[::-1]])


def octahedral_grid(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Latitudes and longitudes (degrees) of the octahedral reduced Gaussian grid O-n, ring by ring."""
    lats = gaussian_latitudes(n)
    sizes = octahedral_ring_sizes(n)
    lat = np.repeat(lats, sizes)
    lon = np.concatenate([np.arange(s) * (360.0 / s) for s in sizes])
    return lat, lon


def regular_latlon_grid(resolution: float, include_poles: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A regular grid with ``resolution`` degrees spacing, flattened row by row (north first)."""
    if resolution <= 0 or 180.0 / resolution != round(180.0 / resolution):
        raise ValueError(
            f"resolution {resolution} must be positive and divide 180 degrees evenly (e.g. 0.25, 1, 2.5)"
        )
    nlat = int(round(180.0 / resolution))
    if include_poles:
        lats = np.linspace(90.0, -90.0, nlat + 1)
    else:
        lats = 90.0 - resolution / 2 - resolution * np.arange(nlat)
    lons = np.arange(int(round(360.0 / resolution))) * resolution
    lat, lon = np.meshgrid(lats, lons, indexing="ij")
    return lat.ravel(), lon.ravel()


def latlon_patch(
    lat_range: tuple[float, float], lon_range: tuple[float, float], resolution: float
) -> tuple[np.ndarray, np.ndarray]:
    """A limited-area regular grid: latitudes ``lat_range`` (south, north) and longitudes ``lon_range``
    (west, east; east < west wraps across 0) in degrees, every ``resolution`` degrees, both ends included,
    flattened row by row (north first). Longitudes are returned in [0, 360)."""
    (south, north), (west, east) = lat_range, lon_range
    if not (-90.0 <= south < north <= 90.0):
        raise ValueError(
            f"lat_range {lat_range} must be (south, north) with -90 <= south < north <= 90 degrees"
        )
    if not resolution > 0:
        raise ValueError(f"resolution {resolution} must be a positive number of degrees")
    width = (east - west) % 360.0
    if width == 0.0:
        raise ValueError(
            f"lon_range {lon_range} spans no longitudes; use regular_latlon_grid for a global grid"
        )
    lats = north - resolution * np.arange(int(np.floor((north - south) / resolution + 1e-9)) + 1)
    lons = np.mod(west + resolution * np.arange(int(np.floor(width / resolution + 1e-9)) + 1), 360.0)
    lat, lon = np.meshgrid(lats, lons, indexing="ij")
    return lat.ravel(), lon.ravel()


def grid_from_name(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates for a grid name: ``o32``/``O96`` (octahedral) or ``1.0``/``0.25`` (regular, degrees)."""
    m = re.fullmatch(r"[oO](\d+)", name.strip())
    if m:
        return octahedral_grid(int(m.group(1)))
    try:
        return regular_latlon_grid(float(name))
    except ValueError:
        raise ValueError(
            f"unknown grid {name!r}: use 'o<N>' for an octahedral reduced Gaussian grid (e.g. 'o32') "
            "or a spacing in degrees for a regular lat-lon grid (e.g. '1.0')"
        ) from None
