"""Per-variable statistics of a dataset in the anemoi-datasets layout, and how to compute them.

:class:`Statistics` holds the arrays anemoi-datasets stores (``mean``, ``stdev``, ``minimum``,
``maximum``; optionally ``sums``, ``squares``, ``count``, ``has_nans``), each ``(variables,)``;
:func:`compute_statistics` computes them from ``(dates, variables, ensemble, cells)`` data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Statistics", "compute_statistics", "STATISTICS_REQUIRED", "STATISTICS_OPTIONAL"]

STATISTICS_REQUIRED = ("mean", "stdev", "minimum", "maximum")
STATISTICS_OPTIONAL = ("sums", "squares", "count", "has_nans")


@dataclass(frozen=True)
class Statistics:
    """Per-variable statistics, each of shape ``(variables,)`` in the dataset's variable order."""

    mean: np.ndarray
    stdev: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray
    sums: np.ndarray | None = None
    squares: np.ndarray | None = None
    count: np.ndarray | None = None
    has_nans: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = None
        for name in STATISTICS_REQUIRED + STATISTICS_OPTIONAL:
            value = getattr(self, name)
            if value is None:
                continue
            value = np.asarray(value)
            if value.ndim != 1:
                raise ValueError(f"statistics '{name}' must be 1-d (one value per variable), got shape {value.shape}")
            if n is None:
                n = len(value)
            elif len(value) != n:
                raise ValueError(f"statistics '{name}' has {len(value)} values but 'mean' has {n}")
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.mean)

    def as_dict(self) -> dict[str, np.ndarray]:
        """The arrays that are present, by their anemoi names."""
        return {k: getattr(self, k) for k in STATISTICS_REQUIRED + STATISTICS_OPTIONAL if getattr(self, k) is not None}


def compute_statistics(data: np.ndarray) -> Statistics:
    """Statistics per variable over dates, members and cells of ``data`` ``(dates, variables, ensemble, cells)``.

    NaNs are skipped (and flagged in ``has_nans``); computed in float64 as anemoi-datasets does
    (``stdev = sqrt(squares / count - mean**2)``, clipped at zero).
    """
    if data.ndim != 4:
        raise ValueError(f"data must be (dates, variables, ensemble, cells), got shape {data.shape}")
    n_vars = data.shape[1]
    count = np.zeros(n_vars, dtype=np.int64)
    sums, squares = np.zeros(n_vars), np.zeros(n_vars)
    minimum, maximum = np.full(n_vars, np.nan), np.full(n_vars, np.nan)
    has_nans = np.zeros(n_vars, dtype=bool)
    for v in range(n_vars):
        x = np.asarray(data[:, v], dtype=np.float64)
        finite = ~np.isnan(x)
        count[v] = int(finite.sum())
        if count[v] == 0:
            raise ValueError(f"variable index {v} has no values that are not NaN: cannot compute its statistics")
        has_nans[v] = count[v] < x.size
        xz = np.where(finite, x, 0.0) if has_nans[v] else x
        sums[v], squares[v] = xz.sum(), (xz * xz).sum()
        minimum[v], maximum[v] = np.nanmin(x), np.nanmax(x)
    mean = sums / count
    variance = np.maximum(squares / count - mean * mean, 0.0)
    return Statistics(
        mean=mean,
        stdev=np.sqrt(variance),
        minimum=minimum,
        maximum=maximum,
        sums=sums,
        squares=squares,
        count=count,
        has_nans=has_nans,
    )
