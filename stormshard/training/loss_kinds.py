"""The names of the pointwise training losses (``training.loss``), apart from their code so that a config
validates without importing torch (:mod:`stormshard.training.losses` computes them)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["LOSS_KINDS", "LossKind"]

LossKind = Literal["mse", "mae", "huber", "logcosh", "rmse"]
#: the pointwise loss kinds of :class:`~stormshard.training.losses.WeightedPointwiseLoss`
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
