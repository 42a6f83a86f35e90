"""The rollout schedule: how many autoregressive steps the loss covers at each optimizer step.

``training.rollout`` is an int (the same rollout all run) or a schedule
``{"start": 1, "increase_every": 1000, "unit": "steps", "maximum": 12}``: optimizer step ``s``
(0-based) trains with

    rollout(s) = min(maximum, start + s // increase_every)                 (unit "steps")
    rollout(s) = min(maximum, start + (s // steps_per_epoch) // increase_every)   (unit "epochs")

where an epoch is ``steps_per_epoch`` optimizer steps, the count ``training.epochs`` uses
(``len(train samples) // (replicas x micro batch x accumulation)``). The rollout is a pure
function of the step, so a resumed run trains each step with the rollout the uninterrupted run
used. Training windows hold ``multistep_input + maximum`` dates (the sampler's sample count does
not change with the rollout); a micro-batch reads only the dates its step needs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RolloutSchedule", "rollout_at", "max_rollout"]


class RolloutSchedule(BaseModel):
    """``start`` steps at first, one more every ``increase_every`` steps or epochs, at most ``maximum``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int = Field(1, ge=1, strict=True, description="rollout of the first optimizer step")
    increase_every: int = Field(..., ge=1, strict=True, description="steps or epochs between increases")
    unit: Literal["steps", "epochs"] = "steps"
    maximum: int = Field(..., ge=1, strict=True, description="the rollout never exceeds this")

    @model_validator(mode="after")
    def _check(self) -> RolloutSchedule:
        if self.maximum < self.start:
            raise ValueError(f"training.rollout.maximum={self.maximum} is below training.rollout.start={self.start}: "
                             f"set maximum to at least {self.start}")
        return self


def max_rollout(rollout: int | RolloutSchedule) -> int:
    """The largest rollout of the run (the training windows hold this many target dates)."""
    return rollout if isinstance(rollout, int) else rollout.maximum


def rollout_at(step: int, rollout: int | RolloutSchedule, steps_per_epoch: int = 1) -> int:
    """The rollout of optimizer step ``step`` (0-based); ``steps_per_epoch`` for ``unit="epochs"``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if isinstance(rollout, int):
        return rollout
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
    ticks = step if rollout.unit == "steps" else step // steps_per_epoch
    return min(rollout.maximum, rollout.start + ticks // rollout.increase_every)
