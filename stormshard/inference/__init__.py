"""Inference: sharded forecasts from bundles or training checkpoints, anemoi zarr and netCDF output,
verification scores (RMSE, ACC, CRPS, spread/skill) and plots."""

from __future__ import annotations

from stormshard.inference.forecast import ForecastResult, format_scores, run_forecast
from stormshard.inference.loader import (
    PRECISIONS,
    ModelSource,
    build_forecaster,
    load_forecaster,
    open_model_source,
)
from stormshard.inference.outputs import ChunkExchange, ForecastStore, write_netcdf
from stormshard.inference.request import ForecastRequest, check_request
from stormshard.inference.runner import replica_tasks, rollout, rollout_steps
from stormshard.inference.verification import Climatology, compute_climatology, score_forecast

__all__ = [
    "run_forecast", "ForecastResult", "format_scores",
    "load_forecaster", "open_model_source", "build_forecaster", "ModelSource", "PRECISIONS",
    "ChunkExchange", "ForecastStore", "write_netcdf",
    "ForecastRequest", "check_request",
    "rollout", "rollout_steps", "replica_tasks",
    "Climatology", "compute_climatology", "score_forecast",
]
