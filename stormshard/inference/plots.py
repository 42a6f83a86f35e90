"""PNG plots of a forecast: maps of forecast, truth and error, and scores against lead time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stormshard.inference.output_paths import map_file_name, score_plot_file_name

__all__ = ["plot_maps", "plot_scores"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_maps(forecast: np.ndarray, truth: np.ndarray, names: list[str], variables: list[str], steps: list[int],
              lat: np.ndarray, lon: np.ndarray, init_date: Any, valid_dates: np.ndarray, out: Path) -> list[Path]:
    """One PNG per variable and lead step (1-based): forecast, truth and error side by side.

    ``forecast`` / ``truth``: ``(steps, grid, variables)`` in ``names`` order (scatter on lat/lon)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    lon = ((lon + 180.0) % 360.0) - 180.0
    size = float(np.clip(40000.0 / max(lat.size, 1), 1.0, 40.0))  # dots that tile the globe
    for name in variables:
        j = names.index(name)
        for k in steps:
            fc, tr = forecast[k - 1, :, j], truth[k - 1, :, j]
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
            fig.suptitle(f"init {init_date}, lead step {k} (valid {valid_dates[k - 1]})")
            path = out / map_file_name(name, k)
            fig.savefig(path, dpi=80)
            plt.close(fig)
            paths.append(path)
    return paths


_PANELS = (
    ("RMSE", (("rmse", "model"), ("rmse_persistence", "persistence"), ("rmse_climatology", "climatology"))),
    ("anomaly correlation", (("acc", "model"), ("acc_persistence", "persistence"))),
    ("CRPS", (("crps", "ensemble"),)),
    ("spread / skill", (("spread_skill", "ensemble"),)),
)


def plot_scores(scores: dict[str, dict[str, list[float]]], lead_hours: list[float], out: Path,
                title: str = "") -> list[Path]:
    """One PNG per variable (``scores_<variable>.png``): lines of each score against lead time
    (RMSE of model, persistence and climatology; ACC of model and persistence; for ensembles
    CRPS and the spread/skill ratio, with the reliable ratio 1 marked)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, s in scores.items():
        panels = [(label, [(k, lab) for k, lab in lines if k in s]) for label, lines in _PANELS]
        panels = [(label, lines) for label, lines in panels if lines]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), constrained_layout=True)
        for ax, (label, lines) in zip(np.atleast_1d(axes), panels, strict=True):
            for key, lab in lines:
                ax.plot(lead_hours, s[key], marker="o", label=lab)
            if key == "spread_skill":
                ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel("lead time (h)")
            ax.set_title(f"{name}: {label}")
            ax.grid(alpha=0.3)
            ax.legend()
        if title:
            fig.suptitle(title)
        path = out / score_plot_file_name(name)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
