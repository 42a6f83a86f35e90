"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (counted in optimizer steps).

``lr_at(step)`` for optimizer step ``s`` (0-based) with peak ``lr``, floor ``lr_min``, ``warmup_steps``
``W`` and ``total_steps`` ``T``:

- ``s < W``: ``lr * (s + 1) / W`` (the first step already trains; step ``W - 1`` reaches ``lr``);
- ``W <= s < T``: ``lr_min + (lr - lr_min) * (1 + cos(pi * (s - W) / (T - W))) / 2``;
- ``s >= T``: ``lr_min``.

:func:`build_scheduler` wraps it as a torch ``LambdaLR`` whose step count is the optimizer step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # torch loads with the scheduler, not with the settings (read by the experiment config)
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LRScheduleSettings", "lr_at", "build_scheduler"]


class LRScheduleSettings(BaseModel):
    """Peak ``lr``, floor ``lr_min``, ``warmup_steps`` and ``total_steps`` (optimizer steps)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-3, gt=0, description="peak learning rate, reached at the end of warm-up")
    lr_min: float = Field(0.0, ge=0, description="floor of the cosine decay")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    total_steps: int = Field(1000, ge=1, description="optimizer steps until the decay reaches lr_min")

    @model_validator(mode="after")
    def _check(self) -> LRScheduleSettings:
        if not math.isfinite(self.lr):
            raise ValueError(f"schedule.lr must be finite, got {self.lr}")
        if self.lr_min > self.lr:
            raise ValueError(
                f"schedule.lr_min={self.lr_min} is above schedule.lr={self.lr}: the cosine decays from lr "
                "down to lr_min; set lr_min <= lr"
            )
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"schedule.warmup_steps={self.warmup_steps} exceeds schedule.total_steps={self.total_steps}: "
                "warm-up is part of the run; set warmup_steps <= total_steps"
            )
        return self


def lr_at(step: int, settings: LRScheduleSettings) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    s = settings
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if step >= s.total_steps:
        return s.lr_min
    decay_steps = s.total_steps - s.warmup_steps
    progress = (step - s.warmup_steps) / decay_steps
    return s.lr_min + (s.lr - s.lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: Optimizer, settings: LRScheduleSettings) -> LambdaLR:
    """A ``LambdaLR`` giving ``lr_at(step)``: sets every group's base lr to ``settings.lr`` first."""
    from torch.optim.lr_scheduler import LambdaLR

    for group in optimizer.param_groups:
        group["lr"] = settings.lr
        group["initial_lr"] = settings.lr
    return LambdaLR(optimizer, lambda step: lr_at(step, settings) / settings.lr)
