"""Coordinates on the unit sphere: lat/lon (radians) <-> unit vectors, great-circle and chord distances.

All graph builders work on unit vectors ``(nodes, 3)`` so that a ``scipy.spatial.cKDTree`` with the
Euclidean (chord) metric ranks neighbours exactly as the great-circle distance does.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "latlon_to_xyz",
    "xyz_to_latlon",
    "arc_to_chord",
    "chord_to_arc",
    "haversine",
    "check_latlon_degrees",
]


def latlon_to_xyz(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Unit vectors ``(nodes, 3)`` for latitudes and longitudes in radians."""
    lat = np.asarray(lat, dtype=np.float64)
    lon = np.asarray(lon, dtype=np.float64)
    cos_lat = np.cos(lat)
    return np.stack([cos_lat * np.cos(lon), cos_lat * np.sin(lon), np.sin(lat)], axis=-1)


def xyz_to_latlon(xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Latitude in [-pi/2, pi/2] and longitude in [0, 2 pi) (radians) of vectors ``(nodes, 3)``."""
    xyz = np.asarray(xyz, dtype=np.float64)
    norm = np.linalg.norm(xyz, axis=-1)
    lat = np.arcsin(np.clip(xyz[..., 2] / norm, -1.0, 1.0))
    lon = np.mod(np.arctan2(xyz[..., 1], xyz[..., 0]), 2 * np.pi)
    return lat, lon


def arc_to_chord(arc: np.ndarray | float) -> np.ndarray | float:
    """Chord length of a great-circle arc (radians) on the unit sphere."""
    return 2.0 * np.sin(np.minimum(np.asarray(arc, dtype=np.float64), np.pi) / 2.0)


def chord_to_arc(chord: np.ndarray | float) -> np.ndarray | float:
    """Great-circle arc (radians) of a chord on the unit sphere."""
    return 2.0 * np.arcsin(np.clip(np.asarray(chord, dtype=np.float64) / 2.0, 0.0, 1.0))


def haversine(lat1: np.ndarray, lon1: np.ndarray, lat2: np.ndarray, lon2: np.ndarray) -> np.ndarray:
    """Great-circle distance (radians on the unit sphere) by the haversine formula; inputs in radians."""
    dlat = np.asarray(lat2) - np.asarray(lat1)
    dlon = np.asarray(lon2) - np.asarray(lon1)
    h = np.sin(dlat / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin(dlon / 2) ** 2
    return 2.0 * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))


def check_latlon_degrees(lat: object, lon: object, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate and return ``(lat, lon)`` as float64 1-D arrays in degrees; clear errors naming ``name``."""
    lat_a = np.asarray(lat, dtype=np.float64)
    lon_a = np.asarray(lon, dtype=np.float64)
    if lat_a.ndim != 1 or lon_a.shape != lat_a.shape:
        raise ValueError(
            f"{name}: latitudes and longitudes must be 1-D arrays of the same length, got shapes "
            f"{lat_a.shape} and {lon_a.shape}; flatten 2-D grids with .ravel()"
        )
    if lat_a.size == 0:
        raise ValueError(f"{name}: no points given; pass at least one (lat, lon) pair")
    if not (np.isfinite(lat_a).all() and np.isfinite(lon_a).all()):
        raise ValueError(f"{name}: latitudes and longitudes must be finite (found NaN or inf)")
    if np.abs(lat_a).max() > 90.0:
        raise ValueError(
            f"{name}: latitudes must lie in [-90, 90] degrees, got a maximum |lat| of {np.abs(lat_a).max():.6g}; "
            "pass degrees, not radians, and latitude first"
        )
    return lat_a, lon_a
