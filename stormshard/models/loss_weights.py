"""Loss weights as AIFS sets them: per variable by name, by pressure level, by node area.

Kept with the models (beside their :mod:`~stormshard.models.variables`): the rules read only the output
variables' names, and both training (its losses) and checkpoint conversion (anemoi's scalers in and out)
use them.

The loss of every task weighs the error at output variable ``v`` and grid cell ``g`` by

    W[g, v] = area[g] * variable_weight[v] * level_weight[v]

- ``variable_weight`` (``training.loss_scaling.variables``): a weight per variable name or per
  parameter (``"q": 0.6`` weighs ``q_50 ... q_1000``; a full name wins over its parameter),
  ``default_weight`` for the others;
- ``level_weight`` (``training.loss_scaling.pressure_level``): for variables named
  ``<param>_<level>`` (e.g. ``t_850``), a function of the level, anemoi-training's level scalers:
  ``relu``: ``max(y_intercept, slope * level)`` (``ReluVariableLevelScaler``; AIFS uses slope
  0.001, y_intercept 0.2), ``linear``: ``slope * level + y_intercept``, ``polynomial``:
  ``(slope * level)**2 + y_intercept``, ``constant``: ``y_intercept``; ``params`` restricts it to
  some parameters (default: every ``<param>_<level>`` name); other variables get 1;
- ``area``: the data nodes' area weights of the graph (this rank's slice; the losses divide by
  the full-grid total, so the scale of the area weights does not matter).

The losses (:mod:`stormshard.training.losses`) take the per-variable product
``variable_weight * level_weight`` and the area weights and form ``W`` on this rank's slice.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch loads with the loss, not with the settings (read by the experiment config)
    from torch import Tensor

__all__ = ["PressureLevelScaling", "LossScalingSettings", "split_level", "level_weight", "variable_loss_weights",
           "combined_weights"]

_LEVEL = re.compile(r"^(?P<param>.+)_(?P<level>\d+(?:\.\d+)?)$")


class PressureLevelScaling(BaseModel):
    """One of anemoi-training's variable-level scalers (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["relu", "linear", "polynomial", "constant"] = "relu"
    slope: float = Field(0.001, description="per unit of level (hPa)")
    y_intercept: float = Field(0.2, description="floor (relu) or offset (linear, polynomial, constant)")
    params: list[str] | None = Field(None, description="parameters scaled by level (default: every <param>_<level>)")


class LossScalingSettings(BaseModel):
    """``training.loss_scaling``: per-variable weights and the pressure-level scaling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    variables: dict[str, float] = Field(default_factory=dict, description="weight per variable or parameter name")
    default_weight: float = Field(1.0, ge=0, description="weight of variables not named in variables")
    pressure_level: PressureLevelScaling | None = None


def split_level(name: str) -> tuple[str, float] | None:
    """``"t_850"`` -> ``("t", 850.0)``; None for a name without a trailing ``_<level>``."""
    m = _LEVEL.match(name)
    return (m.group("param"), float(m.group("level"))) if m else None


def level_weight(level: float, scaling: PressureLevelScaling) -> float:
    """The weight of pressure level ``level`` (hPa) under ``scaling``."""
    s = scaling
    if s.type == "relu":
        return max(s.y_intercept, s.slope * level)
    if s.type == "linear":
        return s.slope * level + s.y_intercept
    if s.type == "polynomial":
        return (s.slope * level) ** 2 + s.y_intercept
    return s.y_intercept


def variable_loss_weights(output_names: Sequence[str], settings: LossScalingSettings) -> np.ndarray:
    """``(outputs,)`` float64: ``variable_weight * level_weight`` per output variable, in order.

    Raises ValueError naming ``training.loss_scaling`` when a weight names neither an output
    variable nor a parameter of one, when a weight is negative, when ``pressure_level.params``
    names a parameter with no ``<param>_<level>`` output, or when a weight comes out negative or
    all weights are zero.
    """
    names = list(output_names)
    parsed = {n: split_level(n) for n in names}
    params = {p[0] for p in parsed.values() if p is not None}
    unknown = sorted(k for k in settings.variables if k not in names and k not in params)
    if unknown:
        raise ValueError(f"training.loss_scaling.variables names {unknown}, which are neither output variables nor "
                         f"parameters of one (outputs: {names}; parameters: {sorted(params)}): fix the names or "
                         "remove them")
    negative = {k: w for k, w in settings.variables.items() if not np.isfinite(w) or w < 0}
    if negative:
        raise ValueError(f"training.loss_scaling.variables has negative or non-finite weights {negative}: "
                         "weights must be >= 0")
    level = settings.pressure_level
    if level is not None and level.params is not None:
        missing = sorted(set(level.params) - params)
        if missing:
            raise ValueError(f"training.loss_scaling.pressure_level.params names {missing}, which have no "
                             f"<param>_<level> output variable (parameters with levels: {sorted(params)})")
    weights = np.empty(len(names))
    for i, name in enumerate(names):
        p = parsed[name]
        w = settings.variables.get(name)
        if w is None and p is not None:
            w = settings.variables.get(p[0])
        w = settings.default_weight if w is None else w
        if level is not None and p is not None and (level.params is None or p[0] in level.params):
            w *= level_weight(p[1], level)
        weights[i] = w
    bad = {n: float(w) for n, w in zip(names, weights, strict=True) if not np.isfinite(w) or w < 0}
    if bad:
        raise ValueError(f"training.loss_scaling gives negative weights {bad} (pressure_level "
                         f"{level.type if level else None}: slope / y_intercept): choose them so weights stay >= 0")
    if not weights.any():
        raise ValueError("training.loss_scaling makes every output weight zero: the loss would be empty; "
                         "give at least one variable a positive weight")
    return weights


def combined_weights(area: Tensor, variable_weights: Tensor | np.ndarray) -> Tensor:
    """``W = area[:, None] * variable_weights[None, :]``: ``(grid_local, outputs)``, area's dtype."""
    import torch

    vw = torch.as_tensor(variable_weights if isinstance(variable_weights, torch.Tensor) else np.asarray(variable_weights))
    return area[:, None] * vw.to(area.device, area.dtype)[None, :]
