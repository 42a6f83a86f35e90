"""Inference: forecast rollouts from exported bundles, anemoi-layout output, maps, RMSE."""

from __future__ import annotations

from stormshard.inference.forecast import ForecastResult, plot_maps, rmse_per_lead, rollout, run_forecast  # noqa: F401

__all__ = ["ForecastResult", "plot_maps", "rmse_per_lead", "rollout", "run_forecast"]
