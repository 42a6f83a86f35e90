"""Forecast scores per variable and lead time, area-weighted over the grid (numpy, one process).

Layouts: ``members`` ``(members, steps, grid, variables)``; ``truth`` and ``climatology``
``(steps, grid, variables)``; ``persistence`` ``(grid, variables)`` (the state at the initial
date); ``weights`` ``(grid,)`` node areas (normalised here). Every score is ``(steps, variables)``.

- RMSE of the ensemble mean (the forecast itself when deterministic), of persistence and of the
  climatology;
- anomaly correlation (ACC) of the ensemble mean and of persistence: the area-weighted Pearson
  correlation of forecast and observed anomalies from the climatology;
- ensembles: CRPS (the empirical ensemble CRPS, ``mean|x_i - y| - mean|x_i - x_j| / 2``) and the
  spread/skill ratio ``sqrt((M + 1) / M) * spread / RMSE(mean)`` with spread the square root of
  the area-weighted unbiased ensemble variance (1 for a reliable ensemble).

The climatology is the mean over the training period, per cell and hour of the day
(:func:`compute_climatology`). :func:`combine_scores` averages the scores of several initial dates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stormshard.data.anemoi_layout import AnemoiDataset, as_datetime64

__all__ = ["Climatology", "compute_climatology", "rmse", "acc", "crps", "spread", "score_forecast",
           "combine_scores"]


def _w(weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum())[:, None]


def rmse(pred: np.ndarray, truth: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(steps, variables)`` area-weighted RMSE of ``pred`` vs ``truth`` ``(steps, grid, variables)``."""
    return np.sqrt(((pred - truth) ** 2 * _w(weights)).sum(axis=-2))


def acc(pred: np.ndarray, truth: np.ndarray, clim: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(steps, variables)`` area-weighted anomaly correlation against the climatology ``clim``."""
    w = _w(weights)
    a, o = pred - clim, truth - clim
    a = a - (a * w).sum(axis=-2, keepdims=True)
    o = o - (o * w).sum(axis=-2, keepdims=True)
    cov = (a * o * w).sum(axis=-2)
    norm = np.sqrt((a * a * w).sum(axis=-2) * (o * o * w).sum(axis=-2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norm > 0, cov / norm, np.nan)


def crps(members: np.ndarray, truth: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(steps, variables)`` area-weighted ensemble CRPS of ``members`` ``(M, steps, grid, variables)``."""
    skill = np.abs(members - truth[None]).mean(axis=0)
    m = members.shape[0]
    pair = np.zeros_like(skill)
    for i in range(m):  # O(M^2) pairs without an (M, M, ...) temporary
        pair += np.abs(members[i][None] - members).sum(axis=0)
    per_point = skill - pair / (2 * m * m)
    return (per_point * _w(weights)).sum(axis=-2)


def spread(members: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(steps, variables)``: square root of the area-weighted unbiased ensemble variance."""
    return np.sqrt((members.var(axis=0, ddof=1) * _w(weights)).sum(axis=-2))


class Climatology:
    """Per cell and hour of the day: the mean of the dataset over the training dates ``(hours, grid,
    variables)`` (variables in ``names`` order)."""

    def __init__(self, hours: Sequence[int], mean: np.ndarray, names: Sequence[str], period: tuple[str, str],
                 samples: int) -> None:
        self.hours, self.mean, self.names, self.period, self.samples = list(hours), mean, list(names), period, samples

    def at(self, dates: np.ndarray) -> np.ndarray:
        """``(len(dates), grid, variables)`` for the valid ``dates``."""
        hours = [int((d - d.astype("datetime64[D]")) / np.timedelta64(1, "h")) for d in dates]
        absent = sorted(set(hours) - set(self.hours))
        if absent:
            raise ValueError(f"the climatology of {self.period} has the hours of the day {self.hours}, not {absent}: "
                             "forecast valid times must be times of day the training period has")
        return self.mean[[self.hours.index(h) for h in hours]]

    def save(self, path: Any) -> None:
        np.savez(path, hours=np.asarray(self.hours), mean=self.mean, names=np.asarray(self.names),
                 period=np.asarray(self.period), samples=np.asarray(self.samples))

    @classmethod
    def load(cls, path: Any) -> Climatology:
        f = np.load(path)
        return cls(f["hours"].tolist(), f["mean"], f["names"].tolist(), tuple(f["period"].tolist()), int(f["samples"]))


def compute_climatology(dataset: AnemoiDataset, names: Sequence[str], start: Any, end: Any,
                        max_dates_per_hour: int = 256) -> Climatology:
    """Mean of ``names`` over the dataset's dates in ``[start, end]`` (None: its first / last
    date) per hour of the day, from at most ``max_dates_per_hour`` evenly spaced dates per hour
    (missing dates are skipped). Raises when the dataset holds none of the period's dates."""
    lo = dataset.dates[0] if start is None else as_datetime64(start, "training start")
    hi = dataset.dates[-1] if end is None else as_datetime64(end, "training end")
    period = (str(lo), str(hi))
    candidates = [i for i in np.flatnonzero((dataset.dates >= lo) & (dataset.dates <= hi))
                  if int(i) not in dataset.missing_dates]
    if not candidates:
        raise ValueError(f"the dataset {dataset.path} has no dates in the training period {period[0]} to {period[1]}: "
                         "the climatology comes from it; pass a dataset that covers the training period, or "
                         "verify=False (--no-scores)")
    cols = [dataset.variables.index(n) for n in names]
    by_hour: dict[int, list[int]] = {}
    for i in candidates:
        d = dataset.dates[i]
        by_hour.setdefault(int((d - d.astype("datetime64[D]")) / np.timedelta64(1, "h")), []).append(int(i))
    hours = sorted(by_hour)
    mean = np.zeros((len(hours), dataset.num_cells, len(cols)))
    total = 0
    for h, hour in enumerate(hours):
        idx = by_hour[hour]
        pick = np.unique(np.linspace(0, len(idx) - 1, min(len(idx), max_dates_per_hour)).round().astype(int))
        for i in (idx[p] for p in pick):
            mean[h] += dataset.read([i])[0, cols, 0].T
        mean[h] /= len(pick)
        total += len(pick)
    return Climatology(hours, mean, names, period, total)


def score_forecast(members: np.ndarray, truth: np.ndarray, persistence: np.ndarray, climatology: np.ndarray,
                   weights: np.ndarray, names: Sequence[str]) -> dict[str, dict[str, list[float]]]:
    """``{variable: {score: [per lead time]}}``; scores ``rmse``, ``rmse_persistence``,
    ``rmse_climatology``, ``acc``, ``acc_persistence``, and for ensembles ``crps``, ``spread``,
    ``spread_skill``."""
    mean = members.mean(axis=0)
    pers = np.broadcast_to(persistence, truth.shape)
    out: dict[str, np.ndarray] = {
        "rmse": rmse(mean, truth, weights), "rmse_persistence": rmse(pers, truth, weights),
        "rmse_climatology": rmse(climatology, truth, weights), "acc": acc(mean, truth, climatology, weights),
        "acc_persistence": acc(pers, truth, climatology, weights),
    }
    m = members.shape[0]
    if m > 1:
        out["crps"] = crps(members, truth, weights)
        out["spread"] = spread(members, weights)
        with np.errstate(invalid="ignore", divide="ignore"):
            out["spread_skill"] = np.sqrt((m + 1) / m) * out["spread"] / out["rmse"]
    return {n: {k: [float(x) for x in v[:, j]] for k, v in out.items()} for j, n in enumerate(names)}


def combine_scores(per_date: Sequence[dict[str, dict[str, list[float]]]], members: int) -> dict[str, dict[str, list[float]]]:
    """Scores over several initial dates: RMSE and spread as the root of the mean square, ACC and
    CRPS as means, spread/skill from the combined spread and RMSE."""
    if len(per_date) == 1:
        return per_date[0]
    out: dict[str, dict[str, list[float]]] = {}
    for name in per_date[0]:
        out[name] = {}
        for key in per_date[0][name]:
            if key == "spread_skill":
                continue
            v = np.array([d[name][key] for d in per_date])
            square = key.startswith("rmse") or key == "spread"
            out[name][key] = (np.sqrt((v**2).mean(axis=0)) if square else v.mean(axis=0)).tolist()
        if "spread" in out[name]:
            ratio = np.sqrt((members + 1) / members) * np.array(out[name]["spread"]) / np.array(out[name]["rmse"])
            out[name]["spread_skill"] = ratio.tolist()
    return out
