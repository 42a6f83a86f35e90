"""``training.weight_averaging``: an average of the weights kept beside the trained ones (torch-free).

``null`` (the default) keeps none. Otherwise::

    {"kind": "ema", "decay": 0.999, "start_step": 0, "every_n_steps": 1}   # exponential moving average
    {"kind": "swa", "start_step": 1000, "every_n_steps": 1}                # equal-weight running mean

anemoi-training's ``training.weight_averaging: ema`` (Lightning's ``EMAWeightAveraging``, decay 0.999) and
``swa`` (Lightning's ``StochasticWeightAveraging``). An update follows optimizer step ``s`` (0-based) when
``s >= start_step`` and ``s % every_n_steps == 0`` and the step was taken (a step the engine skipped, e.g. a
non-finite gradient, is no update). SWA here is the average only: the learning-rate schedule is left as
configured (anemoi's ``swa_lrs`` switch is not done). What the average is and how it is updated:
:mod:`stormshard.training.weight_averaging`.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["AVERAGING_KINDS", "AveragingKind", "WeightAveragingSettings"]

AveragingKind = Literal["ema", "swa"]
#: the kinds of ``training.weight_averaging.kind``
AVERAGING_KINDS: tuple[str, ...] = get_args(AveragingKind)
_DEFAULT_DECAY = 0.999  # anemoi-training's ema.yaml


class WeightAveragingSettings(BaseModel):
    """One weight average: ``kind`` ``"ema"`` (with ``decay``) or ``"swa"``, updated after the optimizer steps
    ``s >= start_step`` with ``s % every_n_steps == 0``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(..., description="'ema' (exponential moving average) or 'swa' (equal-weight mean)")
    decay: float | None = Field(None, description="EMA only: avg <- decay * avg + (1 - decay) * weights; in (0, 1), "
                                "default 0.999")
    start_step: int = Field(0, strict=True, description="the first optimizer step (0-based) that updates the average")
    every_n_steps: int = Field(1, strict=True, description="update after every n-th optimizer step")

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, value: str) -> str:
        if value not in AVERAGING_KINDS:
            raise ValueError(f"unknown weight averaging kind {value!r}: use \"ema\" (exponential moving average, "
                             "with decay) or \"swa\" (equal-weight running mean from start_step on)")
        return value

    @field_validator("decay")
    @classmethod
    def _check_decay(cls, value: float | None) -> float | None:
        if value is None:
            return value
        if isinstance(value, bool) or not math.isfinite(value) or not 0.0 < value < 1.0:
            raise ValueError(f"decay must lie strictly between 0 and 1 (got {value!r}): the average keeps that "
                             f"fraction of itself per update; anemoi's default is {_DEFAULT_DECAY}")
        return value

    @field_validator("start_step")
    @classmethod
    def _check_start(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"start_step must be 0 or more (got {value}): the 0-based optimizer step of the first "
                             "update; 0 averages from the first step on")
        return value

    @field_validator("every_n_steps")
    @classmethod
    def _check_every(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"every_n_steps must be 1 or more (got {value}): 1 updates after every optimizer step")
        return value

    @model_validator(mode="after")
    def _check(self) -> WeightAveragingSettings:
        if self.kind == "swa" and self.decay is not None:
            raise ValueError(f"training.weight_averaging.decay={self.decay} is given with kind \"swa\", an equal-weight "
                             "mean that has no decay: remove decay, or use kind \"ema\"")
        if self.kind == "ema" and self.decay is None:
            object.__setattr__(self, "decay", _DEFAULT_DECAY)  # frozen model: the default filled in once
        return self

    def describe(self) -> str:
        """A short phrase for the run log: ``EMA (decay 0.999, from step 0, every step)``."""
        every = "every step" if self.every_n_steps == 1 else f"every {self.every_n_steps} steps"
        what = f"EMA (decay {self.decay}" if self.kind == "ema" else "SWA (equal-weight mean"
        return f"{what}, from step {self.start_step}, {every})"
