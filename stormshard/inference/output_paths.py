"""Where a forecast writes: the one place that names its files, read by the writer
(:mod:`stormshard.inference.forecast`, :mod:`stormshard.inference.plots`) and by the request check
(:func:`stormshard.inference.request.forecast_outputs`, which refuses to replace any of them without
``--overwrite``), so that the two cannot drift.

Per initial date, in its directory (``out``, or ``out/<date>`` for several dates): ``forecast.zarr``,
``forecast.nc``, ``scores.json`` and ``maps/<variable>_step<k>.png``. In ``out``: the combined
``scores.json``, ``climatology.npz`` and ``plots/scores_<variable>.png``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["OUTPUT_NAMES", "DateOutputs", "RunOutputs", "map_file_name", "score_plot_file_name"]

STORE, NETCDF, SCORES, MAPS, PLOTS, CLIMATOLOGY = ("forecast.zarr", "forecast.nc", "scores.json", "maps", "plots",
                                                   "climatology.npz")
#: what a forecast writes in ``out`` or its date directories (a failed forecast removes what it rewrote)
OUTPUT_NAMES = (STORE, NETCDF, SCORES, MAPS, PLOTS, CLIMATOLOGY)


def map_file_name(variable: str, step: int) -> str:
    """The map of ``variable`` at lead step ``step`` (1-based)."""
    return f"{variable}_step{step:03d}.png"


def score_plot_file_name(variable: str) -> str:
    """The plot of ``variable``'s scores against lead time."""
    return f"scores_{variable}.png"


@dataclass(frozen=True)
class DateOutputs:
    """The files of one initial date's forecast, in ``directory``."""

    directory: Path

    @property
    def store(self) -> Path:
        return self.directory / STORE

    @property
    def netcdf(self) -> Path:
        return self.directory / NETCDF

    @property
    def scores(self) -> Path:
        return self.directory / SCORES

    @property
    def maps(self) -> Path:
        return self.directory / MAPS

    def map(self, variable: str, step: int) -> Path:
        return self.maps / map_file_name(variable, step)


@dataclass(frozen=True)
class RunOutputs:
    """The files a forecast writes in ``out`` beside its dates' directories."""

    out: Path

    @property
    def summary(self) -> Path:
        """The scores combined over the initial dates."""
        return self.out / SCORES

    @property
    def climatology(self) -> Path:
        return self.out / CLIMATOLOGY

    @property
    def plots(self) -> Path:
        return self.out / PLOTS

    def score_plot(self, variable: str) -> Path:
        return self.plots / score_plot_file_name(variable)
