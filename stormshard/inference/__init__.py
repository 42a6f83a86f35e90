"""Inference: forecast rollouts from exported bundles, anemoi-layout output, maps, RMSE."""

from __future__ import annotations

from stormshard.inference.forecast import ForecastResult, rollout, run_forecast

__all__ = [
    "rollout", "run_forecast", "ForecastResult",
]
